// BatchMerger against layouts written out by hand: the header's worked example,
// one valid_len per query, self-attention, and Scatter's row placement.
#include "server/serving/batch_merge.h"

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <vector>

#include "core/attention.h"
#include "gtest/gtest.h"

namespace mha::server {
namespace {

// A (B, L, d) tensor whose entry (b, l, f) is 1000 * tag + 100 * b + l + f / 1000,
// so every copied value says where it came from.
std::vector<float> Tagged(int tag, int64_t batch, int64_t length, int64_t width) {
  std::vector<float> t(batch * length * width);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t l = 0; l < length; ++l) {
      for (int64_t f = 0; f < width; ++f) {
        t[(b * length + l) * width + f] = 1000.0f * tag + 100.0f * b + l + f / 1000.0f;
      }
    }
  }
  return t;
}

core::ModelConfig Config(int64_t d) {
  return core::ModelConfig{
      .num_hiddens = d, .num_heads = 1, .query_size = d, .key_size = d, .value_size = d};
}

struct Part {
  std::vector<float> queries, keys, values, output;
  std::vector<int32_t> lens;
  core::AttentionInputs inputs;
};

Part Cross(int tag, int64_t b, int64_t q, int64_t k, std::vector<int32_t> lens, int64_t d) {
  Part p{.queries = Tagged(tag, b, q, d),
         .keys = Tagged(tag + 1, b, k, d),
         .values = Tagged(tag + 2, b, k, d),
         .output = std::vector<float>(b * q * d, -1.0f),
         .lens = std::move(lens)};
  p.inputs = {.batch = b,
              .num_queries = q,
              .num_keys = k,
              .queries = p.queries.data(),
              .keys = p.keys.data(),
              .values = p.values.data(),
              .valid_lens = p.lens};
  return p;
}

std::vector<BatchPart> PartsOf(std::initializer_list<Part*> parts) {
  std::vector<BatchPart> out;
  for (Part* p : parts) out.push_back({&p->inputs, p->output.data()});
  return out;
}

TEST(BatchMergeTest, HeaderExamplePadsAndMasksPerRow) {
  const int64_t d = 3;
  Part a = Cross(10, 1, 3, 5, {}, d);
  Part b = Cross(20, 2, 4, 2, {1, 2}, d);
  const std::vector<BatchPart> parts = PartsOf({&a, &b});
  BatchMerger merger;
  const core::AttentionInputs m = merger.Merge(parts, Config(d));
  EXPECT_EQ(m.batch, 3);
  EXPECT_EQ(m.num_queries, 4);
  EXPECT_EQ(m.num_keys, 5);
  EXPECT_EQ(std::vector<int32_t>(m.valid_lens.begin(), m.valid_lens.end()),
            (std::vector<int32_t>{5, 1, 2}));
  // Row 0: part a's three queries, then a zero query.
  EXPECT_EQ(m.queries[(0 * 4 + 2) * d + 1], a.queries[2 * d + 1]);
  EXPECT_EQ(m.queries[(0 * 4 + 3) * d + 0], 0.0f);
  // Rows 1-2: part b; its keys zero from key 2 on.
  EXPECT_EQ(m.queries[(2 * 4 + 3) * d + 2], b.queries[(1 * 4 + 3) * d + 2]);
  EXPECT_EQ(m.keys[(1 * 5 + 1) * d + 0], b.keys[(0 * 2 + 1) * d + 0]);
  EXPECT_EQ(m.keys[(2 * 5 + 2) * d + 0], 0.0f);
  EXPECT_EQ(m.values[(2 * 5 + 1) * d + 2], b.values[(1 * 2 + 1) * d + 2]);
  EXPECT_EQ(m.values[(0 * 5 + 4) * d + 1], a.values[4 * d + 1]);
  EXPECT_FALSE(m.self_attention());
}

TEST(BatchMergeTest, OnePerQueryRepeatsRowLengthsAndZeroesPaddedQueries) {
  const int64_t d = 2;
  Part a = Cross(10, 1, 2, 3, {3}, d);        // one per row
  Part b = Cross(20, 1, 3, 4, {1, 0, 4}, d);  // one per query
  Part c = Cross(30, 1, 1, 2, {}, d);         // none: its own K
  const std::vector<BatchPart> parts = PartsOf({&a, &b, &c});
  BatchMerger merger;
  const core::AttentionInputs m = merger.Merge(parts, Config(d));
  EXPECT_EQ(m.num_queries, 3);
  EXPECT_EQ(m.num_keys, 4);
  EXPECT_EQ(std::vector<int32_t>(m.valid_lens.begin(), m.valid_lens.end()),
            (std::vector<int32_t>{3, 3, 0, 1, 0, 4, 2, 0, 0}));
}

TEST(BatchMergeTest, NoMaskWhenNothingIsPaddedOrMasked) {
  const int64_t d = 2;
  Part a = Cross(10, 1, 2, 4, {}, d);
  Part b = Cross(20, 2, 3, 4, {}, d);
  const std::vector<BatchPart> parts = PartsOf({&a, &b});
  BatchMerger merger;
  EXPECT_TRUE(merger.Merge(parts, Config(d)).valid_lens.empty());
}

TEST(BatchMergeTest, SelfAttentionPadsQueriesAndKeysTogether) {
  const int64_t d = 2;
  std::vector<float> q0 = Tagged(1, 1, 2, d), q1 = Tagged(2, 1, 5, d);
  std::vector<float> out0(2 * d), out1(5 * d);
  const core::AttentionInputs a{.batch = 1, .num_queries = 2, .num_keys = 2, .queries = q0.data()};
  const core::AttentionInputs b{.batch = 1, .num_queries = 5, .num_keys = 5, .queries = q1.data()};
  const std::vector<BatchPart> parts{{&a, out0.data()}, {&b, out1.data()}};
  BatchMerger merger;
  const core::AttentionInputs m = merger.Merge(parts, Config(d));
  EXPECT_TRUE(m.self_attention());
  EXPECT_EQ(m.num_queries, 5);
  EXPECT_EQ(m.num_keys, 5);
  EXPECT_EQ(std::vector<int32_t>(m.valid_lens.begin(), m.valid_lens.end()),
            (std::vector<int32_t>{2, 5}));
}

TEST(BatchMergeTest, ScatterCopiesEachPartsRowsAndDropsPadding) {
  const int64_t d = 2;
  Part a = Cross(10, 1, 1, 2, {}, d);
  Part b = Cross(20, 2, 3, 2, {}, d);
  const std::vector<BatchPart> parts = PartsOf({&a, &b});
  BatchMerger merger;
  const core::AttentionInputs m = merger.Merge(parts, Config(d));
  // Fill the merged output with its own coordinates, as the core would fill it.
  const std::vector<float> merged = Tagged(0, m.batch, m.num_queries, d);
  std::copy(merged.begin(), merged.end(), merger.output());
  merger.Scatter(parts, Config(d));
  EXPECT_EQ(a.output, (std::vector<float>{0.0f, 0.001f}));  // row 0, query 0
  // Part b's row 1, query 2 came from merged row 2, query 2.
  EXPECT_EQ(b.output[(1 * 3 + 2) * d + 1], merged[(2 * 3 + 2) * d + 1]);
  EXPECT_EQ(b.output[0], merged[(1 * 3 + 0) * d + 0]);
}

TEST(BatchMergeTest, CanMergeNeedsSameKindCausalAndHeadMask) {
  const float q = 0, k = 0;
  const float half[] = {1.0f, 0.5f}, ones[] = {1.0f, 1.0f};
  const core::AttentionInputs self{.queries = &q};
  const core::AttentionInputs cross{.queries = &q, .keys = &k, .values = &k};
  core::AttentionInputs causal = self;
  causal.causal = true;
  core::AttentionInputs masked = self, masked_too = self, other = self;
  masked.head_mask = half;
  masked_too.head_mask = half;
  other.head_mask = ones;
  EXPECT_TRUE(CanMerge(self, self));
  EXPECT_FALSE(CanMerge(self, cross));
  EXPECT_FALSE(CanMerge(self, causal));
  EXPECT_TRUE(CanMerge(masked, masked_too));
  EXPECT_FALSE(CanMerge(masked, other));
  EXPECT_FALSE(CanMerge(masked, self));
}

// A rotary model's query i sits at K - Q + i: requests merge only when padding keeps
// that (equal K - Q), and the merged call then gives each request its output alone.
TEST(BatchMergeTest, RotaryRequestsMergeOnlyWithEqualKMinusQ) {
  core::ModelConfig c{.num_hiddens = 8,
                      .num_heads = 2,
                      .query_size = 8,
                      .key_size = 8,
                      .value_size = 8,
                      .num_kv_heads = 1};
  c.rope = core::RotaryConfig{};
  auto mha = core::MultiHeadAttention::Create(c, core::SeededWeights(c, 1)).value();
  Part a = Cross(1, 1, 3, 5, {}, 8);
  Part b = Cross(2, 2, 4, 6, {}, 8);
  Part other = Cross(3, 1, 4, 5, {}, 8);
  a.inputs.causal = b.inputs.causal = other.inputs.causal = true;
  for (Part* p : {&a, &b, &other}) {  // unit-scale values
    for (auto* v : {&p->queries, &p->keys, &p->values}) {
      for (float& x : *v) x = std::fmod(x, 3.0f) - 1.5f;
    }
  }
  EXPECT_TRUE(CanMerge(a.inputs, b.inputs, /*positions=*/true));
  EXPECT_FALSE(CanMerge(a.inputs, other.inputs, /*positions=*/true));
  EXPECT_TRUE(CanMerge(a.inputs, other.inputs));  // without rope, padding is harmless
  std::vector<float> alone_a(a.output.size()), alone_b(b.output.size());
  ASSERT_TRUE(mha->Forward(a.inputs, alone_a.data()).ok());
  ASSERT_TRUE(mha->Forward(b.inputs, alone_b.data()).ok());
  const std::vector<BatchPart> parts = PartsOf({&a, &b});
  BatchMerger merger;
  const core::AttentionInputs m = merger.Merge(parts, c);
  ASSERT_TRUE(mha->Forward(m, merger.output()).ok());
  merger.Scatter(parts, c);
  for (size_t i = 0; i < alone_a.size(); ++i) EXPECT_NEAR(a.output[i], alone_a[i], 1e-5) << i;
  for (size_t i = 0; i < alone_b.size(); ++i) EXPECT_NEAR(b.output[i], alone_b[i], 1e-5) << i;
}

}  // namespace
}  // namespace mha::server

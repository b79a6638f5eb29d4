// int8 models (precision kInt8) against the double-precision reference of the same
// f32 weights: relative Frobenius error within kInt8Bound for every mask kind, self-
// and cross-attention, dense calls and sessions; per-row activation scales (a row's
// result does not depend on the rows batched with it); refusals naming `precision`.
// Grouped-query int8 models are checked in gqa_rope_test.cc, PyTorch's outputs in
// golden_test.cc.
#include <cmath>
#include <random>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/attention.h"
#include "core/kv_cache.h"
#include "core/matmul.h"
#include "core/reference.h"
#include "gtest/gtest.h"
#include "tests/unit/test_util.h"

namespace mha::core {
namespace {

using ::mha::testing::MaxAbsDiff;
using ::mha::testing::RandomVector;
using ::mha::testing::RelativeFrobenius;

// issue 37's bound: ||int8 - reference||_F <= 2e-2 ||reference||_F. Symmetric int8
// keeps a row's largest value to 1/254 of itself; the measured errors are about
// half of the bound (docs/core.md, "int8 models").
constexpr double kInt8Bound = 2e-2;

ModelConfig Int8(int64_t e, int64_t h, int64_t dq, int64_t dk, int64_t dv, bool bias) {
  return {.num_hiddens = e,
          .num_heads = h,
          .query_size = dq,
          .key_size = dk,
          .value_size = dv,
          .bias = bias,
          .precision = Precision::kInt8};
}

struct Inputs {
  std::vector<float> queries, keys, values, head_mask;
  std::vector<int32_t> lens;
  AttentionInputs in;
};

// Inputs uniform in +-1; lens in [1, K] (mask kind 1: per row, 2: per query).
Inputs MakeInputs(const ModelConfig& c, int64_t B, int64_t Q, int64_t K, bool self, int mask_kind,
                  bool causal, bool head_mask, uint64_t seed) {
  Inputs d;
  std::mt19937_64 rng(seed);
  d.queries = RandomVector(rng, B * Q * c.query_size);
  if (!self) {
    d.keys = RandomVector(rng, B * K * c.key_size);
    d.values = RandomVector(rng, B * K * c.value_size);
  }
  std::uniform_int_distribution<int32_t> len(1, static_cast<int32_t>(K));
  d.lens.resize(mask_kind == 0 ? 0 : mask_kind == 1 ? B : B * Q);
  for (int32_t& l : d.lens) l = len(rng);
  if (head_mask) {
    d.head_mask = RandomVector(rng, c.num_heads, 0.0f, 2.0f);
    d.head_mask[0] = 0.0f;
  }
  d.in = {.batch = B,
          .num_queries = Q,
          .num_keys = K,
          .queries = d.queries.data(),
          .keys = self ? nullptr : d.keys.data(),
          .values = self ? nullptr : d.values.data(),
          .valid_lens = d.lens,
          .causal = causal,
          .head_mask = d.head_mask};
  return d;
}

TEST(Int8Test, EveryMaskKindWithinBoundOfTheReference) {
  double worst = 0, worst_abs = 0;
  for (bool self : {false, true}) {
    const ModelConfig c = self ? Int8(64, 4, 64, 64, 64, true) : Int8(64, 4, 48, 40, 56, true);
    const Weights w = SeededWeights(c, 11);
    auto mha = MultiHeadAttention::Create(c, w, {.query_block = 16, .key_block = 32}).value();
    for (int mask_kind = 0; mask_kind < 3; ++mask_kind) {
      for (bool causal : {false, true}) {
        for (bool head_mask : {false, true}) {
          SCOPED_TRACE(absl::StrCat("self=", self, " mask=", mask_kind, " causal=", causal,
                                    " head_mask=", head_mask));
          const Inputs d = MakeInputs(c, 3, 37, self ? 37 : 53, self, mask_kind, causal, head_mask,
                                      100 + mask_kind);
          std::vector<float> out(3 * 37 * c.num_hiddens);
          ASSERT_TRUE(mha->Forward(d.in, out.data()).ok());
          const ReferenceResult ref = ReferenceForward(c, w, d.in);
          const double err = RelativeFrobenius(out, ref.output);
          EXPECT_LE(err, kInt8Bound);
          // Not an f32 model in disguise: int8 rounding shows.
          EXPECT_GT(err, 1e-4);
          worst = std::max(worst, err);
          worst_abs = std::max(worst_abs, MaxAbsDiff(out, ref.output));
        }
      }
    }
  }
  RecordProperty("worst_relative_frobenius", absl::StrCat(worst));
  RecordProperty("worst_max_abs", absl::StrCat(worst_abs));
  std::cout << "int8 vs reference: worst relative Frobenius " << worst << ", max abs " << worst_abs
            << "\n";
}

// Row chunks of 128 (kInt8RowChunkMax) and several batch rows: the chunked path.
TEST(Int8Test, LongInputsRunAsChunksWithinBound) {
  const ModelConfig c = Int8(96, 6, 96, 96, 96, false);
  const Weights w = SeededWeights(c, 12);
  auto mha = MultiHeadAttention::Create(c, w).value();
  const Inputs d = MakeInputs(c, 2, 300, 300, /*self=*/true, 1, false, false, 5);
  std::vector<float> out(2 * 300 * c.num_hiddens);
  ASSERT_TRUE(mha->Forward(d.in, out.data()).ok());
  EXPECT_LE(RelativeFrobenius(out, ReferenceForward(c, w, d.in).output), kInt8Bound);
}

// Self-attention projects Q, K and V straight into their heads' places (the sums
// rescaled where the attention reads them); cross-attention over a copy of the same
// tensor projects row-major and repacks. Both are the same integer GEMMs and the same
// rescaling, so the outputs are equal to the bit: multi-head and grouped-query heads
// (4 query heads interleaved per task), row chunks across batch rows, every mask kind.
// Where oneDNN has no bf16 matmul, the model runs its int8 weights in f32 (no integer
// GEMM): the two paths then agree to f32's rounding.
TEST(Int8Test, SelfAttentionProjectedIntoHeadsEqualsTheRepackedPath) {
  for (const int64_t kv_heads : {0, 2}) {
    ModelConfig c = Int8(64, 8, 64, 64, 64, true);
    c.num_kv_heads = kv_heads;
    const Weights w = SeededWeights(c, 21);
    auto mha = MultiHeadAttention::Create(c, w, {.query_block = 32, .key_block = 64}).value();
    for (const auto& [B, Q] : {std::pair<int64_t, int64_t>{3, 37}, {2, 300}}) {
      for (int mask_kind = 0; mask_kind < 3; ++mask_kind) {
        SCOPED_TRACE(absl::StrCat("G=", c.kv_heads(), " B=", B, " Q=", Q, " mask=", mask_kind));
        const Inputs self = MakeInputs(c, B, Q, Q, true, mask_kind, mask_kind == 2, false, 31);
        const std::vector<float> copy = self.queries;
        AttentionInputs cross = self.in;
        cross.keys = copy.data();
        cross.values = copy.data();
        std::vector<float> a(B * Q * c.num_hiddens), b(a.size());
        ASSERT_TRUE(mha->Forward(self.in, a.data()).ok());
        ASSERT_TRUE(mha->Forward(cross, b.data()).ok());
        EXPECT_LE(MaxAbsDiff(a, b), mha->GemmPrecision() == Precision::kInt8 ? 0.0 : 1e-5);
        // ReferenceForward is multi-head only; grouped-query int8 models meet the bound
        // against gqa_rope_test's independent reference.
        if (kv_heads == 0) {
          EXPECT_LE(RelativeFrobenius(a, ReferenceForward(c, w, self.in).output), kInt8Bound);
        }
      }
    }
  }
}

// Activations are scaled per row, so a request's result is the same alone or batched
// beside rows 100 times larger (a scale per tensor or per chunk would coarsen it).
TEST(Int8Test, ARowsResultDoesNotDependOnItsBatch) {
  const ModelConfig c = Int8(64, 4, 32, 32, 32, true);
  auto mha = MultiHeadAttention::Create(c, SeededWeights(c, 13)).value();
  const int64_t Q = 20, K = 24;
  Inputs two = MakeInputs(c, 2, Q, K, false, 0, false, false, 9);
  for (size_t i = Q * c.query_size; i < two.queries.size(); ++i) two.queries[i] *= 100;
  for (size_t i = K * c.key_size; i < two.keys.size(); ++i) two.keys[i] *= 100;
  for (size_t i = K * c.value_size; i < two.values.size(); ++i) two.values[i] *= 100;
  std::vector<float> both(2 * Q * c.num_hiddens), alone(Q * c.num_hiddens);
  ASSERT_TRUE(mha->Forward(two.in, both.data()).ok());
  AttentionInputs first = two.in;
  first.batch = 1;
  ASSERT_TRUE(mha->Forward(first, alone.data()).ok());
  both.resize(alone.size());
  EXPECT_LE(MaxAbsDiff(both, alone), 1e-6);
}

// A fully masked row has a zero context: its output is b_o exactly (a zero row
// quantizes to zeros with scale 0).
TEST(Int8Test, ZeroValidLenGivesTheOutputBias) {
  const ModelConfig c = Int8(40, 5, 24, 12, 20, true);
  const Weights w = SeededWeights(c, 14);
  auto mha = MultiHeadAttention::Create(c, w).value();
  Inputs d = MakeInputs(c, 2, 7, 9, false, 1, false, false, 3);
  d.lens = {0, 9};
  d.in.valid_lens = d.lens;
  std::vector<float> out(2 * 7 * c.num_hiddens);
  ASSERT_TRUE(mha->Forward(d.in, out.data()).ok());
  for (int64_t i = 0; i < 7 * c.num_hiddens; ++i) {
    ASSERT_EQ(out[i], w.b_o[i % c.num_hiddens]) << i;
  }
}

// Sessions: decode steps (one token each, the row path's sizes) and a prefill, on the
// f32 cache an int8 model keeps by default and on a bf16 one.
TEST(Int8Test, SessionsWithinBoundOfTheReference) {
  for (bool bf16_cache : {false, true}) {
    ModelConfig c = Int8(96, 6, 96, 96, 96, true);
    if (bf16_cache) c.kv_cache_precision = Precision::kBf16;
    EXPECT_EQ(c.cache_bf16(), bf16_cache);
    const Weights w = SeededWeights(c, 15);
    auto mha = MultiHeadAttention::Create(c, w).value();
    const int64_t n = 40;
    std::mt19937_64 rng(6);
    const std::vector<float> x = RandomVector(rng, n * c.query_size);
    const AttentionInputs in{
        .batch = 1, .num_queries = n, .num_keys = n, .queries = x.data(), .causal = true};
    const ReferenceResult ref = ReferenceForward(c, w, in);
    KvCachePool pool(int64_t{1} << 28);
    for (const std::vector<int64_t>& chunks :
         {std::vector<int64_t>(n, 1), std::vector<int64_t>{17, 3, 20}}) {
      SCOPED_TRACE(absl::StrCat("bf16 cache ", bf16_cache, ", ", chunks.size(), " chunks"));
      KvSequence seq(&pool, c.kv_heads(), c.head_size(), c.cache_bf16());
      std::vector<float> got;
      int64_t at = 0;
      for (int64_t t : chunks) {
        ASSERT_TRUE(seq.Reserve(t).ok());
        std::vector<float> y(t * c.num_hiddens);
        const PagedStep step{.num_queries = t,
                             .queries = x.data() + at * c.query_size,
                             .causal = true,
                             .cache = &seq,
                             .output = y.data()};
        ASSERT_TRUE(mha->ForwardPaged({&step, 1}).ok());
        got.insert(got.end(), y.begin(), y.end());
        at += t;
      }
      EXPECT_LE(RelativeFrobenius(got, ref.output), kInt8Bound);
    }
  }
}

TEST(Int8Test, ConcurrentCallsAgree) {
  const ModelConfig c = Int8(64, 8, 64, 64, 64, false);
  auto mha = MultiHeadAttention::Create(c, SeededWeights(c, 4),
                                        {.num_threads = 1, .query_block = 16, .key_block = 32})
                 .value();
  const Inputs d = MakeInputs(c, 2, 70, 70, true, 1, false, false, 8);
  std::vector<float> expected(2 * 70 * 64);
  ASSERT_TRUE(mha->Forward(d.in, expected.data()).ok());
  std::vector<std::vector<float>> outs(4, std::vector<float>(expected.size()));
  std::vector<std::thread> threads;
  for (auto& out : outs) {
    threads.emplace_back([&] {
      for (int rep = 0; rep < 10; ++rep) ASSERT_TRUE(mha->Forward(d.in, out.data()).ok());
    });
  }
  for (auto& t : threads) t.join();
  for (const auto& out : outs) EXPECT_EQ(out, expected);
}

TEST(Int8Test, RefusedWhereItHasNoMeaningNamingPrecision) {
  EXPECT_EQ(ParsePrecision("int8").value(), Precision::kInt8);
  EXPECT_EQ(PrecisionName(Precision::kInt8), "int8");
  ModelConfig additive = Int8(40, 5, 24, 12, 20, false);
  additive.scoring = Scoring::kAdditive;
  additive.additive_hidden = 4;
  EXPECT_TRUE(absl::StartsWith(additive.Validate().message(), "precision")) << additive.Validate();
  ModelConfig none = Int8(64, 4, 64, 64, 64, false);
  none.projections = Projections::kNone;
  EXPECT_TRUE(absl::StartsWith(none.Validate().message(), "precision")) << none.Validate();
  EXPECT_TRUE(absl::StrContains(ParsePrecision("int4").status().message(), "int8"));
}

}  // namespace
}  // namespace mha::core

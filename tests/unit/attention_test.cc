#include "core/attention.h"

#include <omp.h>

#include <algorithm>
#include <random>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/matmul.h"
#include "core/reference.h"
#include "gtest/gtest.h"
#include "tests/unit/test_util.h"

namespace mha::core {
namespace {

using ::mha::testing::MaxAbsDiff;
using ::mha::testing::RandomVector;

// f32 fast path vs the double-precision reference, elementwise.
constexpr double kF32Tolerance = 1e-4;
// bf16 rounds every GEMM operand to 8 significant bits (relative error 2^-9), so
// unit-scale outputs agree to a few 2^-8; we allow 2^-5.
constexpr double kBf16Tolerance = 1.0 / 32;

struct Case {
  ModelConfig config;
  MultiHeadAttention::Options options;
  int64_t batch, num_queries, num_keys;
  bool self_attention = false;
  bool same_keys_values = false;
  int mask_kind = 0;  // 0 none, 1 (B), 2 (B, Q)
  bool causal = false;
  bool head_mask = false;
  bool weights = false;
  // Additive scoring: every head gets head 0's scoring parameters, the layout of
  // d2l's one shared AdditiveAttention module.
  bool shared_scoring = false;
  std::string Describe() const {
    return absl::StrCat("B=", batch, " Q=", num_queries, " K=", num_keys,
                        " p_o=", config.num_hiddens, " h=", config.num_heads,
                        " d=", config.query_size, "/", config.key_size, "/", config.value_size,
                        " bias=", config.bias, " self=", self_attention, " mask=", mask_kind,
                        " causal=", causal, " head_mask=", head_mask, " weights=", weights,
                        " blocks=", options.query_block, "x", options.key_block, " ",
                        PrecisionName(config.precision), " ", ScoringName(config.scoring),
                        " p_a=", config.additive_hidden, " shared=", shared_scoring);
  }
};

struct Data {
  std::vector<float> queries, keys, values;
  std::vector<int32_t> valid_lens;
  std::vector<float> head_mask;
  AttentionInputs Inputs(const Case& c) const {
    AttentionInputs in{.batch = c.batch,
                       .num_queries = c.num_queries,
                       .num_keys = c.num_keys,
                       .queries = queries.data(),
                       .valid_lens = valid_lens,
                       .causal = c.causal,
                       .head_mask = head_mask};
    if (!c.self_attention) {
      in.keys = keys.data();
      in.values = c.same_keys_values ? keys.data() : values.data();
    }
    return in;
  }
};

Data MakeData(const Case& c, std::mt19937_64& rng) {
  Data d;
  const ModelConfig& m = c.config;
  d.queries = RandomVector(rng, c.batch * c.num_queries * m.query_size);
  if (!c.self_attention) {
    d.keys = RandomVector(rng, c.batch * c.num_keys * m.key_size);
    d.values = RandomVector(rng, c.batch * c.num_keys * m.value_size);
  }
  std::uniform_int_distribution<int32_t> len(0, static_cast<int32_t>(c.num_keys));
  if (c.mask_kind == 1) d.valid_lens.resize(c.batch);
  if (c.mask_kind == 2) d.valid_lens.resize(c.batch * c.num_queries);
  for (int32_t& v : d.valid_lens) v = len(rng);
  if (c.head_mask) {
    d.head_mask = RandomVector(rng, m.num_heads, 0.0f, 2.0f);
    d.head_mask[0] = 0.0f;  // a dropped head
  }
  return d;
}

void ShareScoringAcrossHeads(const ModelConfig& c, Weights& w) {
  const size_t matrix = c.additive_hidden * c.head_size();
  for (int64_t h = 1; h < c.num_heads; ++h) {
    std::copy_n(w.score_w_q.begin(), matrix, w.score_w_q.begin() + h * matrix);
    std::copy_n(w.score_w_k.begin(), matrix, w.score_w_k.begin() + h * matrix);
    std::copy_n(w.score_w_v.begin(), c.additive_hidden,
                w.score_w_v.begin() + h * c.additive_hidden);
  }
}

void CheckAgainstReference(const Case& c, uint64_t seed, double tolerance) {
  SCOPED_TRACE(c.Describe());
  std::mt19937_64 rng(seed);
  Weights weights = SeededWeights(c.config, seed);
  if (c.shared_scoring) ShareScoringAcrossHeads(c.config, weights);
  auto mha = MultiHeadAttention::Create(c.config, weights, c.options);
  ASSERT_TRUE(mha.ok()) << mha.status();
  const Data d = MakeData(c, rng);
  const AttentionInputs in = d.Inputs(c);
  const int64_t h = c.config.num_heads;
  std::vector<float> out(c.batch * c.num_queries * c.config.num_hiddens, -7.0f);
  std::vector<float> attn(c.weights ? c.batch * h * c.num_queries * c.num_keys : 0, -7.0f);
  ASSERT_TRUE((*mha)->Forward(in, out.data(), c.weights ? attn.data() : nullptr).ok());
  const ReferenceResult ref = ReferenceForward(c.config, weights, in);
  EXPECT_LE(MaxAbsDiff(out, ref.output), tolerance);
  if (c.weights) {
    EXPECT_LE(MaxAbsDiff(attn, ref.attention), tolerance);
    // Masked entries are exactly zero, not merely small.
    for (size_t i = 0; i < attn.size(); ++i) {
      if (ref.attention[i] == 0.0) {
        ASSERT_EQ(attn[i], 0.0f) << "index " << i;
      }
    }
  }
}

Case RandomCase(std::mt19937_64& rng, Precision precision, Scoring scoring = Scoring::kDotProduct) {
  auto pick = [&](std::initializer_list<int64_t> xs) {
    return *(xs.begin() + std::uniform_int_distribution<size_t>(0, xs.size() - 1)(rng));
  };
  auto between = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  Case c;
  c.config.num_heads = pick({1, 2, 5, 8, 12});
  c.config.num_hiddens = c.config.num_heads * pick({1, 3, 8, 16, 20, 24});
  c.config.bias = between(0, 1) == 1;
  c.config.precision = precision;
  c.self_attention = between(0, 3) == 0;
  if (c.self_attention) {
    c.config.query_size = c.config.key_size = c.config.value_size = between(1, 64);
  } else {
    c.config.query_size = between(1, 64);
    c.config.key_size = between(1, 64);
    c.config.value_size = between(0, 3) == 0 ? c.config.key_size : between(1, 64);
    c.same_keys_values = c.config.key_size == c.config.value_size && between(0, 1) == 1;
  }
  c.batch = between(1, 8);
  // Lengths: often 1, often a non-multiple of 16, up to 300.
  c.num_queries = pick({1, 2, 7, 16, 33, 100, 129, between(1, 300)});
  c.num_keys = c.self_attention ? c.num_queries : pick({1, 3, 16, 45, 130, between(1, 300)});
  // Keep the double-precision reference affordable.
  while (c.batch * c.num_queries * c.num_keys * c.config.num_hiddens > 60'000'000) {
    c.batch = std::max<int64_t>(1, c.batch / 2);
    if (c.batch == 1) break;
  }
  c.mask_kind = static_cast<int>(between(0, 2));
  c.causal = between(0, 2) == 0;
  c.head_mask = between(0, 3) == 0;
  c.weights = between(0, 2) == 0;
  c.options.query_block = pick({64, 16, 7});
  c.options.key_block = pick({256, 32, 5});
  if (scoring == Scoring::kAdditive) {
    c.config.scoring = scoring;
    c.config.additive_hidden = pick({1, 3, 16, 64});
    c.shared_scoring = between(0, 1) == 1;
    // The reference evaluates a tanh per (query, key, head, feature) in double.
    while (c.batch * c.num_queries * c.num_keys * c.config.num_hiddens * c.config.additive_hidden >
               100'000'000 &&
           c.num_queries > 1) {
      c.batch = std::max<int64_t>(1, c.batch / 2);
      if (c.batch == 1) {
        c.num_queries = std::max<int64_t>(1, c.num_queries / 2);
        if (c.self_attention) c.num_keys = c.num_queries;
      }
    }
  }
  return c;
}

class RandomizedTest : public ::testing::TestWithParam<int> {};

TEST_P(RandomizedTest, F32MatchesReference) {
  std::mt19937_64 rng(1000 + GetParam());
  CheckAgainstReference(RandomCase(rng, Precision::kF32), 1000 + GetParam(), kF32Tolerance);
}

TEST_P(RandomizedTest, Bf16MatchesReferenceWithinBound) {
  std::mt19937_64 rng(5000 + GetParam());
  CheckAgainstReference(RandomCase(rng, Precision::kBf16), 5000 + GetParam(), kBf16Tolerance);
}

INSTANTIATE_TEST_SUITE_P(Shapes, RandomizedTest, ::testing::Range(0, 40));

class AdditiveRandomizedTest : public ::testing::TestWithParam<int> {};

TEST_P(AdditiveRandomizedTest, F32MatchesReference) {
  std::mt19937_64 rng(9000 + GetParam());
  CheckAgainstReference(RandomCase(rng, Precision::kF32, Scoring::kAdditive), 9000 + GetParam(),
                        kF32Tolerance);
}

TEST_P(AdditiveRandomizedTest, Bf16MatchesReferenceWithinBound) {
  std::mt19937_64 rng(13000 + GetParam());
  CheckAgainstReference(RandomCase(rng, Precision::kBf16, Scoring::kAdditive), 13000 + GetParam(),
                        kBf16Tolerance);
}

INSTANTIATE_TEST_SUITE_P(Shapes, AdditiveRandomizedTest, ::testing::Range(0, 24));

// Every combination of mask kinds on one shape that spans several blocks.
// Each scoring, additive in both layouts.
TEST(AttentionTest, EveryMaskCombinationMatchesReference) {
  struct Scorer {
    Scoring scoring;
    int64_t additive_hidden;
    bool shared;
  };
  for (const Scorer& scorer :
       {Scorer{Scoring::kDotProduct, 0, false}, Scorer{Scoring::kAdditive, 6, false},
        Scorer{Scoring::kAdditive, 6, true}}) {
    for (int mask_kind = 0; mask_kind < 3; ++mask_kind) {
      for (bool causal : {false, true}) {
        for (bool head_mask : {false, true}) {
          for (bool weights : {false, true}) {
            Case c;
            c.config = {.num_hiddens = 40,
                        .num_heads = 5,
                        .query_size = 24,
                        .key_size = 12,
                        .value_size = 20,
                        .bias = true,
                        .scoring = scorer.scoring,
                        .additive_hidden = scorer.additive_hidden};
            c.options = {.query_block = 8, .key_block = 16};
            c.batch = 3;
            c.num_queries = 37;
            c.num_keys = 53;
            c.mask_kind = mask_kind;
            c.causal = causal;
            c.head_mask = head_mask;
            c.weights = weights;
            c.shared_scoring = scorer.shared;
            CheckAgainstReference(c, 77, kF32Tolerance);
          }
        }
      }
    }
  }
}

// Calls whose heads' full key blocks are read by several tasks copy them once into
// the block GEMMs' layouts (PreBlockKv: K, and V in bf16): blocks of 64 keys, 5 query
// blocks of 16 reading each, the last key block partly pad rows, every mask kind,
// causal or not, f32 and bf16 (gqa_rope_test.cc has a grouped-query case).
TEST(AttentionTest, PreBlockedKeysAndValuesMatchReference) {
  for (const Precision precision : {Precision::kF32, Precision::kBf16}) {
    for (int mask_kind = 0; mask_kind < 3; ++mask_kind) {
      for (bool causal : {false, true}) {
        for (bool self_attention : {false, true}) {
          Case c;
          c.config = {.num_hiddens = 128,
                      .num_heads = 2,
                      .query_size = 24,
                      .key_size = 20,
                      .value_size = 12,
                      .bias = true,
                      .precision = precision};
          if (self_attention) c.config.key_size = c.config.value_size = c.config.query_size;
          c.options = {.query_block = 16, .key_block = 64};
          c.batch = 2;
          c.num_queries = 70;
          c.num_keys = self_attention ? 70 : 101;
          c.self_attention = self_attention;
          c.mask_kind = mask_kind;
          c.causal = causal;
          CheckAgainstReference(c, 311,
                                precision == Precision::kF32 ? kF32Tolerance : kBf16Tolerance);
        }
      }
    }
  }
}

// Self-attention of 128 queries or more projects each head's Q, K and V columns
// straight into its head-major place (ProjectHeadColumns), in tasks of 256 rows and a
// remainder (300 = 256 + 32 + 12). With 64 features a head, every head's GEMM reads
// its columns in place in the packed W_qkv; with 32, every other head starts inside
// a column block and reads a packing of its own.
TEST(AttentionTest, HeadsProjectedInPlaceMatchReference) {
  for (const Precision precision : {Precision::kF32, Precision::kBf16}) {
    for (const int64_t p : {32, 64}) {
      for (int mask_kind = 0; mask_kind < 3; ++mask_kind) {
        for (const bool causal : {false, true}) {
          Case c;
          c.config = {.num_hiddens = 4 * p,
                      .num_heads = 4,
                      .query_size = 48,
                      .key_size = 48,
                      .value_size = 48,
                      .bias = true,
                      .precision = precision};
          c.options.num_threads = 2;
          c.batch = 2;
          c.num_queries = c.num_keys = 300;
          c.self_attention = true;
          c.mask_kind = mask_kind;
          c.causal = causal;
          c.head_mask = mask_kind == 1;
          CheckAgainstReference(c, 71,
                                precision == Precision::kF32 ? kF32Tolerance : kBf16Tolerance);
        }
      }
    }
  }
}

// A call whose rows x max(Q, K) x p_o passes 2^20 elements runs as slices of batch rows
// (core/attention.cc, kSliceElements): here 5 rows of 2900 keys x 128 run as 2 + 2 + 1.
// Every input, mask kind and the returned weights must be sliced at the right offsets.
TEST(AttentionTest, LargeBatchRunsAsSlicesAndMatchesReference) {
  for (int mask_kind = 0; mask_kind < 3; ++mask_kind) {
    Case c;
    c.config = {.num_hiddens = 128,
                .num_heads = 4,
                .query_size = 32,
                .key_size = 24,
                .value_size = 40,
                .bias = true};
    c.batch = 5;
    c.num_queries = 9;
    c.num_keys = 2900;
    c.mask_kind = mask_kind;
    c.weights = mask_kind != 0;
    CheckAgainstReference(c, 101 + mask_kind, kF32Tolerance);
  }
}

// More threads asked for than OpenMP gives (OMP_THREAD_LIMIT; ctest also runs this
// test with OMP_THREAD_LIMIT=1 as core_thread_limit_test): every output is computed.
TEST(AttentionTest, MatchesReferenceWhenOpenMpGivesFewerThreads) {
  for (const bool self_attention : {true, false}) {
    Case c;
    c.config = ModelConfig{.num_hiddens = 64,
                           .num_heads = 4,
                           .query_size = 64,
                           .key_size = 64,
                           .value_size = 64,
                           .bias = true};
    c.options.num_threads = 4;
    c.batch = 3;
    c.num_queries = 200;
    c.num_keys = self_attention ? 200 : 150;
    c.self_attention = self_attention;
    c.mask_kind = 1;
    CheckAgainstReference(c, 11, kF32Tolerance);
  }
}

TEST(AttentionTest, SeedsToyExample) {
  // d2l: p_o 100, h 5, queries (2, 4, 100), keys = values (2, 6, 100), valid_lens [3, 2].
  Case c;
  c.batch = 2;
  c.num_queries = 4;
  c.num_keys = 6;
  c.same_keys_values = true;
  c.mask_kind = 1;
  std::mt19937_64 rng(0);
  const Weights w = SeededWeights(c.config, 0);
  auto mha = MultiHeadAttention::Create(c.config, w).value();
  Data d = MakeData(c, rng);
  d.valid_lens = {3, 2};
  std::vector<float> out(2 * 4 * 100);
  ASSERT_TRUE(mha->Forward(d.Inputs(c), out.data()).ok());
  EXPECT_EQ(out.size(), 2u * 4 * 100);
  EXPECT_LE(MaxAbsDiff(out, ReferenceForward(c.config, w, d.Inputs(c)).output), kF32Tolerance);
}

TEST(AttentionTest, ZeroValidLenGivesZeroContext) {
  for (bool bias : {false, true}) {
    ModelConfig config{.num_hiddens = 16,
                       .num_heads = 4,
                       .query_size = 8,
                       .key_size = 8,
                       .value_size = 8,
                       .bias = bias};
    const Weights w = SeededWeights(config, 3);
    auto mha = MultiHeadAttention::Create(config, w).value();
    std::mt19937_64 rng(1);
    const auto x = RandomVector(rng, 2 * 5 * 8);
    const std::vector<int32_t> lens = {0, 5};
    std::vector<float> out(2 * 5 * 16), attn(2 * 4 * 5 * 5, -1.0f);
    AttentionInputs in{.batch = 2,
                       .num_queries = 5,
                       .num_keys = 5,
                       .queries = x.data(),
                       .keys = x.data(),
                       .values = x.data(),
                       .valid_lens = lens};
    ASSERT_TRUE(mha->Forward(in, out.data(), attn.data()).ok());
    // Batch row 0 sees no key: context 0, so the output is exactly b_o (or 0).
    for (int64_t i = 0; i < 5; ++i) {
      for (int64_t o = 0; o < 16; ++o) {
        ASSERT_EQ(out[i * 16 + o], bias ? w.b_o[o] : 0.0f);
        ASSERT_FALSE(std::isnan(out[i * 16 + o]));
      }
    }
    for (int64_t i = 0; i < 4 * 5 * 5; ++i) ASSERT_EQ(attn[i], 0.0f);
    // Row 1 is a proper softmax: every weight row sums to 1.
    for (int64_t r = 0; r < 4 * 5; ++r) {
      double sum = 0;
      for (int64_t j = 0; j < 5; ++j) sum += attn[(4 * 5 + r) * 5 + j];
      EXPECT_NEAR(sum, 1.0, 1e-5);
    }
  }
}

TEST(AttentionTest, SelfAttentionEqualsCrossAttentionOnSameInput) {
  ModelConfig config{.num_hiddens = 24,
                     .num_heads = 3,
                     .query_size = 10,
                     .key_size = 10,
                     .value_size = 10,
                     .bias = true};
  auto mha = MultiHeadAttention::Create(config, SeededWeights(config, 9)).value();
  std::mt19937_64 rng(2);
  const auto x = RandomVector(rng, 3 * 11 * 10);
  const std::vector<int32_t> lens = {11, 4, 7};
  std::vector<float> self(3 * 11 * 24), cross(3 * 11 * 24);
  AttentionInputs in{
      .batch = 3, .num_queries = 11, .num_keys = 11, .queries = x.data(), .valid_lens = lens};
  ASSERT_TRUE(mha->Forward(in, self.data()).ok());
  in.keys = in.values = x.data();
  ASSERT_TRUE(mha->Forward(in, cross.data()).ok());
  EXPECT_LE(MaxAbsDiff(self, cross), 1e-5);
}

// Four threads call `mha` on `in` `reps` times each; every answer equals a lone call's.
void ExpectConcurrentCallsAgree(const MultiHeadAttention& mha, const AttentionInputs& in,
                                int reps) {
  std::vector<float> expected(in.batch * in.num_queries * mha.config().num_hiddens);
  ASSERT_TRUE(mha.Forward(in, expected.data()).ok());
  std::vector<std::vector<float>> outs(4, std::vector<float>(expected.size()));
  std::vector<std::thread> threads;
  for (auto& out : outs) {
    threads.emplace_back([&] {
      for (int rep = 0; rep < reps; ++rep) ASSERT_TRUE(mha.Forward(in, out.data()).ok());
    });
  }
  for (auto& t : threads) t.join();
  for (const auto& out : outs) EXPECT_EQ(out, expected);
}

TEST(AttentionTest, ConcurrentCallsAgree) {
  ModelConfig config{
      .num_hiddens = 64, .num_heads = 8, .query_size = 64, .key_size = 64, .value_size = 64};
  auto mha = MultiHeadAttention::Create(config, SeededWeights(config, 4),
                                        {.num_threads = 1, .query_block = 16, .key_block = 32})
                 .value();
  std::mt19937_64 rng(3);
  const auto x = RandomVector(rng, 2 * 70 * 64);
  const std::vector<int32_t> lens = {70, 33};
  AttentionInputs in{
      .batch = 2, .num_queries = 70, .num_keys = 70, .queries = x.data(), .valid_lens = lens};
  ExpectConcurrentCallsAgree(*mha, in, 10);
}

// The small-shape path (blocks of at most kSmallBlockMacs multiply-adds run by
// kernels::SmallScores / SmallContext in registers): mha_core_bench's small shape
// (heads of 32 against 16 keys) and heads of 16 against 37 keys (a 16-key group and
// a tail), self- and cross-attention, every mask kind and their combinations.
TEST(AttentionTest, SmallShapeEveryMaskMatchesReference) {
  struct Shape {
    int64_t hiddens, heads, queries, keys;
    bool self;
  };
  for (const Shape& shape : {Shape{256, 8, 16, 16, true}, Shape{64, 4, 9, 37, false}}) {
    for (int mask_kind = 0; mask_kind < 3; ++mask_kind) {
      for (bool causal : {false, true}) {
        for (bool head_mask : {false, true}) {
          for (bool weights : {false, true}) {
            Case c;
            c.config = {.num_hiddens = shape.hiddens,
                        .num_heads = shape.heads,
                        .query_size = shape.hiddens,
                        .key_size = shape.hiddens,
                        .value_size = shape.hiddens,
                        .bias = true};
            c.batch = 2;
            c.num_queries = shape.queries;
            c.num_keys = shape.keys;
            c.self_attention = shape.self;
            c.mask_kind = mask_kind;
            c.causal = causal;
            c.head_mask = head_mask;
            c.weights = weights;
            CheckAgainstReference(c, 91, kF32Tolerance);
          }
        }
      }
    }
  }
}

// Concurrent calls on the small-shape path share the layer's primitives and
// workspace pool; each thread's answers equal a lone call's (run under TSan in CI).
TEST(AttentionTest, SmallShapeConcurrentCallsAgree) {
  ModelConfig config{
      .num_hiddens = 256, .num_heads = 8, .query_size = 256, .key_size = 256, .value_size = 256};
  auto mha = MultiHeadAttention::Create(config, SeededWeights(config, 5)).value();
  std::mt19937_64 rng(4);
  const auto x = RandomVector(rng, 16 * 256);
  const std::vector<int32_t> lens = {11};
  const AttentionInputs in{
      .batch = 1, .num_queries = 16, .num_keys = 16, .queries = x.data(), .valid_lens = lens};
  ExpectConcurrentCallsAgree(*mha, in, 20);
}

TEST(AttentionTest, RejectsBadInputsNamingTheField) {
  ModelConfig config{
      .num_hiddens = 8, .num_heads = 2, .query_size = 4, .key_size = 4, .value_size = 4};
  auto mha = MultiHeadAttention::Create(config, SeededWeights(config, 0)).value();
  std::vector<float> x(2 * 3 * 4), out(2 * 3 * 8);
  struct Bad {
    std::vector<int32_t> lens;
    std::vector<float> head_mask;
    bool keys_only;
    const char* field;
  };
  const Bad bad[] = {
      {{4, 1}, {}, false, "valid_lens[0]"},   // > K
      {{-1, 1}, {}, false, "valid_lens[0]"},  // negative
      {{1, 1, 1}, {}, false, "valid_lens"},   // neither B nor B*Q entries
      {{}, {1, 1, 1}, false, "head_mask"},    // h = 2
      {{}, {1, NAN}, false, "head_mask[1]"}, {{}, {}, true, "keys, values"},
  };
  for (const Bad& b : bad) {
    AttentionInputs in{.batch = 2,
                       .num_queries = 3,
                       .num_keys = 3,
                       .queries = x.data(),
                       .keys = x.data(),
                       .values = b.keys_only ? nullptr : x.data(),
                       .valid_lens = b.lens,
                       .head_mask = b.head_mask};
    const absl::Status s = mha->Forward(in, out.data());
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << b.field;
    EXPECT_TRUE(absl::StartsWith(s.message(), b.field)) << s.message();
  }
  ModelConfig cross{
      .num_hiddens = 8, .num_heads = 2, .query_size = 4, .key_size = 5, .value_size = 4};
  auto cross_mha = MultiHeadAttention::Create(cross, SeededWeights(cross, 0)).value();
  AttentionInputs self{.batch = 2, .num_queries = 3, .num_keys = 3, .queries = x.data()};
  EXPECT_EQ(cross_mha->Forward(self, out.data()).code(), absl::StatusCode::kInvalidArgument);
}

TEST(AttentionTest, FlopsCountsProjectionsAndBothProducts) {
  ModelConfig c{
      .num_hiddens = 768, .num_heads = 12, .query_size = 768, .key_size = 768, .value_size = 768};
  // BERT-base, B 8, L 128: 4 * 2*B*L*E*E + 2 * 2*B*L*L*E.
  const double b = 8, l = 128, e = 768;
  EXPECT_DOUBLE_EQ(MultiHeadAttention::Flops(c, 8, 128, 128),
                   8 * b * l * e * e + 4 * b * l * l * e);
}

TEST(AttentionTest, FlopsCountsAdditiveScoring) {
  ModelConfig c{.num_hiddens = 256,
                .num_heads = 8,
                .query_size = 256,
                .key_size = 256,
                .value_size = 256,
                .scoring = Scoring::kAdditive,
                .additive_hidden = 64};
  // Four projections; A_q q and A_k k (2*B*(Q+K)*E*p_a); 4 per (head, query, key,
  // feature); the context product.
  const double b = 4, l = 128, e = 256, h = 8, pa = 64;
  EXPECT_DOUBLE_EQ(
      MultiHeadAttention::Flops(c, 4, 128, 128),
      8 * b * l * e * e + 2 * b * 2 * l * e * pa + 4 * b * h * l * l * pa + 2 * b * l * l * e);
}

// A query with no valid key has a zero context under additive scoring too.
TEST(AttentionTest, AdditiveZeroValidLenGivesZeroContext) {
  ModelConfig c{.num_hiddens = 12,
                .num_heads = 3,
                .query_size = 5,
                .key_size = 5,
                .value_size = 5,
                .scoring = Scoring::kAdditive,
                .additive_hidden = 4};
  auto mha = MultiHeadAttention::Create(c, SeededWeights(c, 3)).value();
  std::mt19937_64 rng(3);
  const std::vector<float> x = RandomVector(rng, 2 * 4 * 5);
  const int32_t lens[] = {0, 2};
  std::vector<float> out(2 * 4 * 12, -1.0f), attn(2 * 3 * 4 * 4, -1.0f);
  AttentionInputs in{.batch = 2,
                     .num_queries = 4,
                     .num_keys = 4,
                     .queries = x.data(),
                     .keys = x.data(),
                     .values = x.data(),
                     .valid_lens = lens};
  ASSERT_TRUE(mha->Forward(in, out.data(), attn.data()).ok());
  for (int64_t i = 0; i < 4 * 12; ++i) EXPECT_EQ(out[i], 0.0f) << i;  // no bias: W_o 0 = 0
  for (int64_t i = 0; i < 3 * 4 * 4; ++i) EXPECT_EQ(attn[i], 0.0f) << i;
  EXPECT_NE(out[4 * 12], 0.0f);
}

// Prepare builds every primitive that calls of new shapes use (the projections' row
// chunks, the padded attention blocks): after it, calls whose row counts are multiples
// of 16 but whose Q, K, valid lengths and masks no call had before build none, and
// still match the reference. Remainders below 16 rows are built when met (not here).
// For each thread rule: a model prepared for it builds nothing for calls that keep to
// it (kBeside: the server's, max_threads = Threads(inputs, kBeside)), and kBeside
// prepares fewer primitives where a one-region call's column shares exist.
// A model's GEMMs run in its precision where oneDNN makes bf16 matmuls, and bf16 and
// int8 models' in f32 where it does not (docs/core.md, "Precision on CPUs without
// AVX-512"); f32 models in f32 everywhere.
TEST(AttentionTest, GemmPrecisionFallsBackToF32OnlyWithoutBf16Matmuls) {
  for (const Precision precision : {Precision::kF32, Precision::kBf16, Precision::kInt8}) {
    SCOPED_TRACE(PrecisionName(precision));
    const ModelConfig c{.num_hiddens = 64,
                        .num_heads = 4,
                        .query_size = 64,
                        .key_size = 64,
                        .value_size = 64,
                        .bias = true,
                        .precision = precision};
    auto mha = MultiHeadAttention::Create(c, SeededWeights(c, 3)).value();
    EXPECT_EQ(mha->GemmPrecision(), internal::Bf16MatmulsSupported() ? precision : Precision::kF32);
  }
}

TEST(AttentionTest, PreparedModelBuildsNoPrimitivesForNewShapes) {
  using Rule = MultiHeadAttention::ThreadRule;
  for (const auto& [precision, rule] :
       {std::pair{Precision::kF32, Rule::kAlone}, std::pair{Precision::kBf16, Rule::kAlone},
        std::pair{Precision::kInt8, Rule::kAlone}, std::pair{Precision::kF32, Rule::kBeside},
        std::pair{Precision::kBf16, Rule::kBeside}}) {
    Case base;
    base.config = ModelConfig{.num_hiddens = 256,
                              .num_heads = 4,
                              .query_size = 256,
                              .key_size = 256,
                              .value_size = 256,
                              .bias = true,
                              .precision = precision};
    base.options.num_threads = 2;
    SCOPED_TRACE(PrecisionName(precision));
    SCOPED_TRACE(rule == Rule::kAlone ? "kAlone" : "kBeside");
    const Weights weights = SeededWeights(base.config, 5);
    auto mha = MultiHeadAttention::Create(base.config, weights, base.options).value();
    const int built = mha->Prepare(1024, 512, rule);
    EXPECT_GT(built, 0);
    EXPECT_EQ(mha->Prepare(1024, 512, rule), 0);  // all there
    if (rule == Rule::kBeside && omp_get_thread_limit() > 1) {
      const auto alone = MultiHeadAttention::Create(base.config, weights, base.options).value();
      EXPECT_LT(built, alone->Prepare(1024, 512, Rule::kAlone));  // no column shares
    }
    const int64_t made = internal::MatmulsMade();
    struct Shape {
      int64_t batch, queries, keys;  // keys 0: self-attention
      std::vector<int32_t> lens;
      bool causal = false, head_mask = false;
    };
    const std::vector<Shape> shapes = {
        {1, 96, 0, {}},                  // bert_self's kind
        {2, 24, 40, {}},                 // bert_cross's: K != Q, blocks padded to 32 x 64
        {3, 80, 0, {64, 33, 7}},         // self, valid_lens below K: per-row key prefixes
        {2, 48, 208, {150, 208}, true},  // cross, causal (top-left: 48 key rows)
        {1, 112, 496, {}, false, true},  // head_mask, keys past one block
        {4, 20, 0, {}, true},            // self, causal
        {4, 8, 0, {4, 3, 4, 1}},         // self, short prefixes gathered into one GEMM
        {2, 16, 12, {4, 8}},             // cross, the same
        {1, 16, 0, {}},                  // self, small: one region on two threads
        {1, 512, 0, {}},                 // 4 query blocks read the key block: PreBlockKv
        {2, 288, 0, {}},                 // heads projected in place, chunks of 256 + 32
    };
    std::mt19937_64 rng(17);
    for (const Shape& shape : shapes) {
      Case c = base;
      c.batch = shape.batch;
      c.num_queries = shape.queries;
      c.num_keys = shape.keys == 0 ? shape.queries : shape.keys;
      c.self_attention = shape.keys == 0;
      c.causal = shape.causal;
      c.head_mask = shape.head_mask;
      SCOPED_TRACE(c.Describe());
      Data d = MakeData(c, rng);
      d.valid_lens = shape.lens;
      std::vector<float> out(c.batch * c.num_queries * c.config.num_hiddens);
      const int max_threads = rule == Rule::kBeside ? mha->Threads(d.Inputs(c), rule) : 0;
      ASSERT_TRUE(mha->Forward(d.Inputs(c), out.data(), nullptr, max_threads).ok());
      const ReferenceResult ref = ReferenceForward(c.config, weights, d.Inputs(c));
      if (precision == Precision::kInt8) {
        EXPECT_LE(::mha::testing::RelativeFrobenius(out, ref.output), 2e-2);  // int8_test.cc
      } else {
        EXPECT_LE(MaxAbsDiff(out, ref.output),
                  precision == Precision::kF32 ? kF32Tolerance : kBf16Tolerance);
      }
    }
    EXPECT_EQ(internal::MatmulsMade(), made) << "primitives built after Prepare";
  }
}

// Row counts past one chunk, and remainders, projected in pieces (internal::RowChunk):
// self and cross, per-row key prefixes (one projection per batch row).
TEST(AttentionTest, MatchesReferenceAcrossRowChunks) {
  for (const int64_t rows : {17, 100, 1100}) {
    for (const bool self_attention : {true, false}) {
      Case c;
      c.config = ModelConfig{.num_hiddens = 32,
                             .num_heads = 2,
                             .query_size = 16,
                             .key_size = 16,
                             .value_size = 16,
                             .bias = true};
      if (self_attention) c.config.key_size = c.config.value_size = c.config.query_size;
      c.options.num_threads = 2;
      c.batch = 1;
      c.num_queries = rows;
      c.num_keys = self_attention ? rows : rows + 3;
      c.self_attention = self_attention;
      c.mask_kind = 1;
      CheckAgainstReference(c, 23, kF32Tolerance);
    }
  }
}

}  // namespace
}  // namespace mha::core

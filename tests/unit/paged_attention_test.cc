// MultiHeadAttention::ForwardPaged (attention over a KvSequence's blocks) against
// the stateless Forward on the whole sequence, and against the double-precision
// reference; KvCachePool's budget and block reuse.
#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/attention.h"
#include "core/kv_cache.h"
#include "core/reference.h"
#include "gtest/gtest.h"
#include "tests/unit/test_util.h"

namespace mha::core {
namespace {

using ::mha::testing::MaxAbsDiff;
using ::mha::testing::RandomVector;

// Paged steps against a stateless Forward of the same f32 layer: both sum the same
// products in different orders (plain loops vs oneDNN's GEMMs).
constexpr double kSameLayerTolerance = 1e-5;
// Against the double-precision reference, as attention_test's f32 cases.
constexpr double kReferenceTolerance = 1e-4;
constexpr int64_t kBudget = int64_t{1} << 30;
constexpr float kNone = 0;

ModelConfig Toy(bool bias) {
  ModelConfig c;  // p_o 100, h 5
  c.bias = bias;
  return c;
}

ModelConfig BertBase(bool bias) {
  ModelConfig c;
  c.num_hiddens = c.query_size = c.key_size = c.value_size = 768;
  c.num_heads = 12;
  c.bias = bias;
  return c;
}

struct Layer {
  ModelConfig config;
  Weights weights;
  std::unique_ptr<MultiHeadAttention> mha;
};

Layer Make(const ModelConfig& config, uint64_t seed = 3) {
  Weights w = SeededWeights(config, seed);
  auto mha = MultiHeadAttention::Create(config, w);
  EXPECT_TRUE(mha.ok()) << mha.status();
  return {config, std::move(w), std::move(mha).value()};
}

// Feeds `x` (n, d) to a self-attention session in chunks of the given sizes.
std::vector<float> SelfSession(const Layer& layer, KvCachePool& pool, const std::vector<float>& x,
                               const std::vector<int64_t>& chunks) {
  const int64_t d = layer.config.query_size, E = layer.config.num_hiddens;
  KvSequence seq(&pool, layer.config.num_heads, layer.config.head_size());
  std::vector<float> out;
  int64_t at = 0;
  for (int64_t t : chunks) {
    EXPECT_TRUE(seq.Reserve(t).ok());
    std::vector<float> y(t * E);
    const PagedStep step{.num_queries = t,
                         .queries = x.data() + at * d,
                         .causal = true,
                         .cache = &seq,
                         .output = y.data()};
    const absl::Status s = layer.mha->ForwardPaged({&step, 1});
    EXPECT_TRUE(s.ok()) << s;
    out.insert(out.end(), y.begin(), y.end());
    at += t;
  }
  EXPECT_EQ(seq.size(), at);
  return out;
}

std::vector<float> StatelessCausal(const Layer& layer, const std::vector<float>& x, int64_t n) {
  std::vector<float> out(n * layer.config.num_hiddens);
  const AttentionInputs in{
      .batch = 1, .num_queries = n, .num_keys = n, .queries = x.data(), .causal = true};
  EXPECT_TRUE(layer.mha->Forward(in, out.data()).ok());
  return out;
}

class PagedSelfTest : public ::testing::TestWithParam<std::tuple<bool, bool>> {};

TEST_P(PagedSelfTest, AnyChunkingEqualsOneCausalForward) {
  const auto [bert, bias] = GetParam();
  const Layer layer = Make(bert ? BertBase(bias) : Toy(bias));
  const int64_t n = 75;  // crosses two block boundaries
  std::mt19937_64 rng(7);
  const std::vector<float> x = RandomVector(rng, n * layer.config.query_size);
  const std::vector<float> want = StatelessCausal(layer, x, n);
  const AttentionInputs in{
      .batch = 1, .num_queries = n, .num_keys = n, .queries = x.data(), .causal = true};
  const ReferenceResult ref = ReferenceForward(layer.config, layer.weights, in);
  KvCachePool pool(kBudget);
  const std::vector<std::vector<int64_t>> chunkings = {
      std::vector<int64_t>(n, 1), {n}, {1, 31, 1, 32, 10}, {40, 35}, {17, 17, 17, 24}};
  for (const auto& chunks : chunkings) {
    const std::vector<float> got = SelfSession(layer, pool, x, chunks);
    EXPECT_LE(MaxAbsDiff(got, want), kSameLayerTolerance) << chunks.size() << " chunks";
    EXPECT_LE(MaxAbsDiff(got, ref.output), kReferenceTolerance) << chunks.size() << " chunks";
  }
  EXPECT_EQ(pool.used_bytes(), 0);  // every sequence gave its blocks back
}

INSTANTIATE_TEST_SUITE_P(ToyAndBertBase, PagedSelfTest,
                         ::testing::Combine(::testing::Bool(), ::testing::Bool()));

// Truncate undoes steps: the same step again gives the same output, and another token
// in its place gives what a session that never saw the first one gives.
TEST(PagedTruncateTest, UndoneStepsLeaveNoTrace) {
  const Layer layer = Make(BertBase(true));  // two threads on a decode step
  const int64_t d = layer.config.query_size, E = layer.config.num_hiddens;
  std::mt19937_64 rng(5);
  const std::vector<float> x = RandomVector(rng, 42 * d);  // rows 0-39, then 40 or 41
  KvCachePool pool(kBudget);
  KvSequence seq(&pool, layer.config.num_heads, layer.config.head_size());
  auto step = [&](const float* q, int64_t n) {
    EXPECT_TRUE(seq.Reserve(n).ok());
    std::vector<float> y(n * E);
    const PagedStep s{
        .num_queries = n, .queries = q, .causal = true, .cache = &seq, .output = y.data()};
    EXPECT_TRUE(layer.mha->ForwardPaged({&s, 1}).ok());
    return y;
  };
  step(x.data(), 40);
  const std::vector<float> first = step(x.data() + 40 * d, 1);
  for (int again = 0; again < 3; ++again) {
    seq.Truncate(40);
    EXPECT_EQ(step(x.data() + 40 * d, 1), first) << again;
  }
  seq.Truncate(40);
  const std::vector<float> other = step(x.data() + 41 * d, 1);
  EXPECT_EQ(seq.size(), 41);
  std::vector<float> rows(x.begin(), x.begin() + 40 * d);
  rows.insert(rows.end(), x.begin() + 41 * d, x.end());
  const std::vector<float> full = StatelessCausal(layer, rows, 41);
  EXPECT_LE(MaxAbsDiff(other, std::vector<float>(full.end() - E, full.end())), kSameLayerTolerance);
}

// Cross-attention: keys and values appended in chunks, queries at several points,
// each against a stateless Forward on every key appended so far.
TEST(PagedCrossTest, QueriesSeeEveryKeyAppendedSoFar) {
  for (bool bias : {false, true}) {
    ModelConfig c = Toy(bias);
    c.key_size = 40;
    c.value_size = 60;
    const Layer layer = Make(c);
    std::mt19937_64 rng(11);
    KvCachePool pool(kBudget);
    KvSequence seq(&pool, c.num_heads, c.head_size());
    std::vector<float> keys, values;
    for (int64_t tk : {5, 0, 40, 1}) {
      const int64_t tq = tk == 0 ? 3 : (tk % 2) + 1;
      const std::vector<float> k = RandomVector(rng, tk * c.key_size);
      const std::vector<float> v = RandomVector(rng, tk * c.value_size);
      const std::vector<float> q = RandomVector(rng, tq * c.query_size);
      keys.insert(keys.end(), k.begin(), k.end());
      values.insert(values.end(), v.begin(), v.end());
      ASSERT_TRUE(seq.Reserve(tk).ok());
      std::vector<float> got(tq * c.num_hiddens);
      const PagedStep step{.num_queries = tq,
                           .queries = q.data(),
                           .num_keys = tk,
                           // keys == nullptr means self-attention: a cross step
                           // without new keys still points somewhere.
                           .keys = tk > 0 ? k.data() : &kNone,
                           .values = tk > 0 ? v.data() : &kNone,
                           .cache = &seq,
                           .output = got.data()};
      const absl::Status s = layer.mha->ForwardPaged({&step, 1});
      ASSERT_TRUE(s.ok()) << s;
      const int64_t all = static_cast<int64_t>(keys.size()) / c.key_size;
      ASSERT_EQ(seq.size(), all);
      std::vector<float> want(tq * c.num_hiddens);
      const AttentionInputs in{.batch = 1,
                               .num_queries = tq,
                               .num_keys = all,
                               .queries = q.data(),
                               .keys = keys.data(),
                               .values = values.data()};
      ASSERT_TRUE(layer.mha->Forward(in, want.data()).ok());
      EXPECT_LE(MaxAbsDiff(got, want), kSameLayerTolerance) << "after " << all << " keys";
    }
    // An append-only step: no queries, no output.
    const std::vector<float> k = RandomVector(rng, 3 * c.key_size);
    const std::vector<float> v = RandomVector(rng, 3 * c.value_size);
    ASSERT_TRUE(seq.Reserve(3).ok());
    const PagedStep append{.num_keys = 3, .keys = k.data(), .values = v.data(), .cache = &seq};
    ASSERT_TRUE(layer.mha->ForwardPaged({&append, 1}).ok());
    EXPECT_EQ(seq.size(), 49);
  }
}

TEST(PagedCrossTest, CausalStepsEqualOneCausalForward) {
  ModelConfig c = Toy(true);
  c.key_size = c.value_size = 30;
  const Layer layer = Make(c);
  std::mt19937_64 rng(5);
  const int64_t n = 40;
  const std::vector<float> q = RandomVector(rng, n * c.query_size);
  const std::vector<float> kv = RandomVector(rng, n * c.key_size);
  std::vector<float> want(n * c.num_hiddens);
  const AttentionInputs in{.batch = 1,
                           .num_queries = n,
                           .num_keys = n,
                           .queries = q.data(),
                           .keys = kv.data(),
                           .values = kv.data(),
                           .causal = true};
  ASSERT_TRUE(layer.mha->Forward(in, want.data()).ok());
  KvCachePool pool(kBudget);
  KvSequence seq(&pool, c.num_heads, c.head_size());
  std::vector<float> got(n * c.num_hiddens);
  int64_t at = 0;
  for (int64_t t : {1, 2, 4, 8, 16, 9}) {
    ASSERT_TRUE(seq.Reserve(t).ok());
    const PagedStep step{.num_queries = t,
                         .queries = q.data() + at * c.query_size,
                         .num_keys = t,
                         .keys = kv.data() + at * c.key_size,
                         .values = kv.data() + at * c.value_size,
                         .causal = true,
                         .cache = &seq,
                         .output = got.data() + at * c.num_hiddens};
    ASSERT_TRUE(layer.mha->ForwardPaged({&step, 1}).ok());
    at += t;
  }
  ASSERT_EQ(at, n);
  EXPECT_LE(MaxAbsDiff(got, want), kSameLayerTolerance);
}

// Steps of different sequences in one call (continuous batching) stay apart: each
// equals the same step run alone.
TEST(PagedBatchTest, InterleavedSequencesStayApart) {
  const Layer layer = Make(BertBase(true));
  const int64_t d = layer.config.query_size, E = layer.config.num_hiddens;
  std::mt19937_64 rng(9);
  const std::vector<int64_t> prefix = {3, 70, 33};
  std::vector<std::vector<float>> x;
  for (int64_t n : prefix) x.push_back(RandomVector(rng, (n + 2) * d));
  KvCachePool pool(kBudget);
  auto run = [&](bool together) {
    std::vector<std::unique_ptr<KvSequence>> seqs;
    std::vector<std::vector<float>> outs(prefix.size());
    for (size_t i = 0; i < prefix.size(); ++i) {
      seqs.push_back(std::make_unique<KvSequence>(&pool, 12, 64));
      EXPECT_TRUE(seqs[i]->Reserve(prefix[i] + 2).ok());
      std::vector<float> y(prefix[i] * E);
      const PagedStep prefill{.num_queries = prefix[i],
                              .queries = x[i].data(),
                              .causal = true,
                              .cache = seqs[i].get(),
                              .output = y.data()};
      EXPECT_TRUE(layer.mha->ForwardPaged({&prefill, 1}).ok());
    }
    // Then two decode steps; the second is one call over all sequences, or each alone.
    for (int64_t step = 0; step < 2; ++step) {
      std::vector<PagedStep> steps;
      for (size_t i = 0; i < prefix.size(); ++i) {
        outs[i].resize((step + 1) * E);
        steps.push_back({.num_queries = 1,
                         .queries = x[i].data() + (prefix[i] + step) * d,
                         .causal = true,
                         .cache = seqs[i].get(),
                         .output = outs[i].data() + step * E});
      }
      if (together) {
        EXPECT_TRUE(layer.mha->ForwardPaged(steps).ok());
      } else {
        for (const PagedStep& s : steps) EXPECT_TRUE(layer.mha->ForwardPaged({&s, 1}).ok());
      }
    }
    return outs;
  };
  const auto alone = run(false);
  const auto together = run(true);
  for (size_t i = 0; i < prefix.size(); ++i) {
    EXPECT_LE(MaxAbsDiff(together[i], alone[i]), 1e-6) << "sequence " << i;
    const std::vector<float> full = StatelessCausal(layer, x[i], prefix[i] + 2);
    const std::vector<float> last(full.end() - 2 * E, full.end());
    EXPECT_LE(MaxAbsDiff(together[i], last), kSameLayerTolerance) << "sequence " << i;
  }
}

TEST(PagedBatchTest, BadStepsAreRefusedNamingTheField) {
  const Layer layer = Make(Toy(false));
  KvCachePool pool(kBudget);
  KvSequence seq(&pool, 5, 20);
  std::vector<float> x(4 * 100), y(4 * 100);
  PagedStep step{.num_queries = 2, .queries = x.data(), .cache = &seq, .output = y.data()};
  absl::Status s = layer.mha->ForwardPaged({&step, 1});  // nothing reserved
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("Reserve"), std::string::npos) << s;
  ASSERT_TRUE(seq.Reserve(4).ok());
  step.keys = x.data();  // keys without values
  step.num_keys = 2;
  s = layer.mha->ForwardPaged({&step, 1});
  EXPECT_NE(s.message().find("keys, values"), std::string::npos) << s;
  step.values = x.data();
  step.num_keys = 1;
  step.causal = true;
  s = layer.mha->ForwardPaged({&step, 1});
  EXPECT_NE(s.message().find("causal"), std::string::npos) << s;
  const PagedStep twice[] = {
      {.num_queries = 1, .queries = x.data(), .cache = &seq, .output = y.data()},
      {.num_queries = 1, .queries = x.data(), .cache = &seq, .output = y.data()}};
  s = layer.mha->ForwardPaged(twice);
  EXPECT_NE(s.message().find("step 1: cache"), std::string::npos) << s;
  EXPECT_EQ(seq.size(), 0);  // nothing appended by a refused call
}

// A bf16 model keeps its cache in bf16: half the bytes, and steps within bf16's
// rounding of the stateless bf16 Forward.
TEST(PagedBf16Test, Bf16ModelsCacheBf16) {
  ModelConfig c = BertBase(true);
  c.precision = Precision::kBf16;
  const Layer layer = Make(c);
  const int64_t n = 40;
  std::mt19937_64 rng(3);
  const std::vector<float> x = RandomVector(rng, n * c.query_size);
  const std::vector<float> want = StatelessCausal(layer, x, n);
  KvCachePool pool(kBudget);
  KvSequence seq(&pool, c.num_heads, c.head_size(), /*bf16=*/true);
  ASSERT_TRUE(seq.Reserve(n).ok());
  EXPECT_EQ(seq.bytes(), 2 * (2 * 12 * 32 * 64 * 2));  // two blocks of 2-byte elements
  std::vector<float> got(n * c.num_hiddens);
  for (int64_t at = 0, t = 8; at < n; at += t) {
    const PagedStep step{.num_queries = t,
                         .queries = x.data() + at * c.query_size,
                         .causal = true,
                         .cache = &seq,
                         .output = got.data() + at * c.num_hiddens};
    const absl::Status s = layer.mha->ForwardPaged({&step, 1});
    ASSERT_TRUE(s.ok()) << s;
  }
  // bf16 rounds every operand to 8 significant bits, as attention_test's bf16 cases.
  EXPECT_LE(MaxAbsDiff(got, want), 1.0 / 32);
  KvSequence f32(&pool, c.num_heads, c.head_size());
  ASSERT_TRUE(f32.Reserve(1).ok());
  std::vector<float> y(c.num_hiddens);
  const PagedStep wrong{.num_queries = 1, .queries = x.data(), .cache = &f32, .output = y.data()};
  EXPECT_EQ(layer.mha->ForwardPaged({&wrong, 1}).code(), absl::StatusCode::kInvalidArgument);
}

TEST(KvCachePoolTest, BudgetRefusesWithoutPartialBlocksAndReusesReleasedOnes) {
  // Toy blocks: 2 x 5 heads x 32 tokens x 20 floats = 25,600 bytes.
  constexpr int64_t kBlock = 2 * 5 * 32 * 20 * 4;
  KvCachePool pool(3 * kBlock, /*retain_bytes=*/kBlock);
  auto a = std::make_unique<KvSequence>(&pool, 5, 20);
  ASSERT_TRUE(a->Reserve(64).ok());  // two blocks, in one chunk
  EXPECT_EQ(pool.used_bytes(), 2 * kBlock);
  {
    KvSequence b(&pool, 5, 20);
    const absl::Status s = b.Reserve(40);  // two more blocks: over the budget
    EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
    EXPECT_NE(s.message().find("budget"), std::string::npos) << s;
    EXPECT_EQ(b.capacity(), 0);
    EXPECT_EQ(pool.used_bytes(), 2 * kBlock);
    ASSERT_TRUE(b.Reserve(32).ok());  // one fits
  }
  EXPECT_EQ(pool.used_bytes(), 2 * kBlock);
  EXPECT_EQ(pool.retained_bytes(), kBlock);  // kept for the next sequence
  {
    KvSequence c(&pool, 5, 20);
    ASSERT_TRUE(c.Reserve(1).ok());
    EXPECT_EQ(pool.retained_bytes(), 0);  // reused, not mapped anew
  }
  a.reset();
  EXPECT_EQ(pool.used_bytes(), 0);
  EXPECT_EQ(pool.retained_bytes(), kBlock);  // the rest went back to the system
}

TEST(KvCachePoolTest, ChunksGrowAndKeepEachHeadsBlocksInOneRun) {
  constexpr int64_t kBt = KvCachePool::kBlockTokens, kHeads = 3, kP = 16;
  constexpr int64_t kBlock = 2 * kHeads * kBt * kP * 4, kTile = kBt * kP;
  KvCachePool pool(int64_t{1} << 30);
  KvSequence seq(&pool, kHeads, kP);
  // One block at a time, as decode steps grow a sequence: chunks of 1, 1, 2, 4, 8, 8.
  std::vector<int64_t> held;
  for (int64_t blocks = 1; blocks <= 24; ++blocks) {
    ASSERT_TRUE(seq.Reserve(blocks * kBt - seq.size()).ok());
    seq.Append(blocks * kBt - seq.size());
    held.push_back(seq.capacity() / kBt);
  }
  const std::vector<int64_t> want = {1,  2,  4,  4,  8,  8,  8,  8,  16, 16, 16, 16,
                                     16, 16, 16, 16, 24, 24, 24, 24, 24, 24, 24, 24};
  EXPECT_EQ(held, want);
  EXPECT_EQ(pool.used_bytes(), 24 * kBlock);
  // Within a chunk, a head's blocks follow one another, keys then values; the chunk
  // is one head after another.
  for (int64_t b = 0; b < 24; ++b) {
    for (int64_t h = 0; h < kHeads; ++h) {
      EXPECT_EQ(seq.values<float>(b, h), seq.keys<float>(b, h) + kTile);
    }
  }
  for (int64_t first : {int64_t{4}, int64_t{8}, int64_t{16}}) {  // the 4- and 8-block chunks
    const int64_t count = first == 4 ? 4 : 8;
    for (int64_t i = 1; i < count; ++i) {
      EXPECT_EQ(seq.keys<float>(first + i, 0), seq.keys<float>(first + i - 1, 0) + 2 * kTile);
    }
    EXPECT_EQ(seq.keys<float>(first, 1), seq.keys<float>(first + count - 1, 0) + 2 * kTile);
  }
  // Every element of every block is its own: writing each block's keys and values
  // with its index leaves each one intact.
  for (int64_t b = 0; b < 24; ++b) {
    for (int64_t h = 0; h < kHeads; ++h) {
      std::fill_n(seq.keys<float>(b, h), 2 * kTile, static_cast<float>(b * kHeads + h));
    }
  }
  for (int64_t b = 0; b < 24; ++b) {
    for (int64_t h = 0; h < kHeads; ++h) {
      const float* x = seq.keys<float>(b, h);
      EXPECT_TRUE(std::all_of(x, x + 2 * kTile, [&](float v) { return v == b * kHeads + h; }))
          << "block " << b << ", head " << h;
    }
  }
}

// A prefill's blocks come in one chunk, so that a decode step reads each head of
// them in one run; decode steps then grow the sequence by chunks of up to 8 blocks.
TEST(KvCachePoolTest, AReservationOfManyBlocksTakesThemInOneChunk) {
  constexpr int64_t kBt = KvCachePool::kBlockTokens, kHeads = 3, kP = 16;
  constexpr int64_t kBlock = 2 * kHeads * kBt * kP * 4, kTile = kBt * kP;
  KvCachePool pool(int64_t{1} << 30);
  KvSequence seq(&pool, kHeads, kP);
  ASSERT_TRUE(seq.Reserve(20 * kBt - 5).ok());  // 20 blocks
  EXPECT_EQ(seq.capacity(), 20 * kBt);
  EXPECT_EQ(pool.used_bytes(), 20 * kBlock);
  for (int64_t h = 0; h < kHeads; ++h) {
    for (int64_t b = 1; b < 20; ++b) {
      EXPECT_EQ(seq.keys<float>(b, h), seq.keys<float>(b - 1, h) + 2 * kTile) << b << ", " << h;
    }
    if (h > 0) {
      EXPECT_EQ(seq.keys<float>(0, h), seq.keys<float>(19, h - 1) + 2 * kTile);
    }
  }
  seq.Append(20 * kBt - 5);
  // One more token past the 20 blocks: a chunk of kChunkBlocks, not of 20.
  ASSERT_TRUE(seq.Reserve(6).ok());
  EXPECT_EQ(seq.capacity(), (20 + KvCachePool::kChunkBlocks) * kBt);
  seq.Append(6);
  // A reservation of more blocks than a chunk holds, on a sequence that has some:
  // the rest of its chunk, then the others in one chunk.
  const int64_t left = seq.capacity() - seq.size();
  ASSERT_TRUE(seq.Reserve(left + 12 * kBt).ok());
  EXPECT_EQ(seq.capacity(), (20 + KvCachePool::kChunkBlocks + 12) * kBt);
  const int64_t first = 20 + KvCachePool::kChunkBlocks;
  for (int64_t b = first + 1; b < first + 12; ++b) {
    EXPECT_EQ(seq.keys<float>(b, 2), seq.keys<float>(b - 1, 2) + 2 * kTile) << b;
  }
  EXPECT_EQ(pool.used_bytes(), (20 + KvCachePool::kChunkBlocks + 12) * kBlock);
}

// The mapping (/proc/self/smaps) that holds address x: its bounds and VmFlags.
struct Mapping {
  uintptr_t start = 0, end = 0;
  std::string flags;
};
Mapping MappingOf(const void* x) {
  const auto at = reinterpret_cast<uintptr_t>(x);
  std::ifstream smaps("/proc/self/smaps");
  Mapping found, current;
  for (std::string line; std::getline(smaps, line);) {
    uintptr_t start = 0, end = 0;
    if (std::sscanf(line.c_str(), "%" SCNxPTR "-%" SCNxPTR " ", &start, &end) == 2 &&
        line.find(':') > line.find(' ')) {
      current = {start, end, ""};
    } else if (line.rfind("VmFlags:", 0) == 0) {
      current.flags = line;
      if (current.start <= at && at < current.end) found = current;
    }
  }
  return found;
}

// A chunk of a huge page (2 MiB) or more starts on a huge page's boundary, in a
// mapping of its own bytes (the extra mapped to find the boundary went back), advised
// as transparent huge pages (VmFlags "hg"); a smaller chunk keeps small pages.
TEST(KvCachePoolTest, ChunksOfAHugePageOrMoreAreAlignedAndAdvisedAsHugePages) {
  constexpr int64_t kBt = KvCachePool::kBlockTokens, kHeads = 8, kP = 128;
  constexpr int64_t kBlock = 2 * kHeads * kBt * kP * 4;  // 256 KiB
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  KvCachePool pool(int64_t{1} << 30, /*retain_bytes=*/0);
  KvSequence small(&pool, kHeads, kP);
  ASSERT_TRUE(small.Reserve(kBt).ok());  // a chunk of 1 block
  const Mapping s = MappingOf(small.keys<float>(0, 0));
  ASSERT_NE(s.end, 0u) << "no mapping in /proc/self/smaps";
  EXPECT_EQ(s.flags.find(" hg"), std::string::npos) << s.flags;

  KvSequence big(&pool, kHeads, kP);
  ASSERT_TRUE(big.Reserve(20 * kBt).ok());  // one chunk of 20 blocks, 5 MiB
  const float* chunk = big.keys<float>(0, 0);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(chunk) % kHuge, 0u);
  const Mapping m = MappingOf(chunk);
  EXPECT_EQ(m.start, reinterpret_cast<uintptr_t>(chunk));
  EXPECT_EQ(m.end, reinterpret_cast<uintptr_t>(chunk) + 20 * kBlock);
  if (std::ifstream("/sys/kernel/mm/transparent_hugepage/enabled").good()) {
    EXPECT_NE(m.flags.find(" hg"), std::string::npos) << m.flags;
  }
  // Every byte of it is usable.
  std::fill_n(big.keys<float>(0, 0), 20 * kBlock / 4, 1.0f);
  EXPECT_EQ(big.keys<float>(19, kHeads - 1)[2 * kBt * kP - 1], 1.0f);
}

TEST(KvCachePoolTest, AChunkTheBudgetCannotHoldShrinksToTheBlocksNeeded) {
  constexpr int64_t kBt = KvCachePool::kBlockTokens;
  constexpr int64_t kBlock = 2 * 2 * kBt * 8 * 4;
  KvCachePool pool(5 * kBlock);
  KvSequence seq(&pool, 2, 8);
  for (int64_t blocks = 1; blocks <= 4; ++blocks) {  // chunks of 1, 1 and 2 blocks
    ASSERT_TRUE(seq.Reserve(blocks * kBt).ok());
  }
  EXPECT_EQ(seq.capacity(), 4 * kBt);
  // The next chunk would be 4 blocks; the budget has 1 left, which is all one more
  // token needs.
  ASSERT_TRUE(seq.Reserve(4 * kBt + 1).ok());
  EXPECT_EQ(seq.capacity(), 5 * kBt);
  EXPECT_EQ(pool.used_bytes(), 5 * kBlock);
  const absl::Status s = seq.Reserve(5 * kBt + 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_EQ(seq.capacity(), 5 * kBt);
}

}  // namespace
}  // namespace mha::core

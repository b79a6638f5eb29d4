// The attention-only layer (ModelConfig::projections kNone, issue 35): pre-projected
// q, k, v in, the heads' contexts concatenated and each head's log-sum-exp out, dense
// (Forward) and paged (ForwardPaged), against a double-precision double loop written
// here, independent of core/reference.cc; and the lse merge of partial attentions over
// disjoint key sets.
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/attention.h"
#include "core/kv_cache.h"
#include "gtest/gtest.h"
#include "tests/unit/test_util.h"

namespace mha::core {
namespace {

using ::mha::testing::RandomVector;
using ::mha::testing::TeamOfTwo;

// f32 kernels against the double loop: sums of up to a few hundred products of
// values in [-1, 1], reordered.
constexpr double kF32Tolerance = 1e-4;
// The lse merge: two f32 calls against one, the same sums split in two.
constexpr double kMergeTolerance = 1e-5;
// bf16 activations (precision bf16: q, k, v and the probabilities rounded to 8 bits
// of mantissa, relative error 2^-9 each) against the f32 double loop.
constexpr double kBf16Tolerance = 3e-2;
constexpr float kInf = std::numeric_limits<float>::infinity();

ModelConfig AttentionOnly(int64_t h, int64_t g, int64_t d) {
  ModelConfig c;
  c.num_heads = h;
  c.num_kv_heads = g;
  c.num_hiddens = c.query_size = h * d;
  c.key_size = c.value_size = g * d;
  c.projections = Projections::kNone;
  return c;
}

std::unique_ptr<MultiHeadAttention> Make(const ModelConfig& c,
                                         const MultiHeadAttention::Options& o = {}) {
  auto mha = MultiHeadAttention::Create(c, Weights{}, o);
  EXPECT_TRUE(mha.ok()) << mha.status();
  return mha.ok() ? std::move(mha).value() : nullptr;
}

// The reference: for batch row b, head i (key/value head i / (h / G)), query t, the
// keys j < limit(b, t) (valid_lens and top-left causal folded in): scores
// q.k / sqrt(d) in double, lse = log sum exp, context = softmax . v * head_mask[i];
// no key: lse -inf, context 0.
struct Expected {
  std::vector<double> out;  // (B, Q, h*d)
  std::vector<double> lse;  // (B, h, Q)
};

Expected Reference(const ModelConfig& c, int64_t B, int64_t Q, int64_t K, const float* q,
                   const float* k, const float* v, const std::vector<int32_t>& valid_lens,
                   bool causal, const std::vector<float>& head_mask) {
  const int64_t h = c.num_heads, G = c.kv_heads(), d = c.head_size(), E = h * d, Ekv = G * d;
  Expected e{std::vector<double>(B * Q * E, 0.0), std::vector<double>(B * h * Q, 0.0)};
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < Q; ++t) {
      int64_t limit = K;
      if (valid_lens.size() == static_cast<size_t>(B)) limit = valid_lens[b];
      if (valid_lens.size() == static_cast<size_t>(B * Q)) limit = valid_lens[b * Q + t];
      if (causal) limit = std::min(limit, t + 1);
      for (int64_t i = 0; i < h; ++i) {
        const int64_t g = i / (h / G);
        const float* qi = q + (b * Q + t) * E + i * d;
        double& lse = e.lse[(b * h + i) * Q + t];
        double* out = &e.out[(b * Q + t) * E + i * d];
        if (limit == 0) {
          lse = -std::numeric_limits<double>::infinity();
          continue;
        }
        std::vector<double> s(limit);
        double m = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j < limit; ++j) {
          const float* kj = k + (b * K + j) * Ekv + g * d;
          double dot = 0;
          for (int64_t x = 0; x < d; ++x) dot += static_cast<double>(qi[x]) * kj[x];
          s[j] = dot / std::sqrt(static_cast<double>(d));
          m = std::max(m, s[j]);
        }
        double sum = 0;
        for (double sj : s) sum += std::exp(sj - m);
        lse = m + std::log(sum);
        const double factor = head_mask.empty() ? 1.0 : head_mask[i];
        for (int64_t j = 0; j < limit; ++j) {
          const double a = std::exp(s[j] - m) / sum * factor;
          const float* vj = v + (b * K + j) * Ekv + g * d;
          for (int64_t x = 0; x < d; ++x) out[x] += a * vj[x];
        }
      }
    }
  }
  return e;
}

// The largest |a - b| over finite pairs; an infinite pair must agree exactly (so a
// fully masked row's lse is -inf on both sides).
template <typename A, typename B>
double Diff(const std::vector<A>& a, const std::vector<B>& b) {
  EXPECT_EQ(a.size(), b.size());
  double worst = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    const double x = a[i], y = b[i];
    if (std::isinf(x) || std::isinf(y)) {
      if (x != y) return std::numeric_limits<double>::infinity();
      continue;
    }
    if (std::isnan(x) || std::isnan(y)) return std::numeric_limits<double>::infinity();
    worst = std::max(worst, std::abs(x - y));
  }
  return worst;
}

struct Shape {
  const char* name;
  int64_t h, g, d;
};
const Shape kShapes[] = {{"mha", 4, 4, 16}, {"gqa", 8, 2, 16}, {"mqa", 4, 1, 8}};

struct Masks {
  const char* name;
  int per;  // valid_lens: 0 none, 1 per batch row, 2 per query
  bool causal;
  bool head_mask;
};
const Masks kMasks[] = {
    {"none", 0, false, false},           {"lens_per_row", 1, false, false},
    {"lens_per_query", 2, false, false}, {"causal", 0, true, false},
    {"causal_and_lens", 2, true, false}, {"head_mask", 1, false, true},
};

// valid_lens for `per` with zeros among them (fully masked rows) and K itself.
std::vector<int32_t> Lens(int per, int64_t B, int64_t Q, int64_t K, std::mt19937_64& rng) {
  if (per == 0) return {};
  const int64_t n = per == 1 ? B : B * Q;
  std::vector<int32_t> lens(n);
  std::uniform_int_distribution<int32_t> pick(0, static_cast<int32_t>(K));
  for (int64_t i = 0; i < n; ++i) lens[i] = pick(rng);
  lens[0] = 0;
  if (n > 1) lens[n - 1] = static_cast<int32_t>(K);
  return lens;
}

std::vector<float> HeadMask(int64_t h) {
  std::vector<float> m(h);
  for (int64_t i = 0; i < h; ++i) m[i] = i == 1 ? 0.0f : 0.5f + 0.25f * static_cast<float>(i);
  m[h - 1] = -1.5f;
  return m;
}

void CheckDense(Precision precision, double tolerance) {
  std::mt19937_64 rng(35);
  // key_block 16 makes the online softmax move across several key blocks.
  for (int64_t key_block : {int64_t{16}, int64_t{512}}) {
    for (const Shape& shape : kShapes) {
      ModelConfig c = AttentionOnly(shape.h, shape.g, shape.d);
      c.precision = precision;
      auto mha = Make(c, {.key_block = key_block});
      ASSERT_NE(mha, nullptr);
      for (const Masks& masks : kMasks) {
        for (bool weights : {false, true}) {
          const int64_t B = 3, Q = 5, K = 37;
          const auto q = RandomVector(rng, B * Q * c.num_hiddens);
          const auto k = RandomVector(rng, B * K * c.kv_hiddens());
          const auto v = RandomVector(rng, B * K * c.kv_hiddens());
          const auto lens = Lens(masks.per, B, Q, K, rng);
          const auto head_mask = masks.head_mask ? HeadMask(c.num_heads) : std::vector<float>{};
          AttentionInputs in{.batch = B,
                             .num_queries = Q,
                             .num_keys = K,
                             .queries = q.data(),
                             .keys = k.data(),
                             .values = v.data(),
                             .valid_lens = lens,
                             .causal = masks.causal,
                             .head_mask = head_mask};
          std::vector<float> out(B * Q * c.num_hiddens, 7.0f), lse(B * c.num_heads * Q, 7.0f);
          std::vector<float> attention(weights ? B * c.num_heads * Q * K : 0);
          const absl::Status s =
              mha->Forward(in, out.data(), weights ? attention.data() : nullptr, 0, lse.data());
          ASSERT_TRUE(s.ok()) << s;
          const Expected e =
              Reference(c, B, Q, K, q.data(), k.data(), v.data(), lens, masks.causal, head_mask);
          SCOPED_TRACE(absl::StrCat(shape.name, " ", masks.name, " weights=", weights,
                                    " key_block=", key_block));
          EXPECT_LE(Diff(out, e.out), tolerance);
          EXPECT_LE(Diff(lse, e.lse), tolerance);
        }
      }
    }
  }
}

TEST(AttentionOnlyDenseTest, OutputAndLseMatchTheDoubleLoopF32) {
  CheckDense(Precision::kF32, kF32Tolerance);
}

TEST(AttentionOnlyDenseTest, OutputAndLseMatchTheDoubleLoopBf16) {
  CheckDense(Precision::kBf16, kBf16Tolerance);
}

TEST(AttentionOnlyDenseTest, FullyMaskedRowsHaveMinusInfLseAndZeroContext) {
  const ModelConfig c = AttentionOnly(8, 2, 16);
  auto mha = Make(c);
  ASSERT_NE(mha, nullptr);
  std::mt19937_64 rng(1);
  const int64_t B = 2, Q = 3, K = 4;
  const auto q = RandomVector(rng, B * Q * c.num_hiddens);
  const auto k = RandomVector(rng, B * K * c.kv_hiddens());
  const std::vector<int32_t> lens = {0, 2, 0, 4, 0, 0};  // per query
  // Every head's factor 0: contexts are 0 but the lse is still the scores'.
  const std::vector<float> zeros(c.num_heads, 0.0f);
  AttentionInputs in{.batch = B,
                     .num_queries = Q,
                     .num_keys = K,
                     .queries = q.data(),
                     .keys = k.data(),
                     .values = k.data(),
                     .valid_lens = lens,
                     .head_mask = zeros};
  std::vector<float> out(B * Q * c.num_hiddens, 7.0f), lse(B * c.num_heads * Q, 7.0f);
  ASSERT_TRUE(mha->Forward(in, out.data(), nullptr, 0, lse.data()).ok());
  for (float x : out) EXPECT_EQ(x, 0.0f);
  const Expected e = Reference(c, B, Q, K, q.data(), k.data(), k.data(), lens, false, {});
  EXPECT_LE(Diff(lse, e.lse), kF32Tolerance);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t i = 0; i < c.num_heads; ++i) {
      for (int64_t t = 0; t < Q; ++t) {
        const float l = lse[(b * c.num_heads + i) * Q + t];
        if (lens[b * Q + t] == 0) {
          EXPECT_EQ(l, -kInf);
        } else {
          EXPECT_TRUE(std::isfinite(l));
        }
      }
    }
  }
}

// Merges partial results over disjoint key sets (the formula), in double.
void Merge(const std::vector<float>& c1, const std::vector<float>& l1, const std::vector<float>& c2,
           const std::vector<float>& l2, int64_t B, int64_t Q, int64_t h, int64_t d,
           std::vector<double>& ctx, std::vector<double>& lse) {
  ctx.assign(B * Q * h * d, 0.0);
  lse.assign(B * h * Q, 0.0);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t i = 0; i < h; ++i) {
      for (int64_t t = 0; t < Q; ++t) {
        const size_t li = (b * h + i) * Q + t;
        const double m = std::max(l1[li], l2[li]);
        if (m == -std::numeric_limits<double>::infinity()) {
          lse[li] = m;
          continue;
        }
        const double w1 = std::exp(l1[li] - m), w2 = std::exp(l2[li] - m);
        lse[li] = m + std::log(w1 + w2);
        for (int64_t x = 0; x < d; ++x) {
          const size_t ci = (b * Q + t) * h * d + i * d + x;
          ctx[ci] = (w1 * c1[ci] + w2 * c2[ci]) / (w1 + w2);
        }
      }
    }
  }
}

// Two non-causal calls over disjoint key sets, merged by their lse, equal one call.
TEST(AttentionOnlyMergeTest, TwoCallsOverDisjointKeysMergeIntoOne) {
  std::mt19937_64 rng(7);
  for (const Shape& shape : kShapes) {
    const ModelConfig c = AttentionOnly(shape.h, shape.g, shape.d);
    auto mha = Make(c);
    ASSERT_NE(mha, nullptr);
    const int64_t B = 2, Q = 3, K1 = 29, K2 = 40, K = K1 + K2;
    const int64_t E = c.num_hiddens, Ekv = c.kv_hiddens();
    const auto q = RandomVector(rng, B * Q * E);
    const auto k = RandomVector(rng, B * K * Ekv, -2.0f, 2.0f);
    const auto v = RandomVector(rng, B * K * Ekv);
    // Keys 0..K1 of each row in the first call, the rest in the second.
    auto part = [&](const std::vector<float>& x, int64_t from, int64_t n) {
      std::vector<float> y(B * n * Ekv);
      for (int64_t b = 0; b < B; ++b) {
        std::memcpy(&y[b * n * Ekv], &x[(b * K + from) * Ekv], n * Ekv * sizeof(float));
      }
      return y;
    };
    auto call = [&](const std::vector<float>& kk, const std::vector<float>& vv, int64_t n,
                    std::vector<float>& out, std::vector<float>& lse) {
      out.assign(B * Q * E, 0.0f);
      lse.assign(B * c.num_heads * Q, 0.0f);
      const AttentionInputs in{.batch = B,
                               .num_queries = Q,
                               .num_keys = n,
                               .queries = q.data(),
                               .keys = kk.data(),
                               .values = vv.data()};
      const absl::Status s = mha->Forward(in, out.data(), nullptr, 0, lse.data());
      ASSERT_TRUE(s.ok()) << s;
    };
    std::vector<float> c1, l1, c2, l2, c_all, l_all;
    call(part(k, 0, K1), part(v, 0, K1), K1, c1, l1);
    call(part(k, K1, K2), part(v, K1, K2), K2, c2, l2);
    call(k, v, K, c_all, l_all);
    std::vector<double> merged, merged_lse;
    Merge(c1, l1, c2, l2, B, Q, c.num_heads, c.head_size(), merged, merged_lse);
    SCOPED_TRACE(shape.name);
    EXPECT_LE(Diff(c_all, merged), kMergeTolerance);
    EXPECT_LE(Diff(l_all, merged_lse), kMergeTolerance);
    // And the merge is not trivially close: the parts differ from the whole.
    EXPECT_GT(Diff(c_all, c1), 1e-3);
  }
}

// bf16 as the cache stores it (round to nearest even), for the reference of a bf16 cache.
float RoundBf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  u += 0x7fff + ((u >> 16) & 1);
  u &= 0xffff0000u;
  std::memcpy(&x, &u, 4);
  return x;
}

// A session of an attention-only model: causal steps of the given sizes, each bringing
// its tokens' q, k, v, against the double loop over the whole sequence (causal).
void CheckSession(const Shape& shape, bool bf16_cache) {
  ModelConfig c = AttentionOnly(shape.h, shape.g, shape.d);
  if (bf16_cache) c.kv_cache_precision = Precision::kBf16;
  auto mha = Make(c);
  ASSERT_NE(mha, nullptr);
  const int64_t E = c.num_hiddens, Ekv = c.kv_hiddens(), h = c.num_heads;
  const std::vector<int64_t> chunks = {5, 1, 1, 70, 1, 3, 200, 1};  // crosses cache blocks
  int64_t n = 0;
  for (int64_t t : chunks) n += t;
  std::mt19937_64 rng(11);
  const auto q = RandomVector(rng, n * E);
  const auto k = RandomVector(rng, n * Ekv);
  const auto v = RandomVector(rng, n * Ekv);
  KvCachePool pool(int64_t{1} << 28);
  KvSequence seq(&pool, c.kv_heads(), c.head_size(), bf16_cache);
  std::vector<float> out(n * E), lse(h * n);
  int64_t at = 0;
  for (int64_t t : chunks) {
    ASSERT_TRUE(seq.Reserve(t).ok());
    std::vector<float> step_lse(h * t);
    const PagedStep step{.num_queries = t,
                         .queries = q.data() + at * E,
                         .num_keys = t,
                         .keys = k.data() + at * Ekv,
                         .values = v.data() + at * Ekv,
                         .causal = true,
                         .cache = &seq,
                         .output = out.data() + at * E,
                         .lse = step_lse.data()};
    const absl::Status s = mha->ForwardPaged({&step, 1});
    ASSERT_TRUE(s.ok()) << s;
    for (int64_t i = 0; i < h; ++i) {
      std::copy_n(&step_lse[i * t], t, &lse[i * n + at]);
    }
    at += t;
  }
  auto kr = k, vr = v;
  if (bf16_cache) {
    for (float& x : kr) x = RoundBf16(x);
    for (float& x : vr) x = RoundBf16(x);
  }
  const Expected e = Reference(c, 1, n, n, q.data(), kr.data(), vr.data(), {}, true, {});
  SCOPED_TRACE(absl::StrCat(shape.name, bf16_cache ? " bf16 cache" : " f32 cache"));
  EXPECT_LE(Diff(out, e.out), kF32Tolerance);
  EXPECT_LE(Diff(lse, e.lse), kF32Tolerance);
}

TEST(AttentionOnlyPagedTest, CausalSessionStepsMatchTheDoubleLoopF32Cache) {
  for (const Shape& shape : kShapes) CheckSession(shape, false);
}

TEST(AttentionOnlyPagedTest, CausalSessionStepsMatchTheDoubleLoopBf16Cache) {
  for (const Shape& shape : kShapes) CheckSession(shape, true);
}

// ForwardPaged's step_done on an attention-only model's decode call: each step is
// reported once, as its tasks end (while the call's other thread goes on), with its
// output and lse already those the call leaves and its cache already holding its new
// token; the outputs equal those of the same call without step_done on identical
// caches.
TEST(AttentionOnlyPagedTest, DecodeStepsAreReportedDoneAsTheyEnd) {
  // 6 sessions of 1,024 cached tokens, 2 KiB of keys and values a token: 12 MiB, two
  // threads' worth of cache (ForwardPaged's threads go by bytes read).
  const ModelConfig c = AttentionOnly(8, 4, 64);
  auto mha = Make(c, {.num_threads = 2});
  ASSERT_NE(mha, nullptr);
  constexpr int64_t kSessions = 6, kContext = 1024;
  const int64_t E = c.num_hiddens, Ekv = c.kv_hiddens(), h = c.num_heads;
  std::mt19937_64 rng(5);
  const auto prefill_kv = RandomVector(rng, kContext * Ekv);
  const auto q = RandomVector(rng, kSessions * E);
  const auto kv = RandomVector(rng, kSessions * Ekv);
  KvCachePool pool(int64_t{1} << 28);
  // Two identical sets of caches: one for the call with step_done, one without.
  std::vector<std::unique_ptr<KvSequence>> caches;
  for (int64_t i = 0; i < 2 * kSessions; ++i) {
    caches.push_back(std::make_unique<KvSequence>(&pool, c.kv_heads(), c.head_size(), false));
    ASSERT_TRUE(caches.back()->Reserve(kContext + 1).ok());
    const PagedStep fill{.num_keys = kContext,  // appended, not attended
                         .keys = prefill_kv.data(),
                         .values = prefill_kv.data(),
                         .cache = caches.back().get()};
    ASSERT_TRUE(mha->ForwardPaged({&fill, 1}).ok());
  }
  std::vector<float> out(2 * kSessions * E), lse(2 * kSessions * h);
  auto steps = [&](int64_t set) {
    std::vector<PagedStep> batch;
    for (int64_t s = 0; s < kSessions; ++s) {
      const int64_t at = set * kSessions + s;
      batch.push_back({.num_queries = 1,
                       .queries = q.data() + s * E,
                       .num_keys = 1,
                       .keys = kv.data() + s * Ekv,
                       .values = kv.data() + s * Ekv,
                       .causal = true,
                       .cache = caches[at].get(),
                       .output = out.data() + at * E,
                       .lse = lse.data() + at * h});
    }
    return batch;
  };
  const std::vector<PagedStep> plain = steps(1), reported = steps(0);
  ASSERT_TRUE(mha->ForwardPaged(plain).ok());
  const int team = TeamOfTwo();
  std::mutex mu;
  std::condition_variable reports;
  std::vector<int> times(kSessions, 0);
  std::vector<int64_t> cached(kSessions, 0);
  std::vector<std::vector<float>> seen(kSessions);  // output and lse when reported
  bool last_before_first_returned = false;
  const absl::Status status = mha->ForwardPaged(reported, [&](size_t i) {
    std::unique_lock<std::mutex> lock(mu);
    ++times[i];
    cached[i] = reported[i].cache->size();
    seen[i].assign(reported[i].output, reported[i].output + E);
    seen[i].insert(seen[i].end(), reported[i].lse, reported[i].lse + h);
    reports.notify_all();
    // Step 0 (the front of one thread's tasks) holds its thread until the last step
    // has been reported: by the other thread, which then takes over the rest. Steps
    // reported at the call's end, in order, would wait here in vain. A team of one
    // (OMP_THREAD_LIMIT=1, as under ThreadSanitizer) reports in order on its thread.
    if (i == 0 && team == 2) {
      last_before_first_returned =
          reports.wait_for(lock, std::chrono::seconds(5), [&] { return times[kSessions - 1] > 0; });
    }
  });
  ASSERT_TRUE(status.ok()) << status;
  if (team == 2) {
    EXPECT_TRUE(last_before_first_returned);
  }
  for (int64_t s = 0; s < kSessions; ++s) {
    SCOPED_TRACE(absl::StrCat("step ", s));
    EXPECT_EQ(times[s], 1);
    EXPECT_EQ(cached[s], kContext + 1);
    std::vector<float> final_values(out.begin() + s * E, out.begin() + (s + 1) * E);
    final_values.insert(final_values.end(), lse.begin() + s * h, lse.begin() + (s + 1) * h);
    EXPECT_EQ(seen[s], final_values);
    // The same kernels in the same order on identical caches: the same floats.
    for (int64_t x = 0; x < E; ++x) {
      ASSERT_EQ(out[s * E + x], out[(kSessions + s) * E + x]) << "output " << x;
    }
    for (int64_t x = 0; x < h; ++x) {
      ASSERT_EQ(lse[s * h + x], lse[(kSessions + s) * h + x]) << "lse " << x;
    }
  }
}

// A step is not read once reported done: its caller may free it then (the server's
// warm-up and single-session calls do). Under AddressSanitizer a read after the
// report fails here.
TEST(AttentionOnlyPagedTest, AStepFreedWhenReportedDoneIsNotReadAgain) {
  const ModelConfig c = AttentionOnly(8, 2, 32);
  auto mha = Make(c, {.num_threads = 2});
  ASSERT_NE(mha, nullptr);
  const int64_t E = c.num_hiddens, Ekv = c.kv_hiddens();
  std::mt19937_64 rng(9);
  const auto q = RandomVector(rng, E);
  const auto kv = RandomVector(rng, Ekv);
  KvCachePool pool(int64_t{1} << 24);
  KvSequence cache(&pool, c.kv_heads(), c.head_size(), false);
  ASSERT_TRUE(cache.Reserve(1).ok());
  std::vector<float> out(E);
  auto step = std::make_unique<PagedStep>(PagedStep{.num_queries = 1,
                                                    .queries = q.data(),
                                                    .num_keys = 1,
                                                    .keys = kv.data(),
                                                    .values = kv.data(),
                                                    .causal = true,
                                                    .cache = &cache,
                                                    .output = out.data()});
  int reports = 0;
  const absl::Status s = mha->ForwardPaged({step.get(), 1}, [&](size_t) {
    ++reports;
    step.reset();
  });
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(reports, 1);
  EXPECT_EQ(cache.size(), 1);
  // One key: the context is its value, head by head.
  const int64_t heads_per_kv = c.num_heads / c.kv_heads(), d = c.head_size();
  for (int64_t h = 0; h < c.num_heads; ++h) {
    for (int64_t x = 0; x < d; ++x) {
      ASSERT_NEAR(out[h * d + x], kv[(h / heads_per_kv) * d + x], 1e-6) << h << ", " << x;
    }
  }
}

// The disaggregated decode: old keys in a session on the CPU, recent ones elsewhere (a
// stateless call here); the session's partial result merged with the stateless one
// equals one attention over all of them.
TEST(AttentionOnlyMergeTest, SessionPartialMergedWithStatelessCallEqualsFullAttention) {
  std::mt19937_64 rng(13);
  for (const Shape& shape : kShapes) {
    const ModelConfig c = AttentionOnly(shape.h, shape.g, shape.d);
    auto mha = Make(c);
    ASSERT_NE(mha, nullptr);
    const int64_t E = c.num_hiddens, Ekv = c.kv_hiddens(), h = c.num_heads;
    const int64_t n = 300, recent = 45;  // the session's tokens, the other keys
    const auto k = RandomVector(rng, (n + recent) * Ekv, -2.0f, 2.0f);
    const auto v = RandomVector(rng, (n + recent) * Ekv);
    const auto q_prefix = RandomVector(rng, n * E);
    const auto q = RandomVector(rng, E);  // the decode step's query
    KvCachePool pool(int64_t{1} << 26);
    KvSequence seq(&pool, c.kv_heads(), c.head_size());
    ASSERT_TRUE(seq.Reserve(n).ok());
    // The prefix, then the decode step (its token's k, v appended; causal: it sees
    // every cached key and its own).
    std::vector<float> prefix_out((n - 1) * E);
    const PagedStep prefix{.num_queries = n - 1,
                           .queries = q_prefix.data(),
                           .num_keys = n - 1,
                           .keys = k.data(),
                           .values = v.data(),
                           .causal = true,
                           .cache = &seq,
                           .output = prefix_out.data()};
    ASSERT_TRUE(mha->ForwardPaged({&prefix, 1}).ok());
    std::vector<float> c1(E), l1(h);
    const PagedStep decode{.num_queries = 1,
                           .queries = q.data(),
                           .num_keys = 1,
                           .keys = k.data() + (n - 1) * Ekv,
                           .values = v.data() + (n - 1) * Ekv,
                           .causal = true,
                           .cache = &seq,
                           .output = c1.data(),
                           .lse = l1.data()};
    ASSERT_TRUE(mha->ForwardPaged({&decode, 1}).ok());
    // The other keys, stateless and non-causal.
    std::vector<float> c2(E), l2(h);
    const AttentionInputs other{.batch = 1,
                                .num_queries = 1,
                                .num_keys = recent,
                                .queries = q.data(),
                                .keys = k.data() + n * Ekv,
                                .values = v.data() + n * Ekv};
    ASSERT_TRUE(mha->Forward(other, c2.data(), nullptr, 0, l2.data()).ok());
    std::vector<float> c_all(E), l_all(h);
    const AttentionInputs all{.batch = 1,
                              .num_queries = 1,
                              .num_keys = n + recent,
                              .queries = q.data(),
                              .keys = k.data(),
                              .values = v.data()};
    ASSERT_TRUE(mha->Forward(all, c_all.data(), nullptr, 0, l_all.data()).ok());
    std::vector<double> merged, merged_lse;
    Merge(c1, l1, c2, l2, 1, 1, h, c.head_size(), merged, merged_lse);
    SCOPED_TRACE(shape.name);
    EXPECT_LE(Diff(c_all, merged), kMergeTolerance);
    EXPECT_LE(Diff(l_all, merged_lse), kMergeTolerance);
    EXPECT_GT(Diff(c_all, c1), 1e-3);
  }
}

TEST(AttentionOnlyConfigTest, BadConfigsAreRefusedNamingProjections) {
  struct Bad {
    const char* what;
    ModelConfig c;
  };
  std::vector<Bad> bad;
  ModelConfig c = AttentionOnly(8, 2, 16);
  bad.push_back({"query_size", c});
  bad.back().c.query_size = 64;
  bad.push_back({"key_size", c});
  bad.back().c.key_size = 128;
  bad.push_back({"value_size", c});
  bad.back().c.value_size = 16;
  bad.push_back({"bias", c});
  bad.back().c.bias = true;
  bad.push_back({"rope", c});
  bad.back().c.rope = RotaryConfig{};
  bad.push_back({"additive", AttentionOnly(8, 8, 16)});  // grouped heads refuse it earlier
  bad.back().c.scoring = Scoring::kAdditive;
  bad.back().c.additive_hidden = 4;
  for (const Bad& b : bad) {
    const absl::Status s = b.c.Validate();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << b.what;
    EXPECT_NE(s.message().find("projections"), std::string::npos) << b.what << ": " << s;
  }
  EXPECT_TRUE(c.Validate().ok());
  EXPECT_FALSE(c.SupportsSelfAttention());
  EXPECT_TRUE(SeededWeights(c, 1).w_q.empty());
  // Weights given to a layer that has none.
  ModelConfig full = c;
  full.projections = Projections::kFull;
  const auto made = MultiHeadAttention::Create(c, SeededWeights(full, 1));
  ASSERT_FALSE(made.ok());
  EXPECT_NE(made.status().message().find("projections NONE"), std::string::npos) << made.status();
}

TEST(AttentionOnlyConfigTest, KeysAndValuesAreAlwaysRequired) {
  const ModelConfig c = AttentionOnly(4, 4, 16);  // d_q == d_k == d_v, still no self-attention
  auto mha = Make(c);
  ASSERT_NE(mha, nullptr);
  std::vector<float> q(c.num_hiddens), out(c.num_hiddens);
  const AttentionInputs in{.batch = 1, .num_queries = 1, .num_keys = 1, .queries = q.data()};
  const absl::Status s = mha->Forward(in, out.data());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("keys"), std::string::npos) << s;
  KvCachePool pool(int64_t{1} << 20);
  KvSequence seq(&pool, c.kv_heads(), c.head_size());
  ASSERT_TRUE(seq.Reserve(1).ok());
  const PagedStep step{
      .num_queries = 1, .queries = q.data(), .causal = true, .cache = &seq, .output = out.data()};
  const absl::Status p = mha->ForwardPaged({&step, 1});
  EXPECT_EQ(p.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(p.message().find("keys"), std::string::npos) << p;
  EXPECT_EQ(seq.size(), 0);
}

}  // namespace
}  // namespace mha::core

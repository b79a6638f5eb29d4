#include "core/kernels.h"

#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "core/online_softmax.h"
#include "gtest/gtest.h"

namespace mha::core::kernels {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// The kernels built for each instruction set (kernels.h, Isa): a test of this suite
// runs once per build, skipped where the CPU lacks it.
class IsaKernelsTest : public testing::TestWithParam<Isa> {
 protected:
  void SetUp() override {
    if (GetParam() > CpuIsa()) GTEST_SKIP() << "this CPU runs " << IsaName(CpuIsa());
    CapIsa(GetParam());
    ASSERT_EQ(ActiveIsa(), GetParam());
  }
  void TearDown() override { CapIsa(Isa::kAvx512); }
};
INSTANTIATE_TEST_SUITE_P(Builds, IsaKernelsTest,
                         testing::Values(Isa::kAvx512, Isa::kAvx2, Isa::kBaseline),
                         [](const testing::TestParamInfo<Isa>& info) {
                           return std::string(IsaName(info.param));
                         });

TEST(KernelsTest, ExpSubSumMatchesStdExp) {
  const std::vector<float> s = {0.0f, -0.5f, -3.0f, -20.0f, -86.0f, -200.0f, -kInf};
  std::vector<float> p(s.size());
  const float sum = ExpSubSum(s.data(), 0.0f, p.data(), static_cast<int64_t>(s.size()));
  float expected = 0.0f;
  for (size_t j = 0; j < s.size(); ++j) {
    EXPECT_NEAR(p[j], std::exp(s[j]), 1e-6f * std::exp(s[j]) + 1e-37f) << s[j];
    expected += p[j];
  }
  EXPECT_FLOAT_EQ(sum, expected);
}

// The exp rows at every length from 0 to 70 (whole pairs of vectors, one vector, masked
// tails), with scores from 0 down past the flush point, once per build (AVX-512 and
// AVX2 intrinsics, the portable loop): the dispatched kernels against std::exp in double to 1e-6
// relative, against the portable loops to 2 ulp; the bfloat16 row (its own, shorter polynomial):
// its f32 exponentials within 3e-6 of std::exp, so each bfloat16 within half an ulp (2^-8 relative)
// of exp, plus 3e-6, and within one of the portable bfloat16 loop's. base2: 2^(s - m), for scores
// in log2 units (the dense pass's), to the same bounds; its range reaches past its floor (2^-125.5)
// as base e's does past exp(-87).
TEST_P(IsaKernelsTest, ExpRowsMatchStdExpAndThePortableLoops) {
  for (int64_t i = 0; i <= 141; ++i) {
    const bool base2 = i > 70;
    const int64_t n = base2 ? i - 71 : i;
    SCOPED_TRACE(base2 ? "base 2" : "base e");
    const float range = base2 ? 140.0f : 95.0f;
    std::vector<float> s(n + 1, 12345.0f);  // s[n] is past the row: never read into p
    for (int64_t j = 0; j < n; ++j) s[j] = 3.0f - range * static_cast<float>((j * 37) % n) / n;
    const float m = 3.0f;
    std::vector<float> p(n + 1, -1.0f), portable(n + 1, -1.0f);
    std::vector<uint16_t> p16(n + 1, 0xdead), portable16(n + 1, 0xdead);
    std::vector<float> tmp(n + 1, -1.0f);
    const float sum = ExpSubSum(s.data(), m, p.data(), n, base2);
    const float portable_sum = ExpSubSumPortable(s.data(), m, portable.data(), n, base2);
    std::vector<float> s_copy = s;
    const float sum16 = ExpSubSumBf16(s_copy.data(), m, p16.data(), n, base2);
    const float portable_sum16 =
        ExpSubSumBf16Portable(s.data(), m, portable16.data(), n, tmp.data(), base2);
    double want_sum = 0.0;
    for (int64_t j = 0; j < n; ++j) {
      const double x = static_cast<double>(s[j]) - m;
      const double want = base2 ? std::exp2(x) : std::exp(x);
      want_sum += want;
      EXPECT_NEAR(p[j], want, 1e-6 * want + 1e-37) << "n " << n << " j " << j;
      EXPECT_NEAR(p[j], portable[j], 2 * std::numeric_limits<float>::epsilon() * portable[j])
          << "n " << n << " j " << j;
      EXPECT_NEAR(tmp[j], want, 3e-6 * want + 1e-37) << "n " << n << " j " << j;
      const double got16 = std::bit_cast<float>(static_cast<uint32_t>(p16[j]) << 16);
      EXPECT_NEAR(got16, want, (1.0 / 256 + 3e-6) * want + 1e-37) << "n " << n << " j " << j;
    }
    // The portable loop may round its f32 exponentials differently (by an ulp or two),
    // which can move a bfloat16 to its neighbour.
    for (int64_t j = 0; j < n; ++j) {
      EXPECT_LE(std::abs(int{p16[j]} - int{portable16[j]}), 1) << "n " << n << " j " << j;
    }
    EXPECT_EQ(p[n], -1.0f) << n;
    EXPECT_EQ(p16[n], 0xdead) << n;
    EXPECT_NEAR(sum, want_sum, 1e-6 * want_sum) << n;
    EXPECT_NEAR(portable_sum, want_sum, 1e-6 * want_sum) << n;
    EXPECT_NEAR(sum16, want_sum, 3e-6 * want_sum) << n;
    EXPECT_NEAR(sum16, portable_sum16, 1e-6 * sum16) << n;
  }
}

// A block's rows at once (ExpSubSumRows, RowMaxes, RowStats::UpdateRows) give each row
// what it gets alone: the same exponentials, sums to 1e-6 (added in another order).
TEST_P(IsaKernelsTest, ExpRowsOfABlockMatchOneRowAtATime) {
  using internal::RowStats;
  for (const bool base2 : {false, true}) {
    for (const int64_t n : {32, 31, 20, 1}) {
      for (const int64_t rows : {1, 3, 4, 9}) {
        SCOPED_TRACE(testing::Message()
                     << (base2 ? "base 2" : "base e") << ", n " << n << ", rows " << rows);
        std::vector<float> s(rows * n + 1, 12345.0f), m(rows);
        for (int64_t i = 0; i < rows; ++i) {
          for (int64_t j = 0; j < n; ++j) {
            s[i * n + j] = 2.0f - 0.37f * static_cast<float>((i * 7 + j * 13) % 101) + i;
          }
          m[i] = 2.0f + i + (i % 2 ? 0.5f : 0.0f);
        }
        std::vector<float> maxes(rows);
        RowMaxes(s.data(), n, rows, maxes.data());
        std::vector<float> one = s, all = s, sums_one(rows, 0.25f), sums_all(rows, 0.25f);
        for (int64_t i = 0; i < rows; ++i) {
          EXPECT_EQ(maxes[i], RowMax(s.data() + i * n, n)) << "row " << i;
          sums_one[i] += ExpSubSum(one.data() + i * n, m[i], one.data() + i * n, n, base2);
        }
        ExpSubSumRows(all.data(), n, m.data(), sums_all.data(), rows, base2);
        for (int64_t j = 0; j < rows * n; ++j) EXPECT_EQ(all[j], one[j]) << "element " << j;
        EXPECT_EQ(all[rows * n], 12345.0f);  // past the last row: not written
        for (int64_t i = 0; i < rows; ++i) {
          EXPECT_NEAR(sums_all[i], sums_one[i], 1e-6f * sums_one[i]) << "row " << i;
        }
        // RowStats: UpdateRows equals Update row by row. Row 0 meets its first scores;
        // the others have met some (sum 2), odd rows with a maximum that the block
        // passes by more than kLazyRescale (their sums and contexts rescaled). Row 0
        // goes through a call of its own, the rest through one from row 1.
        constexpr int64_t p = 5;
        RowStats by_row, at_once;
        by_row.Reset(rows, base2);
        at_once.Reset(rows, base2);
        std::vector<float> o_row(rows * p), o_once(rows * p);
        for (int64_t d = 0; d < rows * p; ++d) o_row[d] = o_once[d] = 0.1f * static_cast<float>(d);
        for (int64_t i = 1; i < rows; ++i) {
          by_row.max[i] = at_once.max[i] = 1.0f - 9.0f * (i % 2);
          by_row.sum[i] = at_once.sum[i] = 2.0f;
        }
        std::vector<float> row_scores = s, block = s;
        for (int64_t i = 0; i < rows; ++i) {
          float* si = row_scores.data() + i * n;
          by_row.Update(i, si, n, o_row.data() + i * p, p,
                        [&](float ref) { return ExpSubSum(si, ref, si, n, base2); });
        }
        at_once.UpdateRows(0, 1, block.data(), n, o_once.data(), p);
        at_once.UpdateRows(1, rows, block.data() + n, n, o_once.data() + p, p);
        for (int64_t i = 0; i < rows; ++i) {
          EXPECT_EQ(at_once.max[i], by_row.max[i]) << "row " << i;
          EXPECT_NEAR(at_once.sum[i], by_row.sum[i], 1e-6f * by_row.sum[i]) << "row " << i;
        }
        EXPECT_EQ(o_once, o_row);
        for (int64_t j = 0; j < rows * n; ++j) EXPECT_EQ(block[j], row_scores[j]) << j;
      }
    }
  }
}

// The online softmax over blocks whose maxima rise by less than kLazyRescale (no
// rescaling: exponentials above 1), by more (the context so far rescaled), and fall:
// the normalised context and the log-sum-exp equal a softmax over all the scores at
// once, in double, whichever the reference point; in base e and base 2.
TEST(KernelsTest, OnlineSoftmaxRescalesOnlyPastItsThreshold) {
  using internal::RowStats;
  const std::vector<std::vector<float>> blocks = {
      {0.5f, -1.0f, 0.0f}, {5.5f, 3.0f}, {30.0f, 29.0f, 12.0f}, {-50.0f}, {36.0f, 35.5f}};
  constexpr int64_t p = 3;
  auto value = [](int64_t j, int64_t d) { return std::sin(0.7 * j + d) * 2.0; };
  for (const bool base2 : {false, true}) {
    SCOPED_TRACE(base2 ? "base 2" : "base e");
    RowStats stats;
    stats.Reset(1, base2);
    float o[p] = {0, 0, 0};
    std::vector<double> all;
    int64_t j0 = 0;
    int rescales = 0;
    for (const std::vector<float>& block : blocks) {
      const auto n = static_cast<int64_t>(block.size());
      std::vector<float> e(block);
      const float before = stats.max[0];
      stats.Update(0, block.data(), n, o, p,
                   [&](float m) { return ExpSubSum(block.data(), m, e.data(), n, base2); });
      if (before != -std::numeric_limits<float>::infinity() && stats.max[0] != before) ++rescales;
      for (int64_t j = 0; j < n; ++j) {
        for (int64_t d = 0; d < p; ++d) o[d] += e[j] * static_cast<float>(value(j0 + j, d));
        all.push_back(block[j]);
      }
      j0 += n;
      double true_max = -1e300;
      for (double x : all) true_max = std::max(true_max, x);
      EXPECT_GE(stats.max[0], true_max - RowStats::kLazyRescale);
      EXPECT_LE(stats.max[0], true_max);
    }
    EXPECT_EQ(rescales, 1);  // 30 (past 5.5 + 8); not 5.5 (past 0.5 by 5) nor 36
    const double base = base2 ? 2.0 : std::exp(1.0);
    double sum = 0, want[p] = {0, 0, 0};
    for (size_t j = 0; j < all.size(); ++j) {
      const double w = std::pow(base, all[j] - 36.0);
      sum += w;
      for (int64_t d = 0; d < p; ++d) want[d] += w * value(static_cast<int64_t>(j), d);
    }
    float ctx[p];
    stats.NormaliseRow(0, o, p, 1.0f, ctx);
    for (int64_t d = 0; d < p; ++d) EXPECT_NEAR(ctx[d], want[d] / sum, 1e-6) << d;
    const double lse = (36.0 + std::log(sum) / std::log(base)) * (base2 ? std::log(2.0) : 1.0);
    EXPECT_NEAR(stats.Lse(0), lse, 1e-5);
  }
}

// Scores that overflowed float32 (huge but finite inputs) reach the softmax as inf;
// inf - inf is NaN, which must come out as NaN (as in PyTorch), never through an
// undefined float -> int conversion (UBSan found it with the request fuzzer). Once per
// build.
TEST_P(IsaKernelsTest, OverflowedScoresGiveNan) {
  const std::vector<float> s = {kInf, 1.0f, kInf, std::numeric_limits<float>::quiet_NaN()};
  std::vector<float> p(s.size());
  const float m = RowMax(s.data(), static_cast<int64_t>(s.size()));
  EXPECT_EQ(m, kInf);
  const float sum = ExpSubSum(s.data(), m, p.data(), static_cast<int64_t>(s.size()));
  EXPECT_TRUE(std::isnan(p[0]));
  EXPECT_LT(p[1], 1e-37f);  // 1 - inf = -inf: flushed to ~2^-126, not NaN
  EXPECT_TRUE(std::isnan(p[2]));
  EXPECT_TRUE(std::isnan(p[3]));
  EXPECT_TRUE(std::isnan(sum));
  // The same through the portable loop and the bfloat16 row.
  std::vector<float> q(s.size()), tmp(s.size());
  std::vector<uint16_t> q16(s.size());
  EXPECT_TRUE(std::isnan(ExpSubSumPortable(s.data(), m, q.data(), 4)));
  EXPECT_TRUE(std::isnan(ExpSubSumBf16Portable(s.data(), m, q16.data(), 4, tmp.data())));
  std::vector<float> s_copy = s;
  EXPECT_TRUE(std::isnan(ExpSubSumBf16(s_copy.data(), m, q16.data(), 4)));
  auto is_nan16 = [](uint16_t b) { return (b & 0x7f80u) == 0x7f80u && (b & 0x7fu) != 0; };
  EXPECT_TRUE(std::isnan(q[0]) && std::isnan(q[2]) && std::isnan(q[3]) && q[1] < 1e-37f);
  EXPECT_TRUE(is_nan16(q16[0]) && is_nan16(q16[2]) && is_nan16(q16[3]));
  EXPECT_EQ(q16[1] & 0x7f80u, 0x0080u);  // ~2^-126: the smallest normal exponent
}

// s[j] = sum_a w[a] tanh(qa[a] + kt[a * ld + j]), against std::tanh in double, over
// arguments from 0 (where 1 - exp(-2|x|) cancels) to past tanh's saturation.
// The small-block products against double-precision loops, on odd sizes (vector
// tails, register groups and their tails) and with accumulation; a NaN or inf in v reaches the
// context as oneDNN's GEMM would carry it (0 x inf is NaN).
TEST_P(IsaKernelsTest, SmallBlockProductsMatchDoubleLoops) {
  for (const auto [p, mq, nk] : {std::array<int64_t, 3>{20, 4, 6},
                                 {64, 3, 17},
                                 {1, 1, 1},
                                 {33, 7, 5},
                                 // The register-blocked paths: whole groups of 32 keys and of 64
                                 // columns, with feature, key and column tails past them.
                                 {64, 1, 32},
                                 {128, 2, 70},
                                 {67, 3, 45},
                                 // Groups of 16 keys and of 32 and 16 columns (the small
                                 // shape's heads of 32 against 16 keys), with tails.
                                 {32, 16, 16},
                                 {48, 2, 53},
                                 {112, 3, 21},
                                 // Keys past what the kernel transposes at once.
                                 {512, 1, 20}}) {
    SCOPED_TRACE(testing::Message() << "p " << p << " mq " << mq << " nk " << nk);
    std::vector<float> q(mq * p), k(nk * p), v(nk * p);
    for (size_t i = 0; i < q.size(); ++i) q[i] = std::sin(0.7f * static_cast<float>(i));
    for (size_t i = 0; i < k.size(); ++i) k[i] = std::cos(0.3f * static_cast<float>(i));
    for (size_t i = 0; i < v.size(); ++i) v[i] = std::sin(0.11f * static_cast<float>(i) + 1);
    const float scale = 0.125f;
    std::vector<float> s(mq * nk);
    SmallScores(q.data(), k.data(), p, mq, nk, scale, s.data());
    for (int64_t i = 0; i < mq; ++i) {
      for (int64_t j = 0; j < nk; ++j) {
        double dot = 0;
        for (int64_t c = 0; c < p; ++c) dot += double{q[i * p + c]} * k[j * p + c];
        EXPECT_NEAR(s[i * nk + j], scale * dot, 1e-5) << i << "," << j;
      }
    }
    // The same keys transposed into a (p, ld) block with spare columns.
    const int64_t ld = nk + 3;
    std::vector<float> kt(p * ld, kInf);
    for (int64_t j = 0; j < nk; ++j) {
      for (int64_t c = 0; c < p; ++c) kt[c * ld + j] = k[j * p + c];
    }
    std::vector<float> st(mq * nk);
    TransposedScores(q.data(), kt.data(), ld, p, mq, nk, scale, st.data());
    for (size_t i = 0; i < s.size(); ++i) EXPECT_NEAR(st[i], s[i], 1e-5) << i;
    std::vector<float> o(mq * p, 100.0f);  // overwritten, not accumulated
    SmallContext(s.data(), v.data(), p, mq, nk, /*accumulate=*/false, o.data());
    std::vector<float> twice = o;
    SmallContext(s.data(), v.data(), p, mq, nk, /*accumulate=*/true, twice.data());
    for (int64_t i = 0; i < mq; ++i) {
      for (int64_t c = 0; c < p; ++c) {
        double sum = 0;
        for (int64_t j = 0; j < nk; ++j) sum += double{s[i * nk + j]} * v[j * p + c];
        EXPECT_NEAR(o[i * p + c], sum, 1e-5) << i << "," << c;
        EXPECT_NEAR(twice[i * p + c], 2 * sum, 2e-5) << i << "," << c;
      }
    }
  }
  const std::vector<float> probs = {0.0f, 1.0f};
  const std::vector<float> v = {kInf, 2.0f};
  float o = 0.0f;
  SmallContext(probs.data(), v.data(), 1, 1, 2, /*accumulate=*/false, &o);
  EXPECT_TRUE(std::isnan(o));
}

// The bfloat16 cache's kernels read the same values as the f32 ones once widened:
// on keys and values that bfloat16 holds exactly, they give the f32 kernels' answers
// (vector groups of keys and columns, and their tails).
TEST_P(IsaKernelsTest, Bf16CacheKernelsEqualTheF32OnesOnTheSameValues) {
  for (const auto [p, mq, nk] :
       {std::array<int64_t, 3>{64, 1, 32}, {128, 2, 70}, {67, 3, 45}, {48, 2, 53}}) {
    SCOPED_TRACE(testing::Message() << "p " << p << " mq " << mq << " nk " << nk);
    const int64_t ld = nk + 3;
    std::vector<float> q(mq * p), kt(p * ld), v(nk * p), probs(mq * nk);
    for (size_t i = 0; i < q.size(); ++i) q[i] = std::sin(0.7f * static_cast<float>(i));
    for (size_t i = 0; i < kt.size(); ++i) kt[i] = std::cos(0.3f * static_cast<float>(i));
    for (size_t i = 0; i < v.size(); ++i) v[i] = std::sin(0.11f * static_cast<float>(i) + 1);
    for (size_t i = 0; i < probs.size(); ++i) probs[i] = 0.01f * static_cast<float>(i % 17);
    std::vector<uint16_t> kt16(kt.size()), v16(v.size());
    ToBf16(kt.data(), kt16.data(), static_cast<int64_t>(kt.size()));
    ToBf16(v.data(), v16.data(), static_cast<int64_t>(v.size()));
    auto widen = [](const std::vector<uint16_t>& h, std::vector<float>& f) {
      for (size_t i = 0; i < h.size(); ++i) f[i] = std::bit_cast<float>(uint32_t{h[i]} << 16);
    };
    widen(kt16, kt);
    widen(v16, v);
    std::vector<float> s(mq * nk), s16(mq * nk);
    TransposedScores(q.data(), kt.data(), ld, p, mq, nk, 0.125f, s.data());
    TransposedScoresBf16(q.data(), kt16.data(), ld, p, mq, nk, 0.125f, s16.data());
    for (size_t i = 0; i < s.size(); ++i) EXPECT_NEAR(s16[i], s[i], 1e-6) << i;
    std::vector<float> o(mq * p, 0.5f), o16 = o;
    SmallContext(probs.data(), v.data(), p, mq, nk, /*accumulate=*/true, o.data());
    SmallContextBf16(probs.data(), v16.data(), p, mq, nk, o16.data());
    for (size_t i = 0; i < o.size(); ++i) EXPECT_NEAR(o16[i], o[i], 1e-6) << i;
  }
}

// The paged pass's group kernels against double-precision loops: one to nine rows
// (every register-blocked group size, and 9 split into two groups), whole blocks of
// 32 keys, groups of 16 and tails of keys, heads whose columns fill groups of 64, 32
// and 16 vectors or leave a tail, keys transposed at a stride wider than the block.
// f32 and bfloat16 caches (the double loops read the bfloat16 values widened); values
// in column panels (ValueIndex<T>) of as many rows as the keys' stride, those past nk
// NaN; the context accumulates onto what o held, and a prefetched block changes nothing.
TEST_P(IsaKernelsTest, GroupKernelsMatchDoubleLoops) {
  for (const auto [p, nk] : {std::array<int64_t, 2>{128, 32},
                             {128, 17},
                             {64, 48},
                             {67, 70},
                             {48, 5},
                             {16, 1},
                             {80, 33},
                             {5, 32}}) {
    // Key rows 3 wider than nk, or as wide as the next multiple of 16 (a cache block's
    // last keys: the kernels then read whole vectors past nk). The columns past nk hold
    // NaN, which must not reach a score.
    for (const int64_t ld : {nk + 3, (nk + 15) / 16 * 16}) {
      for (int64_t mq = 1; mq <= 9; ++mq) {
        SCOPED_TRACE(testing::Message()
                     << "p " << p << " mq " << mq << " nk " << nk << " ld " << ld);
        std::vector<float> q(mq * p), kt(p * ld), v(ld * p), probs(mq * nk);
        for (size_t i = 0; i < q.size(); ++i) q[i] = std::sin(0.7f * static_cast<float>(i));
        for (size_t i = 0; i < kt.size(); ++i) {
          kt[i] = static_cast<int64_t>(i) % ld < nk ? std::cos(0.3f * static_cast<float>(i))
                                                    : std::numeric_limits<float>::quiet_NaN();
        }
        for (int64_t j = 0; j < ld; ++j) {
          for (int64_t c = 0; c < p; ++c) {
            v[ValueIndex<float>(j, c, p, ld)] =
                j < nk ? std::sin(0.11f * static_cast<float>(j * p + c) + 1)
                       : std::numeric_limits<float>::quiet_NaN();
          }
        }
        for (size_t i = 0; i < probs.size(); ++i) probs[i] = 0.01f * static_cast<float>(i % 17);
        std::vector<uint16_t> kt16(kt.size()), v16(v.size());
        ToBf16(kt.data(), kt16.data(), static_cast<int64_t>(kt.size()));
        for (int64_t j = 0; j < ld; ++j) {  // the same values in bfloat16's panels
          for (int64_t c = 0; c < p; ++c) {
            ToBf16(&v[ValueIndex<float>(j, c, p, ld)], &v16[ValueIndex<uint16_t>(j, c, p, ld)], 1);
          }
        }
        std::vector<float> kt_w(kt.size()), v_w(v.size());
        for (size_t i = 0; i < kt16.size(); ++i)
          kt_w[i] = std::bit_cast<float>(uint32_t{kt16[i]} << 16);
        for (size_t i = 0; i < v16.size(); ++i)
          v_w[i] = std::bit_cast<float>(uint32_t{v16[i]} << 16);
        const float scale = 0.125f;
        // Reading ahead (past the tiles' ends: a prefetch does not fault) changes nothing.
        std::vector<float> s(mq * nk, kInf), s16(mq * nk, kInf);
        GroupScores(q.data(), kt.data(), ld, p, mq, nk, scale, s.data(), kReadAhead);
        GroupScoresBf16(q.data(), kt16.data(), ld, p, mq, nk, scale, s16.data(), kReadAhead);
        for (int64_t i = 0; i < mq; ++i) {
          for (int64_t j = 0; j < nk; ++j) {
            double dot = 0, dot16 = 0;
            for (int64_t c = 0; c < p; ++c) {
              dot += double{q[i * p + c]} * kt[c * ld + j];
              dot16 += double{q[i * p + c]} * kt_w[c * ld + j];
            }
            EXPECT_NEAR(s[i * nk + j], scale * dot, 2e-5) << i << "," << j;
            EXPECT_NEAR(s16[i * nk + j], scale * dot16, 2e-5) << i << "," << j;
          }
        }
        std::vector<float> o(mq * p), o16(mq * p);
        for (size_t i = 0; i < o.size(); ++i)
          o[i] = o16[i] = 0.5f - 0.01f * static_cast<float>(i % 50);
        const std::vector<float> before = o;
        GroupContext(probs.data(), v.data(), ld, p, mq, nk, o.data(), kReadAhead);
        GroupContextBf16(probs.data(), v16.data(), ld, p, mq, nk, o16.data(), kReadAhead);
        for (int64_t i = 0; i < mq; ++i) {
          for (int64_t c = 0; c < p; ++c) {
            double sum = before[i * p + c], sum16 = before[i * p + c];
            for (int64_t j = 0; j < nk; ++j) {
              sum += double{probs[i * nk + j]} * v[ValueIndex<float>(j, c, p, ld)];
              sum16 += double{probs[i * nk + j]} * v_w[ValueIndex<uint16_t>(j, c, p, ld)];
            }
            EXPECT_NEAR(o[i * p + c], sum, 2e-5) << i << "," << c;
            EXPECT_NEAR(o16[i * p + c], sum16, 2e-5) << i << "," << c;
          }
        }
      }
    }
  }
}

// Rows through packed panels against a double-precision x W^T + b: whole panels
// and a partial last one, one to five rows (groups of three and their tails) at row
// strides wider than the rows, with and without bias, and panels split into ranges as
// threads take them. Nothing outside the rows' columns is written.
TEST_P(IsaKernelsTest, PanelRowsMatchDoubleLoops) {
  for (const auto [n, k] : {std::array<int64_t, 2>{20, 7}, {128, 1}, {150, 33}, {2304, 768}}) {
    for (const int64_t m : {1, 2, 3, 5}) {
      for (const bool with_bias : {false, true}) {
        SCOPED_TRACE(testing::Message()
                     << "n " << n << " k " << k << " m " << m << " bias " << with_bias);
        const int64_t ldx = k + 3, ldy = n + 5;
        std::vector<float> w(n * k), x(m * ldx), b(n);
        for (size_t i = 0; i < w.size(); ++i) w[i] = std::sin(0.37f * static_cast<float>(i));
        for (size_t i = 0; i < x.size(); ++i) x[i] = std::cos(0.21f * static_cast<float>(i));
        for (size_t i = 0; i < b.size(); ++i) b[i] = 0.5f - 0.01f * static_cast<float>(i % 100);
        const int64_t panels = PanelCount(n);
        ASSERT_EQ(panels, (n + 127) / 128);
        std::vector<float> packed(panels * k * kPanelColumns);
        PackPanels(w.data(), n, k, packed.data());
        const float* bias = with_bias ? b.data() : nullptr;
        std::vector<float> y(m * ldy, kInf);
        const int64_t split = panels / 2;
        PanelRows(x.data(), ldx, m, packed.data(), n, k, bias, y.data(), ldy, split, panels);
        for (int64_t col = 0; col < split * kPanelColumns; ++col) ASSERT_EQ(y[col], kInf) << col;
        PanelRows(x.data(), ldx, m, packed.data(), n, k, bias, y.data(), ldy, 0, split);
        for (int64_t r = 0; r < m; ++r) {
          for (int64_t col = n; col < ldy; ++col) EXPECT_EQ(y[r * ldy + col], kInf) << r;
          for (int64_t col = 0; col < n; ++col) {
            double expected = with_bias ? b[col] : 0.0;
            for (int64_t i = 0; i < k; ++i) expected += double{x[r * ldx + i]} * w[col * k + i];
            EXPECT_NEAR(y[r * ldy + col], expected, 1e-5 * (1 + std::sqrt(static_cast<double>(k))))
                << "row " << r << " column " << col;
          }
        }
      }
    }
  }
}

// Once per build (the AVX2 one in intrinsics), over rows of 9 to 41 keys: whole
// groups of 16, one of 8, masked tails.
TEST_P(IsaKernelsTest, AdditiveScoresMatchStdTanh) {
  const int64_t pa = 3;
  const std::vector<float> qa = {0.0f, -0.7f, 2.5f};
  const std::vector<float> w = {1.0f, -0.5f, 0.25f};
  for (const int64_t n : {9, 16, 24, 29, 41}) {
    const int64_t ld = n + 2;  // ld > n: a block of a longer key row
    std::vector<float> kt(pa * ld);
    for (int64_t i = 0; i < pa * ld; ++i) kt[i] = 0.37f * static_cast<float>(i % 13 - 6) - 1e-4f;
    kt[0] = 1e-6f;   // tanh of a tiny argument
    kt[1] = 40.0f;   // saturated
    kt[2] = -95.0f;  // past exp's flush to zero
    kt[n - 1] = -40.0f;
    std::vector<float> s(n + 1, -1.0f);  // s[n] is past the row
    AdditiveScores(qa.data(), kt.data(), ld, w.data(), pa, s.data(), n);
    for (int64_t j = 0; j < n; ++j) {
      double expected = 0;
      for (int64_t a = 0; a < pa; ++a) {
        expected += double{w[a]} * std::tanh(double{qa[a]} + double{kt[a * ld + j]});
      }
      EXPECT_NEAR(s[j], expected, 5e-7) << "n " << n << " key " << j;
    }
    EXPECT_EQ(s[n], -1.0f) << n;
  }
}

// The int8 row path's sums are exact integers: against int64 loops over the same
// quantized values, for column counts off the 64-column panels and depths off 4.
TEST(KernelsTest, Int8PanelRowsEqualIntegerLoops) {
  if (!Int8RowPathSupported()) GTEST_SKIP() << "no AVX-512 VNNI on this CPU";
  uint64_t state = 7;
  auto next = [&] {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<int>(state >> 33);
  };
  for (const auto& [n, k] : {std::pair<int64_t, int64_t>{64, 4}, {100, 37}, {130, 768}, {1, 3}}) {
    std::vector<int8_t> w(n * k);
    for (int8_t& v : w) v = static_cast<int8_t>(next() % 255 - 127);
    std::vector<int8_t> panels(Int8PanelCount(n) * Int8PanelDepth(k) * kInt8PanelColumns);
    std::vector<int32_t> sums(n);
    PackInt8Panels(w.data(), n, k, panels.data(), sums.data());
    for (int64_t m = 1; m <= 3; ++m) {
      const int64_t depth = Int8PanelDepth(k);
      std::vector<int8_t> q(m * depth, 0);
      for (int64_t r = 0; r < m; ++r) {
        for (int64_t i = 0; i < k; ++i) q[r * depth + i] = static_cast<int8_t>(next() % 255 - 127);
      }
      std::vector<uint8_t> u(q.size());
      for (size_t i = 0; i < q.size(); ++i) u[i] = static_cast<uint8_t>(q[i] + 128);
      std::vector<float> col_scales(n), bias(n), y(m * n, -1.0f);
      for (int64_t j = 0; j < n; ++j) {
        col_scales[j] = 0.5f + static_cast<float>(j % 7);
        bias[j] = static_cast<float>(j % 5) - 2.0f;
      }
      const float row_scales[3] = {1.0f, 0.25f, 2.0f};
      const Int8Epilogue e{.column_sums = sums.data(),
                           .row_scales = row_scales,
                           .col_scales = col_scales.data(),
                           .bias = bias.data(),
                           .y = y.data(),
                           .ldy = n};
      Int8PanelRows(u.data(), depth, m, panels.data(), n, k, e, 0, Int8PanelCount(n));
      for (int64_t r = 0; r < m; ++r) {
        for (int64_t j = 0; j < n; ++j) {
          int64_t acc = 0;
          for (int64_t i = 0; i < k; ++i) acc += int64_t{q[r * depth + i]} * w[j * k + i];
          const double want = static_cast<double>(acc) * row_scales[r] * col_scales[j] + bias[j];
          ASSERT_NEAR(y[r * n + j], want, 1e-6 * std::abs(want) + 1e-6)
              << "n " << n << " k " << k << " m " << m << " row " << r << " col " << j;
        }
      }
    }
  }
}

}  // namespace
}  // namespace mha::core::kernels

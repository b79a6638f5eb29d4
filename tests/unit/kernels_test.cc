#include "core/kernels.h"

#include <cmath>
#include <limits>
#include <vector>

#include "gtest/gtest.h"

namespace mha::core::kernels {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

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

// Scores that overflowed float32 (huge but finite inputs) reach the softmax as inf;
// inf - inf is NaN, which must come out as NaN (as in PyTorch), never through an
// undefined float -> int conversion (UBSan found it with the request fuzzer).
TEST(KernelsTest, OverflowedScoresGiveNan) {
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
}

// s[j] = sum_a w[a] tanh(qa[a] + kt[a * ld + j]), against std::tanh in double, over
// arguments from 0 (where 1 - exp(-2|x|) cancels) to past tanh's saturation.
TEST(KernelsTest, AdditiveScoresMatchStdTanh) {
  const int64_t pa = 3, ld = 11, n = 9;  // ld > n: a block of a longer key row
  const std::vector<float> qa = {0.0f, -0.7f, 2.5f};
  const std::vector<float> w = {1.0f, -0.5f, 0.25f};
  std::vector<float> kt(pa * ld);
  for (int64_t i = 0; i < pa * ld; ++i) kt[i] = 0.37f * static_cast<float>(i % 13 - 6) - 1e-4f;
  kt[0] = 1e-6f;   // tanh of a tiny argument
  kt[1] = 40.0f;   // saturated
  kt[2] = -95.0f;  // past exp's flush to zero
  std::vector<float> s(n, -1.0f);
  AdditiveScores(qa.data(), kt.data(), ld, w.data(), pa, s.data(), n);
  for (int64_t j = 0; j < n; ++j) {
    double expected = 0;
    for (int64_t a = 0; a < pa; ++a) {
      expected += double{w[a]} * std::tanh(double{qa[a]} + double{kt[a * ld + j]});
    }
    EXPECT_NEAR(s[j], expected, 5e-7) << "key " << j;
  }
}

}  // namespace
}  // namespace mha::core::kernels

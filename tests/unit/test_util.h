// Shared helpers for the core's unit tests.
#ifndef MHA_TESTS_UNIT_TEST_UTIL_H_
#define MHA_TESTS_UNIT_TEST_UTIL_H_

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

namespace mha::testing {

inline std::vector<float> RandomVector(std::mt19937_64& rng, int64_t n, float lo = -1.0f,
                                       float hi = 1.0f) {
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = dist(rng);
  return v;
}

// Largest |a[i] - b[i]|.
template <typename A, typename B>
double MaxAbsDiff(const std::vector<A>& a, const std::vector<B>& b) {
  double worst = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    worst = std::max(worst, std::abs(static_cast<double>(a[i]) - static_cast<double>(b[i])));
  }
  return worst;
}

}  // namespace mha::testing

#endif  // MHA_TESTS_UNIT_TEST_UTIL_H_

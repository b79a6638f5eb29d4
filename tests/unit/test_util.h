// Shared helpers for the core's unit tests.
#ifndef MHA_TESTS_UNIT_TEST_UTIL_H_
#define MHA_TESTS_UNIT_TEST_UTIL_H_

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

namespace mha::testing {

// The team OpenMP gives for two threads (one under OMP_THREAD_LIMIT=1).
inline int TeamOfTwo() {
  int team = 0;
#pragma omp parallel num_threads(2)
  {
#pragma omp single
    team = omp_get_num_threads();
  }
  return team;
}

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

// ||got - want||_F / ||want||_F over the first min(sizes) elements, skipping
// elements where `want` is NaN; 0 when want is all zero and got matches it.
template <typename A, typename B>
double RelativeFrobenius(const std::vector<A>& got, const std::vector<B>& want) {
  double err = 0, norm = 0;
  for (size_t i = 0; i < got.size() && i < want.size(); ++i) {
    const double w = static_cast<double>(want[i]);
    if (std::isnan(w)) continue;
    const double d = static_cast<double>(got[i]) - w;
    err += d * d;
    norm += w * w;
  }
  return norm == 0 ? std::sqrt(err) : std::sqrt(err / norm);
}

}  // namespace mha::testing

#endif  // MHA_TESTS_UNIT_TEST_UTIL_H_

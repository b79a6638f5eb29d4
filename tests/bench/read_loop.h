// The read loop the memory benchmarks measure against (memory_read, paged_read,
// amx_read): the sum of x[begin, end) as uint64 words, in four interleaved partial sums
// so that the adds do not wait on one another and the loads are all that bound it; its
// rate on two OpenMP threads (paged_read, amx_read); and how paged_read and amx_read
// print their cases against it.
#ifndef MHA_TESTS_BENCH_READ_LOOP_H_
#define MHA_TESTS_BENCH_READ_LOOP_H_

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace mha::bench {

inline uint64_t SumWords(const uint64_t* x, int64_t begin, int64_t end) {
  uint64_t a = 0, b = 0, c = 0, d = 0;
  int64_t i = begin;
  for (; i + 4 <= end; i += 4) {
    a += x[i];
    b += x[i + 1];
    c += x[i + 2];
    d += x[i + 3];
  }
  for (; i < end; ++i) a += x[i];
  return a + b + c + d;
}

#if defined(_OPENMP)  // memory_read runs its own threads and builds without OpenMP
// The read loop over `bytes` at x (a multiple of 8) on two OpenMP threads, each summing
// its half: GB/s.
inline double ReadGbs(const void* x, int64_t bytes) {
  const auto* words = static_cast<const uint64_t*>(x);
  const int64_t n = bytes / 8;
  const auto start = std::chrono::steady_clock::now();
  uint64_t total = 0;
#pragma omp parallel num_threads(2) reduction(+ : total)
  {
    const int64_t t = omp_get_thread_num();
    total += SumWords(words, n * t / 2, n * (t + 1) / 2);
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (total == 12345) std::puts("");  // the sum is used
  return static_cast<double>(bytes) / seconds / 1e9;
}
#endif

// One line a case: its median GB/s over the rounds (figures[i], one a round), their
// spread, and the median's ratio to the first case's (the read loop's).
inline void PrintAgainstRead(const std::vector<std::string>& names,
                             const std::vector<std::vector<double>>& figures) {
  size_t width = 0;
  for (const std::string& name : names) width = std::max(width, name.size());
  double read = 0;
  for (size_t i = 0; i < names.size(); ++i) {
    std::vector<double> v = figures[i];
    std::sort(v.begin(), v.end());
    const double median = v[v.size() / 2];
    if (i == 0) read = median;
    std::printf("%-*s  median %6.2f GB/s (%.2f-%.2f)  %.2fx the read loop\n",
                static_cast<int>(width), names[i].c_str(), median, v.front(), v.back(),
                median / read);
  }
}

}  // namespace mha::bench

#endif  // MHA_TESTS_BENCH_READ_LOOP_H_

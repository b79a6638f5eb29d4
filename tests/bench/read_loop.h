// The read loop the memory benchmarks measure against (memory_read, paged_read,
// amx_read): the sum of x[begin, end) as uint64 words, in four interleaved partial sums
// so that the adds do not wait on one another and the loads are all that bound it. And
// how paged_read and amx_read print their cases against it.
#ifndef MHA_TESTS_BENCH_READ_LOOP_H_
#define MHA_TESTS_BENCH_READ_LOOP_H_

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

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

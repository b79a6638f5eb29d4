// The read loop the memory benchmarks measure against (memory_read, paged_read): the
// sum of x[begin, end) as uint64 words, in four interleaved partial sums so that the
// adds do not wait on one another and the loads are all that bound it.
#ifndef MHA_TESTS_BENCH_READ_LOOP_H_
#define MHA_TESTS_BENCH_READ_LOOP_H_

#include <cstdint>

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

}  // namespace mha::bench

#endif  // MHA_TESTS_BENCH_READ_LOOP_H_

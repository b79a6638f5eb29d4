// A memory read-bandwidth floor for the attention-only worker's benchmark
// (tests/bench/attention_only_bench.py): `threads` threads each sum their half (or
// share) of a `bytes` buffer of uint64 words, `rounds` times; prints the best
// round's bytes / second as "read GB/s: X" (GB = 1e9 bytes). The buffer is written
// once first, so its pages are mapped before the timed reads.
//
//   memory_read [--bytes=1073741824] [--threads=2] [--rounds=5]
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "tests/bench/read_loop.h"

namespace {

int64_t Flag(int argc, char** argv, const char* name, int64_t fallback) {
  const std::string prefix = std::string("--") + name + "=";
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], prefix.c_str(), prefix.size()) == 0) {
      return std::strtoll(argv[i] + prefix.size(), nullptr, 10);
    }
  }
  return fallback;
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t bytes = Flag(argc, argv, "bytes", int64_t{1} << 30);
  const int64_t threads = std::max<int64_t>(1, Flag(argc, argv, "threads", 2));
  const int64_t rounds = std::max<int64_t>(1, Flag(argc, argv, "rounds", 5));
  const int64_t words = bytes / 8;
  std::vector<uint64_t> buffer(static_cast<size_t>(words));
  for (int64_t i = 0; i < words; ++i) buffer[static_cast<size_t>(i)] = static_cast<uint64_t>(i);
  std::vector<uint64_t> sums(static_cast<size_t>(threads));
  double best = 0;
  for (int64_t r = 0; r < rounds; ++r) {
    const auto start = std::chrono::steady_clock::now();
    std::vector<std::thread> pool;
    for (int64_t t = 0; t < threads; ++t) {
      pool.emplace_back([&, t] {
        const int64_t begin = words * t / threads, end = words * (t + 1) / threads;
        sums[static_cast<size_t>(t)] = mha::bench::SumWords(buffer.data(), begin, end);
      });
    }
    for (std::thread& th : pool) th.join();
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    best = std::max(best, static_cast<double>(words * 8) / seconds);
  }
  uint64_t total = 0;
  for (uint64_t s : sums) total += s;
  std::printf("read GB/s: %.3f (%lld bytes, %lld threads, best of %lld; checksum %llu)\n",
              best / 1e9, static_cast<long long>(words * 8), static_cast<long long>(threads),
              static_cast<long long>(rounds), static_cast<unsigned long long>(total));
  return 0;
}

// A memory read-bandwidth floor for the attention-only worker's benchmark
// (tests/bench/attention_only_bench.py): `threads` threads each sum their half (or
// share) of a `bytes` buffer of uint64 words, `rounds` times; prints the best
// round's bytes / second as "read GB/s: X" (GB = 1e9 bytes). The buffer is written
// once first, so its pages are mapped before the timed reads.
//
//   memory_read [--bytes=1073741824] [--threads=2] [--rounds=5] [--rows=0]
//               [--run_bytes=0] [--huge=0] [--read_ahead=0]
//
// --huge=1 advises the buffer as transparent huge pages (MADV_HUGEPAGE) before it
// is written, as the session cache's chunks are (core/kv_cache.cc): with 4 KiB pages
// a stream takes a TLB miss every 4 KiB. --read_ahead=N (with --rows) prefetches
// each line N bytes ahead of the one read, as the paged kernels do
// (kernels::kReadAhead): with --rows=1 --huge=1, the most this machine's cores read.
//
// Two variations say what a decode step's reads could reach, whatever its kernels
// (docs/performance.md, "What a read with the step's arithmetic reaches"):
// --rows=R reads the buffer as f32 and does R multiply-adds of 16 floats per 64
// bytes on registers (a paged decode task does that per key or value element it
// reads, R the query rows sharing a key/value head: 4 at G 8 of 32 heads, 1 at
// G 32); --run_bytes=N reads it in runs of N bytes taken in a shuffled order, each
// thread its share of the runs, as a task reads its head's chunks. With neither, the
// loop is the bench's floor, unchanged.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
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

typedef float Floats16 __attribute__((vector_size(64)));

// Sums `rows` scaled copies of x[0, n) (n a multiple of 32: whole 128-byte steps), 16 floats at a
// time: rows x 2 accumulators, so that the multiply-adds' latency does not bound the loop.
__attribute__((target_clones("avx512f", "default"))) float MultiplyAdd(const float* x, int64_t n,
                                                                       int64_t rows,
                                                                       int64_t ahead) {
  Floats16 acc[2][4] = {};
  const float factors[4] = {1.1f, 0.9f, 1.3f, 0.7f};
  for (int64_t i = 0; i < n; i += 32) {
    if (ahead > 0) {
      __builtin_prefetch(reinterpret_cast<const char*>(x + i) + ahead);
      __builtin_prefetch(reinterpret_cast<const char*>(x + i + 16) + ahead);
    }
    Floats16 a, b;
    std::memcpy(&a, x + i, sizeof(a));
    std::memcpy(&b, x + i + 16, sizeof(b));
    for (int64_t r = 0; r < 4; ++r) {  // unrolled: rows is 1 to 4
      if (r >= rows) break;
      acc[0][r] += a * factors[r];
      acc[1][r] += b * factors[r];
    }
  }
  float total = 0;
  for (const auto& half : acc) {
    for (const Floats16& v : half) {
      for (int k = 0; k < 16; ++k) total += v[k];
    }
  }
  return total;
}

// Thread t's part of round: words [begin, end) of `buffer`, or its share of `runs`.
uint64_t ReadShare(const uint64_t* buffer, int64_t words, const std::vector<int64_t>& runs,
                   int64_t run_words, int64_t rows, int64_t ahead, int64_t t, int64_t threads) {
  auto read = [&](int64_t begin, int64_t end) -> uint64_t {
    if (rows == 0) return mha::bench::SumWords(buffer, begin, end);
    const float* x = reinterpret_cast<const float*>(buffer + begin);
    return static_cast<uint64_t>(MultiplyAdd(x, (end - begin) * 2, rows, ahead));
  };
  if (runs.empty()) {  // whole 16-word (128-byte) steps each
    const int64_t steps = words / 16;
    return read(steps * t / threads * 16, steps * (t + 1) / threads * 16);
  }
  const int64_t count = static_cast<int64_t>(runs.size());
  uint64_t sum = 0;
  for (int64_t k = count * t / threads; k < count * (t + 1) / threads; ++k) {
    sum += read(runs[static_cast<size_t>(k)] * run_words,
                (runs[static_cast<size_t>(k)] + 1) * run_words);
  }
  return sum;
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t bytes = Flag(argc, argv, "bytes", int64_t{1} << 30);
  const int64_t threads = std::max<int64_t>(1, Flag(argc, argv, "threads", 2));
  const int64_t rounds = std::max<int64_t>(1, Flag(argc, argv, "rounds", 5));
  const int64_t rows = std::clamp<int64_t>(Flag(argc, argv, "rows", 0), 0, 4);
  const int64_t run_bytes = Flag(argc, argv, "run_bytes", 0);
  const int64_t ahead = std::max<int64_t>(0, Flag(argc, argv, "read_ahead", 0));
  // Whole runs of whole 128-byte steps.
  const int64_t step = run_bytes > 0 ? std::max<int64_t>(128, run_bytes / 128 * 128) : 128;
  const int64_t words = bytes / step * step / 8;
  std::vector<int64_t> runs;
  if (run_bytes > 0) {
    runs.resize(static_cast<size_t>(words * 8 / step));
    std::iota(runs.begin(), runs.end(), 0);
    std::shuffle(runs.begin(), runs.end(), std::mt19937_64(1));
  }
  // 64-byte aligned, so that no 64-byte load of --rows straddles two cache lines.
  std::unique_ptr<uint64_t[], decltype(&std::free)> memory(
      static_cast<uint64_t*>(std::aligned_alloc(64, static_cast<size_t>(words) * 8)), &std::free);
  uint64_t* buffer = memory.get();
  if (Flag(argc, argv, "huge", 0) != 0) {
    const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
    const uintptr_t first = (reinterpret_cast<uintptr_t>(buffer) + page - 1) / page * page;
    const uintptr_t last = (reinterpret_cast<uintptr_t>(buffer + words)) / page * page;
    if (madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE) != 0) {
      std::perror("madvise");
    }
  }
  // Words are their index; read as floats (--rows) they are pairs of 1.5f and 0.75f,
  // since the small integers' bit patterns are subnormal floats.
  constexpr uint64_t kFloats = 0x3f400000'3fc00000;
  for (int64_t i = 0; i < words; ++i) buffer[i] = rows > 0 ? kFloats : static_cast<uint64_t>(i);
  std::vector<uint64_t> sums(static_cast<size_t>(threads));
  double best = 0;
  for (int64_t r = 0; r < rounds; ++r) {
    const auto start = std::chrono::steady_clock::now();
    std::vector<std::thread> pool;
    for (int64_t t = 0; t < threads; ++t) {
      pool.emplace_back([&, t] {
        sums[static_cast<size_t>(t)] =
            ReadShare(buffer, words, runs, step / 8, rows, ahead, t, threads);
      });
    }
    for (std::thread& th : pool) th.join();
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    best = std::max(best, static_cast<double>(words * 8) / seconds);
  }
  uint64_t total = 0;
  for (uint64_t s : sums) total += s;
  std::printf("read GB/s: %.3f (%lld bytes, %lld threads, best of %lld; checksum %llu", best / 1e9,
              static_cast<long long>(words * 8), static_cast<long long>(threads),
              static_cast<long long>(rounds), static_cast<unsigned long long>(total));
  if (rows > 0) std::printf("; %lld rows of multiply-adds", static_cast<long long>(rows));
  if (run_bytes > 0) std::printf("; shuffled runs of %lld bytes", static_cast<long long>(step));
  if (rows > 0 && ahead > 0) std::printf("; read ahead %lld bytes", static_cast<long long>(ahead));
  if (Flag(argc, argv, "huge", 0) != 0) std::printf("; huge pages");
  std::printf(")\n");
  return 0;
}

// How fast the paged pass's kernels read a cache from memory, against a plain read
// loop over the same bytes, in one process with the cases alternated round by round
// (this VM's memory bandwidth moves by 20-30% between runs, so separate runs cannot be
// compared). Issue 35's figure is the attention-only worker's step through the server
// (attention_only_bench.py); this isolates its two kernels, kernels::GroupScores and
// GroupContext, from everything else a step does.
//
// The cache: 16 sequences of 4,096 tokens of a grouped-query layer (G 8 key/value heads
// of d_h 128, f32: 512 MiB), in blocks of KvCachePool::kBlockTokens tokens. A task is
// one sequence's key/value head, its h/G = 4 query rows through every block (scores,
// then context), as AttendPagedTask runs them; two threads share the 128 tasks. Cases:
//   read           two threads summing the buffer as uint64 words (memory_read's loop)
//   chunks:N       the cache's layout (core/kv_cache.h; a tile of values is read as
//                  the cache's column panels) with chunks of N blocks: each
//                  head's blocks of a chunk together, so a task reads N x 32 KiB in one
//                  run; the cache's sequences grow to chunks of 8; with and without the
//                  paged pass's read-ahead (kernels::kReadAhead)
//   own blocks     the layout before chunks (2026-11-27): each block holding every
//                  head's keys, then every head's values, so a task read 16 KiB runs
//                  128 KiB apart (here in one mapping; a mapping per block, as the
//                  cache had them, measured the same)
//   in_cache       every task over the first sequence's first 2 blocks (chunks:8),
//                  again and again (512 KiB, in the cores' caches): the kernels'
//                  arithmetic rate
//   fma peak       (CPUs with AVX2 and FMA) two threads of independent multiply-add
//                  chains in registers, in the kernels' best build's vectors: the
//                  cores' arithmetic peak, as the GB/s of an f32 cache read at 4
//                  multiply-add lanes an element (a G 8 group's 4 query rows:
//                  G lanes/s x 4 bytes / 4 lanes); a bf16 cache at that peak reads half
//   ..., bf16      the same with a bf16 cache of the same shape (the buffer's first
//                  half, read as bf16: half the bytes; GroupScoresBf16 / GroupContextBf16),
//                  in a decode's chunks of 8 and a prefill's runs (chunks:128)
//   ..., ISA       the kernels' builds for the instruction sets below the CPU's best
//                  (kernels::Isa; the cases above run the best)
// Prints each case's median GB/s over the rounds (cache bytes read / wall time), its
// spread, and its ratio to the read loop's median.
//
//   paged_read [--rounds=15] [--huge=1]
//
// --huge=1 advises the cache as transparent huge pages (MADV_HUGEPAGE) before it is
// written, as the session cache's chunks are: the read loop and the kernels then read
// what a served step reads (on the Intel VM huge pages read 1.5x faster than small).
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "core/kernels.h"
#include "core/kv_cache.h"
#include "tests/bench/read_loop.h"

namespace {

using mha::core::KvCachePool;
namespace kernels = mha::core::kernels;

constexpr int64_t kP = 128, kG = 8, kRows = 4, kSequences = 16, kTokens = 4096;
constexpr int64_t kBt = KvCachePool::kBlockTokens;
constexpr int64_t kBlocks = kTokens / kBt;
constexpr int64_t kTile = kP * kBt;               // elements: one head's keys (or values)
constexpr int64_t kBlockFloats = 2 * kG * kTile;  // every head's keys and values
constexpr int64_t kFloats = kSequences * kBlocks * kBlockFloats;

template <typename T>
struct Layout {
  const T* cache;
  int64_t chunk;  // N: chunks of N blocks; 0: blocks of their own (every head together)
  const T* keys(int64_t s, int64_t g, int64_t b) const {
    const T* seq = cache + s * kBlocks * kBlockFloats;
    if (chunk == 0) return seq + b * kBlockFloats + g * kTile;
    return seq + (b / chunk) * chunk * kBlockFloats + (g * chunk + b % chunk) * 2 * kTile;
  }
  const T* values(int64_t s, int64_t g, int64_t b) const {
    if (chunk == 0) return keys(s, g, b) + kG * kTile;
    return keys(s, g, b) + kTile;
  }
};

void Scores(const float* q, const float* kt, float* s, int64_t ahead) {
  kernels::GroupScores(q, kt, kBt, kP, kRows, kBt, 0.1f, s, ahead);
}
void Scores(const float* q, const uint16_t* kt, float* s, int64_t ahead) {
  kernels::GroupScoresBf16(q, kt, kBt, kP, kRows, kBt, 0.1f, s, ahead);
}
void Context(const float* w, const float* v, float* o, int64_t ahead) {
  kernels::GroupContext(w, v, kBt, kP, kRows, kBt, o, ahead);
}
void Context(const float* w, const uint16_t* v, float* o, int64_t ahead) {
  kernels::GroupContextBf16(w, v, kBt, kP, kRows, kBt, o, ahead);
}

// Every task through `blocks` blocks of its sequence (of the first one: `first_only`);
// returns the bytes read / second.
template <typename T>
double Attend(const Layout<T>& layout, bool prefetch, int64_t blocks, int64_t repeat,
              bool first_only) {
  const auto start = std::chrono::steady_clock::now();
  float sink = 0;
#pragma omp parallel num_threads(2) reduction(+ : sink)
  {
    std::vector<float> q(kRows * kP, 0.01f), s(kRows * kBt), o(kRows * kP, 0.0f);
    for (int64_t r = 0; r < repeat; ++r) {
#pragma omp for schedule(dynamic, 1)
      for (int64_t task = 0; task < kSequences * kG; ++task) {
        const int64_t seq = first_only ? 0 : task / kG, g = task % kG;
        for (int64_t b = 0; b < blocks; ++b) {
          const int64_t ahead = prefetch ? kernels::kReadAhead : 0;
          Scores(q.data(), layout.keys(seq, g, b), s.data(), ahead);
          for (float& x : s) x *= 1e-3f;  // stands in for the softmax's weights
          Context(s.data(), layout.values(seq, g, b), o.data(), ahead);
        }
      }
    }
    sink += o[0];
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (sink == 12345.0f) std::puts("");
  return static_cast<double>(repeat * kSequences * blocks * 2 * kG * kTile) * sizeof(T) / seconds /
         1e9;
}

// n rounds of 12 independent multiply-add chains of F (8 or 16 floats): more chains
// than a multiply-add's latency (4 cycles) times the 2 a core issues a cycle. Returns
// the lanes computed.
template <typename F>
inline __attribute__((always_inline)) double Chains(int64_t n) {
  F a[12];
  for (int k = 0; k < 12; ++k) a[k] = F{} + 0.001f * static_cast<float>(k);
  const F x = F{} + 0.9999f, y = F{} + 1e-4f;
  for (int64_t i = 0; i < n; ++i) {
#pragma GCC unroll 12
    for (int k = 0; k < 12; ++k) a[k] = a[k] * x + y;
  }
  float sum = 0;  // every lane of every chain, so that none can be left out
  for (int k = 0; k < 12; ++k) {
    for (size_t l = 0; l < sizeof(F) / sizeof(float); ++l) sum += a[k][l];
  }
  if (sum == 12345.0f) std::puts("");
  return static_cast<double>(n) * 12 * sizeof(F) / sizeof(float);
}
typedef float Floats8 __attribute__((vector_size(32)));
typedef float Floats16 __attribute__((vector_size(64)));
__attribute__((target("avx2,fma"))) double ChainsAvx2(int64_t n) { return Chains<Floats8>(n); }
__attribute__((target("avx512f"))) double ChainsAvx512(int64_t n) { return Chains<Floats16>(n); }

// The fma peak case (see the top, AVX2 or AVX-512 CPUs only): G lanes / s, 2 threads.
double FmaPeak() {
  const kernels::Isa isa = kernels::CpuIsa();
  const auto start = std::chrono::steady_clock::now();
  double lanes = 0;
#pragma omp parallel num_threads(2) reduction(+ : lanes)
  lanes += isa == kernels::Isa::kAvx512 ? ChainsAvx512(20'000'000) : ChainsAvx2(40'000'000);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return lanes / seconds / 1e9;
}

}  // namespace

int main(int argc, char** argv) {
  int rounds = 15;
  bool huge = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--rounds=", 9) == 0) rounds = std::max(1, std::atoi(argv[i] + 9));
    if (std::strcmp(argv[i], "--huge=1") == 0) huge = true;
  }
  void* mapped = mmap(nullptr, kFloats * sizeof(float), PROT_READ | PROT_WRITE,
                      MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (mapped == MAP_FAILED) {
    std::perror("mmap");
    return 1;
  }
  // Before the first write, as the session cache's chunks are advised (core/kv_cache.cc).
  if (huge && madvise(mapped, kFloats * sizeof(float), MADV_HUGEPAGE) != 0) std::perror("madvise");
  auto* cache = static_cast<float*>(mapped);
  for (int64_t i = 0; i < kFloats; ++i) cache[i] = 0.5f;  // mapped before any timing

  struct Case {
    std::string name;
    int64_t chunk;  // -1: the read loop; -2: the fma peak
    bool prefetch;
    int64_t blocks, repeat;
    kernels::Isa isa = kernels::CpuIsa();
    bool bf16 = false;
  };
  std::vector<Case> cases = {
      {"read", -1, false, 0, 0},
      {"chunks:8, prefetch", 8, true, kBlocks, 1},
      {"chunks:8, no prefetch", 8, false, kBlocks, 1},
      {"chunks:2, prefetch", 2, true, kBlocks, 1},
      {"chunks:128, prefetch", 128, true, kBlocks, 1},
      {"own blocks, prefetch", 0, true, kBlocks, 1},
      {"own blocks, no prefetch", 0, false, kBlocks, 1},
      {"in_cache", 8, false, 2, kBlocks / 2},
      {"chunks:8, prefetch, bf16", 8, true, kBlocks, 1, kernels::CpuIsa(), true},
      {"in_cache, bf16", 8, false, 2, kBlocks / 2, kernels::CpuIsa(), true},
      {"chunks:128, prefetch, bf16", 128, true, kBlocks, 1, kernels::CpuIsa(), true},
  };
  if (kernels::CpuIsa() != kernels::Isa::kBaseline)
    cases.insert(cases.begin() + 1, {"fma peak", -2, false, 0, 0});
  for (const kernels::Isa isa : {kernels::Isa::kAvx2, kernels::Isa::kBaseline}) {
    if (isa >= kernels::CpuIsa()) continue;
    const std::string name = kernels::IsaName(isa);
    cases.push_back({"chunks:8, prefetch, " + name, 8, true, kBlocks, 1, isa});
    cases.push_back({"in_cache, " + name, 8, false, 2, kBlocks / 2, isa});
  }
  std::vector<std::vector<double>> figures(cases.size());
  for (int r = 0; r < rounds; ++r) {
    for (size_t c = 0; c < cases.size(); ++c) {
      const Case& k = cases[c];
      kernels::CapIsa(k.isa);
      const bool first_only = k.blocks < kBlocks;
      if (k.chunk == -1) {
        figures[c].push_back(mha::bench::ReadGbs(cache, kFloats * sizeof(float)));
      } else if (k.chunk == -2) {
        figures[c].push_back(FmaPeak());
      } else if (k.bf16) {
        // The f32 buffer's bytes as bf16 elements (0 and 0.5 alternately); the kernels,
        // in another file, read them with memcpy.
        const Layout<uint16_t> bf16{reinterpret_cast<const uint16_t*>(cache), k.chunk};
        figures[c].push_back(Attend(bf16, k.prefetch, k.blocks, k.repeat, first_only));
      } else {
        figures[c].push_back(
            Attend(Layout<float>{cache, k.chunk}, k.prefetch, k.blocks, k.repeat, first_only));
      }
    }
  }
  std::printf(
      "cache of %lld MiB (%lld sequences x %lld tokens, G %lld, d_h %lld, f32 unless named), "
      "%d alternated rounds, 2 threads, the kernels' %s build unless named, %s pages\n",
      static_cast<long long>(kFloats * sizeof(float) >> 20), static_cast<long long>(kSequences),
      static_cast<long long>(kTokens), static_cast<long long>(kG), static_cast<long long>(kP),
      rounds, kernels::IsaName(kernels::CpuIsa()), huge ? "huge" : "small");
  std::vector<std::string> names;
  for (const Case& k : cases) names.push_back(k.name);
  mha::bench::PrintAgainstRead(names, figures);
  munmap(mapped, kFloats * sizeof(float));
  return 0;
}

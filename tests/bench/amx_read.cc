// Whether faster arithmetic would read a bf16 cache from memory faster: the
// attention-only worker's G 8 decode step (16 sessions x 8 key/value heads x 4,096
// tokens, d_h 128, bf16: 256 MiB; each task one head's run of 128 blocks, its 4 query
// rows through every block, scores then context) computed with AMX tiles
// (`tdpbf16ps`), against a read loop over the same bytes, cases alternated in one
// process (docs/performance.md, "What holds bf16 below the bound on Intel"). A probe,
// not the server's kernels: the cache here is laid out for the tiles, and the softmax
// is a stand-in (weights = scores x 1e-3), as in paged_read.
//
// A block is its keys, then its values, each 8 tiles of 1 KiB in the tiles' pair
// layout: keys tile (s, h) holds features 32 s .. 32 s + 31 of keys 16 h .. 16 h + 15,
// row i a pair of features (32 s + 2 i, + 1) of each key side by side; values tile t
// holds columns 16 t .. 16 t + 15, row i a pair of tokens (2 i, 2 i + 1) of each column
// side by side. The query rows, and each block's weights, are split into 3 bf16 parts
// (hi, mid, lo: the f32 value to 2^-24), so that the sums keep f32's precision; the
// start checks one block's scores against a double reference. Each tile load asks for
// the 16 lines 8 KiB ahead of it (into L2), as the kernels read ahead. Cases:
//   read            two threads summing the buffer as uint64 words (memory_read's loop)
//   amx             every task's scores, stand-in softmax and context
//   amx, loads only the same tile loads and read-ahead, no arithmetic
//   amx, in cache   every task over the first 2 blocks of one of 8 heads' runs, again
//                   and again (256 KiB, as paged_read's in_cache): the rate of the
//                   arithmetic alone
// Prints each case's median GB/s over the rounds (cache bytes / wall time), its spread,
// and its ratio to the read loop's median. Exits 0 saying why when the CPU has no
// AMX-BF16 or the kernel does not grant the tile state.
//
//   amx_read [--rounds=5]
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "tests/bench/read_loop.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#if !defined(__clang__)  // GCC bug 105593: the AVX-512 headers' undefined operands
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace {

constexpr int64_t kP = 128, kBt = 32, kRows = 4, kParts = 3, kM = kRows * kParts;
constexpr int64_t kTasks = 16 * 8, kBlocks = 4096 / kBt;
constexpr int64_t kTile = 1024;                   // bytes: 16 rows of 64
constexpr int64_t kHalf = kP * kBt * 2;           // a block's keys (or values), bf16
constexpr int64_t kBlock = 2 * kHalf;             // 16 KiB
constexpr int64_t kTaskBytes = kBlocks * kBlock;  // 2 MiB
constexpr int64_t kBytes = kTasks * kTaskBytes;   // 256 MiB
constexpr int64_t kReadAhead = 8 << 10;

uint16_t ToBf16(float x) {  // to nearest, ties to even (finite x)
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return static_cast<uint16_t>((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}
float FromBf16(uint16_t b) {
  const uint32_t u = uint32_t{b} << 16;
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}
// Byte offsets in a block of key (feature c, key j) and value (token j, column c).
int64_t KeyAt(int64_t c, int64_t j) {
  return (((c / 32) * 2 + j / 16) * 16 + (c % 32) / 2) * 64 + ((j % 16) * 2 + c % 2) * 2;
}
int64_t ValueAt(int64_t j, int64_t c) {
  return kHalf + ((c / 16) * 16 + j / 2) * 64 + ((c % 16) * 2 + j % 2) * 2;
}

#define MHA_AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")))

struct TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tile 0: the split query or weight rows (kM x 32 bf16); 1: a tile of the cache; 2 and
// 3: kM rows of 16 sums. Per thread.
MHA_AMX void ConfigureTiles() {
  TileConfig config{};
  config.palette = 1;
  for (int t = 0; t < 4; ++t) {
    config.rows[t] = t == 1 ? 16 : kM;
    config.colsb[t] = 64;
  }
  // GCC 12 does not tell its optimiser that ldtilecfg reads the configuration: without
  // this, the stores above may be dropped as dead.
  asm volatile("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
}

// The query rows' A tiles: step s, features [32 s, 32 s + 32) of the kM split rows.
struct Queries {
  alignas(64) uint16_t a[kP / 32][kM * 32];
};
Queries SplitQueries(const std::vector<float>& q) {
  Queries out{};
  for (int64_t r = 0; r < kRows; ++r) {
    for (int64_t c = 0; c < kP; ++c) {
      float rest = q[r * kP + c];
      for (int64_t part = 0; part < kParts; ++part) {
        const uint16_t b = ToBf16(rest);
        out.a[c / 32][(part * kRows + r) * 32 + c % 32] = b;
        rest -= FromBf16(b);
      }
    }
  }
  return out;
}

// 32 floats (two vectors) into kParts rows of 32 bf16 at out, rows 32 * kRows apart.
MHA_AMX void SplitRow(__m512 lo, __m512 hi, uint16_t* out) {
  for (int64_t part = 0; part < kParts; ++part) {
    const __m512i b = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
    _mm512_store_si512(out + part * kRows * 32, b);
    const __m512i widened_lo =
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(b)), 16);
    const __m512i widened_hi =
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(b, 1)), 16);
    lo = _mm512_sub_ps(lo, _mm512_castsi512_ps(widened_lo));
    hi = _mm512_sub_ps(hi, _mm512_castsi512_ps(widened_hi));
  }
}

// Row r's sum over the kParts rows of 16 floats at x + 16 v, rows `ld` floats apart.
MHA_AMX __m512 PartsSum(const float* x, int64_t ld, int64_t r) {
  __m512 sum = _mm512_load_ps(x + r * ld);
  for (int64_t part = 1; part < kParts; ++part) {
    sum = _mm512_add_ps(sum, _mm512_load_ps(x + (part * kRows + r) * ld));
  }
  return sum;
}

enum class Mode { kFull, kLoadsOnly };

// One task over `blocks` blocks at base (block b at (b % wrap)); returns a sum of its
// context, so that nothing is left out. With `check`: block 0's scores, (kRows, kBt),
// and the context at the end, (kRows, kP).
struct Check {
  float* scores;
  float* context;
};
MHA_AMX float Task(const char* base, const Queries& q, Mode mode, int64_t blocks, int64_t wrap,
                   bool read_ahead, const Check* check) {
  alignas(64) float s[kM * kBt];  // the two sums tiles side by side: kM rows of 32 keys
  alignas(64) uint16_t w[kM * kBt];
  alignas(64) float c[kM * 16];
  alignas(64) float o[kRows * kP] = {};
  for (int64_t b = 0; b < blocks; ++b) {
    const char* keys = base + (b % wrap) * kBlock;
    const char* ahead = keys + kReadAhead;
    auto ask = [&] {  // the 16 lines 8 KiB ahead of the tile about to load
      if (!read_ahead) return;
      for (int l = 0; l < 16; ++l, ahead += 64) _mm_prefetch(ahead, _MM_HINT_T1);
    };
    if (mode == Mode::kLoadsOnly) {
      for (int64_t t = 0; t < 16; ++t) {
        ask();
        _tile_loadd(1, keys + t * kTile, 64);
      }
      continue;
    }
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t step = 0; step < kP / 32; ++step) {
      _tile_loadd(0, q.a[step], 64);
      ask();
      _tile_loadd(1, keys + 2 * step * kTile, 64);
      _tile_dpbf16ps(2, 0, 1);
      ask();
      _tile_loadd(1, keys + (2 * step + 1) * kTile, 64);
      _tile_dpbf16ps(3, 0, 1);
    }
    _tile_stored(2, s, kBt * 4);
    _tile_stored(3, s + 16, kBt * 4);
    for (int64_t r = 0; r < kRows; ++r) {
      const __m512 lo = PartsSum(s, kBt, r), hi = PartsSum(s + 16, kBt, r);
      if (check != nullptr && b == 0) {
        _mm512_storeu_ps(check->scores + r * kBt, lo);
        _mm512_storeu_ps(check->scores + r * kBt + 16, hi);
      }
      const __m512 scale = _mm512_set1_ps(1e-3f);  // the softmax's stand-in
      SplitRow(_mm512_mul_ps(lo, scale), _mm512_mul_ps(hi, scale), w + r * kBt);
    }
    _tile_loadd(0, w, 64);
    const char* values = keys + kHalf;
    for (int64_t t = 0; t < kP / 16; ++t) {
      ask();
      _tile_zero(2);
      _tile_loadd(1, values + t * kTile, 64);
      _tile_dpbf16ps(2, 0, 1);
      _tile_stored(2, c, 64);
      for (int64_t r = 0; r < kRows; ++r) {
        float* out = o + r * kP + 16 * t;
        _mm512_store_ps(out, _mm512_add_ps(_mm512_load_ps(out), PartsSum(c, 16, r)));
      }
    }
  }
  if (check != nullptr) std::copy_n(o, kRows * kP, check->context);
  float sum = 0;
  for (float x : o) sum += x;
  return sum;
}

bool HasAmx() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  const bool tiles = (d >> 24) & 1, bf16_tiles = (d >> 22) & 1, avx512 = (b >> 16) & 1;
  if (!__get_cpuid_count(7, 1, &a, &b, &c, &d)) return false;
  const bool avx512_bf16 = (a >> 5) & 1;
  return tiles && bf16_tiles && avx512 && avx512_bf16;
}

double Seconds(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

#if !defined(__clang__)
#pragma GCC diagnostic pop
#endif

int main(int argc, char** argv) {
  int rounds = 5;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--rounds=", 9) == 0) rounds = std::max(1, std::atoi(argv[i] + 9));
  }
  if (!HasAmx()) {
    std::puts("amx_read: this CPU has no AMX-BF16 (with AVX512-BF16): nothing to measure");
    return 0;
  }
  constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;  // asm/prctl.h, the tile state
  if (syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) != 0) {
    std::puts("amx_read: the kernel does not grant the AMX tile state: nothing to measure");
    return 0;
  }
  void* mapped = mmap(nullptr, kBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (mapped == MAP_FAILED) {
    std::perror("mmap");
    return 1;
  }
  if (madvise(mapped, kBytes, MADV_HUGEPAGE) != 0) std::perror("madvise");  // as the cache
  char* cache = static_cast<char*>(mapped);
  auto* elements = reinterpret_cast<uint16_t*>(cache);
  uint32_t seed = 1;
  for (int64_t i = 0; i < kBytes / 2; ++i) {
    seed = seed * 1664525u + 1013904223u;
    elements[i] = ToBf16(static_cast<float>((seed >> 9) & 0xffff) / 65536.0f - 0.5f);
  }
  std::vector<float> q(kRows * kP);
  for (int64_t i = 0; i < kRows * kP; ++i) q[i] = 0.3f * std::sin(0.37f * static_cast<float>(i));
  const Queries queries = SplitQueries(q);

  // Block 0 against a double reference: its scores from the cache's keys, and its
  // context from the cache's values with the weights the stand-in gives those scores;
  // each error over the sum of its terms' magnitudes (f32's own rounding of 128 or 32
  // terms is about 1e-7 of that).
  {
    ConfigureTiles();
    std::vector<float> scores(kRows * kBt), context(kRows * kP);
    const Check check{scores.data(), context.data()};
    Task(cache, queries, Mode::kFull, 1, 1, false, &check);
    auto element = [&](int64_t at) {
      uint16_t bits;
      std::memcpy(&bits, cache + at, 2);
      return static_cast<double>(FromBf16(bits));
    };
    double worst_scores = 0, worst_context = 0;
    for (int64_t r = 0; r < kRows; ++r) {
      for (int64_t j = 0; j < kBt; ++j) {
        double sum = 0, magnitude = 0;
        for (int64_t c = 0; c < kP; ++c) {
          const double term = q[r * kP + c] * element(KeyAt(c, j));
          sum += term;
          magnitude += std::fabs(term);
        }
        worst_scores = std::max(worst_scores, std::fabs(scores[r * kBt + j] - sum) / magnitude);
      }
      for (int64_t c = 0; c < kP; ++c) {
        double sum = 0, magnitude = 0;
        for (int64_t j = 0; j < kBt; ++j) {
          const double term = (scores[r * kBt + j] * 1e-3f) * element(ValueAt(j, c));
          sum += term;
          magnitude += std::fabs(term);
        }
        worst_context = std::max(worst_context, std::fabs(context[r * kP + c] - sum) / magnitude);
      }
    }
    std::printf(
        "amx_read: block 0 against a double reference, worst error over the terms' "
        "magnitudes: scores %.2e, context %.2e\n",
        worst_scores, worst_context);
    if (!(worst_scores < 1e-6 && worst_context < 1e-6)) {
      std::puts("amx_read: the tiles' sums are wrong; no figures");
      return 1;
    }
  }

  struct Case {
    std::string name;
    bool read;
    Mode mode;
    bool in_cache;
  };
  const std::vector<Case> cases = {{"read", true, Mode::kFull, false},
                                   {"amx", false, Mode::kFull, false},
                                   {"amx, loads only", false, Mode::kLoadsOnly, false},
                                   {"amx, in cache", false, Mode::kFull, true}};
  std::vector<std::vector<double>> figures(cases.size());
  for (int round = 0; round < rounds; ++round) {
    for (size_t i = 0; i < cases.size(); ++i) {
      const Case& k = cases[i];
      if (k.read) {
        figures[i].push_back(mha::bench::ReadGbs(cache, kBytes));
        continue;
      }
      const auto start = std::chrono::steady_clock::now();
      double sink = 0;
#pragma omp parallel num_threads(2) reduction(+ : sink)
      {
        ConfigureTiles();
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < kTasks; ++task) {
          const char* base = cache + (k.in_cache ? task % 8 : task) * kTaskBytes;
          sink +=
              Task(base, queries, k.mode, kBlocks, k.in_cache ? 2 : kBlocks, !k.in_cache, nullptr);
        }
      }
      figures[i].push_back(static_cast<double>(kBytes) / Seconds(start) / 1e9);
      if (sink == 12345.0) std::puts("");
    }
  }
  std::printf(
      "bf16 cache of %lld MiB (16 sessions x 8 heads x 4096 tokens, d_h 128), 4 query "
      "rows a head, %d alternated rounds, 2 threads, huge pages advised\n",
      static_cast<long long>(kBytes >> 20), rounds);
  std::vector<std::string> names;
  for (const Case& k : cases) names.push_back(k.name);
  mha::bench::PrintAgainstRead(names, figures);
  munmap(mapped, kBytes);
  return 0;
}

#else
int main() {
  std::puts("amx_read: x86-64 with GCC or Clang only");
  return 0;
}
#endif

#include "core/kernels.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstring>
#include <iterator>
#include <limits>
#include <type_traits>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

// Function multiversioning: one body, compiled for AVX-512, AVX2 and baseline x86-64;
// the dynamic loader picks the best for the CPU. No -march flag leaks into the build.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && \
    !defined(__SANITIZE_ADDRESS__) && !defined(MHA_TSAN)
#define MHA_MULTIVERSION __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define MHA_MULTIVERSION
#endif

namespace mha::core::kernels {
namespace {

// exp(x) for x <= 0: x = n ln2 + r with |r| <= ln2/2, exp(r) by its Taylor series
// to r^7 (truncation error below 6e-9, under half an f32 ulp), 2^n built in the
// exponent bits. Inputs below kExpFloor flush to ~2^-126 (they vanish in the sum).
// Both versions (ExpNonPositive, ExpNonPositive16) use these constants.
constexpr float kExpFloor = -87.0f;
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f;  // ln 2 = kLn2Hi + kLn2Lo, kLn2Hi exact in 9 bits
constexpr float kLn2Lo = -2.12194440e-4f;
// exp(r) = ((...(c[0] r + c[1]) r + ...) r + c[7]: 1/7!, 1/6!, ..., 1/1!, 1/0!.
constexpr float kExpTaylor[] = {1.0f / 5040, 1.0f / 720, 1.0f / 120, 1.0f / 24,
                                1.0f / 6,    0.5f,       1.0f,       1.0f};
// For exponentials rounded to bfloat16 (8 significant bits, a half ulp of 2e-3 or
// more), up to four multiply-adds fewer: a degree-4 polynomial fitted to exp's
// relative error on [-ln2/2, ln2/2] (at most 2.7e-6 evaluated in float), and in
// ExpNonPositive16 ln 2 in one float, by one fused multiply-add (an error in r of at
// most 126 x 2e-9).
constexpr float kLn2 = 0.693147182f;
constexpr float kExpBf16Poly[] = {0.0414584018f, 0.167910308f, 0.500043690f, 0.999963343f,
                                  0.999999285f};
// 2^f = exp(f ln 2): the same polynomials with coefficient i of f^k times (ln 2)^k,
// for scores already in log2 units (base2: their GEMM's scale has log2 e folded in).
// The reduction f = x - round(x) is then exact, and needs no ln 2 at all.
template <size_t N>
constexpr std::array<float, N> InBase2(const float (&c)[N]) {
  std::array<float, N> out{};
  double power = 1.0;  // (ln 2)^k for the coefficient of f^k, k = N - 1 - i
  for (size_t i = N; i-- > 0;) {
    out[i] = static_cast<float>(c[i] * power);
    power *= 0.69314718055994530942;
  }
  return out;
}
constexpr std::array<float, 8> kExp2Taylor = InBase2(kExpTaylor);
constexpr std::array<float, 5> kExp2Bf16Poly = InBase2(kExpBf16Poly);
template <bool kBf16, bool kBase2 = false>
constexpr const auto& ExpPoly() {
  if constexpr (kBase2) {
    if constexpr (kBf16) {
      return kExp2Bf16Poly;
    } else {
      return kExp2Taylor;
    }
  } else if constexpr (kBf16) {
    return kExpBf16Poly;
  } else {
    return kExpTaylor;
  }
}
// The floor in log2 units: 2^-125.5 is exp(-87).
constexpr float kExp2Floor = kExpFloor * kLog2e;

// NaN (scores that overflowed to inf, minus an inf maximum) gives NaN: it is kept out
// of the float -> int conversion, which is undefined for NaN.
// kBase2: 2^x instead.
template <bool kBf16 = false, bool kBase2 = false>
inline float ExpNonPositive(float x) {
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to integer
  const bool nan = x != x;
  constexpr float kFloor = kBase2 ? kExp2Floor : kExpFloor;
  x = x > kFloor ? x : kFloor;  // NaN compares false: the floor
  float n, r;
  if constexpr (kBase2) {
    n = (x + kRound) - kRound;
    r = x - n;
  } else {
    n = (x * kLog2e + kRound) - kRound;
    // Both parts of ln 2 here, for kBf16 too: without a fused multiply-add (which this
    // loop does not ask for), n ln 2 rounded to float is off by up to 4e-6 at n = -126.
    r = (x - n * kLn2Hi) - n * kLn2Lo;
  }
  const auto& poly = ExpPoly<kBf16, kBase2>();
  float p = poly[0];
  for (size_t i = 1; i < std::size(poly); ++i) p = p * r + poly[i];
  const int32_t e = (static_cast<int32_t>(n) + 127) << 23;
  return nan ? std::numeric_limits<float>::quiet_NaN() : p * std::bit_cast<float>(e);
}

// tanh |x| = (1 - e) / (1 + e) with e = exp(-2|x|) in (0, 1]; the sign is put back.
// Large |x| flush e to ~2^-126, giving +-1.
inline float Tanh(float x) {
  const float ax = x < 0.0f ? -x : x;
  const float e = ExpNonPositive(-2.0f * ax);
  const float t = (1.0f - e) / (1.0f + e);
  return x < 0.0f ? -t : t;
}

inline uint16_t Bf16Bits(float x) {
  uint32_t u = std::bit_cast<uint32_t>(x);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

}  // namespace

namespace {
[[gnu::always_inline]] inline float MaxOf(const float* s, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
  for (int64_t j = 0; j < n; ++j) m = s[j] > m ? s[j] : m;
  return m;
}
}  // namespace

MHA_MULTIVERSION float RowMax(const float* s, int64_t n) { return MaxOf(s, n); }

MHA_MULTIVERSION void RowMaxes(const float* s, int64_t n, int64_t rows, float* out) {
  for (int64_t i = 0; i < rows; ++i) out[i] = MaxOf(s + i * n, n);
}

namespace {
// The portable rows' loop, inlined into each clone of its callers.
template <bool kBf16, bool kBase2>
[[gnu::always_inline]] inline float ExpRow(const float* s, float m, float* p, int64_t n) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) {
    const float e = ExpNonPositive<kBf16, kBase2>(s[j] - m);
    p[j] = e;
    sum += e;
  }
  return sum;
}
}  // namespace

MHA_MULTIVERSION float ExpSubSumPortable(const float* s, float m, float* p, int64_t n, bool base2) {
  return base2 ? ExpRow<false, true>(s, m, p, n) : ExpRow<false, false>(s, m, p, n);
}

MHA_MULTIVERSION float ExpSubSumBf16Portable(const float* s, float m, uint16_t* p, int64_t n,
                                             float* tmp, bool base2) {
  // Two vectorised passes: GCC does not vectorise the exp, the float reduction and a
  // 16-bit store in one loop.
  const float sum = base2 ? ExpRow<true, true>(s, m, tmp, n) : ExpRow<true, false>(s, m, tmp, n);
  ToBf16(tmp, p, n);
  return sum;
}

// Key by key across the row, one scoring feature a at a time: the loop over keys is
// contiguous in kt and in s, so it vectorises without horizontal sums (in the
// AVX-512 clone; GCC 12 leaves the AVX2 one scalar, hence AdditiveScoresAvx2).
namespace {
MHA_MULTIVERSION void AdditiveScoresPortable(const float* qa, const float* kt, int64_t ld,
                                             const float* w, int64_t pa, float* s, int64_t n) {
  std::fill_n(s, n, 0.0f);
  for (int64_t a = 0; a < pa; ++a) {
    const float q = qa[a], wa = w[a];
    const float* k = kt + a * ld;
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) s[j] += wa * Tanh(q + k[j]);
  }
}
}  // namespace

#if defined(__x86_64__) && defined(__GNUC__)
#if !defined(__clang__)  // GCC bug 105593, as for the VNNI kernels below
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#define MHA_AVX512 __attribute__((target("avx512f")))
#define MHA_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
namespace {

// ExpNonPositive on 16 lanes, in fewer instructions than the compiler's version of
// the loop: the rounding of n in one instruction, and 2^n applied by vscalefps, which
// also needs no clamp of n. The same reduction and polynomial, so the same values.
// max(-87, x) keeps a NaN x (vmaxps returns its second operand when either is NaN).
template <bool kBf16 = false, bool kBase2 = false>
MHA_AVX512 inline __m512 ExpNonPositive16(__m512 x) {
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  if constexpr (kBase2) {
    x = _mm512_max_ps(_mm512_set1_ps(kExp2Floor), x);
    const __m512 n = _mm512_roundscale_ps(x, kNearest);
    const __m512 f = _mm512_sub_ps(x, n);
    const auto& poly = ExpPoly<kBf16, true>();
    __m512 q = _mm512_set1_ps(poly[0]);
    for (size_t i = 1; i < std::size(poly); ++i) {
      q = _mm512_fmadd_ps(q, f, _mm512_set1_ps(poly[i]));
    }
    return _mm512_scalef_ps(q, n);
  }
  x = _mm512_max_ps(_mm512_set1_ps(kExpFloor), x);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)), kNearest);
  __m512 r;
  if constexpr (kBf16) {
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2), x);
  } else {
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  }
  const auto& poly = ExpPoly<kBf16>();
  __m512 q = _mm512_set1_ps(poly[0]);
  for (size_t i = 1; i < std::size(poly); ++i) q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(poly[i]));
  return _mm512_scalef_ps(q, n);
}

// Bf16Bits on 16 lanes, narrowed to 16 bits in the store.
MHA_AVX512 inline __m512i Bf16Bits16(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  return _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))),
                           16);
}

MHA_AVX512 inline void PutExp16(float* p, uint16_t* p16, int64_t at, __m512 e, __mmask16 keep) {
  if (p16 != nullptr) {
    _mm512_mask_cvtepi32_storeu_epi16(p16 + at, keep, Bf16Bits16(e));
  } else {
    _mm512_mask_storeu_ps(p + at, keep, e);
  }
}

// exp(s - m) over n scores, 16 at a time and a masked tail; two sums, so that the
// additions of consecutive vectors do not wait on each other. Writes f32 to p or
// bfloat16 to p16 (whichever is not null).
template <bool kBf16, bool kBase2>
MHA_AVX512 float ExpSubSumAvx512(const float* s, float m, float* p, uint16_t* p16, int64_t n) {
  const __m512 vm = _mm512_set1_ps(m);
  __m512 sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 32 <= n; j += 32) {
    const __m512 e0 = ExpNonPositive16<kBf16, kBase2>(_mm512_sub_ps(_mm512_loadu_ps(s + j), vm));
    const __m512 e1 =
        ExpNonPositive16<kBf16, kBase2>(_mm512_sub_ps(_mm512_loadu_ps(s + j + 16), vm));
    PutExp16(p, p16, j, e0, 0xffff);
    PutExp16(p, p16, j + 16, e1, 0xffff);
    sum0 = _mm512_add_ps(sum0, e0);
    sum1 = _mm512_add_ps(sum1, e1);
  }
  for (; j < n; j += 16) {
    const __mmask16 keep =
        n - j >= 16 ? __mmask16{0xffff} : static_cast<__mmask16>((1u << (n - j)) - 1);
    const __m512 e =
        ExpNonPositive16<kBf16, kBase2>(_mm512_sub_ps(_mm512_maskz_loadu_ps(keep, s + j), vm));
    PutExp16(p, p16, j, e, keep);
    sum0 = _mm512_mask_add_ps(sum0, keep, sum0, e);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(sum0, sum1));
}

// The bfloat16 row in one pass, narrowed by vcvtne2ps2bf16 (two vectors an
// instruction): the same rounding as Bf16Bits16, to nearest even, for normal values
// and NaN. It flushes denormals to zero, which these exponentials never are (their
// least is about exp(-87) > 2^-126).
template <bool kBase2>
MHA_AVX512_BF16 float ExpSubSumBf16Avx512(const float* s, float m, uint16_t* p16, int64_t n) {
  const __m512 vm = _mm512_set1_ps(m);
  __m512 sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 32 <= n; j += 32) {
    const __m512 e0 = ExpNonPositive16<true, kBase2>(_mm512_sub_ps(_mm512_loadu_ps(s + j), vm));
    const __m512 e1 =
        ExpNonPositive16<true, kBase2>(_mm512_sub_ps(_mm512_loadu_ps(s + j + 16), vm));
    const __m512bh h = _mm512_cvtne2ps_pbh(e1, e0);  // e0 in the low half
    _mm512_storeu_si512(p16 + j, reinterpret_cast<const __m512i&>(h));
    sum0 = _mm512_add_ps(sum0, e0);
    sum1 = _mm512_add_ps(sum1, e1);
  }
  for (; j < n; j += 16) {
    const __mmask16 keep =
        n - j >= 16 ? __mmask16{0xffff} : static_cast<__mmask16>((1u << (n - j)) - 1);
    const __m512 e =
        ExpNonPositive16<true, kBase2>(_mm512_sub_ps(_mm512_maskz_loadu_ps(keep, s + j), vm));
    const __m256bh h = _mm512_cvtneps_pbh(e);
    _mm256_mask_storeu_epi16(p16 + j, keep, reinterpret_cast<const __m256i&>(h));
    sum0 = _mm512_mask_add_ps(sum0, keep, sum0, e);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(sum0, sum1));
}

#define MHA_AVX2 __attribute__((target("avx2,fma")))

// ExpNonPositive16 on 8 lanes, for CPUs with AVX2 and FMA but not AVX-512: the same
// reduction and polynomial in the same fused multiply-adds, so the same values; 2^n
// goes into the exponent bits, as in ExpNonPositive (n + 127 stays in (0, 255): the
// floor bounds n below, and the online softmax's lazy rescale keeps x under 127 above).
// A NaN x stays NaN through the polynomial, whatever bits its n gives.
template <bool kBf16, bool kBase2>
MHA_AVX2 inline __m256 ExpNonPositive8(__m256 x) {
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  __m256 n, r;
  if constexpr (kBase2) {
    x = _mm256_max_ps(_mm256_set1_ps(kExp2Floor), x);
    n = _mm256_round_ps(x, kNearest);
    r = _mm256_sub_ps(x, n);
  } else {
    x = _mm256_max_ps(_mm256_set1_ps(kExpFloor), x);
    n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), kNearest);
    if constexpr (kBf16) {
      r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2), x);
    } else {
      r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
      r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
    }
  }
  const auto& poly = ExpPoly<kBf16, kBase2>();
  __m256 q = _mm256_set1_ps(poly[0]);
  for (size_t i = 1; i < std::size(poly); ++i) q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(poly[i]));
  const __m256i e =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(q, _mm256_castsi256_ps(e));
}

// Bf16Bits on 8 lanes, packed to 8 halves.
MHA_AVX2 inline __m128i Bf16Bits8(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i h =
      _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
  return _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

// The lanes of a row's last vector of 8 that hold elements, `left` of them (1 to 8), as
// the mask of a maskload / maskstore.
MHA_AVX2 inline __m256i TailMask8(int64_t left) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(std::min<int64_t>(left, 8))),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

template <bool kBf16>
MHA_AVX2 inline void PutExp8(float* p, uint16_t* p16, int64_t at, __m256 e) {
  if constexpr (kBf16) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p16 + at), Bf16Bits8(e));
  } else {
    _mm256_storeu_ps(p + at, e);
  }
}

// The sum of x's 8 lanes.
MHA_AVX2 inline float Sum8(__m256 x) {
  __m128 half = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  half = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(half, _mm_movehdup_ps(half)));
}

// ExpSubSumAvx512 on 8 lanes: f32 to p or bfloat16 to p16; the tail through a
// masked load and store (f32) or a copy of its halves (bfloat16).
template <bool kBf16, bool kBase2>
MHA_AVX2 float ExpSubSumAvx2(const float* s, float m, float* p, uint16_t* p16, int64_t n) {
  const __m256 vm = _mm256_set1_ps(m);
  __m256 sum0 = _mm256_setzero_ps(), sum1 = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m256 e0 = ExpNonPositive8<kBf16, kBase2>(_mm256_sub_ps(_mm256_loadu_ps(s + j), vm));
    const __m256 e1 = ExpNonPositive8<kBf16, kBase2>(_mm256_sub_ps(_mm256_loadu_ps(s + j + 8), vm));
    PutExp8<kBf16>(p, p16, j, e0);
    PutExp8<kBf16>(p, p16, j + 8, e1);
    sum0 = _mm256_add_ps(sum0, e0);
    sum1 = _mm256_add_ps(sum1, e1);
  }
  for (; j < n; j += 8) {
    const __m256i keep = TailMask8(n - j);
    const __m256 e = _mm256_and_ps(
        ExpNonPositive8<kBf16, kBase2>(_mm256_sub_ps(_mm256_maskload_ps(s + j, keep), vm)),
        _mm256_castsi256_ps(keep));
    if (n - j >= 8) {
      PutExp8<kBf16>(p, p16, j, e);
    } else if constexpr (kBf16) {
      alignas(16) uint16_t halves[8];
      _mm_store_si128(reinterpret_cast<__m128i*>(halves), Bf16Bits8(e));
      std::memcpy(p16 + j, halves, static_cast<size_t>(n - j) * sizeof(uint16_t));
    } else {
      _mm256_maskstore_ps(p + j, keep, e);
    }
    sum0 = _mm256_add_ps(sum0, e);
  }
  return Sum8(_mm256_add_ps(sum0, sum1));
}

// Tanh on 8 lanes: Tanh's formula with ExpNonPositive8.
MHA_AVX2 inline __m256 Tanh8(__m256 x) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256 e = ExpNonPositive8<false, false>(
      _mm256_mul_ps(_mm256_set1_ps(-2.0f), _mm256_andnot_ps(sign, x)));
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 t = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
  return _mm256_or_ps(t, _mm256_and_ps(x, sign));
}

// AdditiveScores on 8 lanes: 16 keys at a time (then 8, then a masked tail) summed
// over the features in registers, in the portable loop's order of features.
MHA_AVX2 void AdditiveScoresAvx2(const float* qa, const float* kt, int64_t ld, const float* w,
                                 int64_t pa, float* s, int64_t n) {
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    for (int64_t a = 0; a < pa; ++a) {
      const __m256 q = _mm256_set1_ps(qa[a]), wa = _mm256_set1_ps(w[a]);
      const float* k = kt + a * ld + j;
      s0 = _mm256_fmadd_ps(wa, Tanh8(_mm256_add_ps(q, _mm256_loadu_ps(k))), s0);
      s1 = _mm256_fmadd_ps(wa, Tanh8(_mm256_add_ps(q, _mm256_loadu_ps(k + 8))), s1);
    }
    _mm256_storeu_ps(s + j, s0);
    _mm256_storeu_ps(s + j + 8, s1);
  }
  for (; j < n; j += 8) {
    const __m256i keep = TailMask8(n - j);
    __m256 sum = _mm256_setzero_ps();
    for (int64_t a = 0; a < pa; ++a) {
      const __m256 k = _mm256_maskload_ps(kt + a * ld + j, keep);
      sum = _mm256_fmadd_ps(_mm256_set1_ps(w[a]), Tanh8(_mm256_add_ps(_mm256_set1_ps(qa[a]), k)),
                            sum);
    }
    _mm256_maskstore_ps(s + j, keep, sum);
  }
}

// AVX512-BF16 with BW and VL, for the bfloat16 exponentials' one-pass narrowing
// (ActiveIsa says whether AVX-512F is there at all).
const bool kAvx512Bf16 = [] {
  __builtin_cpu_init();  // may run before libgcc's own constructor
  return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl");
}();

}  // namespace

// The exponentials follow ActiveIsa (kernels.h), so that CapIsa runs each build.
float ExpSubSum(const float* s, float m, float* p, int64_t n, bool base2) {
  switch (ActiveIsa()) {
    case Isa::kAvx512:
      return base2 ? ExpSubSumAvx512<false, true>(s, m, p, nullptr, n)
                   : ExpSubSumAvx512<false, false>(s, m, p, nullptr, n);
    case Isa::kAvx2:
      return base2 ? ExpSubSumAvx2<false, true>(s, m, p, nullptr, n)
                   : ExpSubSumAvx2<false, false>(s, m, p, nullptr, n);
    case Isa::kBaseline:
      break;
  }
  return ExpSubSumPortable(s, m, p, n, base2);
}

namespace {
// Rows of 32 (a paged block's) as 4 vectors each, every row's chains in one
// straight run, so that the next row's chains start while this row's sum is reduced.
template <bool kBase2>
MHA_AVX2 void ExpSubSumRows32Avx2(float* s, const float* m, float* sums, int64_t rows) {
  for (int64_t i = 0; i < rows; ++i) {
    float* row = s + i * 32;
    const __m256 vm = _mm256_set1_ps(m[i]);
    __m256 e[4];
    for (int k = 0; k < 4; ++k) {
      e[k] = ExpNonPositive8<false, kBase2>(_mm256_sub_ps(_mm256_loadu_ps(row + 8 * k), vm));
      _mm256_storeu_ps(row + 8 * k, e[k]);
    }
    sums[i] += Sum8(_mm256_add_ps(_mm256_add_ps(e[0], e[1]), _mm256_add_ps(e[2], e[3])));
  }
}
}  // namespace

float ExpSubSumBf16(float* s, float m, uint16_t* p, int64_t n, bool base2) {
  switch (ActiveIsa()) {
    case Isa::kAvx512:
      if (kAvx512Bf16) {
        return base2 ? ExpSubSumBf16Avx512<true>(s, m, p, n)
                     : ExpSubSumBf16Avx512<false>(s, m, p, n);
      }
      return base2 ? ExpSubSumAvx512<true, true>(s, m, nullptr, p, n)
                   : ExpSubSumAvx512<true, false>(s, m, nullptr, p, n);
    case Isa::kAvx2:
      return base2 ? ExpSubSumAvx2<true, true>(s, m, nullptr, p, n)
                   : ExpSubSumAvx2<true, false>(s, m, nullptr, p, n);
    case Isa::kBaseline:
      break;
  }
  return ExpSubSumBf16Portable(s, m, p, n, s, base2);
}
#if !defined(__clang__)
#pragma GCC diagnostic pop
#endif

void AdditiveScores(const float* qa, const float* kt, int64_t ld, const float* w, int64_t pa,
                    float* s, int64_t n) {
  if (ActiveIsa() == Isa::kAvx2) return AdditiveScoresAvx2(qa, kt, ld, w, pa, s, n);
  AdditiveScoresPortable(qa, kt, ld, w, pa, s, n);
}
#else
float ExpSubSum(const float* s, float m, float* p, int64_t n, bool base2) {
  return ExpSubSumPortable(s, m, p, n, base2);
}

float ExpSubSumBf16(float* s, float m, uint16_t* p, int64_t n, bool base2) {
  return ExpSubSumBf16Portable(s, m, p, n, s, base2);
}

void AdditiveScores(const float* qa, const float* kt, int64_t ld, const float* w, int64_t pa,
                    float* s, int64_t n) {
  AdditiveScoresPortable(qa, kt, ld, w, pa, s, n);
}
#endif

// AVX2 rows of 32 as above; other ISAs and row lengths take ExpSubSum row by row.
void ExpSubSumRows(float* s, int64_t n, const float* m, float* sums, int64_t rows, bool base2) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (n == 32 && ActiveIsa() == Isa::kAvx2) {
    return base2 ? ExpSubSumRows32Avx2<true>(s, m, sums, rows)
                 : ExpSubSumRows32Avx2<false>(s, m, sums, rows);
  }
#endif
  for (int64_t i = 0; i < rows; ++i) sums[i] += ExpSubSum(s + i * n, m[i], s + i * n, n, base2);
}

namespace {
inline float FromBf16(uint16_t bits) { return std::bit_cast<float>(uint32_t{bits} << 16); }
}  // namespace

namespace {

// Sixteen floats: one AVX-512 register (four SSE registers in the baseline build; the
// AVX2 build uses Floats8x2 below). The kernels below keep their running sums in
// these, so the sums stay in registers across a block's features or keys; a loop over
// a float array would load and store them at every step, one dependent round trip
// through memory each.
typedef float Floats16 __attribute__((vector_size(64)));
typedef uint16_t Halves16 __attribute__((vector_size(32)));
typedef uint32_t Words16 __attribute__((vector_size(64)));

// Inlined into each clone (compiled for its instruction set), not called from it.
#define MHA_INLINE inline __attribute__((always_inline))

MHA_INLINE void Load16(const float* x, Floats16& v) { std::memcpy(&v, x, sizeof v); }
MHA_INLINE void Store16(float* x, const Floats16& v) { std::memcpy(x, &v, sizeof v); }
// The halves (bf16) and words of a vector of floats' width.
template <typename F>
struct WordsOf;
template <>
struct WordsOf<Floats16> {
  using type = Words16;
  using halves = Halves16;
};
// A vector of bf16 keys or values, widened to f32 (the high half of an f32).
template <typename F>
MHA_INLINE void Widen(const uint16_t* x, F& v) {
  typename WordsOf<F>::halves h;
  std::memcpy(&h, x, sizeof h);
  const auto bits = __builtin_convertvector(h, typename WordsOf<F>::type) << 16;
  std::memcpy(&v, &bits, sizeof v);
}
MHA_INLINE void Load16(const uint16_t* x, Floats16& v) { Widen(x, v); }
MHA_INLINE float Widen(float x) { return x; }
MHA_INLINE float Widen(uint16_t x) { return FromBf16(x); }

// Sixteen floats as two 8-float vectors: the kernels' sums and operands in their AVX2
// build. GCC 12 keeps a 64-byte vector in memory where no register holds
// it, and builds each scalar-times-vector product there through the stack
// (docs/performance.md, "On an AVX2 CPU"); two 32-byte halves stay in registers. The
// same operations element by element as on Floats16, so the same sums.
typedef float Floats8 __attribute__((vector_size(32)));
typedef uint16_t Halves8 __attribute__((vector_size(16)));
typedef uint32_t Words8 __attribute__((vector_size(32)));
struct Floats8x2 {
  Floats8 lo, hi;
};
MHA_INLINE Floats8x2& operator+=(Floats8x2& a, const Floats8x2& b) {
  a.lo += b.lo;
  a.hi += b.hi;
  return a;
}
MHA_INLINE Floats8x2 operator+(const Floats8x2& a, const Floats8x2& b) {
  return {a.lo + b.lo, a.hi + b.hi};
}
MHA_INLINE Floats8x2 operator*(float w, const Floats8x2& x) { return {w * x.lo, w * x.hi}; }
MHA_INLINE void Load16(const float* x, Floats8x2& v) {
  std::memcpy(&v.lo, x, sizeof v.lo);
  std::memcpy(&v.hi, x + 8, sizeof v.hi);
}
MHA_INLINE void Store16(float* x, const Floats8x2& v) {
  std::memcpy(x, &v.lo, sizeof v.lo);
  std::memcpy(x + 8, &v.hi, sizeof v.hi);
}
template <>
struct WordsOf<Floats8> {
  using type = Words8;
  using halves = Halves8;
};
MHA_INLINE void Load16(const uint16_t* x, Floats8x2& v) {
  Widen(x, v.lo);
  Widen(x + 8, v.hi);
}
// The vector type of a build's group kernels, and how many rows a group holds: a
// group keeps up to 2 R (scores) or 4 R (context) vectors of sums in registers, 8
// rows in AVX-512's 32 registers of 16 floats, 2 in AVX2's 16 of 8. A bf16 cache's
// AVX2 groups hold up to 4 rows, over 16 keys or columns at a time (2 R vectors of
// sums): a G 8 group's 4 query rows then load and widen each bf16 row once, not twice
// (the f32 kernels measured slower so; docs/performance.md, "On an AVX2 CPU: the
// arithmetic peak measured, and bf16 groups of 4 rows").
template <typename Vec>
inline constexpr bool kHalves = std::is_same_v<Vec, Floats8x2>;
template <typename Vec, typename T>
inline constexpr int kMaxRows = kHalves<Vec> ? (sizeof(T) == 2 ? 4 : 2) : 8;
// Whether a group of R rows also takes 32 keys or columns at a time: not AVX2's groups
// of 3 or 4 rows, whose 32 sums a row (4 R registers of 8) would not fit its 16.
template <typename Vec, int R>
inline constexpr bool kGroupsOf32 = !kHalves<Vec> || R <= 2;

// acc += w * x[0, 16), x f32 or bfloat16. Vectors go by reference: passed by value
// they would change the ABI between the builds.
template <typename Vec, typename T>
MHA_INLINE void Fma16(Vec& acc, float w, const T* x) {
  Vec v;
  Load16(x, v);
  acc += w * v;
}

// Software prefetch spread over a kernel's loop: `Step` asks for the next few
// cache lines of [next, end), so that the memory reads run while the loop computes
// instead of in one burst before it (a burst waits for the line fill buffers).
struct Prefetcher {
  const char* next = nullptr;
  const char* end = nullptr;
  int64_t per_step = 0;
  Prefetcher(const void* start, int64_t bytes, int64_t steps)
      : next(static_cast<const char*>(start)),
        end(next + (start == nullptr ? 0 : bytes)),
        per_step(steps > 0 ? (bytes / 64 + steps - 1) / steps : 0) {}
  MHA_INLINE void Step() {
    for (int64_t i = 0; i < per_step && next < end; ++i, next += 64) __builtin_prefetch(next);
  }
  MHA_INLINE void Rest() {
    for (; next < end; next += 64) __builtin_prefetch(next);
  }
};

// Where the read-ahead lands: L2 on Intel CPUs for an f32 cache, and for a bf16 cache
// read by the 16-float kernels, where each read faster than L1; L1 for AVX2's bf16
// kernels and on other CPUs (docs/performance.md, "On an Intel CPU" and "A bf16 cache's
// read-ahead into L2 on Intel"). The 16-float kernels also pace an f32 cache's
// (kReadAheadPace, below).
const bool kReadAheadIntoL2 = [] {
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();  // may run before libgcc's own constructor
  return __builtin_cpu_is("intel") != 0;
#else
  return false;  // __builtin_cpu_is is x86's
#endif
}();

// The pacing of an f32 cache's read-ahead into L2 by the 16-float kernels (AVX-512;
// the baseline build shares their vectors): each prefetch is issued behind
// kReadAheadPace conditional branches on flags the compiler cannot see are true
// (PacingBranches, always true). Alternated with the unpaced kernels on an Intel VM,
// round by round, they read an f32 cache from memory 6-27% faster (paged_read's
// chunks of 8 and of 128) and in cache within the noise; a decode step of 16 sessions
// at context 4,096 took 12-17% less time in the core and through the server. Not
// paced: the AVX2 kernels, which read 16% slower paced, and bf16 caches (into L1),
// which read 5-13% slower. Why it helps is a reading, not a measurement (the VM has
// no hardware counters): the branches in flight are bounded, and so then are the rows
// a kernel has in flight while it waits for memory. docs/performance.md, "Pacing the
// f32 read-ahead on Intel". Caches read without read-ahead (32 MiB and under) do not
// pass here.
inline constexpr int kReadAheadPace = 5;

MHA_INLINE bool PacingBranches() {
  for (int b = 0; b < kReadAheadPace; ++b) {
    bool go = true;
    asm volatile("" : "+r"(go));  // a flag the compiler cannot see is true
    if (!go) return false;
  }
  return true;
}

// The group kernels' software prefetch: as a kernel loads vector `i` of a row of cache
// elements at x, it asks for the line `bytes` further on (0: none), into L1 (on Intel,
// an f32 cache's, paced, and the 16-float kernels' bf16 cache's: into L2,
// kReadAheadIntoL2), once per cache line (a bf16 line is two vectors; AVX2's 16-wide
// bf16 groups read half a line of each row and ask for it once per pass). A kernel
// reads its tile in order (those groups in a pass per 16 keys or columns), and a cache
// block's values follow its keys, and its next block's keys its values, within a
// head's run of a chunk (KvSequence::keys): the prefetches run a fixed distance ahead
// of the reads across the whole run, through the softmax between the scores and the
// context and across the blocks. The hardware prefetchers alone kept too few reads in
// flight for one core to stream the cache at the memory's pace (docs/performance.md,
// "Reading ahead of the kernels").
struct ReadAhead {
  int64_t bytes = 0;
  template <typename Vec, typename T>
  MHA_INLINE void At(const T* x, int i) const {
    if (bytes != 0 && (16 * sizeof(T) * i) % 64 == 0) {
      const char* line = reinterpret_cast<const char*>(x) + bytes;
      constexpr bool kIntoL2 = sizeof(T) == 4 || !kHalves<Vec>;
      constexpr bool kPaced = sizeof(T) == 4 && !kHalves<Vec>;
      if (kIntoL2 && kReadAheadIntoL2) {
        if (!kPaced || PacingBranches()) __builtin_prefetch(line, 0, 1);  // prefetcht2
      } else {
        __builtin_prefetch(line, 0, 3);  // prefetcht0
      }
    }
  }
};

// s[j0, j0 + 16 V) = scale * q (p) kt[:, j0 : j0 + 16 V]: V vectors of keys, each
// summed in four (AVX2: two) interleaved partial sums over the features, so that the
// multiply-adds form 4 V short chains instead of V long ones.
template <typename Vec, int V, typename T>
MHA_INLINE void TransposedScoresGroup(const float* q, const T* kt, int64_t ld, int64_t p,
                                      int64_t j0, float scale, float* s, Prefetcher& pf) {
  constexpr int U = kHalves<Vec> ? 2 : 4;
  Vec acc[U][V] = {};
  int64_t c = 0;
  for (; c + U <= p; c += U) {
    if (c % 4 == 0) pf.Step();
    const T* r = kt + c * ld + j0;
    for (int u = 0; u < U; ++u) {
      for (int v = 0; v < V; ++v) Fma16(acc[u][v], q[c + u], r + u * ld + 16 * v);
    }
  }
  for (; c < p; ++c) {
    for (int v = 0; v < V; ++v) Fma16(acc[0][v], q[c], kt + c * ld + j0 + 16 * v);
  }
  for (int v = 0; v < V; ++v) {
    if constexpr (U == 4) {
      Store16(s + j0 + 16 * v, scale * ((acc[0][v] + acc[1][v]) + (acc[2][v] + acc[3][v])));
    } else {
      Store16(s + j0 + 16 * v, scale * (acc[0][v] + acc[1][v]));
    }
  }
}

// s[0, nk) = scale * q (p) kt[:, :nk], one query row against keys stored transposed:
// groups of 32 keys, then of 16 (TransposedScoresGroup); keys past the last group
// take a plain loop.
template <typename Vec, typename T>
MHA_INLINE void TransposedScoresRow(const float* q, const T* kt, int64_t ld, int64_t p, int64_t nk,
                                    float scale, float* s, Prefetcher& pf) {
  int64_t j0 = 0;
  for (; j0 + 32 <= nk; j0 += 32) TransposedScoresGroup<Vec, 2>(q, kt, ld, p, j0, scale, s, pf);
  for (; j0 + 16 <= nk; j0 += 16) TransposedScoresGroup<Vec, 1>(q, kt, ld, p, j0, scale, s, pf);
  if (j0 == nk) return;
  std::fill(s + j0, s + nk, 0.0f);
  for (int64_t c = 0; c < p; ++c) {
    const float qc = scale * q[c];
    const T* row = kt + c * ld;
#pragma omp simd
    for (int64_t j = j0; j < nk; ++j) s[j] += qc * Widen(row[j]);
  }
}

// o[c0, c0 + 16 V) += w (nk) v[:, c0 : c0 + 16 V]: V vectors of columns, each summed
// in two interleaved partial sums over the keys.
template <typename Vec, int V, typename T>
MHA_INLINE void ContextGroup(const float* w, const T* v, int64_t p, int64_t nk, int64_t c0,
                             float* o, Prefetcher& pf) {
  Vec a[V], b[V] = {};
  for (int u = 0; u < V; ++u) Load16(o + c0 + 16 * u, a[u]);
  int64_t j = 0;
  for (; j + 2 <= nk; j += 2) {
    pf.Step();
    const T* r = v + j * p + c0;
    for (int u = 0; u < V; ++u) Fma16(a[u], w[j], r + 16 * u);
    for (int u = 0; u < V; ++u) Fma16(b[u], w[j + 1], r + p + 16 * u);
  }
  if (j < nk) {
    for (int u = 0; u < V; ++u) Fma16(a[u], w[j], v + j * p + c0 + 16 * u);
  }
  for (int u = 0; u < V; ++u) Store16(o + c0 + 16 * u, a[u] + b[u]);
}

// o (p) += w (nk) v (nk, p), one row: groups of 64 columns (not on AVX2: 16 registers
// of sums), then of 32 and of 16 (ContextGroup); columns past the last group take a
// plain loop.
template <typename Vec, typename T>
MHA_INLINE void ContextRow(const float* w, const T* v, int64_t p, int64_t nk, float* o,
                           Prefetcher& pf) {
  int64_t c0 = 0;
  if constexpr (!kHalves<Vec>) {
    for (; c0 + 64 <= p; c0 += 64) ContextGroup<Vec, 4>(w, v, p, nk, c0, o, pf);
  }
  for (; c0 + 32 <= p; c0 += 32) ContextGroup<Vec, 2>(w, v, p, nk, c0, o, pf);
  for (; c0 + 16 <= p; c0 += 16) ContextGroup<Vec, 1>(w, v, p, nk, c0, o, pf);
  if (c0 == p) return;
  for (int64_t j = 0; j < nk; ++j) {
    const float wj = w[j];
    const T* vj = v + j * p;
#pragma omp simd
    for (int64_t c = c0; c < p; ++c) o[c] += wj * Widen(vj[c]);
  }
}

// The group kernels' rows of V vectors (16 V elements at x). An f32 row is V vectors
// in element order. A bf16 row of an even V is read in 64-byte loads of 32 elements,
// each widened to two vectors by a shift and a mask (its even elements, then its odd
// ones): half the instructions of widening 16 at a time. Sums over such rows stay in
// that split order, element by element, and LoadSums / StoreSums turn them from and to
// element order: the same sums, in the same order of additions. So is a bf16 row of
// one Floats8x2 (16 elements, one 32-byte load: lo the even ones, hi the odd ones).
template <typename T, int V, typename Vec>
inline constexpr bool kSplit = sizeof(T) == 2 && (V % 2 == 0 || kHalves<Vec>);
// 32 bf16 elements at x (16 for Floats8): the even ones (0, 2, ...) to `even`, the odd
// ones to `odd`. A pair of halves loads each half on its own: one 64-byte copy into
// the pair went through the stack.
template <typename F>
MHA_INLINE void LoadSplit(const uint16_t* x, F& even, F& odd) {
  typename WordsOf<F>::type w;
  std::memcpy(&w, x, sizeof w);
  const auto e = w << 16, o = w & 0xffff0000u;
  std::memcpy(&even, &e, sizeof e);
  std::memcpy(&odd, &o, sizeof o);
}
MHA_INLINE void LoadSplit(const uint16_t* x, Floats8x2& even, Floats8x2& odd) {
  LoadSplit(x, even.lo, odd.lo);
  LoadSplit(x + 16, even.hi, odd.hi);
}
// 32 sums in element order (a: 0-15, b: 16-31) to split order (a: the even
// elements, b: the odd ones), and back to memory in element order.
MHA_INLINE void SplitSums(Floats16& a, Floats16& b) {
  const Floats16 first = a, second = b;
  a = __builtin_shufflevector(first, second, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28,
                              30);
  b = __builtin_shufflevector(first, second, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29,
                              31);
}
MHA_INLINE void SplitSums(Floats8x2& a, Floats8x2& b) {
  const Floats8x2 first = a, second = b;
  a.lo = __builtin_shufflevector(first.lo, first.hi, 0, 2, 4, 6, 8, 10, 12, 14);
  a.hi = __builtin_shufflevector(second.lo, second.hi, 0, 2, 4, 6, 8, 10, 12, 14);
  b.lo = __builtin_shufflevector(first.lo, first.hi, 1, 3, 5, 7, 9, 11, 13, 15);
  b.hi = __builtin_shufflevector(second.lo, second.hi, 1, 3, 5, 7, 9, 11, 13, 15);
}
MHA_INLINE void StoreMerged(float* x, const Floats16& a, const Floats16& b) {
  Store16(x, __builtin_shufflevector(a, b, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23));
  Store16(x + 16, __builtin_shufflevector(a, b, 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14,
                                          30, 15, 31));
}
MHA_INLINE void StoreMerged(float* x, const Floats8x2& a, const Floats8x2& b) {
  const Floats8 parts[4] = {__builtin_shufflevector(a.lo, b.lo, 0, 8, 1, 9, 2, 10, 3, 11),
                            __builtin_shufflevector(a.lo, b.lo, 4, 12, 5, 13, 6, 14, 7, 15),
                            __builtin_shufflevector(a.hi, b.hi, 0, 8, 1, 9, 2, 10, 3, 11),
                            __builtin_shufflevector(a.hi, b.hi, 4, 12, 5, 13, 6, 14, 7, 15)};
  for (int i = 0; i < 4; ++i) std::memcpy(x + 8 * i, &parts[i], sizeof parts[i]);
}
// 16 sums in element order to split order (lo: the even elements, hi: the odd ones),
// and back to memory in element order.
MHA_INLINE void SplitSums(Floats8x2& a) {
  const Floats8x2 x = a;
  a.lo = __builtin_shufflevector(x.lo, x.hi, 0, 2, 4, 6, 8, 10, 12, 14);
  a.hi = __builtin_shufflevector(x.lo, x.hi, 1, 3, 5, 7, 9, 11, 13, 15);
}
MHA_INLINE void StoreMerged(float* x, const Floats8x2& a) {
  const Floats8 first = __builtin_shufflevector(a.lo, a.hi, 0, 8, 1, 9, 2, 10, 3, 11);
  const Floats8 second = __builtin_shufflevector(a.lo, a.hi, 4, 12, 5, 13, 6, 14, 7, 15);
  std::memcpy(x, &first, sizeof first);
  std::memcpy(x + 8, &second, sizeof second);
}
template <int V, typename T, typename Vec>
MHA_INLINE void LoadRow(const T* x, Vec (&k)[V]) {
  if constexpr (kSplit<T, V, Vec> && V == 1) {
    LoadSplit(x, k[0].lo, k[0].hi);
  } else if constexpr (kSplit<T, V, Vec>) {
    for (int v = 0; v < V; v += 2) LoadSplit(x + 16 * v, k[v], k[v + 1]);
  } else {
    for (int v = 0; v < V; ++v) Load16(x + 16 * v, k[v]);
  }
}
template <typename T, int V, typename Vec>
MHA_INLINE void LoadSums(const float* x, Vec (&a)[V]) {
  for (int v = 0; v < V; ++v) Load16(x + 16 * v, a[v]);
  if constexpr (kSplit<T, V, Vec> && V == 1) {
    SplitSums(a[0]);
  } else if constexpr (kSplit<T, V, Vec>) {
    for (int v = 0; v < V; v += 2) SplitSums(a[v], a[v + 1]);
  }
}
template <typename T, int V, typename Vec>
MHA_INLINE void StoreSums(float* x, const Vec (&a)[V]) {
  if constexpr (kSplit<T, V, Vec> && V == 1) {
    StoreMerged(x, a[0]);
  } else if constexpr (kSplit<T, V, Vec>) {
    for (int v = 0; v < V; v += 2) StoreMerged(x + 16 * v, a[v], a[v + 1]);
  } else {
    for (int v = 0; v < V; ++v) Store16(x + 16 * v, a[v]);
  }
}

// R rows' scores against V vectors of keys at j0: s[r * lds + j0, + 16 V) =
// scale * q[r * p, + p) kt[:, j0 : j0 + 16 V] for r < R. Each vector of keys is loaded
// once for the R rows; the sums run in U interleaved partial sums over the features,
// so that R U V chains of multiply-adds are in flight (at least 8 for the whole
// blocks of 32 keys; AVX2's groups of 3 rows over a bf16 cache have 6). R 1 is
// TransposedScoresGroup's order of additions.
template <typename Vec, int R, int U, int V, typename T>
MHA_INLINE void ScoresRowsGroup(const float* q, const T* kt, int64_t ld, int64_t p, int64_t j0,
                                float scale, float* s, int64_t lds, ReadAhead ra) {
  Vec acc[U][R][V] = {};
  int64_t c = 0;
  for (; c + U <= p; c += U) {
#pragma GCC unroll 4
    for (int u = 0; u < U; ++u) {
      Vec k[V];
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) ra.At<Vec>(kt + (c + u) * ld + j0 + 16 * v, v);
      LoadRow<V>(kt + (c + u) * ld + j0, k);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const float qc = q[r * p + c + u];
#pragma GCC unroll 4
        for (int v = 0; v < V; ++v) acc[u][r][v] += qc * k[v];
      }
    }
  }
  for (; c < p; ++c) {
    Vec k[V];
    LoadRow<V>(kt + c * ld + j0, k);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const float qc = q[r * p + c];
      for (int v = 0; v < V; ++v) acc[0][r][v] += qc * k[v];
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    Vec sums[V];
    for (int v = 0; v < V; ++v) {
      Vec sum;
      if constexpr (U == 4) {
        sum = (acc[0][r][v] + acc[1][r][v]) + (acc[2][r][v] + acc[3][r][v]);
      } else if constexpr (U == 2) {
        sum = acc[0][r][v] + acc[1][r][v];
      } else {
        sum = acc[0][r][v];
      }
      sums[v] = scale * sum;
    }
    StoreSums<T>(s + r * lds + j0, sums);
  }
}

// R rows (q rows of p, s rows of nk) against keys [0, nk) stored transposed: groups
// of 32 keys (not for AVX2's groups of 3 or 4 rows), then of 16; keys past the last
// group take a plain loop per row.
template <typename Vec, int R, typename T>
MHA_INLINE void ScoresRows(const float* q, const T* kt, int64_t ld, int64_t p, int64_t nk,
                           float scale, float* s, ReadAhead ra) {
  // 8 or more chains, in at most 16 registers of sums (AVX2: 8, and 6 chains for 3
  // rows over a bf16 cache: 2 partial sums would leave too few registers)
  constexpr int U = kHalves<Vec> ? (R == 1 ? 2 : 1) : R == 1 ? 4 : R <= 3 ? 2 : 1;
  constexpr int U1 = kHalves<Vec> ? (R == 1 ? 4 : R == 2 ? 2 : 1) : R <= 2 ? 4 : 2;
  int64_t j0 = 0;
  if constexpr (kGroupsOf32<Vec, R>) {
    for (; j0 + 32 <= nk; j0 += 32) {
      ScoresRowsGroup<Vec, R, U, 2>(q, kt, ld, p, j0, scale, s, nk, ra);
    }
  }
  for (; j0 + 16 <= nk; j0 += 16)
    ScoresRowsGroup<Vec, R, U1, 1>(q, kt, ld, p, j0, scale, s, nk, ra);
  if (j0 == nk) return;
  if (j0 + 16 <= ld) {
    // The rows of kt hold a whole vector past j0 (a cache block's last keys): one more
    // group, whose sums past nk are dropped, in place of the plain loop below, where
    // each key's sum is a chain of p multiply-adds through memory.
    float last[R * 16];
    ScoresRowsGroup<Vec, R, U1, 1>(q, kt + j0, ld, p, 0, scale, last, 16, ra);
    for (int r = 0; r < R; ++r) std::copy_n(last + r * 16, nk - j0, s + r * nk + j0);
    return;
  }
  for (int r = 0; r < R; ++r) {
    float* sr = s + r * nk;
    std::fill(sr + j0, sr + nk, 0.0f);
    for (int64_t c = 0; c < p; ++c) {
      const float qc = scale * q[r * p + c];
      const T* row = kt + c * ld;
#pragma omp simd
      for (int64_t j = j0; j < nk; ++j) sr[j] += qc * Widen(row[j]);
    }
  }
}

// R rows' context over V vectors of columns at c0: o[r * ldo + c0, + 16 V) +=
// w[r * nk, + nk) v[:, c0 : c0 + 16 V] for r < R, v's rows ldv apart. Each vector of
// a value row is loaded once for the R rows; U interleaved partial sums over the keys
// (2 for one row, ContextGroup's order of additions).
template <typename Vec, int R, int U, int V, typename T>
MHA_INLINE void ContextRowsGroup(const float* w, const T* v, int64_t ldv, int64_t nk, int64_t c0,
                                 float* o, int64_t ldo, ReadAhead ra) {
  Vec a[U][R][V];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    LoadSums<T>(o + r * ldo + c0, a[0][r]);
    for (int i = 1; i < U; ++i) {
      for (int u = 0; u < V; ++u) a[i][r][u] = Vec{};
    }
  }
  int64_t j = 0;
  for (; j + U <= nk; j += U) {
#pragma GCC unroll 4
    for (int i = 0; i < U; ++i) {
      Vec x[V];
#pragma GCC unroll 4
      for (int u = 0; u < V; ++u) ra.At<Vec>(v + (j + i) * ldv + c0 + 16 * u, u);
      LoadRow<V>(v + (j + i) * ldv + c0, x);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const float wj = w[r * nk + j + i];
#pragma GCC unroll 4
        for (int u = 0; u < V; ++u) a[i][r][u] += wj * x[u];
      }
    }
  }
  for (; j < nk; ++j) {
    Vec x[V];
    LoadRow<V>(v + j * ldv + c0, x);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const float wj = w[r * nk + j];
      for (int u = 0; u < V; ++u) a[0][r][u] += wj * x[u];
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    Vec sums[V];
    for (int u = 0; u < V; ++u) {
      sums[u] = a[0][r][u];
      for (int i = 1; i < U; ++i) sums[u] += a[i][r][u];
    }
    StoreSums<T>(o + r * ldo + c0, sums);
  }
}

// R rows (w rows of nk, o rows of ldo) += w v, v (nk, cols) (a panel of values):
// groups of 64 columns for up to four rows (32 for more, keeping R V sums in
// registers), then of 32 (not for AVX2's groups of 3 or 4 rows) and 16; columns past
// the last group take a plain loop per row.
template <typename Vec, int R, typename T>
MHA_INLINE void ContextRows(const float* w, const T* v, int64_t cols, int64_t nk, float* o,
                            int64_t ldo, ReadAhead ra) {
  constexpr int U = R == 1 ? 2 : 1;
  int64_t c0 = 0;
  if constexpr (R <= 4 && !kHalves<Vec>) {
    for (; c0 + 64 <= cols; c0 += 64) {
      ContextRowsGroup<Vec, R, U, 4>(w, v, cols, nk, c0, o, ldo, ra);
    }
  }
  if constexpr (kGroupsOf32<Vec, R>) {
    for (; c0 + 32 <= cols; c0 += 32) {
      ContextRowsGroup<Vec, R, U, 2>(w, v, cols, nk, c0, o, ldo, ra);
    }
  }
  for (; c0 + 16 <= cols; c0 += 16) {
    ContextRowsGroup<Vec, R, R <= 2 ? 2 : 1, 1>(w, v, cols, nk, c0, o, ldo, ra);
  }
  if (c0 == cols) return;
  for (int r = 0; r < R; ++r) {
    float* orow = o + r * ldo;
    for (int64_t j = 0; j < nk; ++j) {
      const float wj = w[r * nk + j];
      const T* vj = v + j * cols;
#pragma omp simd
      for (int64_t c = c0; c < cols; ++c) orow[c] += wj * Widen(vj[c]);
    }
  }
}

// Rows in groups of at most kMaxRows<Vec, T>. More are split evenly (9 as 5 + 4, not
// 8 + 1), so that no group is left with a row or two.
template <typename Vec, typename T>
inline int GroupRows(int64_t rest) {
  constexpr int kMax = kMaxRows<Vec, T>;
  if (rest <= kMax) return static_cast<int>(rest);
  const int64_t groups = (rest + kMax - 1) / kMax;
  return static_cast<int>((rest + groups - 1) / groups);
}

// ScoresRows / ContextRows for `rows` rows (1 to R).
template <typename Vec, typename T, int R = kMaxRows<Vec, T>>
MHA_INLINE void ScoresRowsOf(int rows, const float* q, const T* kt, int64_t ld, int64_t p,
                             int64_t nk, float scale, float* s, ReadAhead ra) {
  if constexpr (R > 1) {
    if (rows < R) return ScoresRowsOf<Vec, T, R - 1>(rows, q, kt, ld, p, nk, scale, s, ra);
  }
  ScoresRows<Vec, R>(q, kt, ld, p, nk, scale, s, ra);
}
template <typename Vec, typename T, int R = kMaxRows<Vec, T>>
MHA_INLINE void ContextRowsOf(int rows, const float* w, const T* v, int64_t cols, int64_t nk,
                              float* o, int64_t ldo, ReadAhead ra) {
  if constexpr (R > 1) {
    if (rows < R) return ContextRowsOf<Vec, T, R - 1>(rows, w, v, cols, nk, o, ldo, ra);
  }
  ContextRows<Vec, R>(w, v, cols, nk, o, ldo, ra);
}

template <typename Vec, typename T>
MHA_INLINE void GroupScoresImpl(const float* q, const T* kt, int64_t ld, int64_t p, int64_t mq,
                                int64_t nk, float scale, float* s, ReadAhead ra) {
  for (int64_t r0 = 0; r0 < mq;) {
    const int rows = GroupRows<Vec, T>(mq - r0);
    ScoresRowsOf<Vec, T>(rows, q + r0 * p, kt, ld, p, nk, scale, s + r0 * nk, ra);
    r0 += rows;
  }
}

// One panel of values (ValueIndex), (nk, cols), into its columns of o's rows of p.
template <typename Vec, typename T>
MHA_INLINE void GroupContextPanel(const float* w, const T* v, int64_t cols, int64_t p, int64_t mq,
                                  int64_t nk, float* o, ReadAhead ra) {
  for (int64_t r0 = 0; r0 < mq;) {
    const int rows = GroupRows<Vec, T>(mq - r0);
    ContextRowsOf<Vec, T>(rows, w + r0 * nk, v, cols, nk, o + r0 * p, p, ra);
    r0 += rows;
  }
}

template <typename Vec, typename T>
MHA_INLINE void GroupContextImpl(const float* w, const T* v, int64_t panel_rows, int64_t p,
                                 int64_t mq, int64_t nk, float* o, ReadAhead ra) {
  for (int64_t c0 = 0; c0 < p; c0 += kValuePanel<T>) {
    const int64_t cols = std::min(kValuePanel<T>, p - c0);
    GroupContextPanel<Vec>(w, v + c0 * panel_rows, cols, p, mq, nk, o + c0, ra);
  }
}

template <typename Vec>
MHA_INLINE void SmallScoresOn(const float* q, const float* k, int64_t p, int64_t mq, int64_t nk,
                              float scale, float* s) {
  // The keys transposed once, then every row against them as the paged kernels do: a
  // dot product per key would end in a horizontal sum each (most of a small block's
  // time at p 32). A small block has nk p <= 8192 (its caller's bound on mq nk p).
  float kt[8192];
  if (nk * p > 8192) {
    for (int64_t i = 0; i < mq; ++i) {
      for (int64_t j = 0; j < nk; ++j) {
        float dot = 0.0f;
        for (int64_t c = 0; c < p; ++c) dot += q[i * p + c] * k[j * p + c];
        s[i * nk + j] = scale * dot;
      }
    }
    return;
  }
  for (int64_t j = 0; j < nk; ++j) {
    for (int64_t c = 0; c < p; ++c) kt[c * nk + j] = k[j * p + c];
  }
  Prefetcher none(nullptr, 0, 0);
  for (int64_t i = 0; i < mq; ++i)
    TransposedScoresRow<Vec>(q + i * p, kt, nk, p, nk, scale, s + i * nk, none);
}

template <typename Vec, typename T>
MHA_INLINE void SmallContextOn(const float* probs, const T* v, int64_t p, int64_t mq, int64_t nk,
                               bool accumulate, float* o, const void* prefetch,
                               int64_t prefetch_bytes) {
  Prefetcher pf(prefetch, prefetch_bytes, (p / 64) * (nk / 2));
  for (int64_t i = 0; i < mq; ++i) {
    if (!accumulate) std::fill_n(o + i * p, p, 0.0f);
    ContextRow<Vec>(probs + i * nk, v, p, nk, o + i * p, pf);
  }
  pf.Rest();
}

template <typename Vec, typename T>
MHA_INLINE void TransposedScoresOn(const float* q, const T* kt, int64_t ld, int64_t p, int64_t mq,
                                   int64_t nk, float scale, float* s, const void* prefetch,
                                   int64_t prefetch_bytes) {
  Prefetcher pf(prefetch, prefetch_bytes, (nk / 32) * (p / 4));
  for (int64_t i = 0; i < mq; ++i) {
    TransposedScoresRow<Vec>(q + i * p, kt, ld, p, nk, scale, s + i * nk, pf);
  }
  pf.Rest();
}

}  // namespace

int64_t PanelCount(int64_t n) { return (n + kPanelColumns - 1) / kPanelColumns; }

void PackPanels(const float* w, int64_t n, int64_t k, float* panels) {
  std::fill_n(panels, PanelCount(n) * k * kPanelColumns, 0.0f);
  for (int64_t col = 0; col < n; ++col) {
    float* out = panels + col / kPanelColumns * k * kPanelColumns + col % kPanelColumns;
    for (int64_t i = 0; i < k; ++i) out[i * kPanelColumns] = w[col * k + i];
  }
}

namespace {

// R rows of x through V vectors of a panel's columns (from w, rows kPanelColumns
// apart; the first `cols` of them real, y's columns past them not written) into their
// rows of y: R x V vectors of sums, kept in registers over the panel's k rows. The
// panel streams in from memory for the first group of rows and from L2 for the others.
template <typename Vec, int R, int V>
MHA_INLINE void PanelGroup(const float* x, int64_t ldx, const float* w, int64_t k,
                           const float* bias, int64_t cols, float* y, int64_t ldy) {
  Vec a[R][V];
  float edge[16 * V] = {};
  if (bias != nullptr) std::copy_n(bias, std::min<int64_t>(cols, 16 * V), edge);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) Load16(edge + 16 * v, a[r][v]);
  }
  for (int64_t i = 0; i < k; ++i, w += kPanelColumns) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const float xi = x[r * ldx + i];
#pragma GCC unroll 8
      for (int v = 0; v < V; ++v) Fma16(a[r][v], xi, w + 16 * v);
    }
  }
  for (int r = 0; r < R; ++r) {
    float* out = cols >= 16 * V ? y + r * ldy : edge;
    for (int v = 0; v < V; ++v) Store16(out + 16 * v, a[r][v]);
    if (out == edge) std::copy_n(edge, cols, y + r * ldy);
  }
}

// A panel's columns for R rows: all 128 at once in AVX-512 (8 R vectors of sums), in
// slices of 64 (one row) or 32 (two or three) in AVX2, whose 16 registers hold a
// quarter as many floats. A slice reads its part of each of the panel's rows, so the
// panel still streams in once.
template <typename Vec, int R>
MHA_INLINE void PanelSlices(const float* x, int64_t ldx, const float* w, int64_t k,
                            const float* bias, int64_t cols, float* y, int64_t ldy) {
  constexpr int V = !kHalves<Vec> ? 8 : R == 1 ? 4 : 2;
  for (int64_t c0 = 0; c0 < cols; c0 += 16 * V) {
    PanelGroup<Vec, R, V>(x, ldx, w + c0, k, bias == nullptr ? nullptr : bias + c0, cols - c0,
                          y + c0, ldy);
  }
}

// Groups of three rows: 24 vectors of sums in AVX-512, the most that leave registers
// for the broadcast rows and the panel's loads.
template <typename Vec>
MHA_INLINE void PanelRowsOn(const float* x, int64_t ldx, int64_t m, const float* panels, int64_t n,
                            int64_t k, const float* b, float* y, int64_t ldy, int64_t first,
                            int64_t last) {
  static_assert(kPanelColumns == 8 * 16);
  for (int64_t panel = first; panel < last; ++panel) {
    const int64_t col0 = panel * kPanelColumns, cols = std::min(kPanelColumns, n - col0);
    const float* w = panels + panel * k * kPanelColumns;
    const float* bias = b == nullptr ? nullptr : b + col0;
    int64_t r0 = 0;
    for (; r0 + 3 <= m; r0 += 3) {
      PanelSlices<Vec, 3>(x + r0 * ldx, ldx, w, k, bias, cols, y + r0 * ldy + col0, ldy);
    }
    if (m - r0 == 2) {
      PanelSlices<Vec, 2>(x + r0 * ldx, ldx, w, k, bias, cols, y + r0 * ldy + col0, ldy);
    }
    if (m - r0 == 1) {
      PanelSlices<Vec, 1>(x + r0 * ldx, ldx, w, k, bias, cols, y + r0 * ldy + col0, ldy);
    }
  }
}

// The kernels above, built for each instruction set (kernels.h, Isa): Body<Vec>::Run
// is inlined into a function compiled for AVX-512 (on Floats16), for AVX2 with FMA
// (Floats8x2) and for baseline x86-64 (Floats16); Dispatch calls the one ActiveIsa
// names.
#if defined(__x86_64__) && defined(__GNUC__)
#define MHA_ISA_BUILDS 1
template <template <typename> class Body, typename... A>
__attribute__((target("avx512f"))) void RunAvx512(A... a) {
  Body<Floats16>::Run(a...);
}
template <template <typename> class Body, typename... A>
__attribute__((target("avx2,fma"))) void RunAvx2(A... a) {
  Body<Floats8x2>::Run(a...);
}
#endif
template <template <typename> class Body, typename... A>
void RunBaseline(A... a) {
  Body<Floats16>::Run(a...);
}

const Isa kCpuIsa = [] {
#if defined(MHA_ISA_BUILDS)
  __builtin_cpu_init();  // may run before libgcc's own constructor
  if (__builtin_cpu_supports("avx512f")) return Isa::kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::kAvx2;
#endif
  return Isa::kBaseline;
}();
std::atomic<Isa> isa_cap{Isa::kAvx512};

template <template <typename> class Body, typename... A>
void Dispatch(A... a) {
#if defined(MHA_ISA_BUILDS)
  switch (ActiveIsa()) {
    case Isa::kAvx512:
      return RunAvx512<Body>(a...);
    case Isa::kAvx2:
      return RunAvx2<Body>(a...);
    case Isa::kBaseline:
      break;
  }
#endif
  RunBaseline<Body>(a...);
}

template <typename Vec>
struct SmallScoresBody {
  MHA_INLINE static void Run(const float* q, const float* k, int64_t p, int64_t mq, int64_t nk,
                             float scale, float* s) {
    SmallScoresOn<Vec>(q, k, p, mq, nk, scale, s);
  }
};
template <typename Vec>
struct SmallContextBody {
  template <typename T>
  MHA_INLINE static void Run(const float* probs, const T* v, int64_t p, int64_t mq, int64_t nk,
                             bool accumulate, float* o, const void* prefetch,
                             int64_t prefetch_bytes) {
    SmallContextOn<Vec>(probs, v, p, mq, nk, accumulate, o, prefetch, prefetch_bytes);
  }
};
template <typename Vec>
struct TransposedScoresBody {
  template <typename T>
  MHA_INLINE static void Run(const float* q, const T* kt, int64_t ld, int64_t p, int64_t mq,
                             int64_t nk, float scale, float* s, const void* prefetch,
                             int64_t prefetch_bytes) {
    TransposedScoresOn<Vec>(q, kt, ld, p, mq, nk, scale, s, prefetch, prefetch_bytes);
  }
};
template <typename Vec>
struct GroupScoresBody {
  template <typename T>
  MHA_INLINE static void Run(const float* q, const T* kt, int64_t ld, int64_t p, int64_t mq,
                             int64_t nk, float scale, float* s, int64_t read_ahead) {
    GroupScoresImpl<Vec>(q, kt, ld, p, mq, nk, scale, s, ReadAhead{read_ahead});
  }
};
template <typename Vec>
struct GroupContextBody {
  template <typename T>
  MHA_INLINE static void Run(const float* probs, const T* v, int64_t panel_rows, int64_t p,
                             int64_t mq, int64_t nk, float* o, int64_t read_ahead) {
    GroupContextImpl<Vec>(probs, v, panel_rows, p, mq, nk, o, ReadAhead{read_ahead});
  }
};
template <typename Vec>
struct PanelRowsBody {
  MHA_INLINE static void Run(const float* x, int64_t ldx, int64_t m, const float* panels, int64_t n,
                             int64_t k, const float* b, float* y, int64_t ldy, int64_t first,
                             int64_t last) {
    PanelRowsOn<Vec>(x, ldx, m, panels, n, k, b, y, ldy, first, last);
  }
};

}  // namespace

Isa CpuIsa() { return kCpuIsa; }
Isa ActiveIsa() { return std::min(kCpuIsa, isa_cap.load(std::memory_order_relaxed)); }
void CapIsa(Isa cap) { isa_cap.store(cap, std::memory_order_relaxed); }
const char* IsaName(Isa isa) {
  switch (isa) {
    case Isa::kAvx512:
      return "avx512";
    case Isa::kAvx2:
      return "avx2";
    case Isa::kBaseline:
      break;
  }
  return "baseline";
}

void SmallScores(const float* q, const float* k, int64_t p, int64_t mq, int64_t nk, float scale,
                 float* s) {
  Dispatch<SmallScoresBody>(q, k, p, mq, nk, scale, s);
}
void SmallContext(const float* probs, const float* v, int64_t p, int64_t mq, int64_t nk,
                  bool accumulate, float* o, const void* prefetch, int64_t prefetch_bytes) {
  Dispatch<SmallContextBody>(probs, v, p, mq, nk, accumulate, o, prefetch, prefetch_bytes);
}
void SmallContextBf16(const float* probs, const uint16_t* v, int64_t p, int64_t mq, int64_t nk,
                      float* o, const void* prefetch, int64_t prefetch_bytes) {
  Dispatch<SmallContextBody>(probs, v, p, mq, nk, true, o, prefetch, prefetch_bytes);
}
void TransposedScores(const float* q, const float* kt, int64_t ld, int64_t p, int64_t mq,
                      int64_t nk, float scale, float* s, const void* prefetch,
                      int64_t prefetch_bytes) {
  Dispatch<TransposedScoresBody>(q, kt, ld, p, mq, nk, scale, s, prefetch, prefetch_bytes);
}
void TransposedScoresBf16(const float* q, const uint16_t* kt, int64_t ld, int64_t p, int64_t mq,
                          int64_t nk, float scale, float* s, const void* prefetch,
                          int64_t prefetch_bytes) {
  Dispatch<TransposedScoresBody>(q, kt, ld, p, mq, nk, scale, s, prefetch, prefetch_bytes);
}
void GroupScores(const float* q, const float* kt, int64_t ld, int64_t p, int64_t mq, int64_t nk,
                 float scale, float* s, int64_t read_ahead) {
  Dispatch<GroupScoresBody>(q, kt, ld, p, mq, nk, scale, s, read_ahead);
}
void GroupScoresBf16(const float* q, const uint16_t* kt, int64_t ld, int64_t p, int64_t mq,
                     int64_t nk, float scale, float* s, int64_t read_ahead) {
  Dispatch<GroupScoresBody>(q, kt, ld, p, mq, nk, scale, s, read_ahead);
}
void GroupContext(const float* probs, const float* v, int64_t panel_rows, int64_t p, int64_t mq,
                  int64_t nk, float* o, int64_t read_ahead) {
  Dispatch<GroupContextBody>(probs, v, panel_rows, p, mq, nk, o, read_ahead);
}
void GroupContextBf16(const float* probs, const uint16_t* v, int64_t panel_rows, int64_t p,
                      int64_t mq, int64_t nk, float* o, int64_t read_ahead) {
  Dispatch<GroupContextBody>(probs, v, panel_rows, p, mq, nk, o, read_ahead);
}
void PanelRows(const float* x, int64_t ldx, int64_t m, const float* panels, int64_t n, int64_t k,
               const float* b, float* y, int64_t ldy, int64_t first, int64_t last) {
  Dispatch<PanelRowsBody>(x, ldx, m, panels, n, k, b, y, ldy, first, last);
}

MHA_MULTIVERSION void Scale(float* x, float factor, int64_t n) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) x[j] *= factor;
}

MHA_MULTIVERSION void ToBf16(const float* x, uint16_t* y, int64_t n) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) y[j] = Bf16Bits(x[j]);
}

MHA_MULTIVERSION void QuantizeRows(const uint16_t* x, int64_t ldx, int64_t m, int64_t k, int8_t* q,
                                   float* scales) {
  for (int64_t r = 0; r < m; ++r, x += ldx, q += k) {
    float most = 0.0f;
#pragma omp simd reduction(max : most)
    for (int64_t j = 0; j < k; ++j) most = std::max(most, std::fabs(FromBf16(x[j])));
    scales[r] = most / 127.0f;
    const float inv = most > 0.0f ? 127.0f / most : 0.0f;
    // |x * inv| <= 127 (up to rounding), so the conversion cannot overflow; adding
    // half away from zero and truncating rounds to nearest.
#pragma omp simd
    for (int64_t j = 0; j < k; ++j) {
      const float v = FromBf16(x[j]) * inv;
      const float rounded = v + (v < 0.0f ? -0.5f : 0.5f);
      q[j] = static_cast<int8_t>(std::clamp(static_cast<int32_t>(rounded), -127, 127));
    }
  }
}

MHA_MULTIVERSION void QuantizeRows(const float* x, int64_t ldx, int64_t m, int64_t k, int8_t* q,
                                   float* scales) {
  for (int64_t r = 0; r < m; ++r, x += ldx, q += k) {
    float most = 0.0f;
#pragma omp simd reduction(max : most)
    for (int64_t j = 0; j < k; ++j) most = std::max(most, std::fabs(x[j]));
    scales[r] = most / 127.0f;
    const float inv = most > 0.0f ? 127.0f / most : 0.0f;
#pragma omp simd
    for (int64_t j = 0; j < k; ++j) {
      const float v = x[j] * inv;
      const float rounded = v + (v < 0.0f ? -0.5f : 0.5f);
      q[j] = static_cast<int8_t>(std::clamp(static_cast<int32_t>(rounded), -127, 127));
    }
  }
}

namespace {

// n sums of one row rescaled into f32 or bf16 y (DequantizeRows).
MHA_INLINE void DequantizeSpan(const int32_t* acc, int64_t n, float row_scale,
                               const float* col_scales, const float* b, void* y, bool bf16) {
  if (bf16) {
    auto* out = static_cast<uint16_t*>(y);
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) {
      out[j] = Bf16Bits(static_cast<float>(acc[j]) * row_scale * col_scales[j] + (b ? b[j] : 0.0f));
    }
  } else {
    auto* out = static_cast<float*>(y);
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) {
      out[j] = static_cast<float>(acc[j]) * row_scale * col_scales[j] + (b ? b[j] : 0.0f);
    }
  }
}

}  // namespace

MHA_MULTIVERSION void DequantizeRows(const int32_t* acc, int64_t m, int64_t n,
                                     const float* row_scales, const float* col_scales,
                                     const float* b, void* y, int64_t ldy, bool bf16) {
  const int64_t row_bytes = ldy * (bf16 ? 2 : 4);
  for (int64_t r = 0; r < m; ++r, acc += n) {
    DequantizeSpan(acc, n, row_scales[r], col_scales, b, static_cast<char*>(y) + r * row_bytes,
                   bf16);
  }
}

MHA_MULTIVERSION void DequantizeRowSegments(const int32_t* acc, int64_t n, float row_scale,
                                            const float* col_scales, const float* b, int64_t width,
                                            void* const* dst, bool bf16) {
  for (int64_t c0 = 0, s = 0; c0 < n; c0 += width, ++s) {
    DequantizeSpan(acc + c0, width, row_scale, col_scales + c0, b ? b + c0 : nullptr, dst[s], bf16);
  }
}

int64_t Int8PanelDepth(int64_t k) { return (k + 3) / 4 * 4; }
int64_t Int8PanelCount(int64_t n) { return (n + kInt8PanelColumns - 1) / kInt8PanelColumns; }

void PackInt8Panels(const int8_t* w, int64_t n, int64_t k, int8_t* panels, int32_t* column_sums) {
  const int64_t depth = Int8PanelDepth(k);
  std::fill_n(panels, Int8PanelCount(n) * depth * kInt8PanelColumns, int8_t{0});
  for (int64_t col = 0; col < n; ++col) {
    // Panel, then the group of 4 inputs, then the column's 4 bytes within it.
    int8_t* out =
        panels + col / kInt8PanelColumns * depth * kInt8PanelColumns + col % kInt8PanelColumns * 4;
    int32_t sum = 0;
    for (int64_t i = 0; i < k; ++i) {
      out[i / 4 * kInt8PanelColumns * 4 + i % 4] = w[col * k + i];
      sum += w[col * k + i];
    }
    column_sums[col] = 128 * sum;
  }
}

#if defined(__x86_64__) && defined(__GNUC__)
// GCC 12's AVX-512 intrinsics start some results from _mm512_undefined_*, which
// -Wmaybe-uninitialized reports at -O3 (GCC bug 105593).
#if !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#define MHA_VNNI __attribute__((target("avx512f,avx512bw,avx512vnni")))

bool Int8RowPathSupported() { return __builtin_cpu_supports("avx512vnni"); }

namespace {

// R rows through one panel: R x 4 vectors of 16 column sums, in registers over k,
// then rescaled into y.
template <int R>
MHA_VNNI inline void Int8PanelGroup(const uint8_t* x, int64_t ldx, const int8_t* w, int64_t depth,
                                    const Int8Epilogue& e, int64_t col0, int64_t cols) {
  __m512i a[R][4];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < 4; ++v) a[r][v] = _mm512_setzero_si512();
  }
  for (int64_t i = 0; i < depth; i += 4, w += 4 * kInt8PanelColumns) {
    const __m512i w0 = _mm512_loadu_si512(w);
    const __m512i w1 = _mm512_loadu_si512(w + 64);
    const __m512i w2 = _mm512_loadu_si512(w + 128);
    const __m512i w3 = _mm512_loadu_si512(w + 192);
    for (int r = 0; r < R; ++r) {
      int32_t four;
      std::memcpy(&four, x + r * ldx + i, 4);
      const __m512i xb = _mm512_set1_epi32(four);
      a[r][0] = _mm512_dpbusd_epi32(a[r][0], xb, w0);
      a[r][1] = _mm512_dpbusd_epi32(a[r][1], xb, w1);
      a[r][2] = _mm512_dpbusd_epi32(a[r][2], xb, w2);
      a[r][3] = _mm512_dpbusd_epi32(a[r][3], xb, w3);
    }
  }
  // The u8 rows are the s8 ones + 128: take 128 * column sum back off, then
  // y = sum * row scale * column scale + b.
  for (int v = 0; v < 4; ++v) {
    const int64_t c0 = col0 + 16 * v, n = std::min<int64_t>(16, cols - 16 * v);
    if (n <= 0) break;
    const __mmask16 keep = static_cast<__mmask16>((1u << n) - 1);
    const __m512i shift = _mm512_maskz_loadu_epi32(keep, e.column_sums + c0);
    const __m512 scale = _mm512_maskz_loadu_ps(keep, e.col_scales + c0);
    const __m512 bias =
        e.bias == nullptr ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(keep, e.bias + c0);
    for (int r = 0; r < R; ++r) {
      const __m512 sum = _mm512_cvtepi32_ps(_mm512_sub_epi32(a[r][v], shift));
      const __m512 out =
          _mm512_fmadd_ps(_mm512_mul_ps(sum, _mm512_set1_ps(e.row_scales[r])), scale, bias);
      _mm512_mask_storeu_ps(e.y + r * e.ldy + c0, keep, out);
    }
  }
}

}  // namespace

MHA_VNNI void Int8PanelRows(const uint8_t* x, int64_t ldx, int64_t m, const int8_t* panels,
                            int64_t n, int64_t k, const Int8Epilogue& e, int64_t first,
                            int64_t last) {
  const int64_t depth = Int8PanelDepth(k);
  for (int64_t panel = first; panel < last; ++panel) {
    const int64_t col0 = panel * kInt8PanelColumns;
    const int64_t cols = std::min(kInt8PanelColumns, n - col0);
    const int8_t* w = panels + panel * depth * kInt8PanelColumns;
    if (m == 3) Int8PanelGroup<3>(x, ldx, w, depth, e, col0, cols);
    if (m == 2) Int8PanelGroup<2>(x, ldx, w, depth, e, col0, cols);
    if (m == 1) Int8PanelGroup<1>(x, ldx, w, depth, e, col0, cols);
  }
}
#if !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#else
bool Int8RowPathSupported() { return false; }
void Int8PanelRows(const uint8_t*, int64_t, int64_t, const int8_t*, int64_t, int64_t,
                   const Int8Epilogue&, int64_t, int64_t) {}
#endif

}  // namespace mha::core::kernels

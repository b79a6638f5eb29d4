#include "core/kernels.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>

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
// exponent bits. Inputs below -87 flush to ~2^-126 (they vanish in the sum). NaN
// (scores that overflowed to inf, minus an inf maximum) gives NaN: it is kept out of
// the float -> int conversion, which is undefined for NaN.
inline float ExpNonPositive(float x) {
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693359375f;
  constexpr float kLn2Lo = -2.12194440e-4f;
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to integer
  const bool nan = x != x;
  x = x > -87.0f ? x : -87.0f;  // NaN compares false: -87
  const float n = (x * kLog2e + kRound) - kRound;
  const float r = (x - n * kLn2Hi) - n * kLn2Lo;
  float p = 1.0f / 5040;
  p = p * r + 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
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

MHA_MULTIVERSION float RowMax(const float* s, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
  for (int64_t j = 0; j < n; ++j) m = s[j] > m ? s[j] : m;
  return m;
}

MHA_MULTIVERSION float ExpSubSum(const float* s, float m, float* p, int64_t n) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) {
    const float e = ExpNonPositive(s[j] - m);
    p[j] = e;
    sum += e;
  }
  return sum;
}

float ExpSubSumBf16(float* s, float m, uint16_t* p, int64_t n) {
  // Two vectorised passes: GCC does not vectorise the exp, the float reduction and a
  // 16-bit store in one loop.
  const float sum = ExpSubSum(s, m, s, n);
  ToBf16(s, p, n);
  return sum;
}

// Key by key across the row, one scoring feature a at a time: the loop over keys is
// contiguous in kt and in s, so it vectorises without horizontal sums.
MHA_MULTIVERSION void AdditiveScores(const float* qa, const float* kt, int64_t ld, const float* w,
                                     int64_t pa, float* s, int64_t n) {
  std::fill_n(s, n, 0.0f);
  for (int64_t a = 0; a < pa; ++a) {
    const float q = qa[a], wa = w[a];
    const float* k = kt + a * ld;
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) s[j] += wa * Tanh(q + k[j]);
  }
}

MHA_MULTIVERSION void SmallScores(const float* q, const float* k, int64_t p, int64_t mq, int64_t nk,
                                  float scale, float* s) {
  for (int64_t i = 0; i < mq; ++i) {
    const float* qi = q + i * p;
    for (int64_t j = 0; j < nk; ++j) {
      const float* kj = k + j * p;
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t c = 0; c < p; ++c) dot += qi[c] * kj[c];
      s[i * nk + j] = scale * dot;
    }
  }
}

MHA_MULTIVERSION void SmallContext(const float* probs, const float* v, int64_t p, int64_t mq,
                                   int64_t nk, bool accumulate, float* o) {
  for (int64_t i = 0; i < mq; ++i) {
    float* oi = o + i * p;
    if (!accumulate) std::fill_n(oi, p, 0.0f);
    for (int64_t j = 0; j < nk; ++j) {
      const float w = probs[i * nk + j];
      const float* vj = v + j * p;
#pragma omp simd
      for (int64_t c = 0; c < p; ++c) oi[c] += w * vj[c];
    }
  }
}

MHA_MULTIVERSION void TransposedScores(const float* q, const float* kt, int64_t ld, int64_t p,
                                       int64_t mq, int64_t nk, float scale, float* s) {
  for (int64_t i = 0; i < mq; ++i) {
    float* si = s + i * nk;
    std::fill_n(si, nk, 0.0f);
    for (int64_t c = 0; c < p; ++c) {
      const float qc = scale * q[i * p + c];
      const float* row = kt + c * ld;
#pragma omp simd
      for (int64_t j = 0; j < nk; ++j) si[j] += qc * row[j];
    }
  }
}

namespace {
inline float FromBf16(uint16_t bits) { return std::bit_cast<float>(uint32_t{bits} << 16); }
}  // namespace

MHA_MULTIVERSION void TransposedScoresBf16(const float* q, const uint16_t* kt, int64_t ld,
                                           int64_t p, int64_t mq, int64_t nk, float scale,
                                           float* s) {
  for (int64_t i = 0; i < mq; ++i) {
    float* si = s + i * nk;
    std::fill_n(si, nk, 0.0f);
    for (int64_t c = 0; c < p; ++c) {
      const float qc = scale * q[i * p + c];
      const uint16_t* row = kt + c * ld;
#pragma omp simd
      for (int64_t j = 0; j < nk; ++j) si[j] += qc * FromBf16(row[j]);
    }
  }
}

MHA_MULTIVERSION void SmallContextBf16(const float* probs, const uint16_t* v, int64_t p, int64_t mq,
                                       int64_t nk, float* o) {
  for (int64_t i = 0; i < mq; ++i) {
    float* oi = o + i * p;
    for (int64_t j = 0; j < nk; ++j) {
      const float w = probs[i * nk + j];
      const uint16_t* vj = v + j * p;
#pragma omp simd
      for (int64_t c = 0; c < p; ++c) oi[c] += w * FromBf16(vj[c]);
    }
  }
}

MHA_MULTIVERSION void Scale(float* x, float factor, int64_t n) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) x[j] *= factor;
}

MHA_MULTIVERSION void ToBf16(const float* x, uint16_t* y, int64_t n) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) y[j] = Bf16Bits(x[j]);
}

}  // namespace mha::core::kernels

// Rotary position embedding (RoPE) of the attention passes (ModelConfig::rope): the
// first rotary_dim features of a query or key head, taken as rotary_dim / 2 pairs,
// each pair (a, b) rotated by the angle position * inv_freq[k]:
//   a' = a cos - b sin,  b' = b cos + a sin,  inv_freq[k] = theta^(-2k / rotary_dim)
// Pairs are (k, k + rotary_dim/2) (rotate-half, Hugging Face's Llama) or (2k, 2k + 1)
// (interleaved, Meta's original). Features past rotary_dim are unchanged.
//
// The angles and their cos and sin are computed in double precision, then rounded to
// float once into a table of positions x pairs, kept and shared between calls (grown
// as a call needs more positions): a position near 8191 is as accurate as position 1.
// Hugging Face computes the angles in float32, about 1e-3 off at 8k positions.
//
// Internal to core/: only core/*.cc include it.
#ifndef MHA_CORE_ROTARY_H_
#define MHA_CORE_ROTARY_H_

#include <bit>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "core/config.h"

namespace mha::core::internal {

// cos and sin of every (position, pair) for positions [0, positions()).
class RotaryTable {
 public:
  RotaryTable(int64_t positions, int64_t rotary_dim, double theta);
  int64_t positions() const { return positions_; }
  const float* cos(int64_t position) const { return cos_.data() + position * half_; }
  const float* sin(int64_t position) const { return sin_.data() + position * half_; }

 private:
  int64_t positions_, half_;
  std::vector<float> cos_, sin_;  // (positions, rotary_dim / 2)
};

class Rotary {
 public:
  explicit Rotary(const ModelConfig& c)
      : rotary_dim_(c.rotary_dim()), theta_(c.rope_theta()), interleaved_(c.rope->interleaved) {}

  // A table covering positions [0, n) at least. Thread-safe; the table is immutable
  // and stays valid while the caller holds it.
  std::shared_ptr<const RotaryTable> Table(int64_t n) const;

  // y (p features) = x rotated to `position` of `table`; x and y may be the same. T is
  // float, or uint16_t for bfloat16 (rotated in f32, rounded to nearest even once).
  template <typename In, typename Out>
  void Apply(const In* x, Out* y, int64_t p, const RotaryTable& table, int64_t position) const {
    const int64_t half = rotary_dim_ / 2;
    const float* c = table.cos(position);
    const float* s = table.sin(position);
    // Rotate-half pairs k with k + half; interleaved pairs 2k with 2k + 1.
    const int64_t stride = interleaved_ ? 2 : 1, other = interleaved_ ? 1 : half;
    for (int64_t k = 0; k < half; ++k) {
      const int64_t i = k * stride;
      const float a = Widen(x[i]), b = Widen(x[i + other]);
      y[i] = Narrow<Out>(a * c[k] - b * s[k]);
      y[i + other] = Narrow<Out>(b * c[k] + a * s[k]);
    }
    for (int64_t i = rotary_dim_; i < p; ++i) y[i] = Narrow<Out>(Widen(x[i]));
  }

 private:
  static float Widen(float x) { return x; }
  static float Widen(uint16_t x) { return std::bit_cast<float>(uint32_t{x} << 16); }
  template <typename Out>
  static Out Narrow(float x) {
    if constexpr (sizeof(Out) == 4) {
      return x;
    } else {
      uint32_t u = std::bit_cast<uint32_t>(x);
      u += 0x7fffu + ((u >> 16) & 1u);
      return static_cast<uint16_t>(u >> 16);
    }
  }

  const int64_t rotary_dim_;
  const double theta_;
  const bool interleaved_;
  mutable absl::Mutex mu_;
  mutable std::shared_ptr<const RotaryTable> table_ ABSL_GUARDED_BY(mu_);
};

}  // namespace mha::core::internal

#endif  // MHA_CORE_ROTARY_H_

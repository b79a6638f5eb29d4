// SplitMix64 (Steele, Lea and Flood, 2014): a 64-bit generator small enough to
// write again in any language, so that inputs made from a seed are the same
// everywhere. The toy examples (mha_toy_example, attention_client infer, bench and
// heatmap, client/python) fill queries (B, Q, d_q) row-major, then keys (B, K, d_k),
// then values (B, K, d_v) with Signed() from one SplitMix64(seed), seed 0 by default:
//
//   state += 0x9E3779B97F4A7C15
//   z = state
//   z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
//   z = (z ^ (z >> 27)) * 0x94D049BB133111EB
//   z ^= z >> 31                                  (uint64 arithmetic, wrapping)
//   value = float((z >> 11) * 2^-53 * 2 - 1)      (the product in double)
//
// Seed 0 gives z = 0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F, ...
#ifndef MHA_BASE_SPLITMIX64_H_
#define MHA_BASE_SPLITMIX64_H_

#include <cstdint>

namespace mha {

class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t seed) : state_(seed) {}

  uint64_t Next() {
    state_ += 0x9E3779B97F4A7C15ull;
    uint64_t z = state_;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }

  // Uniform in [-1, 1) as a double; as a float 1.0 is possible by rounding.
  float Signed() {
    return static_cast<float>(static_cast<double>(Next() >> 11) * 0x1.0p-53 * 2.0 - 1.0);
  }

 private:
  uint64_t state_;
};

}  // namespace mha

#endif  // MHA_BASE_SPLITMIX64_H_

// The learned parameters of one layer, float32, row-major, in the d2l layout:
//   w_q (p_o, d_q), w_k (p_kv, d_k), w_v (p_kv, d_v), w_o (p_o, p_o)
//   b_q, b_o (p_o), b_k, b_v (p_kv) when ModelConfig::bias, else empty,
// where p_kv = G * head_size (ModelConfig::kv_hiddens(); p_o unless grouped).
// y = x W^T + b, as nn.Linear computes.
// Additive scoring (ModelConfig::scoring kAdditive) adds, one set per head h:
//   score_w_q (h, p_a, p), score_w_k (h, p_a, p), score_w_v (h, p_a)
// with p = p_o / h and p_a = additive_hidden; empty for dot-product scoring.
#ifndef MHA_CORE_WEIGHTS_H_
#define MHA_CORE_WEIGHTS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/config.h"

namespace mha::core {

struct Weights {
  std::vector<float> w_q, w_k, w_v, w_o;
  std::vector<float> b_q, b_k, b_v, b_o;
  std::vector<float> score_w_q, score_w_k, score_w_v;

  // INVALID_ARGUMENT naming the first tensor whose size disagrees with `config`.
  absl::Status Validate(const ModelConfig& config) const;
};

// Deterministic weights for demos and load tests: each matrix is uniform in
// +-1/sqrt(fan_in) (nn.Linear's default range), biases likewise, drawn from a
// 64-bit generator seeded by `seed` and the tensor's name. Same seed, same weights,
// on every machine. Additive scoring parameters are drawn per head. An
// attention-only config (projections NONE) gets none.
Weights SeededWeights(const ModelConfig& config, uint64_t seed);

// Loads weights for `config` from a .safetensors file, under either naming:
//
//  PyTorch nn.MultiheadAttention (needs d_q == p_o, as PyTorch does):
//    in_proj_weight (3p_o, p_o)                         when d_k == d_v == d_q
//    or q_proj_weight (p_o, d_q), k_proj_weight (p_o, d_k), v_proj_weight (p_o, d_v)
//    in_proj_bias (3p_o)                                when bias
//    out_proj.weight (p_o, p_o), out_proj.bias (p_o)    (bias when bias)
//  d2l MultiHeadAttention:
//    W_q.weight (p_o, d_q), W_k.weight (p_o, d_k), W_v.weight (p_o, d_v),
//    W_o.weight (p_o, p_o), and each ".bias" (p_o) when bias
//    with additive scoring (d2l naming only), each in either layout:
//      attention.W_q.weight  (p_a, p) shared by every head, or (h, p_a, p) per head
//      attention.W_k.weight  (p_a, p)                       or (h, p_a, p)
//      attention.w_v.weight  (1, p_a)                       or (h, p_a)
//    "shared" is d2l's MultiHeadAttention holding one AdditiveAttention module.
//  Hugging Face attention modules (the only naming for num_kv_heads G < h):
//    q_proj.weight (p_o, d_q), k_proj.weight (p_kv, d_k), v_proj.weight (p_kv, d_v),
//    o_proj.weight (p_o, p_o); when bias, q_proj.bias, k_proj.bias, v_proj.bias
//    required and o_proj.bias optional (absent = zero, as Qwen2).
//
// The naming is detected from the tensor names. A missing, extra, mis-shaped or
// non-float tensor is INVALID_ARGUMENT naming it; F16/BF16/F64 are converted.
absl::StatusOr<Weights> LoadSafetensorsWeights(const std::string& path, const ModelConfig& config);

class SafetensorsFile;
absl::StatusOr<Weights> WeightsFromSafetensors(const SafetensorsFile& file,
                                               const ModelConfig& config);

}  // namespace mha::core

#endif  // MHA_CORE_WEIGHTS_H_

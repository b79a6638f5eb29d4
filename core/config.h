// The description of one multi-head attention layer: its sizes, biases and the
// precision of its matrix products.
#ifndef MHA_CORE_CONFIG_H_
#define MHA_CORE_CONFIG_H_

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace mha::core {

// Precision of the GEMMs. Inputs and outputs are always float32; kBf16 converts
// activations and weights to bfloat16 for the matrix products and accumulates in
// float32 (softmax statistics stay float32). kInt8 (docs/core.md, "int8 models")
// quantizes the four projections' weights to int8 at load, symmetric, one scale per
// output feature, and their inputs at every call, symmetric, one scale per row; the
// projections accumulate in int32 and add their biases in float32. Attention itself
// (scores, softmax, context) runs as in a bf16 model. Dot-product scoring with
// projections only; sessions' caches stay f32 unless kv_cache_precision says bf16.
enum class Precision { kF32, kBf16, kInt8 };

absl::string_view PrecisionName(Precision precision);
absl::StatusOr<Precision> ParsePrecision(absl::string_view name);  // "f32" | "bf16" | "int8"

// The attention pooling of every head, for its projected query q (p), keys k_j and
// values v_j (p = p_o / h each):
//   kDotProduct  score_j = q . k_j / sqrt(p)
//   kAdditive    score_j = w_v . tanh(A_q q + A_k k_j), A_q and A_k (p_a, p), w_v (p_a):
//                Bahdanau's additive attention with p_a = additive_hidden, no scaling
// Masks, softmax over keys and the context sum_j a_j v_j are the same for both.
enum class Scoring { kDotProduct, kAdditive };

absl::string_view ScoringName(Scoring scoring);  // "dot_product" | "additive"

// Whether the layer owns its projections. kFull: W_q, W_k, W_v, W_o as above.
// kNone (the attention-only worker): no weights; queries are already projected and
// rotated, (.., h * d_h), keys and values (.., G * d_h), and the output is the heads'
// contexts concatenated (head_mask applied, no W_o). Needs query_size = num_hiddens,
// key_size = value_size = G * d_h, dot-product scoring, no bias and no rope; keys and
// values are always given (no self-attention).
enum class Projections { kFull, kNone };

// Rotary position embedding (RoPE) of q and k, applied to the first rotary_dim
// features of every query and key head after projection: feature pairs rotated by
// position * inv_freq[k], inv_freq[k] = theta^(-2k / rotary_dim), the angles in double
// precision. Positions (docs/core.md): key j of a stateless call at j, query i at
// K - Q + i; a session's token t at t.
struct RotaryConfig {
  double theta = 0;          // 0 = 10000
  int64_t rotary_dim = 0;    // 0 = the head size; even, <= the head size
  bool interleaved = false;  // false: pairs (k, k + rotary_dim/2) (Hugging Face's Llama);
                             // true: pairs (2k, 2k + 1) (Meta's original)
};

// Sizes follow the d2l seeds: num_hiddens is p_o, query/key/value_size are the
// input feature sizes d_q, d_k, d_v (they may differ from p_o).
//
// Example, the seeds' toy layer:
//   ModelConfig c{.num_hiddens = 100, .num_heads = 5, .query_size = 100,
//                 .key_size = 100, .value_size = 100};
//   c.head_size() == 20
struct ModelConfig {
  int64_t num_hiddens = 100;  // p_o, the width of every projection and the output
  int64_t num_heads = 5;      // h; p_o % h must be 0
  int64_t query_size = 100;   // d_q
  int64_t key_size = 100;     // d_k
  int64_t value_size = 100;   // d_v
  bool bias = false;          // biases on W_q, W_k, W_v and W_o (all or none)
  Precision precision = Precision::kF32;
  Scoring scoring = Scoring::kDotProduct;
  int64_t additive_hidden = 0;  // p_a: required (>= 1) with kAdditive, else 0
  float dropout = 0.0f;         // accepted for parity with training configs; identity here
  // G key/value heads (grouped-query attention; 1: multi-query), each shared by
  // num_heads / G query heads: query head i uses key/value head i / (num_heads / G).
  // 0 = num_heads (multi-head). W_k, W_v are (G * head_size, d_k), (G * head_size, d_v).
  int64_t num_kv_heads = 0;
  std::optional<RotaryConfig> rope;  // absent: no rotary embedding
  // The element type of sessions' K/V caches (ForwardPaged); absent: the model's
  // precision (f32 for kInt8). kBf16 halves an f32 or int8 model's cache; a bf16
  // model's is always bf16.
  std::optional<Precision> kv_cache_precision;
  Projections projections = Projections::kFull;

  int64_t head_size() const { return num_hiddens / num_heads; }
  // G, resolved (never 0), and the width of the K and V projections.
  int64_t kv_heads() const { return num_kv_heads == 0 ? num_heads : num_kv_heads; }
  int64_t kv_hiddens() const { return kv_heads() * head_size(); }
  // The rotary settings, resolved: theta 10000 when 0, rotary_dim the head size when 0.
  double rope_theta() const { return rope && rope->theta != 0 ? rope->theta : 10000.0; }
  int64_t rotary_dim() const {
    return rope && rope->rotary_dim != 0 ? rope->rotary_dim : head_size();
  }
  // Sessions' caches hold bf16 (KvSequence's bf16 flag), resolved.
  bool cache_bf16() const { return kv_cache_precision.value_or(precision) == Precision::kBf16; }
  bool attention_only() const { return projections == Projections::kNone; }
  // Self-attention (keys and values omitted) needs d_k == d_v == d_q and projections.
  bool SupportsSelfAttention() const {
    return !attention_only() && key_size == query_size && value_size == query_size;
  }
  // INVALID_ARGUMENT naming the first field that is out of range.
  absl::Status Validate() const;
};

}  // namespace mha::core

#endif  // MHA_CORE_CONFIG_H_

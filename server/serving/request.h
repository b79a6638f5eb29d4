// A request as every front hands it to the serving layer, whatever protocol carried
// it: views of its tensors (RequestView), and the one validation every front runs on
// them (Validate) into core views (ValidatedRequest). No protocol types; fronts
// decode their messages into a RequestView (server/attention_v1/codec.h,
// server/kserve/inference_codec.h) and size their responses (OutputViews).
//
// Validate checks, in this order (the first failure is returned):
//   max_request_bytes    serialized size over the model's limit -> RESOURCE_EXHAUSTED
//   queries              required; rank 3; dims >= 1; data length == prod(shape)
//                        (int64 overflow guarded); shape (B, Q, d_q) -> INVALID_ARGUMENT
//   keys, values         both or neither; rank 3; (B, K, d_k) and (B, K, d_v);
//                        neither needs a model with d_k == d_v == d_q -> INVALID_ARGUMENT
//   limits               B > max_batch_size, Q or K > max_sequence_length,
//                        return_attention with B*h*Q*K > max_attention_elements
//                        -> RESOURCE_EXHAUSTED naming the limit and its value
//   valid_lens           0, B or B*Q entries, each in [0, K] -> INVALID_ARGUMENT
//   head_mask            0 or h entries, finite -> INVALID_ARGUMENT
//   return_lse           on a model with projections FULL -> INVALID_ARGUMENT
//   values               every query/key/value entry finite -> INVALID_ARGUMENT
//                        naming the position, e.g.
//                        "queries: non-finite value nan at index 17 (batch 0,
//                         position 0, feature 17)"
// Messages name the field and the expectation:
//   "keys: expected shape (2, 6, 100), got (2, 6, 99)".
// The model is found by the caller (ModelSource::Find, server/serving/model_source.h:
// NOT_FOUND for an unknown name). All checks run before any allocation proportional to the request.
#ifndef MHA_SERVER_SERVING_REQUEST_H_
#define MHA_SERVER_SERVING_REQUEST_H_

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "core/attention.h"
#include "server/serving/model.h"

namespace mha::server {

// A front's request before validation: views of its tensors, whatever protocol
// carried them. The data stays owned by the front.
struct TensorView {
  absl::Span<const int64_t> shape;
  const float* data = nullptr;
  int64_t size = 0;  // floats at data
};

struct RequestView {
  int64_t bytes = 0;                     // the request's size on the wire, for max_request_bytes
  std::optional<TensorView> queries;     // (B, Q, d_q); required
  std::optional<TensorView> keys;        // (B, K, d_k); absent for self-attention
  std::optional<TensorView> values;      // (B, K, d_v); present iff keys is
  absl::Span<const int32_t> valid_lens;  // empty, B or B*Q entries
  bool causal = false;
  bool return_attention = false;
  absl::Span<const float> head_mask;  // empty or h entries
  bool return_lse = false;            // attention-only models only
};

// A request that passed validation. `inputs` points where the RequestView did (the
// front's message), which must outlive it.
struct ValidatedRequest {
  const Model* model = nullptr;
  core::AttentionInputs inputs;
  bool return_attention = false;
  bool return_lse = false;  // (B, h, Q) log-sum-exp asked for

  int64_t lse_elements() const {
    return inputs.batch * model->config.num_heads * inputs.num_queries;
  }
  int64_t output_elements() const {
    return inputs.batch * inputs.num_queries * model->config.num_hiddens;
  }
  int64_t attention_elements() const {
    return inputs.batch * model->config.num_heads * inputs.num_queries * inputs.num_keys;
  }
};

// The checks above, for any front. The result points where `request` does.
absl::StatusOr<ValidatedRequest> Validate(const RequestView& request, const Model& model);

// RESOURCE_EXHAUSTED naming max_request_bytes when a request of `bytes` (serialized)
// is over the model's limit.
absl::Status CheckRequestBytes(int64_t bytes, const Model& model);

// INVALID_ARGUMENT naming the first non-finite value of a rank-3 tensor and its
// (batch, position, feature).
absl::Status CheckFiniteValues(absl::string_view field, const TensorView& tensor);

// Where the core writes one request's results: output (B, Q, p_o) and, when the
// request asked for them, attention weights (B, h, Q, K); nullptr otherwise.
struct OutputViews {
  float* output = nullptr;
  float* attention = nullptr;
  float* lse = nullptr;  // (B, h, Q) when return_lse
};

// INVALID_ARGUMENT naming return_lse unless `model` is attention-only (projections
// NONE): the fronts' one wording of that rule.
absl::Status CheckReturnLse(const Model& model);

// "(2, 6, 99)": a shape as messages print it.
std::string ShapeString(absl::Span<const int64_t> shape);

}  // namespace mha::server

#endif  // MHA_SERVER_SERVING_REQUEST_H_

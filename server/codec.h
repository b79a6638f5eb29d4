// The attention.v1 codec, and the validation every front shares: an AttendRequest decoded and
// checked against its model into core views (ValidatedRequest), and the AttendResponse encoded from
// what the core computed. The one place that reads or writes attention.v1 tensors; the batcher and
// the core see only views.
//
// Decoding (ValidateRequest) checks, in this order (the first failure is returned):
//   max_request_bytes    serialized size over the model's limit -> RESOURCE_EXHAUSTED
//   encodings            (attention.v1) a tensor sets data or raw, not both; raw is
//                        whole float32s -> INVALID_ARGUMENT naming the field
//   queries              required; rank 3; dims >= 1; data length == prod(shape)
//                        (int64 overflow guarded); shape (B, Q, d_q) -> INVALID_ARGUMENT
//   keys, values         both or neither; rank 3; (B, K, d_k) and (B, K, d_v);
//                        neither needs a model with d_k == d_v == d_q -> INVALID_ARGUMENT
//   limits               B > max_batch_size, Q or K > max_sequence_length,
//                        return_attention with B*h*Q*K > max_attention_elements
//                        -> RESOURCE_EXHAUSTED naming the limit and its value
//   valid_lens           0, B or B*Q entries, each in [0, K] -> INVALID_ARGUMENT
//   head_mask            0 or h entries, finite -> INVALID_ARGUMENT
//   values               every query/key/value entry finite -> INVALID_ARGUMENT
//                        naming the position, e.g.
//                        "queries: non-finite value nan at index 17 (batch 0,
//                         position 0, feature 17)"
// Messages name the field and the expectation:
//   "keys: expected shape (2, 6, 100), got (2, 6, 99)".
// The model is found by the caller (ModelRepository::Find: NOT_FOUND for an
// unknown name). All checks run before any allocation proportional to the request.
//
// Encoding, for a request of B = 2, Q = 4 on the toy model (p_o 100, h 5, K 6):
//   OutputViews v = PrepareResponse(request, /*raw=*/false, &response);
//   // response.output: shape (2, 4, 100), 800 zeros; v.output points at them.
//   // with return_attention, response.attention: shape (2, 5, 4, 6), v.attention.
//   ... the core writes v.output (and v.attention) ...
//   EncodeTiming({.queue = q, .compute = c, .batch_rows = 8}, &response);
#ifndef MHA_SERVER_CODEC_H_
#define MHA_SERVER_CODEC_H_

#include <cstdint>
#include <optional>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/attention.h"
#include "proto/attention.pb.h"
#include "server/model.h"
#include "server/work_item.h"

namespace mha::server {

// A front's request before validation: views of its tensors, whatever protocol
// carried them (attention.v1 here, the Open Inference Protocol in
// server/inference_codec.h). The data stays owned by the front.
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
};

// A request that passed validation. `inputs` points into the AttendRequest it was
// made from, which must outlive it.
struct ValidatedRequest {
  const Model* model = nullptr;
  core::AttentionInputs inputs;
  bool return_attention = false;

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

// A tensor's values as a view, from data or from raw (little-endian float32 bytes);
// nullopt when not `present`. INVALID_ARGUMENT naming `field` when both are set or
// raw is not whole float32s.
absl::StatusOr<std::optional<TensorView>> ViewTensor(absl::string_view field, bool present,
                                                     const attention::v1::Tensor& tensor);
// INVALID_ARGUMENT naming the first non-finite value of a rank-3 tensor and its
// (batch, position, feature).
absl::Status CheckFiniteValues(absl::string_view field, const TensorView& tensor);
// Sizes `tensor` for `elements` zeroed floats, in raw or in data, and returns them.
float* AllocateTensor(int64_t elements, bool raw, attention::v1::Tensor* tensor);

// Decodes `request` for `model` (found by the caller). The result points into
// `request`, which must outlive it.
absl::StatusOr<ValidatedRequest> ValidateRequest(const attention::v1::AttendRequest& request,
                                                 const Model& model);

// Where the core writes one request's results: output (B, Q, p_o) and, when the
// request asked for them, attention weights (B, h, Q, K); nullptr otherwise.
struct OutputViews {
  float* output = nullptr;
  float* attention = nullptr;
};

// True when the request's queries came as raw bytes: its response is sent raw too.
bool WantsRawResponse(const attention::v1::AttendRequest& request);

// Sizes response.output (and response.attention when asked) for `request`, zeroed, in
// Tensor.raw when `raw` or Tensor.data otherwise, and returns views of their values.
// The response must outlive the views.
OutputViews PrepareResponse(const ValidatedRequest& request, bool raw,
                            attention::v1::AttendResponse* response);

// AttendResponse.timing from the batcher's ComputeTiming.
void EncodeTiming(const ComputeTiming& timing, attention::v1::AttendResponse* response);

// One request's forward pass on the calling thread, straight into its response
// (tests, fuzzing and tools; the server goes through the batcher).
absl::Status RunForward(const ValidatedRequest& request, bool raw,
                        attention::v1::AttendResponse* response);

}  // namespace mha::server

#endif  // MHA_SERVER_CODEC_H_

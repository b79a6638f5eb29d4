// The attention.v1 codec: an AttendRequest decoded and checked against its model into
// core views (ValidatedRequest), and the AttendResponse encoded from what the core
// computed. The one place that reads or writes attention.v1 tensors; the serving layer
// and the core see only views.
//
// Decoding (ValidateRequest): an AttendRequest's tensors as views (ViewTensor: a
// tensor sets data or raw, not both; raw is whole float32s -> INVALID_ARGUMENT
// naming the field, checked after max_request_bytes), then the serving layer's
// Validate (server/serving/request.h), whose checks and messages every front shares.
//
// Encoding, for a request of B = 2, Q = 4 on the toy model (p_o 100, h 5, K 6):
//   OutputViews v = PrepareResponse(request, /*raw=*/false, &response);
//   // response.output: shape (2, 4, 100), 800 zeros; v.output points at them.
//   // with return_attention, response.attention: shape (2, 5, 4, 6), v.attention.
//   ... the core writes v.output (and v.attention) ...
//   EncodeTiming({.queue = q, .compute = c, .batch_rows = 8}, &response);
#ifndef MHA_SERVER_ATTENTION_V1_CODEC_H_
#define MHA_SERVER_ATTENTION_V1_CODEC_H_

#include <cstdint>
#include <optional>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "base/status_macros.h"
#include "core/attention.h"
#include "proto/attention.pb.h"
#include "server/serving/model.h"
#include "server/serving/request.h"
#include "server/serving/work_item.h"

namespace mha::server {

// A tensor's values as a view, from data or from raw (little-endian float32 bytes);
// nullopt when not `present`. INVALID_ARGUMENT naming `field` when both are set or
// raw is not whole float32s.
absl::StatusOr<std::optional<TensorView>> ViewTensor(absl::string_view field, bool present,
                                                     const attention::v1::Tensor& tensor);
// An attention.v1 message's queries, keys and values (AttendRequest,
// SessionRequest: the same three fields) as views; nullopt for an absent one. The
// first error of ViewTensor, in that order.
struct MessageTensors {
  std::optional<TensorView> queries, keys, values;
};
template <typename Message>
absl::StatusOr<MessageTensors> ViewTensors(const Message& message) {
  MessageTensors views;
  MHA_ASSIGN_OR_RETURN(views.queries,
                       ViewTensor("queries", message.has_queries(), message.queries()));
  MHA_ASSIGN_OR_RETURN(views.keys, ViewTensor("keys", message.has_keys(), message.keys()));
  MHA_ASSIGN_OR_RETURN(views.values,
                       ViewTensor("values", message.has_values(), message.values()));
  return views;
}
// Sizes `tensor` for `elements` zeroed floats, in raw or in data, and returns them.
float* AllocateTensor(int64_t elements, bool raw, attention::v1::Tensor* tensor);

// Decodes `request` for `model` (found by the caller). The result points into
// `request`, which must outlive it.
absl::StatusOr<ValidatedRequest> ValidateRequest(const attention::v1::AttendRequest& request,
                                                 const Model& model);

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

#endif  // MHA_SERVER_ATTENTION_V1_CODEC_H_

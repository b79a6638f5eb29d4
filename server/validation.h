// Request validation: the one place where an AttendRequest is checked against a
// model and its limits, and turned into core::AttentionInputs views.
//
// Rules, in the order they are checked (the first failure is returned):
//   model                unknown -> NOT_FOUND; "" ambiguous -> INVALID_ARGUMENT
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
//   values               every query/key/value entry finite -> INVALID_ARGUMENT
//                        naming the position, e.g.
//                        "queries: non-finite value nan at index 17 (batch 0,
//                         position 0, feature 17)"
// Messages name the field and the expectation:
//   "keys: expected shape (2, 6, 100), got (2, 6, 99)".
// All checks run before any allocation proportional to the request.
#ifndef MHA_SERVER_VALIDATION_H_
#define MHA_SERVER_VALIDATION_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "core/attention.h"
#include "proto/attention.pb.h"
#include "server/model_repository.h"

namespace mha::server {

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

absl::StatusOr<ValidatedRequest> ValidateRequest(const attention::v1::AttendRequest& request,
                                                 const ModelRepository& models);

}  // namespace mha::server

#endif  // MHA_SERVER_VALIDATION_H_

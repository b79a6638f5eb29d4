// The Open Inference Protocol (KServe v2) as attention_client speaks it. Every verb
// builds an attention.v1 AttendRequest (request.h); for the kserve and http
// protocols it is translated here, in one place, to a ModelInferRequest (gRPC) and
// from that to an HTTP body, and their responses are translated back to an
// AttendResponse, so every protocol prints and checks the same thing. Pure
// functions of their arguments, no network; thread-safe.
//
// Tensors (docs/service.md): inputs "queries" FP32 (B, Q, d_q); "keys" FP32
// (B, K, d_k) and "values" FP32 (B, K, d_v), both or neither; "valid_lens" INT32 (B)
// or (B, Q); "head_mask" FP32 (h); request parameter "causal" (bool, sent when
// true). Outputs "output" FP32 (B, Q, p_o), always requested, and "attention" FP32
// (B, h, Q, K), requested by name when return_attention. Tensor bytes are raw
// little-endian (raw_input_contents / raw_output_contents, or HTTP binary data).
//
//   inference::ModelInferRequest infer = ToModelInferRequest(attend_request);
//   HttpRequest http = ToHttpRequest(infer);        // POST http.path, http.body
//   auto response = ParseHttpInferResponse(200, header_length, body);
//   auto attend = ToAttendResponse(*response);      // output, attention, timing
#ifndef MHA_CLIENT_SDK_KSERVE_H_
#define MHA_CLIENT_SDK_KSERVE_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "proto/attention.pb.h"
#include "proto/inference/grpc_service.pb.h"

namespace mha::client {

// The model an empty --model names: the Open Inference Protocol has no default model.
inline constexpr char kDefaultModel[] = "default";

// The model an empty --model names over kserve and http, as attention.v1 picks it:
// of `served` (the names of the models ready on the server), the only one, else
// kDefaultModel when served. NOT_FOUND when none is; otherwise INVALID_ARGUMENT
// "model: required: the server serves a, b; give --model=a or --model=b".
absl::StatusOr<std::string> ChooseModel(const std::vector<std::string>& served);

// The model names of a repository index body (POST /v2/repository/index: a JSON
// array of {"name": ...}), each once, in order. INVALID_ARGUMENT when it is not one.
absl::StatusOr<std::vector<std::string>> ParseHttpIndexNames(absl::string_view json);

// `request` as a ModelInferRequest: model_name request.model() (kDefaultModel when
// empty), id request_id, one input per tensor present with its bytes in
// raw_input_contents, parameter "causal" when set, outputs "output" (and
// "attention" when return_attention).
inference::ModelInferRequest ToModelInferRequest(const attention::v1::AttendRequest& request);

// An HTTP request for POST with Triton's binary tensor data extension: `body` is a
// JSON header of `header_length` bytes (sent as Inference-Header-Content-Length)
// followed by each input's bytes in input order; every output is asked for binary.
struct HttpRequest {
  std::string path;  // "/v2/models/{model}[/versions/{version}]/infer"
  std::string body;
  int64_t header_length = 0;
};

// "/v2/models/{model}" or "/v2/models/{model}/versions/{version}", each percent-encoded.
std::string ModelPath(absl::string_view model, absl::string_view version);

// `request`'s inputs must carry raw_input_contents, as ToModelInferRequest makes them.
HttpRequest ToHttpRequest(const inference::ModelInferRequest& request);

// The canonical code of an HTTP error status: 400 INVALID_ARGUMENT, 404 NOT_FOUND,
// 429 RESOURCE_EXHAUSTED, 503 UNAVAILABLE, 504 DEADLINE_EXCEEDED, 501 UNIMPLEMENTED,
// 500 INTERNAL (and 401, 403, 409, 499, 412); OK for 2xx; UNKNOWN otherwise.
absl::StatusCode CodeFromHttpStatus(int status);

// The error an HTTP error response stands for: the code from `status`, the message
// the body's {"error": "..."} (else the body, abbreviated), then "(HTTP <status>)".
absl::Status HttpError(int status, absl::string_view body);

// An infer response body: an error for a status other than 200 (HttpError); else
// the JSON header (the first `header_length` bytes when the response has
// Inference-Header-Content-Length, else the whole body) and the binary outputs
// after it, consumed exactly, into raw_output_contents (FP32 "data" arrays are
// converted to bytes too). INTERNAL naming the field for a malformed body.
absl::StatusOr<inference::ModelInferResponse> ParseHttpInferResponse(
    int status, std::optional<int64_t> header_length, absl::string_view body);

// GET /v2/models/{model}'s body as the gRPC message. INTERNAL when malformed.
absl::StatusOr<inference::ModelMetadataResponse> ParseHttpModelMetadata(absl::string_view json);

// The model's sizes from its metadata: d_q, d_k, d_v from the last dimension of
// the inputs queries, keys, values (d_k = d_v = d_q when keys are not listed), p_o
// from the output "output", h from input "head_mask" or output "attention" (0 when
// neither gives it). Bias, precision and limits are not in the metadata and stay
// unset. FAILED_PRECONDITION when queries or output are missing or not rank 3.
absl::StatusOr<attention::v1::ModelInfo> ModelInfoFromMetadata(
    const inference::ModelMetadataResponse& metadata);

// The server's timing, when the response carries int64 parameters "queue_us",
// "compute_us" and "batch_rows"; nullopt otherwise.
std::optional<attention::v1::Timing> TimingOf(const inference::ModelInferResponse& response);

// The outputs "output" and "attention" (when present) as attention.v1 tensors, id
// as request_id and the timing when the response has it. INTERNAL when "output" is
// missing, is not FP32 or its bytes do not fill its shape.
absl::StatusOr<attention::v1::AttendResponse> ToAttendResponse(
    const inference::ModelInferResponse& response);

}  // namespace mha::client

#endif  // MHA_CLIENT_SDK_KSERVE_H_

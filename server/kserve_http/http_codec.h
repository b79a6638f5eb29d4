// The Open Inference Protocol's HTTP/REST bodies (KServe v2 JSON, with Triton's
// binary tensor data extension) to and from the inference.* messages of the gRPC
// front, so that both fronts share one request path. Only the body: the HTTP server
// routes, picks status codes and sets the headers from what these return.
//
// Request, POST /v2/models/{model}[/versions/{version}]/infer, with the header
// Inference-Header-Content-Length: <size of the JSON>:
//   {"id": "r1", "parameters": {"binary_data_output": true},
//    "inputs": [{"name": "queries", "datatype": "FP32", "shape": [1, 2, 2],
//                "data": [[[1, 2], [3, 4]]]},
//               {"name": "keys", "datatype": "FP32", "shape": [1, 2, 2],
//                "parameters": {"binary_data_size": 16}}],
//    "outputs": [{"name": "output", "parameters": {"binary_data": false}}]}
//   <16 bytes: the keys, little-endian float32>
// becomes a ModelInferRequest with model_name and model_version from the path,
// id "r1", parameters {binary_data_output: bool true}, inputs "queries" and "keys"
// (datatype, shape, parameters), outputs [{"output", {binary_data: bool false}}] and
// raw_input_contents [the 16 bytes of 1, 2, 3, 4 as float32, the 16 tail bytes].
//
// Request rules (the first failure is returned, always INVALID_ARGUMENT):
//   guards, before any parsing: Inference-Header-Content-Length in [0, body size];
//       arrays and objects nested at most 32 deep ("JSON nesting deeper than 32");
//       then the JSON must parse (nlohmann's message, with line and column).
//   top level: an object; "id" a string; "parameters" an object; "inputs" a required
//       array of objects; "outputs" an array of objects. Other keys are ignored.
//   parameters (request, input, output): bool -> bool_param, integer -> int64_param
//       (uint64_param past int64), other number -> double_param, string ->
//       string_param; null, arrays and objects are refused. binary_data_output and
//       binary_data must be bools; an input's binary_data_size a non-negative integer
//       (it is consumed: the input's parameters in the result never hold it).
//   inputs[i]: "name" and "datatype" required strings; "shape" a required array of
//       integers >= 0 whose product (and size in bytes) fits in int64; datatype one
//       of BOOL, UINT8-64, INT8-64, FP16, FP32, FP64, BF16 (BYTES is not served).
//       Exactly one of:
//         "data": a flat array of prod(shape) values, or arrays nested exactly as
//           the shape; BOOL takes true/false, integer types take integers in their
//           range, FP32/FP64 take numbers in their range (FP32: |x| <= FLT_MAX).
//           FP16 and BF16 must be sent as binary data.
//         parameters.binary_data_size: prod(shape) * element size bytes, taken from
//           the binary part in the order of the inputs that declare it.
//         parameters.shared_memory_region (a string; with shared_memory_byte_size and
//           optionally shared_memory_offset, Triton's system shared memory): the
//           values are in that registered region; neither data nor binary_data_size
//           (INVALID_ARGUMENT naming the input), and no raw_input_contents entry.
//           server/kserve/inference_codec.h checks the parameters against the region.
//       The binary part must be consumed exactly.
// Messages name the field and the expectation, quoting client strings abbreviated:
//   inputs[1] ("keys").data[0][1][0]: expected a number for FP32, got "x"
//   inputs[0] ("queries").data: shape (1, 2, 2) needs 4 values, got 3
// Every input of the result but those in shared memory has its row-major
// little-endian bytes in the matching raw_input_contents entry (never
// InferTensorContents), however it was sent; raw_input_contents is indexed over
// those inputs only, as over gRPC. Inputs
// keep the body's order; duplicate names are left to the server's validation.
// No allocation is proportional to a size the body claims but does not carry.
//
// Response: outputs[i] is decoded from raw_output_contents[i] as
//   {"model_name": "attention", "model_version": "1", "id": "r1",
//    "outputs": [{"name": "output", "datatype": "FP32", "shape": [1, 2],
//                 "data": [0.1, -2.5]}]}
// ("id" and "parameters" only when set). An output written into a shared-memory
// region (its response tensor carries the shared_memory_region parameter; its
// raw_output_contents entry is empty) is
//   {"name": ..., "datatype": ..., "shape": ...}
// with no data and no parameters, binary or not, as Triton writes it (tritonclient's
// C++ HTTP client takes an output with "parameters" for a binary one).
// Otherwise an output goes binary, as
//   {"name": ..., "datatype": ..., "shape": ..., "parameters": {"binary_data_size": 8}}
// with its bytes appended after the JSON in output order, when the request's output
// of that name has parameters.binary_data true, or when the request has
// binary_data_output true and that output does not set binary_data false; `lse` is
// always binary (binary_data false for it is INVALID_ARGUMENT naming that field). Floats are
// printed with the fewest digits that read back (as float, or as double rounded to
// float) to the same bits; FP16 and BF16 print as the floats they are exactly. An
// output sent as JSON with an Inf or NaN element (JSON has no such number) is
// INVALID_ARGUMENT naming the output and the element; binary outputs carry them.
//
// Thread safety: pure functions of their arguments; call from any thread.
#ifndef MHA_SERVER_KSERVE_HTTP_HTTP_CODEC_H_
#define MHA_SERVER_KSERVE_HTTP_HTTP_CODEC_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "proto/inference/grpc_service.pb.h"

namespace mha::server {

// Parses the body of an infer request for `model_name` / `model_version` (from the
// path; the version may be empty). `header_length` is the value of the
// Inference-Header-Content-Length header when the request has one: the JSON is then
// the first header_length bytes and the rest is binary input data. Without it the
// whole body is JSON. Never throws.
absl::StatusOr<inference::ModelInferRequest> ParseInferRequest(
    absl::string_view model_name, absl::string_view model_version, absl::string_view body,
    std::optional<int64_t> header_length);
// The same, taking `body`'s buffer for a binary tensor over 64 KiB that ends the body
// (its bytes shifted down in place rather than copied into a new string); *body is
// left unspecified.
absl::StatusOr<inference::ModelInferRequest> ParseInferRequest(
    absl::string_view model_name, absl::string_view model_version, std::string* body,
    std::optional<int64_t> header_length);

// An HTTP response body and the headers that describe it.
struct HttpBody {
  std::string body;
  std::string content_type;    // "application/json" or "application/octet-stream"
  int64_t header_length = -1;  // Inference-Header-Content-Length; -1: no such header
  // EncodeInferResponseHead only: the outputs (indices into raw_output_contents)
  // whose bytes follow `body` on the wire, in order; `body` is then the JSON alone.
  std::vector<int> binary_outputs;
};

// The body answering `request` (as parsed above) with `response`; INVALID_ARGUMENT
// for a non-finite value of a JSON output (above). INTERNAL when
// the response is inconsistent (a server bug): raw_output_contents not one per
// output, an unknown datatype or BYTES, or bytes that do not fill the output's shape.
// Never throws.
absl::StatusOr<HttpBody> EncodeInferResponse(const inference::ModelInferRequest& request,
                                             const inference::ModelInferResponse& response);
// The same, but the binary outputs' bytes are not copied after the JSON: the caller
// sends `response.raw_output_contents(i)` for each i of binary_outputs after `body`
// (the HTTP front moves them into HttpResponse::tail; a 3.1 MB output is then never
// copied in user space).
absl::StatusOr<HttpBody> EncodeInferResponseHead(const inference::ModelInferRequest& request,
                                                 const inference::ModelInferResponse& response);

// The two paths behind ParseInferRequest and EncodeInferResponse[Head], for tests and
// fuzzers that compare them. The general path reads and writes every form through
// nlohmann's DOM and words every refusal; the fast path reads and writes only the
// common binary form (plain strings, integers, every input and output binary; see
// http_codec.cc) and gives up (nullopt) on anything else, so that what it returns is
// what the general path would.
namespace http_codec_internal {
absl::StatusOr<inference::ModelInferRequest> ParseGeneral(absl::string_view model_name,
                                                          absl::string_view model_version,
                                                          absl::string_view body,
                                                          std::optional<int64_t> header_length);
std::optional<inference::ModelInferRequest> ParseFast(absl::string_view model_name,
                                                      absl::string_view model_version,
                                                      absl::string_view body,
                                                      std::optional<int64_t> header_length);
absl::StatusOr<HttpBody> EncodeGeneral(const inference::ModelInferRequest& request,
                                       const inference::ModelInferResponse& response, bool split);
std::optional<HttpBody> EncodeFast(const inference::ModelInferRequest& request,
                                   const inference::ModelInferResponse& response, bool split);
}  // namespace http_codec_internal

// The body of a repository request (Triton's repository extension): POST
// /v2/repository/index takes {"ready": bool}, .../models/{name}/load and /unload
// take {"parameters": {...}}. Empty or a JSON object (the same depth guard as
// infer); "ready" must be a bool; "parameters" an object, whose entries are
// listed by name with whether each is a bool (KserveModels::ControlModel decides
// which it takes). INVALID_ARGUMENT naming the field. Never throws.
struct RepositoryBody {
  struct Parameter {
    std::string name;
    bool is_bool = false;
  };
  bool ready = false;
  std::vector<Parameter> parameters;
};
absl::StatusOr<RepositoryBody> ParseRepositoryBody(absl::string_view body);

// ModelStatistics as Triton writes it over HTTP: every count, nanosecond figure,
// timestamp and batch size a JSON number (protobuf's JSON mapping would write the
// uint64s as strings), every duration present.
std::string StatisticsBody(const inference::ModelStatisticsResponse& statistics);

// {"error":"<message>"}, the message capped (CapMessage) and JSON-escaped (invalid UTF-8 becomes
// U+FFFD).
std::string ErrorBody(absl::string_view message);

}  // namespace mha::server

#endif  // MHA_SERVER_KSERVE_HTTP_HTTP_CODEC_H_

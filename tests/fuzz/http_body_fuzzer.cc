// libFuzzer target (d): KServe v2 HTTP infer bodies -> ParseInferRequest, as the
// HTTP front does, then EncodeInferResponse of a response built from what parsed;
// every body also goes through ParseRepositoryBody (the repository extension).
// Input layout: byte 0 picks how Inference-Header-Content-Length is set (0: absent,
// 1: the next 4 bytes modulo the body size + 1, 2: the next 4 bytes as a signed
// int32, possibly out of range); bytes 1-4 are that little-endian value; the rest is
// the body. Checks: refusals are INVALID_ARGUMENT with a message ErrorBody turns into
// valid JSON; accepted requests carry one raw_input_contents entry per input not
// in shared memory (parameters.shared_memory_region) of exactly prod(shape) *
// element size bytes, and none for the others; the encoded response reads back (its
// JSON parses, JSON data matches the bytes bit for bit, binary outputs follow the
// header in order and as the request asked, shared-memory outputs carry their
// parameters and no data); the fast path for binary bodies builds exactly what the
// general path builds, request and response, whenever it builds anything.
#include <google/protobuf/stubs/logging.h>
#include <google/protobuf/util/message_differencer.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "proto/inference/grpc_service.pb.h"
#include "server/kserve_http/http_codec.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

using inference::ModelInferRequest;
using inference::ModelInferResponse;
using Json = nlohmann::json;

bool InSharedMemory(const ModelInferRequest::InferInputTensor& input) {
  return input.parameters().count("shared_memory_region") > 0;
}

// Responses carry at most this many outputs: enough to mix JSON and binary ones.
constexpr int kMaxOutputs = 16;

int ElementSize(const std::string& datatype) {
  if (datatype == "BOOL" || datatype == "UINT8" || datatype == "INT8") return 1;
  if (datatype == "UINT16" || datatype == "INT16" || datatype == "FP16" || datatype == "BF16") {
    return 2;
  }
  if (datatype == "UINT32" || datatype == "INT32" || datatype == "FP32") return 4;
  if (datatype == "UINT64" || datatype == "INT64" || datatype == "FP64") return 8;
  return 0;
}

// The half's value by arithmetic (the codec decodes by bit manipulation).
float HalfValue(uint16_t h) {
  const int exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
  float value;
  if (exponent == 31) {
    value = mantissa == 0 ? INFINITY : NAN;
  } else if (exponent == 0) {
    value = std::ldexp(static_cast<float>(mantissa), -24);
  } else {
    value = std::ldexp(static_cast<float>(1024 + mantissa), exponent - 25);
  }
  return (h & 0x8000) != 0 ? -value : value;
}

// One element of the JSON data of an output against its bytes.
void CheckElement(const std::string& datatype, const char* p, const Json& value) {
  uint64_t word = 0;
  std::memcpy(&word, p, ElementSize(datatype));
  if (datatype == "BOOL") {
    MHA_FUZZ_CHECK(value.is_boolean() && value.get<bool>() == (word != 0));
    return;
  }
  if (datatype[0] == 'U' || datatype[0] == 'I') {
    const int bits = 8 * ElementSize(datatype);
    MHA_FUZZ_CHECK(value.is_number_integer(), "%s\n", value.dump().c_str());
    if (datatype[0] == 'U') {
      MHA_FUZZ_CHECK(value.get<uint64_t>() == word);
    } else {
      const int64_t expected = bits == 64
                                   ? static_cast<int64_t>(word)
                                   : static_cast<int64_t>(word << (64 - bits)) >> (64 - bits);
      MHA_FUZZ_CHECK(value.get<int64_t>() == expected);
    }
    return;
  }
  if (datatype == "FP64") {
    const double d = std::bit_cast<double>(word);
    if (std::isfinite(d)) {
      MHA_FUZZ_CHECK(value.is_number() && std::bit_cast<uint64_t>(value.get<double>()) == word);
    } else {
      MHA_FUZZ_CHECK(value.is_null());
    }
    return;
  }
  const float f = datatype == "FP32"   ? std::bit_cast<float>(static_cast<uint32_t>(word))
                  : datatype == "BF16" ? std::bit_cast<float>(static_cast<uint32_t>(word) << 16)
                                       : HalfValue(static_cast<uint16_t>(word));
  if (!std::isfinite(f)) {
    MHA_FUZZ_CHECK(value.is_null());
    return;
  }
  MHA_FUZZ_CHECK(value.is_number());
  const float back = static_cast<float>(value.get<double>());
  MHA_FUZZ_CHECK(std::bit_cast<uint32_t>(back) == std::bit_cast<uint32_t>(f), "%s %s: %s\n",
                 datatype.c_str(), std::to_string(f).c_str(), value.dump().c_str());
}

bool ExpectBinary(const ModelInferRequest& request, const std::string& name) {
  for (const auto& requested : request.outputs()) {
    if (requested.name() != name) continue;
    const auto it = requested.parameters().find("binary_data");
    if (it != requested.parameters().end()) return it->second.bool_param();
    break;
  }
  const auto it = request.parameters().find("binary_data_output");
  return it != request.parameters().end() && it->second.bool_param();
}

// The outputs the request names (or one per input), each holding an input's tensor.
ModelInferResponse MakeResponse(const ModelInferRequest& request) {
  ModelInferResponse response;
  response.set_model_name(request.model_name());
  response.set_model_version(request.model_version());
  response.set_id(request.id());
  *response.mutable_parameters() = request.parameters();
  const int count = std::min(
      kMaxOutputs, request.outputs_size() > 0 ? request.outputs_size() : request.inputs_size());
  for (int i = 0; i < count; ++i) {
    auto* output = response.add_outputs();
    output->set_name(request.outputs_size() > 0 ? request.outputs(i).name()
                                                : absl::StrCat("out", i));
    if (request.inputs_size() == 0) {
      output->set_datatype("FP32");
      output->add_shape(0);
      response.add_raw_output_contents();
      continue;
    }
    const int from = i % request.inputs_size();
    output->set_datatype(request.inputs(from).datatype());
    *output->mutable_shape() = request.inputs(from).shape();
    *output->mutable_parameters() = request.inputs(from).parameters();
    // An input in shared memory answers as an output written into it: no bytes.
    int raw = 0;
    for (int j = 0; j < from; ++j) raw += InSharedMemory(request.inputs(j)) ? 0 : 1;
    *response.add_raw_output_contents() =
        InSharedMemory(request.inputs(from)) ? std::string() : request.raw_input_contents(raw);
  }
  return response;
}

// Whether some output is sent as JSON (not as binary data).
bool IsShared(const ModelInferResponse::InferOutputTensor& output) {
  return output.parameters().count("shared_memory_region") > 0;
}

bool AnyJsonOutput(const ModelInferRequest& request, const ModelInferResponse& response) {
  for (const auto& output : response.outputs()) {
    if (!IsShared(output) && !ExpectBinary(request, output.name())) return true;
  }
  return false;
}

// The fast path (http_codec.h, http_codec_internal) builds exactly what the general
// path builds whenever it builds anything, and what ParseInferRequest returned is
// the general path's answer otherwise.
void CheckFastParse(absl::string_view body, std::optional<int64_t> header_length,
                    const absl::StatusOr<ModelInferRequest>& answered) {
  namespace internal = mha::server::http_codec_internal;
  const absl::StatusOr<ModelInferRequest> general =
      internal::ParseGeneral("m", "1", body, header_length);
  const std::optional<ModelInferRequest> fast =
      internal::ParseFast("m", "1", body, header_length);
  if (fast.has_value()) {
    MHA_FUZZ_CHECK(general.ok(), "fast path accepted what the general path refuses: %s\n",
                   general.status().ToString().c_str());
    MHA_FUZZ_CHECK(google::protobuf::util::MessageDifferencer::Equals(*fast, *general),
                   "fast:\n%s\ngeneral:\n%s\n", fast->DebugString().c_str(),
                   general->DebugString().c_str());
  }
  MHA_FUZZ_CHECK(answered.status() == general.status());
  if (answered.ok()) {
    MHA_FUZZ_CHECK(google::protobuf::util::MessageDifferencer::Equals(*answered, *general));
  }
}

// The same for responses: byte for byte, head and split.
void CheckFastEncode(const ModelInferRequest& request, const ModelInferResponse& response) {
  namespace internal = mha::server::http_codec_internal;
  for (const bool split : {false, true}) {
    const std::optional<mha::server::HttpBody> fast = internal::EncodeFast(request, response, split);
    if (!fast.has_value()) continue;
    const absl::StatusOr<mha::server::HttpBody> general =
        internal::EncodeGeneral(request, response, split);
    MHA_FUZZ_CHECK(general.ok(), "%s\n", general.status().ToString().c_str());
    MHA_FUZZ_CHECK(fast->body == general->body && fast->content_type == general->content_type &&
                       fast->header_length == general->header_length &&
                       fast->binary_outputs == general->binary_outputs,
                   "fast:\n%s\ngeneral:\n%s\n", fast->body.c_str(), general->body.c_str());
  }
}

void CheckEncoded(const ModelInferRequest& request, const ModelInferResponse& response) {
  CheckFastEncode(request, response);
  const absl::StatusOr<mha::server::HttpBody> encoded =
      mha::server::EncodeInferResponse(request, response);
  if (!encoded.ok() && absl::StrContains(encoded.status().message(), "JSON cannot carry")) {
    // A non-finite value of an output sent as JSON (which has no Inf or NaN) is
    // refused naming the output (issue 41).
    MHA_FUZZ_CHECK(encoded.status().code() == absl::StatusCode::kInvalidArgument &&
                       AnyJsonOutput(request, response),
                   "%s\n", encoded.status().ToString().c_str());
    return;
  }
  MHA_FUZZ_CHECK(encoded.ok(), "%s\n", encoded.status().ToString().c_str());
  const bool binary = encoded->header_length >= 0;
  MHA_FUZZ_CHECK(encoded->content_type ==
                 (binary ? "application/octet-stream" : "application/json"));
  MHA_FUZZ_CHECK(!binary || static_cast<size_t>(encoded->header_length) <= encoded->body.size());
  const std::string_view body = encoded->body;
  const std::string_view header = binary ? body.substr(0, encoded->header_length) : body;
  size_t tail = binary ? encoded->header_length : body.size();
  const Json json = Json::parse(header);  // throws (and so fails) if it is not JSON
  MHA_FUZZ_CHECK(json.at("outputs").size() == static_cast<size_t>(response.outputs_size()));
  bool any_binary = false;
  for (int i = 0; i < response.outputs_size(); ++i) {
    const auto& output = response.outputs(i);
    const std::string& raw = response.raw_output_contents(i);
    const Json& entry = json["outputs"][i];
    MHA_FUZZ_CHECK(entry.at("name") == output.name() && entry.at("datatype") == output.datatype());
    if (IsShared(output)) {
      MHA_FUZZ_CHECK(!entry.contains("data") && !entry.contains("parameters"));
      continue;
    }
    if (ExpectBinary(request, output.name())) {
      any_binary = true;
      MHA_FUZZ_CHECK(!entry.contains("data"));
      MHA_FUZZ_CHECK(entry.at("parameters").at("binary_data_size") == raw.size());
      MHA_FUZZ_CHECK(body.substr(tail, raw.size()) == raw);
      tail += raw.size();
      continue;
    }
    const Json& data = entry.at("data");
    const size_t size = ElementSize(output.datatype());
    MHA_FUZZ_CHECK(data.size() * size == raw.size());
    for (size_t e = 0; e < data.size(); ++e) {
      CheckElement(output.datatype(), raw.data() + e * size, data[e]);
    }
  }
  MHA_FUZZ_CHECK(any_binary == binary && tail == body.size());
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  google::protobuf::SetLogHandler(
      [](google::protobuf::LogLevel, const char*, int, const std::string&) {});
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 5) return 0;
  uint32_t value;
  std::memcpy(&value, data + 1, sizeof(value));
  const absl::string_view body(reinterpret_cast<const char*>(data) + 5, size - 5);
  std::optional<int64_t> header_length;
  if (data[0] % 3 == 1) header_length = value % (body.size() + 1);
  if (data[0] % 3 == 2) header_length = static_cast<int32_t>(value);

  // The repository extension's bodies: OK, or INVALID_ARGUMENT with a message.
  const absl::StatusOr<mha::server::RepositoryBody> repository =
      mha::server::ParseRepositoryBody(body);
  MHA_FUZZ_CHECK(
      repository.ok() || (repository.status().code() == absl::StatusCode::kInvalidArgument &&
                          !repository.status().message().empty()),
      "%s\n", repository.status().ToString().c_str());

  const absl::StatusOr<ModelInferRequest> request =
      mha::server::ParseInferRequest("m", "1", body, header_length);
  CheckFastParse(body, header_length, request);
  if (!request.ok()) {
    MHA_FUZZ_CHECK(request.status().code() == absl::StatusCode::kInvalidArgument &&
                       !request.status().message().empty(),
                   "%s\n", request.status().ToString().c_str());
    const Json error = Json::parse(mha::server::ErrorBody(request.status().message()));
    MHA_FUZZ_CHECK(error.at("error").is_string());
    return 0;
  }
  MHA_FUZZ_CHECK(request->model_name() == "m" && request->model_version() == "1");
  int inline_inputs = 0;
  for (const auto& input : request->inputs()) inline_inputs += InSharedMemory(input) ? 0 : 1;
  MHA_FUZZ_CHECK(request->raw_input_contents_size() == inline_inputs);
  int raw = 0;
  for (int i = 0; i < request->inputs_size(); ++i) {
    const auto& input = request->inputs(i);
    if (InSharedMemory(input)) continue;
    const int element_size = ElementSize(input.datatype());
    MHA_FUZZ_CHECK(element_size > 0, "%s\n", input.datatype().c_str());
    MHA_FUZZ_CHECK(input.parameters().count("binary_data_size") == 0);
    int64_t bytes = element_size;
    for (const int64_t dim : input.shape()) {
      MHA_FUZZ_CHECK(dim >= 0 && !__builtin_mul_overflow(bytes, dim, &bytes));
    }
    MHA_FUZZ_CHECK(static_cast<size_t>(bytes) == request->raw_input_contents(raw++).size());
  }
  CheckEncoded(*request, MakeResponse(*request));
  return 0;
}

#include "client/sdk/kserve.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"
#include "nlohmann/json.hpp"

namespace mha::client {
namespace {

static_assert(std::endian::native == std::endian::little,
              "tensor bytes are sent as the host's floats: little-endian only");

using attention::v1::AttendRequest;
using attention::v1::AttendResponse;
using attention::v1::ModelInfo;
using attention::v1::Tensor;
using inference::InferParameter;
using inference::ModelInferRequest;
using inference::ModelInferResponse;
using inference::ModelMetadataResponse;
using nlohmann::json;

template <typename T>
std::string Bytes(const google::protobuf::RepeatedField<T>& values) {
  return std::string(reinterpret_cast<const char*>(values.data()),
                     static_cast<size_t>(values.size()) * sizeof(T));
}

void AddInput(absl::string_view name, absl::string_view datatype, const std::vector<int64_t>& shape,
              std::string bytes, ModelInferRequest* request) {
  ModelInferRequest::InferInputTensor* input = request->add_inputs();
  input->set_name(std::string(name));
  input->set_datatype(std::string(datatype));
  for (int64_t d : shape) input->add_shape(d);
  request->add_raw_input_contents(std::move(bytes));
}

void AddTensor(absl::string_view name, const Tensor& tensor, ModelInferRequest* request) {
  AddInput(name, "FP32", {tensor.shape().begin(), tensor.shape().end()}, Bytes(tensor.data()),
           request);
}

// Path segments keep unreserved characters; everything else is percent-encoded.
std::string PathSegment(absl::string_view text) {
  std::string out;
  for (char c : text) {
    if (absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.' ||
        c == '~') {
      out.push_back(c);
    } else {
      absl::StrAppend(&out, absl::StrFormat("%%%02X", static_cast<unsigned char>(c)));
    }
  }
  return out;
}

json ParameterJson(const InferParameter& p) {
  switch (p.parameter_choice_case()) {
    case InferParameter::kBoolParam:
      return p.bool_param();
    case InferParameter::kInt64Param:
      return p.int64_param();
    case InferParameter::kStringParam:
      return p.string_param();
    case InferParameter::kDoubleParam:
      return p.double_param();
    case InferParameter::kUint64Param:
      return p.uint64_param();
    default:
      return nullptr;
  }
}

json ParametersJson(const google::protobuf::Map<std::string, InferParameter>& parameters) {
  json out = json::object();
  for (const auto& [name, value] : parameters) out[name] = ParameterJson(value);
  return out;
}

// JSON values back to parameters; false for nulls, arrays and objects.
bool ToParameter(const json& value, InferParameter* p) {
  if (value.is_boolean()) {
    p->set_bool_param(value.get<bool>());
  } else if (value.is_number_unsigned()) {
    const uint64_t v = value.get<uint64_t>();
    if (v <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      p->set_int64_param(static_cast<int64_t>(v));
    } else {
      p->set_uint64_param(v);
    }
  } else if (value.is_number_integer()) {
    p->set_int64_param(value.get<int64_t>());
  } else if (value.is_number_float()) {
    p->set_double_param(value.get<double>());
  } else if (value.is_string()) {
    p->set_string_param(value.get<std::string>());
  } else {
    return false;
  }
  return true;
}

absl::Status Malformed(absl::string_view what, absl::string_view why) {
  return absl::InternalError(absl::StrCat("HTTP response: ", what, ": ", why));
}

absl::StatusOr<std::vector<int64_t>> ShapeOf(const json& tensor, absl::string_view what) {
  const auto it = tensor.find("shape");
  if (it == tensor.end() || !it->is_array()) return Malformed(what, "no \"shape\" array");
  std::vector<int64_t> shape;
  for (const json& d : *it) {
    if (!d.is_number_integer()) return Malformed(what, "\"shape\" holds a non-integer");
    shape.push_back(d.get<int64_t>());
  }
  return shape;
}

absl::Status Flatten(const json& data, std::vector<float>& out) {
  if (data.is_array()) {
    for (const json& item : data) MHA_RETURN_IF_ERROR(Flatten(item, out));
    return absl::OkStatus();
  }
  if (!data.is_number()) return absl::InternalError("expected numbers");
  out.push_back(data.get<float>());
  return absl::OkStatus();
}

int64_t ElementCount(absl::Span<const int64_t> shape) {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0 || (d > 0 && n > std::numeric_limits<int64_t>::max() / d)) return -1;
    n *= d;
  }
  return n;
}

absl::StatusOr<Tensor> ToTensor(const ModelInferResponse::InferOutputTensor& output,
                                const std::string* bytes) {
  const std::string what = absl::StrCat("output \"", output.name(), "\"");
  if (output.datatype() != "FP32") {
    return absl::InternalError(absl::StrCat(what, ": expected FP32, got ", output.datatype()));
  }
  // A protobuf repeated field holds at most INT_MAX values.
  int64_t n = ElementCount(output.shape());
  if (n > std::numeric_limits<int>::max()) n = -1;
  Tensor tensor;
  for (int64_t d : output.shape()) tensor.add_shape(d);
  if (bytes != nullptr) {
    if (n < 0 || static_cast<int64_t>(bytes->size()) != n * 4) {
      return absl::InternalError(absl::StrCat(what, ": shape (",
                                              absl::StrJoin(output.shape(), ", "), ") needs ",
                                              n * 4, " bytes, got ", bytes->size()));
    }
    tensor.mutable_data()->Resize(static_cast<int>(n), 0.0f);
    if (n > 0) std::memcpy(tensor.mutable_data()->mutable_data(), bytes->data(), bytes->size());
  } else {
    const auto& values = output.contents().fp32_contents();
    if (n < 0 || values.size() != n) {
      return absl::InternalError(absl::StrCat(what, ": shape (",
                                              absl::StrJoin(output.shape(), ", "), ") needs ", n,
                                              " values, got ", values.size()));
    }
    *tensor.mutable_data() = values;
  }
  return tensor;
}

}  // namespace

absl::StatusOr<std::string> ChooseModel(const std::vector<std::string>& served) {
  if (served.size() == 1) return served[0];
  if (served.empty()) return absl::NotFoundError("model: the server serves no model that is ready");
  if (std::find(served.begin(), served.end(), kDefaultModel) != served.end()) return kDefaultModel;
  std::vector<std::string> choices;
  for (const std::string& name : served) choices.push_back("--model=" + name);
  return absl::InvalidArgumentError(absl::StrCat("model: required: the server serves ",
                                                 absl::StrJoin(served, ", "), "; give ",
                                                 absl::StrJoin(choices, " or ")));
}

absl::StatusOr<std::vector<std::string>> ParseHttpIndexNames(absl::string_view text) {
  const json index = json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (!index.is_array()) {
    return absl::InvalidArgumentError("repository index: expected a JSON array");
  }
  std::vector<std::string> names;
  for (const json& entry : index) {
    const auto name = entry.is_object() ? entry.find("name") : entry.end();
    if (!entry.is_object() || name == entry.end() || !name->is_string()) {
      return absl::InvalidArgumentError("repository index: expected {\"name\": ...} entries");
    }
    const std::string value = name->get<std::string>();
    if (std::find(names.begin(), names.end(), value) == names.end()) names.push_back(value);
  }
  return names;
}

ModelInferRequest ToModelInferRequest(const AttendRequest& request) {
  ModelInferRequest infer;
  infer.set_model_name(request.model().empty() ? kDefaultModel : request.model());
  infer.set_model_version(request.model_version());
  infer.set_id(request.request_id());
  if (request.causal()) (*infer.mutable_parameters())["causal"].set_bool_param(true);
  AddTensor("queries", request.queries(), &infer);
  if (request.has_keys()) {
    AddTensor("keys", request.keys(), &infer);
    AddTensor("values", request.values(), &infer);
  }
  if (request.valid_lens_size() > 0) {
    const auto& q = request.queries();
    const int64_t lens = request.valid_lens_size();
    std::vector<int64_t> shape = {lens};
    if (q.shape_size() == 3 && lens != q.shape(0) && lens == q.shape(0) * q.shape(1)) {
      shape = {q.shape(0), q.shape(1)};
    }
    AddInput("valid_lens", "INT32", shape, Bytes(request.valid_lens()), &infer);
  }
  if (request.head_mask_size() > 0) {
    AddInput("head_mask", "FP32", {request.head_mask_size()}, Bytes(request.head_mask()), &infer);
  }
  infer.add_outputs()->set_name("output");
  if (request.return_attention()) infer.add_outputs()->set_name("attention");
  return infer;
}

std::string ModelPath(absl::string_view model, absl::string_view version) {
  std::string path = absl::StrCat("/v2/models/", PathSegment(model));
  if (!version.empty()) absl::StrAppend(&path, "/versions/", PathSegment(version));
  return path;
}

HttpRequest ToHttpRequest(const ModelInferRequest& request) {
  HttpRequest http;
  http.path = absl::StrCat(ModelPath(request.model_name(), request.model_version()), "/infer");
  json header = json::object();
  if (!request.id().empty()) header["id"] = request.id();
  header["parameters"] = ParametersJson(request.parameters());
  header["parameters"]["binary_data_output"] = true;
  header["inputs"] = json::array();
  size_t binary_size = 0;
  for (int i = 0; i < request.inputs_size(); ++i) {
    const auto& input = request.inputs(i);
    const size_t size =
        i < request.raw_input_contents_size() ? request.raw_input_contents(i).size() : 0;
    json parameters = ParametersJson(input.parameters());
    parameters["binary_data_size"] = size;
    header["inputs"].push_back({{"name", input.name()},
                                {"datatype", input.datatype()},
                                {"shape", input.shape()},
                                {"parameters", std::move(parameters)}});
    binary_size += size;
  }
  header["outputs"] = json::array();
  for (const auto& output : request.outputs()) {
    json parameters = ParametersJson(output.parameters());
    parameters["binary_data"] = true;
    header["outputs"].push_back({{"name", output.name()}, {"parameters", std::move(parameters)}});
  }
  http.body = header.dump();
  http.header_length = static_cast<int64_t>(http.body.size());
  http.body.reserve(http.body.size() + binary_size);
  for (const std::string& bytes : request.raw_input_contents()) http.body += bytes;
  return http;
}

absl::StatusCode CodeFromHttpStatus(int status) {
  if (status >= 200 && status < 300) return absl::StatusCode::kOk;
  switch (status) {
    case 400:
      return absl::StatusCode::kInvalidArgument;
    case 401:
      return absl::StatusCode::kUnauthenticated;
    case 403:
      return absl::StatusCode::kPermissionDenied;
    case 404:
      return absl::StatusCode::kNotFound;
    case 409:
      return absl::StatusCode::kAborted;
    case 412:
      return absl::StatusCode::kFailedPrecondition;
    case 429:
      return absl::StatusCode::kResourceExhausted;
    case 499:
      return absl::StatusCode::kCancelled;
    case 500:
      return absl::StatusCode::kInternal;
    case 501:
      return absl::StatusCode::kUnimplemented;
    case 503:
      return absl::StatusCode::kUnavailable;
    case 504:
      return absl::StatusCode::kDeadlineExceeded;
    default:
      return absl::StatusCode::kUnknown;
  }
}

absl::Status HttpError(int status, absl::string_view body) {
  std::string message;
  const json parsed = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (parsed.is_object() && parsed.contains("error") && parsed["error"].is_string()) {
    message = parsed["error"].get<std::string>();
  } else {
    constexpr size_t kMax = 200;
    message = body.size() > kMax ? absl::StrCat(body.substr(0, kMax), "...") : std::string(body);
  }
  absl::StatusCode code = CodeFromHttpStatus(status);
  if (code == absl::StatusCode::kOk) code = absl::StatusCode::kUnknown;
  return absl::Status(code,
                      absl::StrCat(message.empty() ? "" : message + " ", "(HTTP ", status, ")"));
}

absl::StatusOr<ModelInferResponse> ParseHttpInferResponse(int status,
                                                          std::optional<int64_t> header_length,
                                                          absl::string_view body) {
  if (status != 200) return HttpError(status, body);
  absl::string_view header = body, binary;
  if (header_length.has_value()) {
    if (*header_length < 0 || *header_length > static_cast<int64_t>(body.size())) {
      return Malformed(
          "Inference-Header-Content-Length",
          absl::StrCat(*header_length, " is outside the body's ", body.size(), " bytes"));
    }
    header = body.substr(0, static_cast<size_t>(*header_length));
    binary = body.substr(static_cast<size_t>(*header_length));
  }
  const json parsed = json::parse(header, nullptr, /*allow_exceptions=*/false);
  if (!parsed.is_object()) return Malformed("header", "not a JSON object");
  ModelInferResponse response;
  for (const auto& [key, field] : {std::pair{"model_name", response.mutable_model_name()},
                                   {"model_version", response.mutable_model_version()},
                                   {"id", response.mutable_id()}}) {
    const auto it = parsed.find(key);
    if (it == parsed.end()) continue;
    if (!it->is_string()) return Malformed(key, "not a string");
    *field = it->get<std::string>();
  }
  if (const auto it = parsed.find("parameters"); it != parsed.end() && it->is_object()) {
    for (const auto& [name, value] : it->items()) {
      InferParameter p;
      if (ToParameter(value, &p)) (*response.mutable_parameters())[name] = p;
    }
  }
  const auto outputs = parsed.find("outputs");
  if (outputs == parsed.end() || !outputs->is_array()) {
    return Malformed("header", "no \"outputs\" array");
  }
  size_t offset = 0;
  for (size_t i = 0; i < outputs->size(); ++i) {
    const json& o = (*outputs)[i];
    const std::string what = absl::StrCat("outputs[", i, "]");
    if (!o.is_object() || !o.contains("name") || !o["name"].is_string() ||
        !o.contains("datatype") || !o["datatype"].is_string()) {
      return Malformed(what, "expected an object with string \"name\" and \"datatype\"");
    }
    auto* output = response.add_outputs();
    output->set_name(o["name"].get<std::string>());
    output->set_datatype(o["datatype"].get<std::string>());
    MHA_ASSIGN_OR_RETURN(const std::vector<int64_t> shape, ShapeOf(o, what));
    for (int64_t d : shape) output->add_shape(d);
    const json* size = nullptr;
    if (const auto p = o.find("parameters"); p != o.end() && p->is_object()) {
      if (const auto s = p->find("binary_data_size"); s != p->end()) size = &*s;
    }
    if (size != nullptr) {
      if (!size->is_number_unsigned() || size->get<uint64_t>() > binary.size() - offset) {
        return Malformed(what, absl::StrCat("binary_data_size ", size->dump(), " but ",
                                            binary.size() - offset, " binary bytes are left"));
      }
      const size_t n = static_cast<size_t>(size->get<uint64_t>());
      response.add_raw_output_contents(std::string(binary.substr(offset, n)));
      offset += n;
    } else if (const auto data = o.find("data"); data != o.end()) {
      std::vector<float> values;
      if (output->datatype() != "FP32" || !Flatten(*data, values).ok()) {
        return Malformed(what, "\"data\" is read for FP32 numbers only");
      }
      response.add_raw_output_contents(
          std::string(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(float)));
    } else {
      return Malformed(what, "neither binary_data_size nor data");
    }
  }
  if (offset != binary.size()) {
    return Malformed("body",
                     absl::StrCat(binary.size() - offset, " binary bytes past the last output's"));
  }
  return response;
}

absl::StatusOr<ModelMetadataResponse> ParseHttpModelMetadata(absl::string_view text) {
  const json parsed = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!parsed.is_object()) return Malformed("model metadata", "not a JSON object");
  ModelMetadataResponse metadata;
  if (const auto it = parsed.find("name"); it != parsed.end() && it->is_string()) {
    metadata.set_name(it->get<std::string>());
  }
  if (const auto it = parsed.find("platform"); it != parsed.end() && it->is_string()) {
    metadata.set_platform(it->get<std::string>());
  }
  if (const auto it = parsed.find("versions"); it != parsed.end() && it->is_array()) {
    for (const json& v : *it) {
      if (v.is_string()) metadata.add_versions(v.get<std::string>());
    }
  }
  for (const char* side : {"inputs", "outputs"}) {
    const auto it = parsed.find(side);
    if (it == parsed.end()) continue;
    if (!it->is_array()) return Malformed(side, "not an array");
    for (size_t i = 0; i < it->size(); ++i) {
      const json& t = (*it)[i];
      const std::string what = absl::StrCat(side, "[", i, "]");
      if (!t.is_object() || !t.contains("name") || !t["name"].is_string()) {
        return Malformed(what, "expected an object with a string \"name\"");
      }
      auto* tensor = side[0] == 'i' ? metadata.add_inputs() : metadata.add_outputs();
      tensor->set_name(t["name"].get<std::string>());
      if (t.contains("datatype") && t["datatype"].is_string()) {
        tensor->set_datatype(t["datatype"].get<std::string>());
      }
      MHA_ASSIGN_OR_RETURN(const std::vector<int64_t> shape, ShapeOf(t, what));
      for (int64_t d : shape) tensor->add_shape(d);
    }
  }
  return metadata;
}

absl::StatusOr<ModelInfo> ModelInfoFromMetadata(const ModelMetadataResponse& metadata) {
  auto find = [](const auto& tensors,
                 absl::string_view name) -> const ModelMetadataResponse::TensorMetadata* {
    for (const auto& t : tensors) {
      if (t.name() == name) return &t;
    }
    return nullptr;
  };
  auto last_dim = [&](const auto& tensors, absl::string_view name) -> absl::StatusOr<int64_t> {
    const ModelMetadataResponse::TensorMetadata* t = find(tensors, name);
    if (t == nullptr || t->shape_size() != 3 || t->shape(2) <= 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "model metadata of \"", metadata.name(), "\": expected a tensor \"", name,
          "\" of shape [-1, -1, size]",
          t == nullptr ? "" : absl::StrCat(", got [", absl::StrJoin(t->shape(), ", "), "]")));
    }
    return t->shape(2);
  };
  ModelInfo info;
  info.set_name(metadata.name());
  MHA_ASSIGN_OR_RETURN(const int64_t d_q, last_dim(metadata.inputs(), "queries"));
  MHA_ASSIGN_OR_RETURN(const int64_t p_o, last_dim(metadata.outputs(), "output"));
  int64_t d_k = d_q, d_v = d_q;
  if (find(metadata.inputs(), "keys") != nullptr) {
    MHA_ASSIGN_OR_RETURN(d_k, last_dim(metadata.inputs(), "keys"));
    MHA_ASSIGN_OR_RETURN(d_v, last_dim(metadata.inputs(), "values"));
  }
  int64_t heads = 0;
  if (const auto* mask = find(metadata.inputs(), "head_mask");
      mask != nullptr && mask->shape_size() == 1 && mask->shape(0) > 0) {
    heads = mask->shape(0);
  } else if (const auto* weights = find(metadata.outputs(), "attention");
             weights != nullptr && weights->shape_size() == 4 && weights->shape(1) > 0) {
    heads = weights->shape(1);
  }
  info.set_query_size(d_q);
  info.set_key_size(d_k);
  info.set_value_size(d_v);
  info.set_num_hiddens(p_o);
  info.set_num_heads(heads);
  if (heads > 0) info.set_head_size(p_o / heads);
  info.set_supports_self_attention(d_k == d_q && d_v == d_q);
  return info;
}

std::optional<attention::v1::Timing> TimingOf(const ModelInferResponse& response) {
  const auto& p = response.parameters();
  int64_t values[3];
  const char* names[] = {"queue_us", "compute_us", "batch_rows"};
  for (int i = 0; i < 3; ++i) {
    const auto it = p.find(names[i]);
    if (it == p.end() || it->second.parameter_choice_case() != InferParameter::kInt64Param) {
      return std::nullopt;
    }
    values[i] = it->second.int64_param();
  }
  attention::v1::Timing timing;
  timing.set_queue_us(values[0]);
  timing.set_compute_us(values[1]);
  timing.set_batch_rows(values[2]);
  return timing;
}

absl::StatusOr<AttendResponse> ToAttendResponse(const ModelInferResponse& response) {
  AttendResponse attend;
  attend.set_request_id(response.id());
  bool have_output = false;
  for (int i = 0; i < response.outputs_size(); ++i) {
    const auto& output = response.outputs(i);
    Tensor* target = output.name() == "output"      ? attend.mutable_output()
                     : output.name() == "attention" ? attend.mutable_attention()
                                                    : nullptr;
    if (target == nullptr) continue;
    const std::string* bytes =
        i < response.raw_output_contents_size() ? &response.raw_output_contents(i) : nullptr;
    MHA_ASSIGN_OR_RETURN(*target, ToTensor(output, bytes));
    have_output |= target == attend.mutable_output();
  }
  if (!have_output) {
    return absl::InternalError("the response has no output named \"output\"");
  }
  if (const auto timing = TimingOf(response)) *attend.mutable_timing() = *timing;
  return attend;
}

}  // namespace mha::client

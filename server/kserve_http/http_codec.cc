#include "server/kserve_http/http_codec.h"

#include <algorithm>
#include <bit>
#include <charconv>
#include <cmath>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <utility>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/types/span.h"
#include "base/status_macros.h"
#include "server/kserve/inference_codec.h"
#include "server/kserve/json_depth.h"
#include "server/serving/abbreviate.h"
#include "server/serving/request.h"

namespace mha::server {
namespace {

using inference::InferParameter;
using inference::ModelInferRequest;
using inference::ModelInferResponse;
using Json = nlohmann::json;
using OrderedJson = nlohmann::ordered_json;
using ParameterMap = google::protobuf::Map<std::string, InferParameter>;

static_assert(std::endian::native == std::endian::little,
              "tensor bytes are copied as they lie in memory");

enum class Kind { kBool, kUnsigned, kSigned, kHalf, kBfloat16, kFloat, kDouble };

struct DataType {
  absl::string_view name;
  Kind kind;
  int size;  // bytes per element
};

constexpr DataType kDataTypes[] = {
    {"BOOL", Kind::kBool, 1},       {"UINT8", Kind::kUnsigned, 1},  {"UINT16", Kind::kUnsigned, 2},
    {"UINT32", Kind::kUnsigned, 4}, {"UINT64", Kind::kUnsigned, 8}, {"INT8", Kind::kSigned, 1},
    {"INT16", Kind::kSigned, 2},    {"INT32", Kind::kSigned, 4},    {"INT64", Kind::kSigned, 8},
    {"FP16", Kind::kHalf, 2},       {"FP32", Kind::kFloat, 4},      {"FP64", Kind::kDouble, 8},
    {"BF16", Kind::kBfloat16, 2},
};

const DataType* FindDataType(absl::string_view name) {
  for (const DataType& type : kDataTypes) {
    if (type.name == name) return &type;
  }
  return nullptr;
}

std::string DataTypeNames() {
  return absl::StrJoin(kDataTypes, ", ",
                       [](std::string* out, const DataType& t) { absl::StrAppend(out, t.name); });
}

std::string Quote(absl::string_view text) { return absl::StrCat("\"", Abbreviate(text), "\""); }

std::string Dump(const Json& value) {
  return value.dump(-1, ' ', false, Json::error_handler_t::replace);
}

// A JSON value as a message quotes it: scalars as written, containers by kind.
std::string Describe(const Json& value) {
  if (value.is_array()) return value.empty() ? "an empty array" : "an array";
  if (value.is_object()) return "an object";
  return Abbreviate(Dump(value));
}

absl::Status Invalid(absl::string_view field, absl::string_view problem) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", problem));
}

absl::Status Expected(absl::string_view field, absl::string_view what, const Json& got) {
  return Invalid(field, absl::StrCat("expected ", what, ", got ", Describe(got)));
}

absl::StatusOr<Json> ParseJson(absl::string_view text) {
  // JSON has no raw NUL (a string holds it as \u0000); nlohmann's parser would take
  // one for the end of the input and accept the bytes after it unread.
  if (const size_t nul = text.find('\0'); nul != absl::string_view::npos) {
    return absl::InvalidArgumentError(absl::StrCat(
        "request body: invalid JSON: a NUL byte at offset ", nul,
        " (nothing may follow the JSON value; binary data needs Inference-Header-Content-Length)"));
  }
  MHA_RETURN_IF_ERROR(CheckJsonDepth(text));
  try {
    return Json::parse(text.begin(), text.end());
  } catch (const Json::exception& e) {
    // what() is "[json.exception.<kind>.<id>] <message>"; the tag means nothing to clients.
    absl::string_view message = e.what();
    if (const size_t tag = message.find("] "); tag != absl::string_view::npos) {
      message.remove_prefix(tag + 2);
    }
    return absl::InvalidArgumentError(absl::StrCat(
        "request body: invalid JSON: ", Abbreviate(message, kMaxStatusMessageBytes / 2)));
  }
}

absl::Status ParseParameters(absl::string_view field, const Json& json, ParameterMap* out) {
  if (!json.is_object()) return Expected(field, "an object", json);
  for (const auto& [key, value] : json.items()) {
    InferParameter parameter;
    switch (value.type()) {
      case Json::value_t::boolean:
        parameter.set_bool_param(value.get<bool>());
        break;
      case Json::value_t::number_integer:
        parameter.set_int64_param(value.get<int64_t>());
        break;
      case Json::value_t::number_unsigned:
        if (const uint64_t u = value.get<uint64_t>();
            u <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
          parameter.set_int64_param(static_cast<int64_t>(u));
        } else {
          parameter.set_uint64_param(u);
        }
        break;
      case Json::value_t::number_float:
        parameter.set_double_param(value.get<double>());
        break;
      case Json::value_t::string:
        parameter.set_string_param(value.get<std::string>());
        break;
      default:
        return Expected(absl::StrCat(field, ".", Abbreviate(key)), "a bool, number or string",
                        value);
    }
    (*out)[key] = std::move(parameter);
  }
  return absl::OkStatus();
}

absl::Status CheckBoolParameter(absl::string_view field, const ParameterMap& parameters,
                                const std::string& name) {
  const auto it = parameters.find(name);
  if (it == parameters.end() || it->second.has_bool_param()) return absl::OkStatus();
  return Invalid(absl::StrCat(field, ".", name), "expected true or false");
}

// Why `value` cannot be an element of `type`, or nullopt once its bytes are appended.
std::optional<std::string> AppendElement(const Json& value, const DataType& type,
                                         std::string* out) {
  switch (type.kind) {
    case Kind::kBool:
      if (!value.is_boolean()) return absl::StrCat("expected true or false, got ", Describe(value));
      out->push_back(value.get<bool>() ? 1 : 0);
      return std::nullopt;
    case Kind::kUnsigned:
    case Kind::kSigned: {
      if (!value.is_number_integer()) {
        return absl::StrCat("expected an integer for ", type.name, ", got ", Describe(value));
      }
      const int bits = 8 * type.size;
      const bool is_signed = type.kind == Kind::kSigned;
      const uint64_t max = is_signed    ? (uint64_t{1} << (bits - 1)) - 1
                           : bits == 64 ? std::numeric_limits<uint64_t>::max()
                                        : (uint64_t{1} << bits) - 1;
      const int64_t min = is_signed ? -static_cast<int64_t>(max) - 1 : 0;
      uint64_t word = 0;
      bool in_range;
      if (value.is_number_unsigned()) {
        word = value.get<uint64_t>();
        in_range = word <= max;
      } else {
        const int64_t v = value.get<int64_t>();
        word = static_cast<uint64_t>(v);
        in_range = v >= min && (v < 0 || static_cast<uint64_t>(v) <= max);
      }
      if (!in_range) {
        return absl::StrCat(Dump(value), " is out of range for ", type.name, " [", min, ", ", max,
                            "]");
      }
      char bytes[8];
      std::memcpy(bytes, &word, sizeof(bytes));
      out->append(bytes, type.size);
      return std::nullopt;
    }
    case Kind::kFloat:
    case Kind::kDouble: {
      if (!value.is_number()) {
        return absl::StrCat("expected a number for ", type.name, ", got ", Describe(value));
      }
      const double v = value.get<double>();
      if (type.kind == Kind::kDouble) {
        char bytes[sizeof(double)];
        std::memcpy(bytes, &v, sizeof(bytes));
        out->append(bytes, sizeof(bytes));
        return std::nullopt;
      }
      if (!(std::fabs(v) <= std::numeric_limits<float>::max())) {
        return absl::StrCat(Dump(value), " is out of range for FP32");
      }
      const float f = static_cast<float>(v);
      char bytes[sizeof(float)];
      std::memcpy(bytes, &f, sizeof(bytes));
      out->append(bytes, sizeof(bytes));
      return std::nullopt;
    }
    case Kind::kHalf:
    case Kind::kBfloat16:
      break;  // refused before any element is read
  }
  return absl::StrCat(type.name, " cannot be sent as JSON numbers");
}

struct InputSpec {
  std::string label;  // inputs[i] ("name")
  const DataType* type = nullptr;
  absl::Span<const int64_t> shape;
  int64_t elements = 0;
  int64_t bytes = 0;
};

absl::Status AppendFlat(const InputSpec& input, const Json& data, std::string* out) {
  if (static_cast<int64_t>(data.size()) != input.elements) {
    return Invalid(absl::StrCat(input.label, ".data"),
                   absl::StrCat("shape ", ShapeString(input.shape), " needs ", input.elements,
                                " values, got ", data.size()));
  }
  out->reserve(input.bytes);
  for (size_t i = 0; i < data.size(); ++i) {
    if (std::optional<std::string> why = AppendElement(data[i], *input.type, out)) {
      return Invalid(absl::StrCat(input.label, ".data[", i, "]"), *why);
    }
  }
  return absl::OkStatus();
}

// `node` at `path` (data[i][j]...) holds dimensions level.. of the shape. Recursion
// follows arrays that are in the body, so CheckJsonDepth bounds it.
absl::Status AppendNested(const InputSpec& input, const Json& node, size_t level, std::string* path,
                          std::string* out) {
  const auto field = [&] { return absl::StrCat(input.label, ".", *path); };
  if (level == input.shape.size()) {
    if (node.is_array()) {
      return Invalid(field(), absl::StrCat("nested deeper than shape ", ShapeString(input.shape)));
    }
    if (std::optional<std::string> why = AppendElement(node, *input.type, out)) {
      return Invalid(field(), *why);
    }
    return absl::OkStatus();
  }
  const int64_t dim = input.shape[level];
  if (!node.is_array() || static_cast<int64_t>(node.size()) != dim) {
    return Invalid(field(), absl::StrCat("expected an array of ", dim, " (dimension ", level,
                                         " of shape ", ShapeString(input.shape), "), got ",
                                         node.is_array() ? absl::StrCat("an array of ", node.size())
                                                         : Describe(node)));
  }
  const size_t length = path->size();
  for (size_t i = 0; i < node.size(); ++i) {
    absl::StrAppend(path, "[", i, "]");
    MHA_RETURN_IF_ERROR(AppendNested(input, node[i], level + 1, path, out));
    path->resize(length);
  }
  return absl::OkStatus();
}

absl::Status AppendData(const InputSpec& input, const Json& data, std::string* out) {
  if (!data.is_array()) return Expected(absl::StrCat(input.label, ".data"), "an array", data);
  if (input.type->kind == Kind::kHalf || input.type->kind == Kind::kBfloat16) {
    return Invalid(absl::StrCat(input.label, ".data"),
                   absl::StrCat(input.type->name,
                                " cannot be sent as JSON numbers; send it as binary data "
                                "(parameters.binary_data_size)"));
  }
  const bool nested =
      std::any_of(data.begin(), data.end(), [](const Json& v) { return v.is_array(); });
  if (!nested) return AppendFlat(input, data, out);
  std::string path = "data";
  return AppendNested(input, data, 0, &path, out);
}

// Elements and bytes of a shape whose dimensions are >= 0, or nullopt past int64.
std::optional<std::pair<int64_t, int64_t>> Size(absl::Span<const int64_t> shape, int element_size) {
  if (std::find(shape.begin(), shape.end(), 0) != shape.end()) return std::pair<int64_t, int64_t>();
  int64_t elements = 1, bytes = 0;
  for (const int64_t dim : shape) {
    if (__builtin_mul_overflow(elements, dim, &elements)) return std::nullopt;
  }
  if (__builtin_mul_overflow(elements, int64_t{element_size}, &bytes)) return std::nullopt;
  return std::pair(elements, bytes);
}

// The binary part of the body, handed out in order to inputs that claim it.
struct BinaryPart {
  absl::string_view bytes;
  bool present = false;  // the request had Inference-Header-Content-Length
  size_t used = 0;
  // The body `bytes` ends, when the caller gave it up: the tensor that ends the body
  // takes its buffer (shifted down, no new allocation) instead of a copy.
  std::string* donor = nullptr;
};

// The input's "shape" into `tensor` and `input` (shape, elements, bytes).
absl::Status ParseShape(const Json& json, ModelInferRequest::InferInputTensor* tensor,
                        InputSpec* input) {
  const auto shape = json.find("shape");
  const std::string shape_field = absl::StrCat(input->label, ".shape");
  if (shape == json.end()) return Invalid(shape_field, "required");
  if (!shape->is_array()) return Expected(shape_field, "an array of integers", *shape);
  for (const Json& dim : *shape) {
    if (!dim.is_number_integer() ||
        (dim.is_number_unsigned() &&
         dim.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))) {
      return Invalid(shape_field, absl::StrCat("expected an array of integers, got an array with ",
                                               Describe(dim)));
    }
    tensor->add_shape(dim.get<int64_t>());
  }
  input->shape = absl::MakeConstSpan(tensor->shape().data(), tensor->shape_size());
  if (std::any_of(input->shape.begin(), input->shape.end(), [](int64_t d) { return d < 0; })) {
    return Invalid(shape_field,
                   absl::StrCat("dimensions must be >= 0, got ", ShapeString(input->shape)));
  }
  const auto size = Size(input->shape, input->type->size);
  if (!size.has_value()) {
    return Invalid(shape_field, absl::StrCat(ShapeString(input->shape), " of ", input->type->name,
                                             " is more than 2^63 bytes"));
  }
  std::tie(input->elements, input->bytes) = *size;
  return absl::OkStatus();
}

// The input's "parameters" into `tensor`, less binary_data_size, which is returned
// (nullopt when absent: the values are in "data").
absl::StatusOr<std::optional<int64_t>> ParseInputParameters(
    const Json& json, const InputSpec& input, ModelInferRequest::InferInputTensor* tensor) {
  const auto parameters = json.find("parameters");
  if (parameters == json.end()) return std::nullopt;
  const std::string field = absl::StrCat(input.label, ".parameters");
  MHA_RETURN_IF_ERROR(ParseParameters(field, *parameters, tensor->mutable_parameters()));
  const auto it = tensor->parameters().find("binary_data_size");
  if (it == tensor->parameters().end()) return std::nullopt;
  if (!it->second.has_int64_param() || it->second.int64_param() < 0) {
    return Invalid(absl::StrCat(field, ".binary_data_size"),
                   absl::StrCat("expected an integer >= 0, got ",
                                Describe(parameters->at("binary_data_size"))));
  }
  const int64_t binary_size = it->second.int64_param();
  tensor->mutable_parameters()->erase("binary_data_size");
  return binary_size;
}

// The next `size` bytes of the binary part (there are that many) into `raw`.
void TakeBytes(int64_t size, BinaryPart* binary, std::string* raw) {
  const char* from = binary->bytes.data() + binary->used;
  binary->used += size;
  if (binary->donor != nullptr && binary->used == binary->bytes.size() && size > 65536) {
    // The last bytes of the body: nothing reads the body after them.
    std::string* donor = std::exchange(binary->donor, nullptr);
    donor->erase(0, static_cast<size_t>(from - donor->data()));
    raw->swap(*donor);
    binary->bytes = {};
    binary->used = 0;
    return;
  }
  raw->assign(from, size);
}

// The input's `binary_size` bytes, the next ones of the request's binary part, into
// `raw`.
absl::Status TakeBinaryData(const InputSpec& input, int64_t binary_size, BinaryPart* binary,
                            std::string* raw) {
  const std::string size_field = absl::StrCat(input.label, ".parameters.binary_data_size");
  if (binary_size != input.bytes) {
    return Invalid(size_field,
                   absl::StrCat("shape ", ShapeString(input.shape), " of ", input.type->name,
                                " is ", input.bytes, " bytes, got ", binary_size));
  }
  const size_t left = binary->bytes.size() - binary->used;
  if (static_cast<uint64_t>(binary_size) > left) {
    return Invalid(size_field,
                   binary->present
                       ? absl::StrCat(binary_size, " bytes, but only ", left,
                                      " bytes of binary data are left after the JSON header")
                       : absl::StrCat(binary_size,
                                      " bytes, but the request has no binary data (no "
                                      "Inference-Header-Content-Length header)"));
  }
  TakeBytes(binary_size, binary, raw);
  return absl::OkStatus();
}

absl::Status ParseInput(size_t index, const Json& json, BinaryPart* binary,
                        ModelInferRequest* request) {
  const std::string at = absl::StrCat("inputs[", index, "]");
  if (!json.is_object()) return Expected(at, "an object", json);
  ModelInferRequest::InferInputTensor* tensor = request->add_inputs();

  const auto name = json.find("name");
  if (name == json.end()) return Invalid(absl::StrCat(at, ".name"), "required");
  if (!name->is_string()) return Expected(absl::StrCat(at, ".name"), "a string", *name);
  tensor->set_name(name->get<std::string>());
  InputSpec input{.label = absl::StrCat(at, " (", Quote(tensor->name()), ")")};

  const auto datatype = json.find("datatype");
  const std::string datatype_field = absl::StrCat(input.label, ".datatype");
  if (datatype == json.end()) return Invalid(datatype_field, "required");
  if (!datatype->is_string()) return Expected(datatype_field, "a string", *datatype);
  tensor->set_datatype(datatype->get<std::string>());
  input.type = FindDataType(tensor->datatype());
  if (tensor->datatype() == "BYTES") {
    return Invalid(datatype_field, "BYTES is not served; send a numeric datatype");
  }
  if (input.type == nullptr) {
    return Invalid(datatype_field, absl::StrCat("expected one of ", DataTypeNames(), ", got ",
                                                Quote(tensor->datatype())));
  }
  MHA_RETURN_IF_ERROR(ParseShape(json, tensor, &input));
  MHA_ASSIGN_OR_RETURN(const std::optional<int64_t> binary_size,
                       ParseInputParameters(json, input, tensor));

  const auto data = json.find("data");
  // Triton's system shared memory: the values are in a registered region
  // (server/kserve/inference_codec.h checks the parameters); no raw entry.
  if (tensor->parameters().contains("shared_memory_region")) {
    if (data != json.end() || binary_size.has_value()) {
      return Invalid(
          input.label,
          absl::StrCat("has parameters.shared_memory_region and ",
                       data != json.end() ? "data" : "parameters.binary_data_size", "; send one"));
    }
    return absl::OkStatus();
  }
  std::string* raw = request->add_raw_input_contents();
  if (!binary_size.has_value()) {
    if (data == json.end()) {
      return Invalid(input.label, "expected data or parameters.binary_data_size");
    }
    return AppendData(input, *data, raw);
  }
  if (data != json.end()) {
    return Invalid(input.label, "has both data and parameters.binary_data_size; send one");
  }
  return TakeBinaryData(input, *binary_size, binary, raw);
}

absl::Status ParseOutput(size_t index, const Json& json, ModelInferRequest* request) {
  const std::string at = absl::StrCat("outputs[", index, "]");
  if (!json.is_object()) return Expected(at, "an object", json);
  ModelInferRequest::InferRequestedOutputTensor* output = request->add_outputs();
  const auto name = json.find("name");
  if (name == json.end()) return Invalid(absl::StrCat(at, ".name"), "required");
  if (!name->is_string()) return Expected(absl::StrCat(at, ".name"), "a string", *name);
  output->set_name(name->get<std::string>());
  if (const auto parameters = json.find("parameters"); parameters != json.end()) {
    const std::string field = absl::StrCat(at, " (", Quote(output->name()), ").parameters");
    MHA_RETURN_IF_ERROR(ParseParameters(field, *parameters, output->mutable_parameters()));
    MHA_RETURN_IF_ERROR(CheckBoolParameter(field, output->parameters(), "binary_data"));
    // The log-sum-exp of a fully masked row is -inf, which JSON cannot carry.
    const auto binary = output->parameters().find("binary_data");
    if (output->name() == "lse" && binary != output->parameters().end() &&
        !binary->second.bool_param()) {
      return Invalid(absl::StrCat(field, ".binary_data"),
                     "lse is sent only as binary data (it may hold -inf, which JSON cannot "
                     "carry); leave binary_data out or set it true");
    }
  }
  return absl::OkStatus();
}

absl::Status ParseBody(const Json& root, BinaryPart* binary, ModelInferRequest* request) {
  if (!root.is_object()) return Expected("request body", "a JSON object", root);
  if (const auto id = root.find("id"); id != root.end()) {
    if (!id->is_string()) return Expected("id", "a string", *id);
    request->set_id(id->get<std::string>());
  }
  if (const auto parameters = root.find("parameters"); parameters != root.end()) {
    MHA_RETURN_IF_ERROR(ParseParameters("parameters", *parameters, request->mutable_parameters()));
    MHA_RETURN_IF_ERROR(
        CheckBoolParameter("parameters", request->parameters(), "binary_data_output"));
  }
  const auto inputs = root.find("inputs");
  if (inputs == root.end()) return Invalid("inputs", "required");
  if (!inputs->is_array()) return Expected("inputs", "an array", *inputs);
  for (size_t i = 0; i < inputs->size(); ++i) {
    MHA_RETURN_IF_ERROR(ParseInput(i, (*inputs)[i], binary, request));
  }
  if (binary->used != binary->bytes.size()) {
    return Invalid("Inference-Header-Content-Length",
                   absl::StrCat(binary->bytes.size(),
                                " bytes of binary data follow the JSON "
                                "header, but the inputs' parameters.binary_data_size claim ",
                                binary->used));
  }
  if (const auto outputs = root.find("outputs"); outputs != root.end()) {
    if (!outputs->is_array()) return Expected("outputs", "an array", *outputs);
    for (size_t i = 0; i < outputs->size(); ++i) {
      MHA_RETURN_IF_ERROR(ParseOutput(i, (*outputs)[i], request));
    }
  }
  return absl::OkStatus();
}

// The double nearest the shortest decimal that reads back as `f`, so that the JSON
// holds 0.1 for 0.1f rather than 0.10000000149011612. A reader that parses into a
// double and then rounds to float rounds twice; where that would not give `f` back,
// the exact value is sent instead.
double ShortestFloat(float f) {
  if (!std::isfinite(f)) return f;
  char text[32];
  const std::to_chars_result printed = std::to_chars(text, text + sizeof(text), f);
  double d = 0;
  const std::from_chars_result read = std::from_chars(text, printed.ptr, d);
  if (printed.ec != std::errc() || read.ec != std::errc() || static_cast<float>(d) != f) {
    return f;
  }
  return d;
}

template <typename T>
T Load(const char* p) {
  T value;
  std::memcpy(&value, p, sizeof(T));
  return value;
}

OrderedJson Element(const DataType& type, const char* p) {
  switch (type.kind) {
    case Kind::kBool:
      return *p != 0;
    case Kind::kUnsigned:
      switch (type.size) {
        case 1:
          return Load<uint8_t>(p);
        case 2:
          return Load<uint16_t>(p);
        case 4:
          return Load<uint32_t>(p);
        default:
          return Load<uint64_t>(p);
      }
    case Kind::kSigned:
      switch (type.size) {
        case 1:
          return Load<int8_t>(p);
        case 2:
          return Load<int16_t>(p);
        case 4:
          return Load<int32_t>(p);
        default:
          return Load<int64_t>(p);
      }
    case Kind::kHalf:
      return ShortestFloat(HalfToFloat(Load<uint16_t>(p)));
    case Kind::kBfloat16:
      return ShortestFloat(std::bit_cast<float>(uint32_t{Load<uint16_t>(p)} << 16));
    case Kind::kFloat:
      return ShortestFloat(Load<float>(p));
    case Kind::kDouble:
      return Load<double>(p);
  }
  return nullptr;
}

// Keys sorted: a protobuf map has no order of its own.
OrderedJson ParametersJson(const ParameterMap& parameters) {
  std::vector<std::pair<std::string, const InferParameter*>> sorted;
  for (const auto& [key, value] : parameters) sorted.emplace_back(key, &value);
  std::sort(sorted.begin(), sorted.end());
  OrderedJson out = OrderedJson::object();
  for (const auto& [key, p] : sorted) {
    switch (p->parameter_choice_case()) {
      case InferParameter::kBoolParam:
        out[key] = p->bool_param();
        break;
      case InferParameter::kInt64Param:
        out[key] = p->int64_param();
        break;
      case InferParameter::kUint64Param:
        out[key] = p->uint64_param();
        break;
      case InferParameter::kDoubleParam:
        out[key] = p->double_param();
        break;
      case InferParameter::kStringParam:
        out[key] = p->string_param();
        break;
      case InferParameter::PARAMETER_CHOICE_NOT_SET:
        break;
    }
  }
  return out;
}

bool IsTrue(const ParameterMap& parameters, const std::string& name) {
  const auto it = parameters.find(name);
  return it != parameters.end() && it->second.has_bool_param() && it->second.bool_param();
}

bool SendsBinary(const ModelInferRequest& request, const std::string& output) {
  if (output == "lse") return true;  // always (ParseOutput refuses binary_data false)
  for (const ModelInferRequest::InferRequestedOutputTensor& requested : request.outputs()) {
    if (requested.name() != output) continue;
    const auto it = requested.parameters().find("binary_data");
    if (it != requested.parameters().end() && it->second.has_bool_param()) {
      return it->second.bool_param();
    }
    break;
  }
  return IsTrue(request.parameters(), "binary_data_output");
}

// The JSON "data" of output i (`name`): its `elements` values, each finite.
absl::StatusOr<OrderedJson> DataJson(const DataType& type, const std::string& raw, int64_t elements,
                                     int i, const std::string& name) {
  OrderedJson data = OrderedJson::array();
  data.get_ref<OrderedJson::array_t&>().reserve(elements);
  for (int64_t e = 0; e < elements; ++e) {
    OrderedJson value = Element(type, raw.data() + e * type.size);
    // nlohmann would write Inf and NaN as null, which reads back as no value.
    if (value.is_number_float() && !std::isfinite(value.get<double>())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "outputs[", i, "] (", Quote(name), "): element ", e, " is ", value.get<double>(),
          ", which JSON cannot carry; ask for this output as binary data "
          "(parameters.binary_data: true)"));
    }
    data.push_back(std::move(value));
  }
  return data;
}

// Response output i's entry in "outputs"; *binary: whether its bytes go after the
// JSON instead of in it.
absl::StatusOr<OrderedJson> OutputJson(const ModelInferRequest& request,
                                       const ModelInferResponse& response, int i, bool* binary) {
  const ModelInferResponse::InferOutputTensor& output = response.outputs(i);
  const std::string& raw = response.raw_output_contents(i);
  const std::string label = absl::StrCat("response outputs[", i, "] (", Quote(output.name()), ")");
  const DataType* type = FindDataType(output.datatype());
  if (type == nullptr) {
    return absl::InternalError(
        absl::StrCat(label, ": datatype ", Quote(output.datatype()), " has no HTTP encoding"));
  }
  const absl::Span<const int64_t> shape(output.shape().data(), output.shape_size());
  OrderedJson entry = OrderedJson::object();
  entry["name"] = output.name();
  entry["datatype"] = output.datatype();
  entry["shape"] = std::vector<int64_t>(shape.begin(), shape.end());
  *binary = false;
  if (output.parameters().contains("shared_memory_region")) {
    // Written into the client's region (Triton's system shared memory): the entry
    // has no data and no parameters, as Triton writes it (tritonclient's C++ HTTP
    // client reads "parameters" as binary data and needs its binary_data_size);
    // its raw_output_contents entry is empty.
    if (!raw.empty()) {
      return absl::InternalError(absl::StrCat(label, ": a shared-memory output with ", raw.size(),
                                              " bytes of raw_output_contents"));
    }
    return entry;
  }
  const bool dims_ok = std::all_of(shape.begin(), shape.end(), [](int64_t d) { return d >= 0; });
  const auto size = dims_ok ? Size(shape, type->size) : std::nullopt;
  if (!size.has_value() || size->second != static_cast<int64_t>(raw.size())) {
    return absl::InternalError(absl::StrCat(label, ": ", raw.size(), " bytes for shape ",
                                            ShapeString(shape), " of ", type->name));
  }
  OrderedJson parameters = ParametersJson(output.parameters());
  *binary = SendsBinary(request, output.name());
  if (*binary) parameters["binary_data_size"] = raw.size();
  if (!parameters.empty()) entry["parameters"] = std::move(parameters);
  if (!*binary) {
    absl::StatusOr<OrderedJson> data = DataJson(*type, raw, size->first, i, output.name());
    if (!data.ok()) return data.status();
    entry["data"] = *std::move(data);
  }
  return entry;
}

// The body; with `split`, binary outputs are listed in binary_outputs instead of
// appended.
absl::StatusOr<HttpBody> Encode(const ModelInferRequest& request,
                                const ModelInferResponse& response, bool split) {
  OrderedJson root = OrderedJson::object();
  root["model_name"] = response.model_name();
  root["model_version"] = response.model_version();
  if (!response.id().empty()) root["id"] = response.id();
  if (!response.parameters().empty()) root["parameters"] = ParametersJson(response.parameters());
  if (response.raw_output_contents_size() != response.outputs_size()) {
    return absl::InternalError(absl::StrCat("response: ", response.outputs_size(), " outputs but ",
                                            response.raw_output_contents_size(),
                                            " raw_output_contents"));
  }
  OrderedJson outputs = OrderedJson::array();
  std::vector<int> binary_outputs;
  for (int i = 0; i < response.outputs_size(); ++i) {
    bool binary = false;
    absl::StatusOr<OrderedJson> entry = OutputJson(request, response, i, &binary);
    if (!entry.ok()) return entry.status();
    if (binary) binary_outputs.push_back(i);
    outputs.push_back(*std::move(entry));
  }
  root["outputs"] = std::move(outputs);

  HttpBody out;
  out.body = root.dump(-1, ' ', false, OrderedJson::error_handler_t::replace);
  if (!binary_outputs.empty()) {
    out.header_length = static_cast<int64_t>(out.body.size());
    if (split) {
      out.binary_outputs = std::move(binary_outputs);
    } else {
      for (int i : binary_outputs) out.body += response.raw_output_contents(i);
    }
    out.content_type = "application/octet-stream";
  } else {
    out.content_type = "application/json";
  }
  return out;
}

// --- The fast path: binary requests and responses of the common form ---
// A binary request's JSON head is a few hundred bytes of a fixed form, and building
// nlohmann's DOM for it, then the response's, was the largest part of the HTTP front's
// own CPU at toy c 64 (docs/performance.md, issue 32). The fast path reads and writes
// that form directly: keys it knows, each once; plain strings (printable ASCII, no
// escapes); integers within int64; every input binary, every output binary with no
// parameters of its own. On anything else it gives up (nullopt) and the general
// path takes the body, which words every refusal: the fast path never refuses, and
// what it builds is what the general path builds (http_body_fuzzer compares them).

class HeadScanner {
 public:
  explicit HeadScanner(absl::string_view text) : p_(text.data()), end_(text.data() + text.size()) {}

  bool Take(char c) {
    SkipSpace();
    if (p_ == end_ || *p_ != c) return false;
    ++p_;
    return true;
  }
  bool Next(char c) {
    SkipSpace();
    return p_ != end_ && *p_ == c;
  }
  bool AtEnd() {
    SkipSpace();
    return p_ == end_;
  }
  bool Word(absl::string_view word) {
    SkipSpace();
    if (static_cast<size_t>(end_ - p_) < word.size() ||
        absl::string_view(p_, word.size()) != word) {
      return false;
    }
    p_ += word.size();
    return true;
  }
  // A string of printable ASCII without escapes.
  std::optional<absl::string_view> PlainString() {
    if (!Take('"')) return std::nullopt;
    const char* start = p_;
    while (p_ != end_ && *p_ != '"') {
      const unsigned char c = static_cast<unsigned char>(*p_);
      if (c < 0x20 || c > 0x7e || c == '\\') return std::nullopt;
      ++p_;
    }
    if (p_ == end_) return std::nullopt;
    const absl::string_view text(start, static_cast<size_t>(p_ - start));
    ++p_;
    return text;
  }
  // An integer as JSON writes one (no fraction, no exponent, not -0), within int64.
  std::optional<int64_t> Integer() {
    SkipSpace();
    const char* start = p_;
    if (p_ != end_ && *p_ == '-') ++p_;
    const char* digits = p_;
    while (p_ != end_ && *p_ >= '0' && *p_ <= '9') ++p_;
    const size_t n = static_cast<size_t>(p_ - digits);
    if (n == 0 || (n > 1 && *digits == '0') || (digits != start && n == 1 && *digits == '0')) {
      return std::nullopt;
    }
    if (p_ != end_ && (*p_ == '.' || *p_ == 'e' || *p_ == 'E')) return std::nullopt;
    int64_t value = 0;
    const std::from_chars_result read = std::from_chars(start, p_, value);
    if (read.ec != std::errc() || read.ptr != p_) return std::nullopt;
    return value;
  }

 private:
  void SkipSpace() {
    while (p_ != end_ && (*p_ == ' ' || *p_ == '\t' || *p_ == '\n' || *p_ == '\r')) ++p_;
  }
  const char* p_;
  const char* end_;
};

// An object: `member(key)` reads each value; false (or a malformed object) gives up.
template <typename Member>
bool ScanObject(HeadScanner& s, Member member) {
  if (!s.Take('{')) return false;
  if (s.Take('}')) return true;
  do {
    const std::optional<absl::string_view> key = s.PlainString();
    if (!key || !s.Take(':') || !member(*key)) return false;
  } while (s.Take(','));
  return s.Take('}');
}

template <typename Element>
bool ScanArray(HeadScanner& s, Element element) {
  if (!s.Take('[')) return false;
  if (s.Take(']')) return true;
  do {
    if (!element()) return false;
  } while (s.Take(','));
  return s.Take(']');
}

// Once per key: false the second time (nlohmann would keep the last; the general
// path decides).
bool Once(bool* seen) { return !std::exchange(*seen, true); }

// A parameters object of bools, int64 integers and plain strings, each key once.
bool ScanParameters(HeadScanner& s, ParameterMap* out) {
  return ScanObject(s, [&](absl::string_view key) {
    InferParameter value;
    if (s.Next('"')) {
      const std::optional<absl::string_view> text = s.PlainString();
      if (!text) return false;
      value.set_string_param(std::string(*text));
    } else if (s.Word("true")) {
      value.set_bool_param(true);
    } else if (s.Word("false")) {
      value.set_bool_param(false);
    } else {
      const std::optional<int64_t> number = s.Integer();
      if (!number) return false;
      value.set_int64_param(*number);
    }
    return out->insert({std::string(key), std::move(value)}).second;
  });
}

bool IsBoolIfPresent(const ParameterMap& parameters, const std::string& name) {
  const auto it = parameters.find(name);
  return it == parameters.end() || it->second.has_bool_param();
}

bool ScanInput(HeadScanner& s, ModelInferRequest::InferInputTensor* tensor, int64_t* binary_size) {
  bool name = false, datatype = false, shape = false, parameters = false;
  const bool read = ScanObject(s, [&](absl::string_view key) {
    if (key == "name" && Once(&name)) {
      const std::optional<absl::string_view> text = s.PlainString();
      if (text) tensor->set_name(std::string(*text));
      return text.has_value();
    }
    if (key == "datatype" && Once(&datatype)) {
      const std::optional<absl::string_view> text = s.PlainString();
      if (text) tensor->set_datatype(std::string(*text));
      return text.has_value();
    }
    if (key == "shape" && Once(&shape)) {
      return ScanArray(s, [&] {
        const std::optional<int64_t> dim = s.Integer();
        if (!dim || *dim < 0) return false;
        tensor->add_shape(*dim);
        return true;
      });
    }
    if (key == "parameters" && Once(&parameters)) {
      return ScanParameters(s, tensor->mutable_parameters());
    }
    return false;  // "data", or a key the general path ignores or refuses
  });
  if (!read || !name || !datatype || !shape) return false;
  auto* map = tensor->mutable_parameters();
  const auto size = map->find("binary_data_size");
  if (size == map->end() || !size->second.has_int64_param() || size->second.int64_param() < 0 ||
      map->contains("shared_memory_region")) {
    return false;
  }
  *binary_size = size->second.int64_param();
  map->erase(size);
  return true;
}

bool ScanOutput(HeadScanner& s, ModelInferRequest::InferRequestedOutputTensor* output) {
  bool name = false, parameters = false;
  const bool read = ScanObject(s, [&](absl::string_view key) {
    if (key == "name" && Once(&name)) {
      const std::optional<absl::string_view> text = s.PlainString();
      if (text) output->set_name(std::string(*text));
      return text.has_value();
    }
    if (key == "parameters" && Once(&parameters)) {
      return ScanParameters(s, output->mutable_parameters());
    }
    return false;
  });
  if (!read || !name || !IsBoolIfPresent(output->parameters(), "binary_data")) return false;
  const auto binary = output->parameters().find("binary_data");
  return !(output->name() == "lse" && binary != output->parameters().end() &&
           !binary->second.bool_param());
}

std::optional<ModelInferRequest> ParseFast(absl::string_view model_name,
                                           absl::string_view model_version, absl::string_view body,
                                           std::optional<int64_t> header_length,
                                           std::string* donor) {
  if (!header_length.has_value() || *header_length < 0 ||
      static_cast<uint64_t>(*header_length) > body.size()) {
    return std::nullopt;
  }
  HeadScanner s(body.substr(0, *header_length));
  ModelInferRequest request;
  absl::InlinedVector<int64_t, 8> binary_sizes;
  bool id = false, parameters = false, inputs = false, outputs = false;
  const bool read = ScanObject(s, [&](absl::string_view key) {
    if (key == "id" && Once(&id)) {
      const std::optional<absl::string_view> text = s.PlainString();
      if (text) request.set_id(std::string(*text));
      return text.has_value();
    }
    if (key == "parameters" && Once(&parameters)) {
      return ScanParameters(s, request.mutable_parameters()) &&
             IsBoolIfPresent(request.parameters(), "binary_data_output");
    }
    if (key == "inputs" && Once(&inputs)) {
      return ScanArray(s, [&] {
        binary_sizes.push_back(0);
        return ScanInput(s, request.add_inputs(), &binary_sizes.back());
      });
    }
    if (key == "outputs" && Once(&outputs)) {
      return ScanArray(s, [&] { return ScanOutput(s, request.add_outputs()); });
    }
    return false;
  });
  if (!read || !inputs || !s.AtEnd()) return std::nullopt;

  // Every input's bytes, in order, exactly filling the binary part.
  BinaryPart binary{.bytes = body.substr(*header_length), .present = true, .donor = donor};
  uint64_t claimed = 0;
  for (int i = 0; i < request.inputs_size(); ++i) {
    const ModelInferRequest::InferInputTensor& tensor = request.inputs(i);
    const DataType* type = FindDataType(tensor.datatype());
    if (type == nullptr) return std::nullopt;
    const auto size =
        Size(absl::MakeConstSpan(tensor.shape().data(), tensor.shape_size()), type->size);
    if (!size.has_value() || size->second != binary_sizes[i]) return std::nullopt;
    claimed += static_cast<uint64_t>(size->second);
    if (claimed > binary.bytes.size()) return std::nullopt;
  }
  if (claimed != binary.bytes.size()) return std::nullopt;

  request.set_model_name(std::string(model_name));
  request.set_model_version(std::string(model_version));
  for (int i = 0; i < request.inputs_size(); ++i) {
    TakeBytes(binary_sizes[i], &binary, request.add_raw_input_contents());
  }
  return request;
}

bool IsPlain(absl::string_view text) {
  return std::all_of(text.begin(), text.end(), [](char c) {
    const unsigned char u = static_cast<unsigned char>(c);
    return u >= 0x20 && u <= 0x7e && c != '"' && c != '\\';
  });
}

std::optional<HttpBody> EncodeFast(const ModelInferRequest& request,
                                   const ModelInferResponse& response, bool split) {
  if (!response.parameters().empty() || response.outputs_size() == 0 ||
      response.raw_output_contents_size() != response.outputs_size() ||
      !IsPlain(response.model_name()) || !IsPlain(response.model_version()) ||
      !IsPlain(response.id())) {
    return std::nullopt;
  }
  HttpBody out;
  std::string& body = out.body;
  absl::StrAppend(&body, "{\"model_name\":\"", response.model_name(), "\",\"model_version\":\"",
                  response.model_version(), "\"");
  if (!response.id().empty()) absl::StrAppend(&body, ",\"id\":\"", response.id(), "\"");
  body += ",\"outputs\":[";
  for (int i = 0; i < response.outputs_size(); ++i) {
    const ModelInferResponse::InferOutputTensor& output = response.outputs(i);
    const std::string& raw = response.raw_output_contents(i);
    const DataType* type = FindDataType(output.datatype());
    const absl::Span<const int64_t> shape(output.shape().data(), output.shape_size());
    if (type == nullptr || !output.parameters().empty() || !IsPlain(output.name()) ||
        std::any_of(shape.begin(), shape.end(), [](int64_t d) { return d < 0; })) {
      return std::nullopt;
    }
    const auto size = Size(shape, type->size);
    if (!size.has_value() || size->second != static_cast<int64_t>(raw.size()) ||
        !SendsBinary(request, output.name())) {
      return std::nullopt;
    }
    absl::StrAppend(&body, i == 0 ? "" : ",", "{\"name\":\"", output.name(), "\",\"datatype\":\"",
                    output.datatype(), "\",\"shape\":[", absl::StrJoin(shape, ","),
                    "],\"parameters\":{\"binary_data_size\":", raw.size(), "}}");
  }
  body += "]}";
  out.header_length = static_cast<int64_t>(body.size());
  out.content_type = "application/octet-stream";
  for (int i = 0; i < response.outputs_size(); ++i) {
    if (split) {
      out.binary_outputs.push_back(i);
    } else {
      body += response.raw_output_contents(i);
    }
  }
  return out;
}

}  // namespace

namespace {

absl::StatusOr<ModelInferRequest> Parse(absl::string_view model_name,
                                        absl::string_view model_version, absl::string_view body,
                                        std::optional<int64_t> header_length, std::string* donor) {
  BinaryPart binary{.present = header_length.has_value(), .donor = donor};
  absl::string_view header = body;
  if (header_length.has_value()) {
    if (*header_length < 0 || static_cast<uint64_t>(*header_length) > body.size()) {
      return Invalid(
          "Inference-Header-Content-Length",
          absl::StrCat("expected 0 to ", body.size(), " (the body's size), got ", *header_length));
    }
    header = body.substr(0, *header_length);
    binary.bytes = body.substr(*header_length);
  }
  MHA_ASSIGN_OR_RETURN(const Json root, ParseJson(header));
  ModelInferRequest request;
  request.set_model_name(std::string(model_name));
  request.set_model_version(std::string(model_version));
  try {
    MHA_RETURN_IF_ERROR(ParseBody(root, &binary, &request));
  } catch (const Json::exception& e) {
    return absl::InternalError(absl::StrCat("request body: ", e.what()));
  }
  return request;
}

}  // namespace

absl::StatusOr<ModelInferRequest> ParseInferRequest(absl::string_view model_name,
                                                    absl::string_view model_version,
                                                    absl::string_view body,
                                                    std::optional<int64_t> header_length) {
  if (std::optional<ModelInferRequest> fast =
          ParseFast(model_name, model_version, body, header_length, nullptr)) {
    return *std::move(fast);
  }
  return Parse(model_name, model_version, body, header_length, nullptr);
}

absl::StatusOr<ModelInferRequest> ParseInferRequest(absl::string_view model_name,
                                                    absl::string_view model_version,
                                                    std::string* body,
                                                    std::optional<int64_t> header_length) {
  if (std::optional<ModelInferRequest> fast =
          ParseFast(model_name, model_version, *body, header_length, body)) {
    return *std::move(fast);
  }
  return Parse(model_name, model_version, *body, header_length, body);
}

absl::StatusOr<HttpBody> EncodeInferResponse(const ModelInferRequest& request,
                                             const ModelInferResponse& response) {
  if (std::optional<HttpBody> fast = EncodeFast(request, response, /*split=*/false)) {
    return *std::move(fast);
  }
  return http_codec_internal::EncodeGeneral(request, response, /*split=*/false);
}

absl::StatusOr<HttpBody> EncodeInferResponseHead(const ModelInferRequest& request,
                                                 const ModelInferResponse& response) {
  if (std::optional<HttpBody> fast = EncodeFast(request, response, /*split=*/true)) {
    return *std::move(fast);
  }
  return http_codec_internal::EncodeGeneral(request, response, /*split=*/true);
}

namespace http_codec_internal {

absl::StatusOr<ModelInferRequest> ParseGeneral(absl::string_view model_name,
                                               absl::string_view model_version,
                                               absl::string_view body,
                                               std::optional<int64_t> header_length) {
  return Parse(model_name, model_version, body, header_length, nullptr);
}

std::optional<ModelInferRequest> ParseFast(absl::string_view model_name,
                                           absl::string_view model_version, absl::string_view body,
                                           std::optional<int64_t> header_length) {
  return ::mha::server::ParseFast(model_name, model_version, body, header_length, nullptr);
}

absl::StatusOr<HttpBody> EncodeGeneral(const ModelInferRequest& request,
                                       const ModelInferResponse& response, bool split) {
  try {
    return Encode(request, response, split);
  } catch (const Json::exception& e) {
    return absl::InternalError(absl::StrCat("response: ", e.what()));
  }
}

std::optional<HttpBody> EncodeFast(const ModelInferRequest& request,
                                   const ModelInferResponse& response, bool split) {
  return ::mha::server::EncodeFast(request, response, split);
}

}  // namespace http_codec_internal

absl::StatusOr<RepositoryBody> ParseRepositoryBody(absl::string_view body) {
  RepositoryBody out;
  if (body.empty()) return out;
  MHA_ASSIGN_OR_RETURN(const Json json, ParseJson(body));
  if (!json.is_object()) {
    return absl::InvalidArgumentError("request body: expected a JSON object, or nothing");
  }
  if (const auto ready = json.find("ready"); ready != json.end()) {
    if (!ready->is_boolean()) return absl::InvalidArgumentError("ready: expected true or false");
    out.ready = ready->get<bool>();
  }
  if (const auto parameters = json.find("parameters"); parameters != json.end()) {
    if (!parameters->is_object()) {
      return absl::InvalidArgumentError("parameters: expected an object");
    }
    for (const auto& [name, value] : parameters->items()) {
      out.parameters.push_back({.name = name, .is_bool = value.is_boolean()});
    }
  }
  return out;
}

namespace {

OrderedJson DurationJson(const inference::StatisticDuration& d) {
  OrderedJson out = OrderedJson::object();
  out["count"] = d.count();
  out["ns"] = d.ns();
  return out;
}

}  // namespace

std::string StatisticsBody(const inference::ModelStatisticsResponse& statistics) {
  OrderedJson models = OrderedJson::array();
  for (const inference::ModelStatistics& m : statistics.model_stats()) {
    OrderedJson model = OrderedJson::object();
    model["name"] = m.name();
    model["version"] = m.version();
    model["last_inference"] = m.last_inference();
    model["inference_count"] = m.inference_count();
    model["execution_count"] = m.execution_count();
    const inference::InferStatistics& i = m.inference_stats();
    OrderedJson stats = OrderedJson::object();
    stats["success"] = DurationJson(i.success());
    stats["fail"] = DurationJson(i.fail());
    stats["queue"] = DurationJson(i.queue());
    stats["compute_input"] = DurationJson(i.compute_input());
    stats["compute_infer"] = DurationJson(i.compute_infer());
    stats["compute_output"] = DurationJson(i.compute_output());
    stats["cache_hit"] = DurationJson(i.cache_hit());
    stats["cache_miss"] = DurationJson(i.cache_miss());
    model["inference_stats"] = std::move(stats);
    OrderedJson batches = OrderedJson::array();
    for (const inference::InferBatchStatistics& b : m.batch_stats()) {
      OrderedJson batch = OrderedJson::object();
      batch["batch_size"] = b.batch_size();
      batch["compute_input"] = DurationJson(b.compute_input());
      batch["compute_infer"] = DurationJson(b.compute_infer());
      batch["compute_output"] = DurationJson(b.compute_output());
      batches.push_back(std::move(batch));
    }
    model["batch_stats"] = std::move(batches);
    models.push_back(std::move(model));
  }
  OrderedJson root = OrderedJson::object();
  root["model_stats"] = std::move(models);
  return root.dump(-1, ' ', false, OrderedJson::error_handler_t::replace);
}

std::string ErrorBody(absl::string_view message) {
  return Dump(Json{{"error", CapMessage(message)}});
}

}  // namespace mha::server

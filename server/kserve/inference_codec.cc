#include "server/kserve/inference_codec.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"
#include "server/serving/abbreviate.h"

namespace mha::server {
namespace {

using inference::InferParameter;
using inference::ModelInferRequest;
using inference::ModelInferResponse;
using InputTensor = inference::ModelInferRequest::InferInputTensor;
using ParameterMap = google::protobuf::Map<std::string, InferParameter>;

constexpr char kRegion[] = "shared_memory_region";
constexpr char kByteSize[] = "shared_memory_byte_size";
constexpr char kOffset[] = "shared_memory_offset";

enum class Input { kQueries, kKeys, kValues, kValidLens, kHeadMask };
constexpr const char* kInputNames[] = {"queries", "keys", "values", "valid_lens", "head_mask"};
constexpr int kNumInputs = 5;

std::optional<Input> InputNamed(absl::string_view name) {
  for (int i = 0; i < kNumInputs; ++i) {
    if (name == kInputNames[i]) return static_cast<Input>(i);
  }
  return std::nullopt;
}

// "inputs[1] ("keys")": how messages name an input.
std::string Field(int index, absl::string_view name) {
  return absl::StrCat("inputs[", index, "] (\"", Abbreviate(name), "\")");
}

int ElementBytes(absl::string_view datatype) {
  if (datatype == "FP32" || datatype == "INT32") return 4;
  if (datatype == "FP16" || datatype == "BF16") return 2;
  if (datatype == "INT64") return 8;
  return 0;
}

// Where a tensor is in shared memory: its region (held), offset and byte_size.
struct SharedMemoryRef {
  std::shared_ptr<const SharedMemoryRegion> region;
  uint64_t offset = 0;
  uint64_t byte_size = 0;
};

struct Parsed {
  const InputTensor* tensor[kNumInputs] = {};
  int index[kNumInputs] = {};
  int64_t elements[kNumInputs] = {};
  // The bytes of a raw_input_contents entry, or of a shared-memory input's range in
  // its region's mapping; nullptr for typed contents.
  const char* raw[kNumInputs] = {};
  std::optional<SharedMemoryRef> shm[kNumInputs];
};

bool NamesSharedMemory(const ParameterMap& parameters) {
  return parameters.contains(kRegion) || parameters.contains(kByteSize) ||
         parameters.contains(kOffset);
}

absl::StatusOr<uint64_t> UnsignedParameter(const InferParameter& value, const std::string& field) {
  if (value.parameter_choice_case() == InferParameter::kUint64Param) return value.uint64_param();
  if (value.parameter_choice_case() == InferParameter::kInt64Param && value.int64_param() >= 0) {
    return static_cast<uint64_t>(value.int64_param());
  }
  return absl::InvalidArgumentError(absl::StrCat(field, ": expected an integer >= 0"));
}

// A tensor's shared-memory parameters (nullopt when it has none), its region found
// in the current registry and its range checked against the region.
absl::StatusOr<std::optional<SharedMemoryRef>> ParseSharedMemory(const ParameterMap& parameters,
                                                                 const std::string& field) {
  if (!NamesSharedMemory(parameters)) return std::nullopt;
  const std::string prefix = absl::StrCat(field, ".parameters.");
  const auto region = parameters.find(kRegion);
  if (region == parameters.end()) {
    return absl::InvalidArgumentError(absl::StrCat(prefix, kRegion, ": required with ", kByteSize,
                                                   " and ", kOffset,
                                                   " (Triton's system shared memory)"));
  }
  if (region->second.parameter_choice_case() != InferParameter::kStringParam ||
      region->second.string_param().empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(prefix, kRegion, ": expected a registered region's name (a string)"));
  }
  const std::string& name = region->second.string_param();
  const auto size = parameters.find(kByteSize);
  if (size == parameters.end()) {
    return absl::InvalidArgumentError(absl::StrCat(prefix, kByteSize, ": required with ", kRegion));
  }
  SharedMemoryRef ref;
  MHA_ASSIGN_OR_RETURN(ref.byte_size, UnsignedParameter(size->second, prefix + kByteSize));
  if (const auto offset = parameters.find(kOffset); offset != parameters.end()) {
    MHA_ASSIGN_OR_RETURN(ref.offset, UnsignedParameter(offset->second, prefix + kOffset));
  }
  const SharedMemoryRegistry* registry = CurrentSharedMemory();
  if (registry == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(prefix, kRegion, " \"", Abbreviate(name),
                     "\": this server has no system shared memory (attention_server "
                     "--shared_memory=system turns it on); send the tensor in the request"));
  }
  absl::StatusOr<std::shared_ptr<const SharedMemoryRegion>> found = registry->Find(name);
  if (!found.ok()) {
    return absl::NotFoundError(absl::StrCat(prefix, kRegion, ": ", found.status().message()));
  }
  ref.region = *std::move(found);
  const uint64_t region_bytes = ref.region->spec().byte_size;
  if (!RangeFits(ref.offset, ref.byte_size, region_bytes)) {
    return absl::InvalidArgumentError(absl::StrCat(
        prefix, kOffset, " ", ref.offset, " + ", kByteSize, " ", ref.byte_size, " is beyond the ",
        region_bytes, " bytes of shared memory region \"", Abbreviate(name), "\""));
  }
  return ref;
}

absl::StatusOr<int64_t> CountElements(const InputTensor& input, const std::string& field) {
  int64_t elements = 1;
  for (int64_t dim : input.shape()) {
    if (dim < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ": every dimension must be >= 0, got shape ", ShapeString(input.shape())));
    }
    if (__builtin_mul_overflow(elements, dim, &elements) || elements > (int64_t{1} << 40)) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": shape ", ShapeString(input.shape()), " is too large"));
    }
  }
  return elements;
}

absl::Status CheckDatatype(Input which, const InputTensor& input, const std::string& field) {
  const std::string& type = input.datatype();
  const bool is_float = type == "FP32" || type == "FP16" || type == "BF16";
  if (which == Input::kValidLens) {
    if (type == "INT32" || type == "INT64") return absl::OkStatus();
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": expected datatype INT32 or INT64, got ", Abbreviate(type)));
  }
  if (is_float) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": expected datatype FP32, FP16 or BF16, got ", Abbreviate(type)));
}

// raw_input_contents: none, or one entry per input not in shared memory.
absl::Status CheckRawCount(const ModelInferRequest& request) {
  if (request.raw_input_contents_size() == 0) return absl::OkStatus();
  int inline_inputs = 0;  // raw_input_contents is indexed over these only
  for (const InputTensor& input : request.inputs()) {
    if (!NamesSharedMemory(input.parameters())) ++inline_inputs;
  }
  if (request.raw_input_contents_size() == inline_inputs) return absl::OkStatus();
  if (inline_inputs == request.inputs_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("raw_input_contents: ", request.raw_input_contents_size(), " entries for ",
                     request.inputs_size(), " inputs; give one per input, in the order of inputs"));
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "raw_input_contents: ", request.raw_input_contents_size(), " entries for ", inline_inputs,
      " inputs not in shared memory; give one per such input, in the order of "
      "inputs (shared-memory inputs have none)"));
}

// Typed contents (no raw_input_contents): `elements` values in the datatype's field.
absl::Status CheckContents(const InputTensor& input, const std::string& field, int64_t elements) {
  const inference::InferTensorContents& c = input.contents();
  const std::string& type = input.datatype();
  int64_t given = 0;
  if (type == "FP32") {
    given = c.fp32_contents_size();
  } else if (type == "INT32") {
    given = c.int_contents_size();
  } else if (type == "INT64") {
    given = c.int64_contents_size();
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": ", type,
                     " values must come in raw_input_contents (typed contents have "
                     "no 16-bit field)"));
  }
  if (given != elements) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": shape ", ShapeString(input.shape()),
                                                   " needs ", elements, " values, contents has ",
                                                   given));
  }
  return absl::OkStatus();
}

// Where inputs[i] (input w, of `elements` values) has its values: a shared-memory
// region, the next raw_input_contents entry (*raw_index), or its typed contents.
absl::Status LocateValues(const ModelInferRequest& request, int i, int w, const std::string& field,
                          int64_t elements, int* raw_index, Parsed& parsed) {
  const InputTensor& input = request.inputs(i);
  MHA_ASSIGN_OR_RETURN(std::optional<SharedMemoryRef> shm,
                       ParseSharedMemory(input.parameters(), field));
  if (shm.has_value()) {
    if (input.has_contents()) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ": has contents and parameters.shared_memory_region; use one or the other"));
    }
    const uint64_t bytes =
        static_cast<uint64_t>(elements) * static_cast<uint64_t>(ElementBytes(input.datatype()));
    if (shm->byte_size != bytes) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".parameters.", kByteSize, ": shape ", ShapeString(input.shape()),
                       " of ", input.datatype(), " is ", bytes, " bytes, got ", shm->byte_size));
    }
    parsed.shm[w] = *std::move(shm);
    return absl::OkStatus();
  }
  if (request.raw_input_contents_size() == 0) return CheckContents(input, field, elements);
  if (input.has_contents()) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": has contents while raw_input_contents is set; use one or the other"));
  }
  const int64_t bytes = elements * ElementBytes(input.datatype());
  const int entry = (*raw_index)++;
  const std::string& data = request.raw_input_contents(entry);
  if (static_cast<int64_t>(data.size()) != bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": shape ", ShapeString(input.shape()), " of ", input.datatype(), " needs ", bytes,
        " bytes, raw_input_contents[", entry, "] has ", data.size()));
  }
  parsed.raw[w] = data.data();
  return absl::OkStatus();
}

// Names, datatypes, counts and where each input's values are.
absl::StatusOr<Parsed> ParseInputs(const ModelInferRequest& request) {
  Parsed parsed;
  MHA_RETURN_IF_ERROR(CheckRawCount(request));
  int raw_index = 0;
  for (int i = 0; i < request.inputs_size(); ++i) {
    const InputTensor& input = request.inputs(i);
    const std::string field = Field(i, input.name());
    const std::optional<Input> which = InputNamed(input.name());
    if (!which.has_value()) {
      return absl::InvalidArgumentError(
          absl::StrCat(field,
                       ": unknown input; expected queries, keys, values, valid_lens or "
                       "head_mask"));
    }
    const int w = static_cast<int>(*which);
    if (parsed.tensor[w] != nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": given twice (also inputs[", parsed.index[w], "])"));
    }
    MHA_RETURN_IF_ERROR(CheckDatatype(*which, input, field));
    MHA_ASSIGN_OR_RETURN(const int64_t elements, CountElements(input, field));
    MHA_RETURN_IF_ERROR(LocateValues(request, i, w, field, elements, &raw_index, parsed));
    parsed.tensor[w] = &input;
    parsed.index[w] = i;
    parsed.elements[w] = elements;
  }
  return parsed;
}

// An FP32, FP16 or BF16 input as f32 values, converted into `storage` unless it
// can be read in place.
TensorView FloatView(const Parsed& parsed, Input which, std::vector<float>* storage) {
  const int w = static_cast<int>(which);
  const InputTensor& input = *parsed.tensor[w];
  const int64_t n = parsed.elements[w];
  TensorView view{.shape = absl::MakeConstSpan(input.shape().data(), input.shape_size()),
                  .size = n};
  if (parsed.raw[w] == nullptr) {
    view.data = input.contents().fp32_contents().data();
    return view;
  }
  const char* bytes = parsed.raw[w];
  if (input.datatype() == "FP32" && reinterpret_cast<uintptr_t>(bytes) % alignof(float) == 0) {
    view.data = reinterpret_cast<const float*>(bytes);
    return view;
  }
  storage->resize(static_cast<size_t>(n));
  if (input.datatype() == "FP32") {
    std::memcpy(storage->data(), bytes, static_cast<size_t>(n) * sizeof(float));
  } else {
    const bool bf16 = input.datatype() == "BF16";
    for (int64_t i = 0; i < n; ++i) {
      uint16_t h;
      std::memcpy(&h, bytes + 2 * i, sizeof(h));
      (*storage)[i] = bf16 ? std::bit_cast<float>(static_cast<uint32_t>(h) << 16) : HalfToFloat(h);
    }
  }
  view.data = storage->data();
  return view;
}

absl::Status DecodeValidLens(const Parsed& parsed, std::vector<int32_t>* out) {
  const int w = static_cast<int>(Input::kValidLens);
  const InputTensor& input = *parsed.tensor[w];
  const std::string field = Field(parsed.index[w], input.name());
  if (input.shape_size() != 1 && input.shape_size() != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": expected shape [B] or [B, Q], got ", ShapeString(input.shape())));
  }
  const int64_t n = parsed.elements[w];
  out->resize(static_cast<size_t>(n));
  const bool int64 = input.datatype() == "INT64";
  for (int64_t i = 0; i < n; ++i) {
    int64_t value;
    if (parsed.raw[w] != nullptr) {
      const char* at = parsed.raw[w] + i * (int64 ? 8 : 4);
      if (int64) {
        std::memcpy(&value, at, sizeof(value));
      } else {
        int32_t v32;
        std::memcpy(&v32, at, sizeof(v32));
        value = v32;
      }
    } else {
      value = int64 ? input.contents().int64_contents(static_cast<int>(i))
                    : input.contents().int_contents(static_cast<int>(i));
    }
    if (value < 0 || value > std::numeric_limits<int32_t>::max()) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": value ", value, " at index ", i, " is out of range [0, K]"));
    }
    (*out)[i] = static_cast<int32_t>(value);
  }
  return absl::OkStatus();
}

absl::Status DecodeParameters(const ModelInferRequest& request, bool* causal,
                              InferDecoded* decoded) {
  for (const auto& [name, value] : request.parameters()) {
    if (name == "causal") {
      if (value.parameter_choice_case() != InferParameter::kBoolParam) {
        return absl::InvalidArgumentError("parameters.causal: expected a bool");
      }
      *causal = value.bool_param();
    } else if (name == "timeout") {
      int64_t us = -1;
      if (value.parameter_choice_case() == InferParameter::kInt64Param) us = value.int64_param();
      if (value.parameter_choice_case() == InferParameter::kUint64Param) {
        us = static_cast<int64_t>(
            std::min<uint64_t>(value.uint64_param(), std::numeric_limits<int64_t>::max()));
      }
      if (us < 0) {
        return absl::InvalidArgumentError(
            "parameters.timeout: expected an integer >= 0 (microseconds)");
      }
      decoded->timeout = absl::Microseconds(us);
    }
  }
  return absl::OkStatus();
}

absl::Status DecodeOutputs(const ModelInferRequest& request, InferDecoded* decoded) {
  bool want_output = false;
  for (int i = 0; i < request.outputs_size(); ++i) {
    const std::string& name = request.outputs(i).name();
    bool* seen = name == "output"      ? &want_output
                 : name == "attention" ? &decoded->want_attention
                 : name == "lse"       ? &decoded->want_lse
                                       : nullptr;
    if (seen == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("outputs[", i, "] (\"", Abbreviate(name),
                                                     "\"): unknown output; expected output, "
                                                     "attention or lse"));
    }
    if (*seen) {
      return absl::InvalidArgumentError(
          absl::StrCat("outputs[", i, "] (\"", name, "\"): requested twice"));
    }
    *seen = true;
    decoded->order.push_back(name);
    const std::string field = absl::StrCat("outputs[", i, "] (\"", name, "\")");
    MHA_ASSIGN_OR_RETURN(std::optional<SharedMemoryRef> shm,
                         ParseSharedMemory(request.outputs(i).parameters(), field));
    if (shm.has_value()) {
      decoded->shared_memory_outputs.push_back(SharedMemoryOutput{.name = name,
                                                                  .field = field,
                                                                  .region = std::move(shm->region),
                                                                  .offset = shm->offset,
                                                                  .byte_size = shm->byte_size});
    }
  }
  if (!want_output) decoded->order.push_back("output");
  return absl::OkStatus();
}

void AddOutput(const char* name, std::initializer_list<int64_t> shape, int64_t elements,
               const ModelInferRequest& request, const InferDecoded& decoded,
               ModelInferResponse* response, float** view) {
  ModelInferResponse::InferOutputTensor* out = response->add_outputs();
  out->set_name(name);
  out->set_datatype("FP32");
  for (int64_t d : shape) out->add_shape(d);
  std::string* bytes = response->add_raw_output_contents();
  for (const SharedMemoryOutput& shm : decoded.shared_memory_outputs) {
    if (shm.name != name) continue;
    // Written into the region once computed; the response names where (Triton's).
    for (const auto& requested : request.outputs()) {
      if (requested.name() != name) continue;
      for (const char* key : {kRegion, kByteSize, kOffset}) {
        if (const auto it = requested.parameters().find(key); it != requested.parameters().end()) {
          (*out->mutable_parameters())[key] = it->second;
        }
      }
    }
    *view = shm.in_place != nullptr ? shm.in_place : shm.values->data();
    return;
  }
  bytes->resize(static_cast<size_t>(elements) * sizeof(float));
  *view = reinterpret_cast<float*>(bytes->data());
}

struct ByteRange {
  std::string what;  // inputs[0] ("queries") or outputs[1] ("attention")
  const SharedMemoryRegion* region;
  uint64_t start;  // in the region's file
  uint64_t bytes;
};

std::string Describe(const ByteRange& r) {
  return absl::StrCat(r.what, " (region \"", Abbreviate(r.region->spec().name), "\", bytes [",
                      r.start, ", ", r.start + r.bytes, ") of key \"",
                      Abbreviate(r.region->spec().key), "\")");
}

absl::Status NamedRegionError(const std::string& field, const absl::Status& status) {
  return absl::Status(status.code(),
                      absl::StrCat(field, ".parameters.", kRegion, ": ", status.message()));
}

// The region's CheckNoFaultSince(seen), the error naming `field`.
absl::Status CheckNoFault(const std::string& field, const SharedMemoryRegion& region,
                          uint64_t seen) {
  if (absl::Status ok = region.CheckNoFaultSince(seen); !ok.ok()) {
    return NamedRegionError(field, ok);
  }
  return absl::OkStatus();
}

// CheckIntact for `region` unless `checked` has it; the error names `field`.
absl::Status CheckIntactOnce(const SharedMemoryRegion& region, const std::string& field,
                             std::vector<const SharedMemoryRegion*>* checked) {
  if (std::find(checked->begin(), checked->end(), &region) != checked->end()) {
    return absl::OkStatus();
  }
  checked->push_back(&region);
  if (absl::Status intact = region.CheckIntact(); !intact.ok()) {
    return NamedRegionError(field, intact);
  }
  return absl::OkStatus();
}

// Sizes the shared-memory outputs now that their shapes are known, and refuses an
// output range sharing a byte of a file with an input's or another output's.
absl::Status CheckSharedMemoryOutputs(const Parsed& parsed, const ValidatedRequest& validated,
                                      InferDecoded* decoded) {
  std::vector<ByteRange> inputs, outputs;
  for (int w = 0; w < kNumInputs; ++w) {
    if (!parsed.shm[w].has_value()) continue;
    const SharedMemoryRef& ref = *parsed.shm[w];
    inputs.push_back({Field(parsed.index[w], kInputNames[w]), ref.region.get(),
                      ref.region->spec().offset + ref.offset, ref.byte_size});
  }
  for (SharedMemoryOutput& out : decoded->shared_memory_outputs) {
    const int64_t elements = out.name == "attention" ? validated.attention_elements()
                             : out.name == "lse"     ? validated.lse_elements()
                                                     : validated.output_elements();
    const uint64_t bytes = static_cast<uint64_t>(elements) * sizeof(float);
    if (out.byte_size < bytes) {
      return absl::InvalidArgumentError(absl::StrCat(out.field, ".parameters.", kByteSize, ": ",
                                                     out.byte_size, " bytes, but the output is ",
                                                     bytes, " bytes (", elements, " FP32 values)"));
    }
    char* at = out.region->data() + out.offset;
    if (reinterpret_cast<uintptr_t>(at) % alignof(float) == 0) {
      out.in_place = reinterpret_cast<float*>(at);
    } else {
      out.values = std::make_shared<std::vector<float>>(static_cast<size_t>(elements));
    }
    outputs.push_back({out.field, out.region.get(), out.region->spec().offset + out.offset, bytes});
  }
  for (size_t o = 0; o < outputs.size(); ++o) {
    const ByteRange& out = outputs[o];
    auto clash = [&out](const ByteRange& other) {
      return out.region->device() == other.region->device() &&
             out.region->inode() == other.region->inode() &&
             RangesOverlap(out.start, out.bytes, other.start, other.bytes);
    };
    for (const ByteRange& in : inputs) {
      if (clash(in)) {
        return absl::InvalidArgumentError(
            absl::StrCat(Describe(out), " overlaps ", Describe(in),
                         "; an output's shared memory must not overlap an input's"));
      }
    }
    for (size_t p = 0; p < o; ++p) {
      if (clash(outputs[p])) {
        return absl::InvalidArgumentError(
            absl::StrCat(Describe(out), " overlaps ", Describe(outputs[p]),
                         "; outputs' shared memory must not overlap"));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

std::function<absl::Status()> FinishSharedMemory(const InferDecoded& decoded) {
  if (decoded.shared_memory_outputs.empty() && decoded.shared_memory_inputs.empty()) {
    return nullptr;
  }
  return [outputs = decoded.shared_memory_outputs,
          inputs = decoded.shared_memory_inputs]() -> absl::Status {
    for (const SharedMemoryOutput& out : outputs) {
      if (out.in_place != nullptr) continue;
      absl::Status written =
          out.region->Write(out.offset, out.values->data(), out.values->size() * sizeof(float));
      if (!written.ok()) return NamedRegionError(out.field, written);
    }
    // A fault while the request read or wrote a region (the client truncated it):
    // what it computed or wrote is not the answer.
    for (const SharedMemoryInput& in : inputs) {
      MHA_RETURN_IF_ERROR(CheckNoFault(in.field, *in.region, in.faults_seen));
    }
    for (const SharedMemoryOutput& out : outputs) {
      MHA_RETURN_IF_ERROR(CheckNoFault(out.field, *out.region, out.faults_seen));
    }
    return absl::OkStatus();
  };
}

float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exponent = (h >> 10) & 0x1f;
  uint32_t mantissa = h & 0x3ff;
  if (exponent == 0x1f) return std::bit_cast<float>(sign | 0x7f800000 | (mantissa << 13));
  if (exponent != 0) {
    return std::bit_cast<float>(sign | ((exponent + 112) << 23) | (mantissa << 13));
  }
  if (mantissa == 0) return std::bit_cast<float>(sign);
  const float magnitude = std::ldexp(static_cast<float>(mantissa), -24);  // subnormal
  return sign != 0 ? -magnitude : magnitude;
}

absl::StatusOr<ValidatedRequest> DecodeInferRequest(const ModelInferRequest& request,
                                                    const Model& model, InferDecoded* decoded) {
  bool causal = false;
  MHA_RETURN_IF_ERROR(DecodeParameters(request, &causal, decoded));
  MHA_RETURN_IF_ERROR(DecodeOutputs(request, decoded));
  if (decoded->want_lse && !model.config.attention_only()) {
    return absl::InvalidArgumentError(
        absl::StrCat("outputs (\"lse\"): return_lse: model ", model.name,
                     " has projections FULL; the lse output is for attention-only models "
                     "(projections NONE)"));
  }
  MHA_ASSIGN_OR_RETURN(Parsed parsed, ParseInputs(request));
  int64_t request_bytes = static_cast<int64_t>(request.ByteSizeLong());
  // The bytes read from shared memory count in the request's size (a merged call
  // copies them).
  for (int w = 0; w < kNumInputs; ++w) {
    if (parsed.shm[w].has_value()) {
      request_bytes += static_cast<int64_t>(std::min<uint64_t>(
          parsed.shm[w]->byte_size, uint64_t{1} << 50));  // elements <= 2^40, bytes <= 8
    }
  }
  MHA_RETURN_IF_ERROR(CheckRequestBytes(request_bytes, model));
  std::vector<const SharedMemoryRegion*> intact;  // each region's file checked once
  for (int w = 0; w < kNumInputs; ++w) {          // read in place, as raw
    if (!parsed.shm[w].has_value()) continue;
    SharedMemoryRef& ref = *parsed.shm[w];
    std::string field = Field(parsed.index[w], kInputNames[w]);
    MHA_RETURN_IF_ERROR(CheckIntactOnce(*ref.region, field, &intact));
    parsed.raw[w] = ref.region->data() + ref.offset;
    decoded->shared_memory_inputs.push_back({std::move(field), ref.region, ref.region->faults()});
  }
  RequestView view{.bytes = request_bytes,
                   .causal = causal,
                   .return_attention = decoded->want_attention,
                   .return_lse = decoded->want_lse};
  auto present = [&parsed](Input which) { return parsed.tensor[static_cast<int>(which)]; };
  if (present(Input::kQueries))
    view.queries = FloatView(parsed, Input::kQueries, &decoded->queries);
  if (present(Input::kKeys)) view.keys = FloatView(parsed, Input::kKeys, &decoded->keys);
  if (present(Input::kValues)) view.values = FloatView(parsed, Input::kValues, &decoded->values);
  if (const InputTensor* mask = present(Input::kHeadMask)) {
    if (mask->shape_size() != 1) {
      return absl::InvalidArgumentError(
          absl::StrCat(Field(parsed.index[static_cast<int>(Input::kHeadMask)], mask->name()),
                       ": expected shape [h], got ", ShapeString(mask->shape())));
    }
    const TensorView m = FloatView(parsed, Input::kHeadMask, &decoded->head_mask);
    view.head_mask = absl::MakeConstSpan(m.data, static_cast<size_t>(m.size));
  }
  if (present(Input::kValidLens)) {
    MHA_RETURN_IF_ERROR(DecodeValidLens(parsed, &decoded->valid_lens));
    view.valid_lens = decoded->valid_lens;
  }
  MHA_ASSIGN_OR_RETURN(ValidatedRequest validated, Validate(view, model));
  // The core reads B or B*Q lengths by count; the shape must say which.
  if (const InputTensor* lens = present(Input::kValidLens)) {
    const int64_t b = validated.inputs.batch, q = validated.inputs.num_queries;
    const bool per_row = lens->shape_size() == 1 && lens->shape(0) == b;
    const bool per_query = lens->shape_size() == 2 && lens->shape(0) == b && lens->shape(1) == q;
    if (!per_row && !per_query) {
      return absl::InvalidArgumentError(absl::StrCat(
          Field(parsed.index[static_cast<int>(Input::kValidLens)], lens->name()),
          ": expected shape [", b, "] or [", b, ", ", q, "], got ", ShapeString(lens->shape())));
    }
  }
  for (SharedMemoryOutput& out : decoded->shared_memory_outputs) {
    MHA_RETURN_IF_ERROR(CheckIntactOnce(*out.region, out.field, &intact));
    out.faults_seen = out.region->faults();
  }
  MHA_RETURN_IF_ERROR(CheckSharedMemoryOutputs(parsed, validated, decoded));
  // A fault while the values were checked (the file truncated meanwhile).
  for (const SharedMemoryInput& in : decoded->shared_memory_inputs) {
    MHA_RETURN_IF_ERROR(CheckNoFault(in.field, *in.region, in.faults_seen));
  }
  return validated;
}

OutputViews PrepareInferResponse(const ModelInferRequest& request,
                                 const ValidatedRequest& validated, const InferDecoded& decoded,
                                 ModelInferResponse* response) {
  response->set_model_name(validated.model->name);
  response->set_model_version(absl::StrCat(validated.model->version));
  response->set_id(request.id());
  const core::AttentionInputs& in = validated.inputs;
  const core::ModelConfig& c = validated.model->config;
  OutputViews views;
  for (const std::string& name : decoded.order) {
    if (name == "attention") {
      AddOutput("attention", {in.batch, c.num_heads, in.num_queries, in.num_keys},
                validated.attention_elements(), request, decoded, response, &views.attention);
    } else if (name == "lse") {
      AddOutput("lse", {in.batch, c.num_heads, in.num_queries}, validated.lse_elements(), request,
                decoded, response, &views.lse);
    } else {
      AddOutput("output", {in.batch, in.num_queries, c.num_hiddens}, validated.output_elements(),
                request, decoded, response, &views.output);
    }
  }
  return views;
}

}  // namespace mha::server

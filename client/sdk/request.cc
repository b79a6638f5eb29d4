#include "client/sdk/request.h"

#include <algorithm>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/types/span.h"
#include "base/splitmix64.h"
#include "client/sdk/status.h"
#include "client/sdk/tensor_io.h"

namespace mha::client {
namespace {

using attention::v1::AttendRequest;
using attention::v1::ModelInfo;
using attention::v1::Tensor;

absl::Status ToTensor(const Array& array, absl::string_view what, Tensor* tensor) {
  if (array.shape.size() != 3) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": expected rank 3, got shape (",
                                                   absl::StrJoin(array.shape, ", "), ")"));
  }
  tensor->Clear();
  for (int64_t d : array.shape) tensor->add_shape(d);
  tensor->mutable_data()->Reserve(static_cast<int>(array.values.size()));
  for (double v : array.values) tensor->add_data(static_cast<float>(v));
  return absl::OkStatus();
}

absl::Status ReadInputs(const std::vector<std::string>& files, AttendRequest* request) {
  if (files.size() == 1 && absl::EndsWith(files[0], ".safetensors")) {
    MHA_ASSIGN_OR_RETURN(auto tensors, ReadSafetensors(files[0]));
    auto get = [&](const char* name) {
      auto it = tensors.find(name);
      return it == tensors.end() ? nullptr : &it->second;
    };
    const Array* queries = get("queries");
    if (queries == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(files[0], ": no tensor named \"queries\""));
    }
    MHA_RETURN_IF_ERROR(
        ToTensor(*queries, absl::StrCat(files[0], ": queries"), request->mutable_queries()));
    const Array* keys = get("keys");
    const Array* values = get("values");
    if ((keys == nullptr) != (values == nullptr)) {
      return absl::InvalidArgumentError(
          absl::StrCat(files[0], ": \"keys\" and \"values\" go together (or neither)"));
    }
    if (keys != nullptr) {
      MHA_RETURN_IF_ERROR(
          ToTensor(*keys, absl::StrCat(files[0], ": keys"), request->mutable_keys()));
      MHA_RETURN_IF_ERROR(
          ToTensor(*values, absl::StrCat(files[0], ": values"), request->mutable_values()));
    }
    if (const Array* lens = get("valid_lens")) {
      request->clear_valid_lens();
      for (double v : lens->values) request->add_valid_lens(static_cast<int32_t>(v));
    }
    return absl::OkStatus();
  }
  if (files.size() != 1 && files.size() != 3) {
    return UsageError(
        "--input: one .safetensors file, or one .npy (queries) or three (queries, keys, values)");
  }
  Tensor* targets[] = {request->mutable_queries(), request->mutable_keys(),
                       request->mutable_values()};
  const char* names[] = {"queries", "keys", "values"};
  for (size_t i = 0; i < files.size(); ++i) {
    MHA_ASSIGN_OR_RETURN(Array array, ReadNpy(files[i]));
    MHA_RETURN_IF_ERROR(ToTensor(array, absl::StrCat(files[i], " (", names[i], ")"), targets[i]));
  }
  if (files.size() == 1) {
    request->clear_keys();
    request->clear_values();
  }
  return absl::OkStatus();
}

absl::Status CheckFeatures(const Tensor& tensor, absl::string_view name, int64_t expected,
                           absl::string_view size_name) {
  if (tensor.shape(2) != expected) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": feature size ", tensor.shape(2),
                                                   " but the model has ", size_name, " = ",
                                                   expected, " (shape ", ShapeString(tensor), ")"));
  }
  return absl::OkStatus();
}

// B or B*Q lengths, or none: INVALID_ARGUMENT naming --valid_lens otherwise.
absl::Status CheckValidLensCount(absl::Span<const int32_t> lens, int64_t batch,
                                 int64_t num_queries) {
  const int64_t count = static_cast<int64_t>(lens.size());
  if (count == 0 || count == batch || count == batch * num_queries) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "--valid_lens: ", count, " entries (", absl::StrJoin(lens, ","), ") for batch ", batch,
      ": give B = ", batch, " or B*Q = ", batch * num_queries, " entries, or --valid_lens=none"));
}

}  // namespace

void FillSigned(SplitMix64& inputs, const std::vector<int64_t>& shape, Tensor* tensor) {
  int64_t n = 1;
  for (int64_t d : shape) {
    tensor->add_shape(d);
    n *= d;
  }
  tensor->mutable_data()->Reserve(static_cast<int>(n));
  for (int64_t i = 0; i < n; ++i) tensor->add_data(inputs.Signed());
}

absl::Status CheckRequestOptions(const RequestOptions& options) {
  MHA_RETURN_IF_ERROR(CheckAtLeast("batch", options.batch, 1));
  MHA_RETURN_IF_ERROR(CheckAtLeast("num_queries", options.num_queries, 1));
  MHA_RETURN_IF_ERROR(CheckAtLeast("num_keys", options.num_keys, 0));
  if (!options.input_files.empty()) return absl::OkStatus();  // B and Q come from the files
  const absl::Status lens =
      CheckValidLensCount(options.valid_lens, options.batch, options.num_queries);
  return lens.ok() ? lens : UsageError(lens.message());
}

std::string ShapeString(const Tensor& tensor) {
  return absl::StrCat("(", absl::StrJoin(tensor.shape(), ", "), ")");
}

int64_t TokenCount(const AttendRequest& request) {
  const Tensor& q = request.queries();
  return q.shape_size() == 3 ? q.shape(0) * q.shape(1) : 0;
}

bool IsMasked(const AttendRequest& request, int64_t b, int64_t q, int64_t j) {
  if (request.causal() && j > q) return true;
  const int64_t num_queries = request.queries().shape(1);
  const int64_t batch = request.queries().shape(0);
  if (request.valid_lens_size() == batch) return j >= request.valid_lens(static_cast<int>(b));
  if (request.valid_lens_size() == batch * num_queries) {
    return j >= request.valid_lens(static_cast<int>(b * num_queries + q));
  }
  return false;
}

absl::StatusOr<AttendRequest> MakeRequest(const RequestOptions& options, const ModelInfo& model) {
  AttendRequest request;
  // The model GetModel resolved when --model is empty (kserve and http have no
  // default model on the server).
  request.set_model(options.model.empty() ? model.name() : options.model);
  request.set_model_version(options.model_version);
  request.set_causal(options.causal);
  request.set_return_attention(options.return_attention);
  for (int32_t len : options.valid_lens) request.add_valid_lens(len);

  MHA_RETURN_IF_ERROR(CheckRequestOptions(options));
  if (!options.input_files.empty()) {
    MHA_RETURN_IF_ERROR(ReadInputs(options.input_files, &request));
  } else {
    SplitMix64 inputs(options.seed);
    FillSigned(inputs, {options.batch, options.num_queries, model.query_size()},
               request.mutable_queries());
    if (options.num_keys > 0) {
      FillSigned(inputs, {options.batch, options.num_keys, model.key_size()},
                 request.mutable_keys());
      FillSigned(inputs, {options.batch, options.num_keys, model.value_size()},
                 request.mutable_values());
    }
  }

  const Tensor& q = request.queries();
  MHA_RETURN_IF_ERROR(CheckFeatures(q, "queries", model.query_size(), "d_q"));
  if (request.has_keys()) {
    MHA_RETURN_IF_ERROR(CheckFeatures(request.keys(), "keys", model.key_size(), "d_k"));
    MHA_RETURN_IF_ERROR(CheckFeatures(request.values(), "values", model.value_size(), "d_v"));
  } else if (!model.supports_self_attention()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model ", model.name(), " has d_q ", model.query_size(), ", d_k ", model.key_size(),
        ", d_v ", model.value_size(), " and cannot self-attend: give keys (--num_keys > 0)"));
  }
  // With input files, B and Q (and maybe the lengths) are the files': lengths of the
  // wrong count are still the user's to fix, a usage error naming where they came from.
  const bool lens_from_file = options.input_files.size() == 1 &&
                              absl::EndsWith(options.input_files[0], ".safetensors") &&
                              !std::equal(options.valid_lens.begin(), options.valid_lens.end(),
                                          request.valid_lens().begin(), request.valid_lens().end());
  if (absl::Status lens = CheckValidLensCount(request.valid_lens(), q.shape(0), q.shape(1));
      !lens.ok()) {
    if (!lens_from_file) return UsageError(absl::StrCat(lens.message(), " (B and Q from --input)"));
    return UsageError(absl::StrCat("--input: ", options.input_files[0], ": its valid_lens has ",
                                   request.valid_lens_size(), " entries for queries ",
                                   ShapeString(q), ": expected B = ", q.shape(0),
                                   " or B*Q = ", q.shape(0) * q.shape(1)));
  }
  return request;
}

}  // namespace mha::client

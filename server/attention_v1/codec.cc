#include "server/attention_v1/codec.h"

#include <bit>
#include <cstdint>
#include <optional>
#include <string>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace mha::server {
namespace {

using attention::v1::AttendRequest;
using attention::v1::AttendResponse;
using attention::v1::Tensor;

void SetShape(std::initializer_list<int64_t> dims, Tensor* tensor) {
  tensor->clear_shape();
  for (int64_t d : dims) tensor->add_shape(d);
}

}  // namespace

// A tensor's values as a view, from data or from raw (little-endian float32 bytes).
absl::StatusOr<std::optional<TensorView>> ViewTensor(absl::string_view field, bool present,
                                                     const Tensor& tensor) {
  static_assert(std::endian::native == std::endian::little, "raw is read in place");
  if (!present) return std::nullopt;
  TensorView view{.shape = absl::MakeConstSpan(tensor.shape().data(), tensor.shape_size())};
  if (tensor.raw().empty()) {
    view.data = tensor.data().data();
    view.size = tensor.data_size();
    return view;
  }
  if (tensor.data_size() > 0) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": has both data (", tensor.data_size(),
                                                   " floats) and raw (", tensor.raw().size(),
                                                   " bytes); send one"));
  }
  if (tensor.raw().size() % sizeof(float) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".raw: ", tensor.raw().size(),
                     " bytes is not a whole number of float32 values (4 bytes each)"));
  }
  // protobuf keeps bytes in a std::string: operator new's memory, or the 8-aligned
  // string object itself when short, so float alignment always holds.
  if (reinterpret_cast<uintptr_t>(tensor.raw().data()) % alignof(float) != 0) {
    return absl::InternalError(absl::StrCat(field, ".raw: bytes not aligned for float32"));
  }
  view.data = reinterpret_cast<const float*>(tensor.raw().data());
  view.size = static_cast<int64_t>(tensor.raw().size() / sizeof(float));
  return view;
}

// Sizes `tensor` for `elements` zeroed floats, in raw or in data, and returns them.
float* AllocateTensor(int64_t elements, bool raw, Tensor* tensor) {
  if (raw) {
    tensor->mutable_raw()->assign(static_cast<size_t>(elements) * sizeof(float), '\0');
    return reinterpret_cast<float*>(tensor->mutable_raw()->data());
  }
  tensor->mutable_data()->Resize(static_cast<int>(elements), 0.0f);
  return tensor->mutable_data()->mutable_data();
}

absl::StatusOr<ValidatedRequest> ValidateRequest(const AttendRequest& request, const Model& model) {
  const auto bytes = static_cast<int64_t>(request.ByteSizeLong());
  MHA_RETURN_IF_ERROR(CheckRequestBytes(bytes, model));
  MHA_ASSIGN_OR_RETURN(const MessageTensors tensors, ViewTensors(request));
  return Validate(
      RequestView{
          .bytes = bytes,
          .queries = tensors.queries,
          .keys = tensors.keys,
          .values = tensors.values,
          .valid_lens = absl::MakeConstSpan(request.valid_lens().data(), request.valid_lens_size()),
          .causal = request.causal(),
          .return_attention = request.return_attention(),
          .head_mask = absl::MakeConstSpan(request.head_mask().data(), request.head_mask_size()),
          .return_lse = request.return_lse(),
      },
      model);
}

bool WantsRawResponse(const AttendRequest& request) { return !request.queries().raw().empty(); }

OutputViews PrepareResponse(const ValidatedRequest& request, bool raw, AttendResponse* response) {
  const core::AttentionInputs& in = request.inputs;
  OutputViews views;
  Tensor* output = response->mutable_output();
  SetShape({in.batch, in.num_queries, request.model->config.num_hiddens}, output);
  views.output = AllocateTensor(request.output_elements(), raw, output);
  if (request.return_attention) {
    Tensor* weights = response->mutable_attention();
    SetShape({in.batch, request.model->config.num_heads, in.num_queries, in.num_keys}, weights);
    views.attention = AllocateTensor(request.attention_elements(), raw, weights);
  }
  if (request.return_lse) {
    Tensor* lse = response->mutable_lse();
    SetShape({in.batch, request.model->config.num_heads, in.num_queries}, lse);
    views.lse = AllocateTensor(request.lse_elements(), raw, lse);
  }
  return views;
}

void EncodeTiming(const ComputeTiming& timing, AttendResponse* response) {
  attention::v1::Timing* out = response->mutable_timing();
  out->set_queue_us(absl::ToInt64Microseconds(timing.queue));
  out->set_compute_us(absl::ToInt64Microseconds(timing.compute));
  out->set_batch_rows(timing.batch_rows);
}

absl::Status RunForward(const ValidatedRequest& request, bool raw, AttendResponse* response) {
  const OutputViews views = PrepareResponse(request, raw, response);
  return request.model->attention->Forward(request.inputs, views.output, views.attention,
                                           /*max_threads=*/0, views.lse);
}

}  // namespace mha::server

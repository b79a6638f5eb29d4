#include "server/codec.h"

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"

namespace mha::server {
namespace {

using attention::v1::AttendRequest;
using attention::v1::AttendResponse;
using attention::v1::Tensor;

std::string ShapeString(absl::Span<const int64_t> shape) {
  return absl::StrCat("(", absl::StrJoin(shape, ", "), ")");
}

// Rank 3, every dimension >= 1, data length == prod(shape).
absl::Status CheckDense(absl::string_view field, const TensorView& tensor,
                        absl::string_view layout) {
  if (tensor.shape.size() != 3) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": expected rank 3 ", layout,
                                                   ", got shape ", ShapeString(tensor.shape)));
  }
  int64_t elements = 1;
  bool overflow = false;
  for (int i = 0; i < 3; ++i) {
    const int64_t dim = tensor.shape[i];
    if (dim < 1) {
      return absl::InvalidArgumentError(absl::StrCat(field, ": every dimension of ", layout,
                                                     " must be >= 1, got shape ",
                                                     ShapeString(tensor.shape)));
    }
    overflow = overflow || __builtin_mul_overflow(elements, dim, &elements);
  }
  if (overflow || elements != tensor.size) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": shape ", ShapeString(tensor.shape), " needs ",
                     overflow ? std::string("more than 2^63") : absl::StrCat(elements),
                     " values, data has ", tensor.size));
  }
  return absl::OkStatus();
}

absl::Status CheckShape(absl::string_view field, const TensorView& tensor, int64_t d0, int64_t d1,
                        int64_t d2) {
  if (tensor.shape[0] != d0 || tensor.shape[1] != d1 || tensor.shape[2] != d2) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": expected shape (", d0, ", ", d1, ", ",
                                                   d2, "), got ", ShapeString(tensor.shape)));
  }
  return absl::OkStatus();
}

// True if any entry is NaN or an infinity (all exponent bits set). Branch-free over
// the bits so that the compiler vectorizes it: it reads every value of every request.
bool AnyNonFinite(const float* data, int64_t n) {
  constexpr uint32_t kExponent = 0x7f800000;
  uint32_t any = 0;
  for (int64_t i = 0; i < n; ++i) {
    any |= static_cast<uint32_t>((std::bit_cast<uint32_t>(data[i]) & kExponent) == kExponent);
  }
  return any != 0;
}

struct Dims {
  int64_t batch = 0, queries = 0, keys = 0;  // B, Q, K
};

constexpr int64_t kMaxResponseFloats = (int64_t{1} << 29) - (int64_t{1} << 20);

absl::Status OverLimit(absl::string_view what, int64_t value, absl::string_view limit,
                       int64_t limit_value, const Model& model) {
  return absl::ResourceExhaustedError(absl::StrCat(what, " ", value, " exceeds ", limit, " ",
                                                   limit_value, " of model ", model.name));
}

// Queries, and keys/values when given: rank, dims, data length, and (B, Q, d_q),
// (B, K, d_k), (B, K, d_v) against the model.
absl::StatusOr<Dims> DecodeShapes(const RequestView& request, const Model& model) {
  const core::ModelConfig& c = model.config;
  if (!request.queries.has_value()) {
    return absl::InvalidArgumentError(
        absl::StrCat("queries: required, shape (B, Q, d_q = ", c.query_size, ")"));
  }
  const TensorView& queries = *request.queries;
  MHA_RETURN_IF_ERROR(CheckDense("queries", queries, "(B, Q, d_q)"));
  Dims dims{.batch = queries.shape[0], .queries = queries.shape[1], .keys = queries.shape[1]};
  MHA_RETURN_IF_ERROR(CheckShape("queries", queries, dims.batch, dims.queries, c.query_size));
  const bool has_keys = request.keys.has_value(), has_values = request.values.has_value();
  if (has_keys != has_values) {
    return absl::InvalidArgumentError(
        has_keys ? "values: required when keys are given (cross-attention); omit "
                   "both for self-attention"
                 : "keys: required when values are given (cross-attention); omit "
                   "both for self-attention");
  }
  if (!has_keys) {
    if (c.SupportsSelfAttention()) return dims;
    return absl::InvalidArgumentError(
        absl::StrCat("keys: required, model ", model.name, " has d_q = ", c.query_size,
                     ", d_k = ", c.key_size, ", d_v = ", c.value_size, " and cannot self-attend"));
  }
  MHA_RETURN_IF_ERROR(CheckDense("keys", *request.keys, "(B, K, d_k)"));
  dims.keys = request.keys->shape[1];
  MHA_RETURN_IF_ERROR(CheckShape("keys", *request.keys, dims.batch, dims.keys, c.key_size));
  MHA_RETURN_IF_ERROR(CheckDense("values", *request.values, "(B, K, d_v)"));
  MHA_RETURN_IF_ERROR(CheckShape("values", *request.values, dims.batch, dims.keys, c.value_size));
  return dims;
}

// The model's limits on B, Q, K and returned weights, and what one message can hold.
absl::Status CheckLimits(const Dims& dims, bool cross, bool return_attention, const Model& model) {
  const ModelLimits& limits = model.limits;
  const int64_t heads = model.config.num_heads;
  if (dims.batch > limits.max_batch_size) {
    return OverLimit("queries: batch size", dims.batch, "max_batch_size", limits.max_batch_size,
                     model);
  }
  if (dims.queries > limits.max_sequence_length) {
    return OverLimit("queries: sequence length", dims.queries, "max_sequence_length",
                     limits.max_sequence_length, model);
  }
  if (dims.keys > limits.max_sequence_length) {
    return OverLimit(cross ? "keys: sequence length" : "queries: sequence length", dims.keys,
                     "max_sequence_length", limits.max_sequence_length, model);
  }
  // Limits come from configuration, so guard the product anyway.
  int64_t weights = 0;
  if (return_attention &&
      (__builtin_mul_overflow(dims.batch * heads, dims.queries * dims.keys, &weights) ||
       weights > limits.max_attention_elements)) {
    return absl::ResourceExhaustedError(
        absl::StrCat("return_attention: B*h*Q*K = ", dims.batch, "*", heads, "*", dims.queries, "*",
                     dims.keys, " weights exceed max_attention_elements ",
                     limits.max_attention_elements, " of model ", model.name));
  }
  // A protobuf message holds at most 2 GiB; answer that before allocating it.
  const int64_t floats = dims.batch * dims.queries * model.config.num_hiddens + weights;
  if (floats > kMaxResponseFloats) {
    return absl::ResourceExhaustedError(
        absl::StrCat("output: the response would hold ", floats, " floats, more than the ",
                     kMaxResponseFloats, " a gRPC message can carry; send a smaller batch"));
  }
  return absl::OkStatus();
}

core::AttentionInputs Views(const RequestView& request, const Dims& dims) {
  const bool cross = request.keys.has_value();
  return core::AttentionInputs{
      .batch = dims.batch,
      .num_queries = dims.queries,
      .num_keys = dims.keys,
      .queries = request.queries->data,
      .keys = cross ? request.keys->data : nullptr,
      .values = cross ? request.values->data : nullptr,
      .valid_lens = {request.valid_lens.data(), request.valid_lens.size()},
      .causal = request.causal,
      .head_mask = {request.head_mask.data(), request.head_mask.size()},
  };
}

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

absl::Status CheckFiniteValues(absl::string_view field, const TensorView& tensor) {
  const float* data = tensor.data;
  const int64_t n = tensor.size;
  if (!AnyNonFinite(data, n)) return absl::OkStatus();
  for (int64_t i = 0; i < n; ++i) {  // find the first one, for the message
    if (!std::isfinite(data[i])) {
      const int64_t features = tensor.shape[2], positions = tensor.shape[1];
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": non-finite value ", data[i], " at index ", i, " (batch ",
                       i / (features * positions), ", position ", (i / features) % positions,
                       ", feature ", i % features, ")"));
    }
  }
  return absl::OkStatus();
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

absl::Status CheckRequestBytes(int64_t bytes, const Model& model) {
  if (bytes > model.limits.max_request_bytes) {
    return OverLimit("request: size in bytes", bytes, "max_request_bytes",
                     model.limits.max_request_bytes, model);
  }
  return absl::OkStatus();
}

absl::StatusOr<ValidatedRequest> Validate(const RequestView& request, const Model& model) {
  MHA_RETURN_IF_ERROR(CheckRequestBytes(request.bytes, model));
  MHA_ASSIGN_OR_RETURN(const Dims dims, DecodeShapes(request, model));
  MHA_RETURN_IF_ERROR(CheckLimits(dims, request.keys.has_value(), request.return_attention, model));
  ValidatedRequest out{.model = &model,
                       .inputs = Views(request, dims),
                       .return_attention = request.return_attention};
  MHA_RETURN_IF_ERROR(CheckFiniteValues("queries", *request.queries));
  if (request.keys.has_value()) {
    MHA_RETURN_IF_ERROR(CheckFiniteValues("keys", *request.keys));
    MHA_RETURN_IF_ERROR(CheckFiniteValues("values", *request.values));
  }
  // valid_lens and head_mask (counts, ranges, finiteness): the core's rules.
  MHA_RETURN_IF_ERROR(model.attention->CheckInputs(out.inputs));
  return out;
}

absl::StatusOr<ValidatedRequest> ValidateRequest(const AttendRequest& request, const Model& model) {
  const auto bytes = static_cast<int64_t>(request.ByteSizeLong());
  MHA_RETURN_IF_ERROR(CheckRequestBytes(bytes, model));
  MHA_ASSIGN_OR_RETURN(std::optional<TensorView> queries,
                       ViewTensor("queries", request.has_queries(), request.queries()));
  MHA_ASSIGN_OR_RETURN(std::optional<TensorView> keys,
                       ViewTensor("keys", request.has_keys(), request.keys()));
  MHA_ASSIGN_OR_RETURN(std::optional<TensorView> values,
                       ViewTensor("values", request.has_values(), request.values()));
  return Validate(
      RequestView{
          .bytes = bytes,
          .queries = queries,
          .keys = keys,
          .values = values,
          .valid_lens = absl::MakeConstSpan(request.valid_lens().data(), request.valid_lens_size()),
          .causal = request.causal(),
          .return_attention = request.return_attention(),
          .head_mask = absl::MakeConstSpan(request.head_mask().data(), request.head_mask_size()),
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
  return request.model->attention->Forward(request.inputs, views.output, views.attention);
}

}  // namespace mha::server

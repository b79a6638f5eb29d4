#include "server/serving/request.h"

#include <bit>
#include <cmath>
#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"

namespace mha::server {
namespace {

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
  if (c.rope && dims.queries > dims.keys) {
    // Refused here, before the batcher: the core would refuse the forward call.
    return absl::InvalidArgumentError(absl::StrCat(
        "queries: model ", model.name, " has rotary positions (rope): its queries are the last Q ",
        "of its K positions, so Q <= K; got Q = ", dims.queries, ", K = ", dims.keys));
  }
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

}  // namespace

std::string ShapeString(absl::Span<const int64_t> shape) {
  return absl::StrCat("(", absl::StrJoin(shape, ", "), ")");
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

absl::Status CheckReturnLse(const Model& model) {
  if (model.config.attention_only()) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("return_lse: model ", model.name,
                   " has projections FULL; the log-sum-exp is returned by attention-only "
                   "models (projections NONE)"));
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
  if (request.return_lse) MHA_RETURN_IF_ERROR(CheckReturnLse(model));
  MHA_ASSIGN_OR_RETURN(const Dims dims, DecodeShapes(request, model));
  MHA_RETURN_IF_ERROR(CheckLimits(dims, request.keys.has_value(), request.return_attention, model));
  ValidatedRequest out{.model = &model,
                       .inputs = Views(request, dims),
                       .return_attention = request.return_attention,
                       .return_lse = request.return_lse};
  MHA_RETURN_IF_ERROR(CheckFiniteValues("queries", *request.queries));
  if (request.keys.has_value()) {
    MHA_RETURN_IF_ERROR(CheckFiniteValues("keys", *request.keys));
    MHA_RETURN_IF_ERROR(CheckFiniteValues("values", *request.values));
  }
  // valid_lens and head_mask (counts, ranges, finiteness): the core's rules.
  MHA_RETURN_IF_ERROR(model.attention->CheckInputs(out.inputs));
  return out;
}

}  // namespace mha::server

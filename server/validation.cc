#include "server/validation.h"

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/status_macros.h"

namespace mha::server {
namespace {

using attention::v1::AttendRequest;
using attention::v1::Tensor;

std::string ShapeString(const Tensor& tensor) {
  return absl::StrCat("(", absl::StrJoin(tensor.shape(), ", "), ")");
}

// Rank 3, every dimension >= 1, data length == prod(shape).
absl::Status CheckDense(absl::string_view field, const Tensor& tensor,
                        absl::string_view layout) {
  if (tensor.shape_size() != 3) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": expected rank 3 ", layout,
                                                   ", got shape ", ShapeString(tensor)));
  }
  int64_t elements = 1;
  bool overflow = false;
  for (int i = 0; i < 3; ++i) {
    const int64_t dim = tensor.shape(i);
    if (dim < 1) {
      return absl::InvalidArgumentError(absl::StrCat(field, ": every dimension of ", layout,
                                                     " must be >= 1, got shape ",
                                                     ShapeString(tensor)));
    }
    overflow = overflow || __builtin_mul_overflow(elements, dim, &elements);
  }
  if (overflow || elements != tensor.data_size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": shape ", ShapeString(tensor), " needs ",
        overflow ? std::string("more than 2^63") : absl::StrCat(elements),
        " values, data has ", tensor.data_size()));
  }
  return absl::OkStatus();
}

absl::Status CheckShape(absl::string_view field, const Tensor& tensor, int64_t d0, int64_t d1,
                        int64_t d2) {
  if (tensor.shape(0) != d0 || tensor.shape(1) != d1 || tensor.shape(2) != d2) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": expected shape (", d0, ", ", d1,
                                                   ", ", d2, "), got ", ShapeString(tensor)));
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

absl::Status CheckFinite(absl::string_view field, const Tensor& tensor) {
  const float* data = tensor.data().data();
  const int64_t n = tensor.data_size();
  if (!AnyNonFinite(data, n)) return absl::OkStatus();
  for (int64_t i = 0; i < n; ++i) {  // find the first one, for the message
    if (!std::isfinite(data[i])) {
      const int64_t features = tensor.shape(2), positions = tensor.shape(1);
      return absl::InvalidArgumentError(absl::StrCat(
          field, ": non-finite value ", data[i], " at index ", i, " (batch ",
          i / (features * positions), ", position ", (i / features) % positions,
          ", feature ", i % features, ")"));
    }
  }
  return absl::OkStatus();
}

constexpr int64_t kMaxResponseFloats = (int64_t{1} << 29) - (int64_t{1} << 20);

absl::Status OverLimit(absl::string_view what, int64_t value, absl::string_view limit,
                       int64_t limit_value, const Model& model) {
  return absl::ResourceExhaustedError(absl::StrCat(what, " ", value, " exceeds ", limit, " ",
                                                   limit_value, " of model ", model.name));
}

}  // namespace

absl::StatusOr<ValidatedRequest> ValidateRequest(const AttendRequest& request,
                                                 const ModelRepository& models) {
  ValidatedRequest out;
  MHA_ASSIGN_OR_RETURN(out.model, models.Find(request.model()));
  const Model& model = *out.model;
  const core::ModelConfig& c = model.config;
  const ModelLimits& limits = model.limits;

  if (const int64_t bytes = static_cast<int64_t>(request.ByteSizeLong());
      bytes > limits.max_request_bytes) {
    return OverLimit("request: size in bytes", bytes, "max_request_bytes",
                     limits.max_request_bytes, model);
  }

  if (!request.has_queries()) {
    return absl::InvalidArgumentError(
        absl::StrCat("queries: required, shape (B, Q, d_q = ", c.query_size, ")"));
  }
  const Tensor& queries = request.queries();
  MHA_RETURN_IF_ERROR(CheckDense("queries", queries, "(B, Q, d_q)"));
  const int64_t batch = queries.shape(0), num_queries = queries.shape(1);
  MHA_RETURN_IF_ERROR(CheckShape("queries", queries, batch, num_queries, c.query_size));

  int64_t num_keys = num_queries;
  if (request.has_keys() != request.has_values()) {
    return request.has_keys()
               ? absl::InvalidArgumentError(
                     "values: required when keys are given (cross-attention); omit both "
                     "for self-attention")
               : absl::InvalidArgumentError(
                     "keys: required when values are given (cross-attention); omit both "
                     "for self-attention");
  }
  if (request.has_keys()) {
    const Tensor& keys = request.keys();
    const Tensor& values = request.values();
    MHA_RETURN_IF_ERROR(CheckDense("keys", keys, "(B, K, d_k)"));
    num_keys = keys.shape(1);
    MHA_RETURN_IF_ERROR(CheckShape("keys", keys, batch, num_keys, c.key_size));
    MHA_RETURN_IF_ERROR(CheckDense("values", values, "(B, K, d_v)"));
    MHA_RETURN_IF_ERROR(CheckShape("values", values, batch, num_keys, c.value_size));
  } else if (!c.SupportsSelfAttention()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "keys: required, model ", model.name, " has d_q = ", c.query_size, ", d_k = ",
        c.key_size, ", d_v = ", c.value_size, " and cannot self-attend"));
  }

  if (batch > limits.max_batch_size) {
    return OverLimit("queries: batch size", batch, "max_batch_size", limits.max_batch_size,
                     model);
  }
  if (num_queries > limits.max_sequence_length) {
    return OverLimit("queries: sequence length", num_queries, "max_sequence_length",
                     limits.max_sequence_length, model);
  }
  if (num_keys > limits.max_sequence_length) {
    return OverLimit(request.has_keys() ? "keys: sequence length" : "queries: sequence length",
                     num_keys, "max_sequence_length", limits.max_sequence_length, model);
  }

  // Limits come from configuration, so guard the product anyway.
  if (request.return_attention()) {
    int64_t elements = 0;
    if (__builtin_mul_overflow(batch * c.num_heads, num_queries * num_keys, &elements) ||
        elements > limits.max_attention_elements) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "return_attention: B*h*Q*K = ", batch, "*", c.num_heads, "*", num_queries, "*",
          num_keys, " weights exceed max_attention_elements ", limits.max_attention_elements,
          " of model ", model.name));
    }
  }

  // A protobuf message holds at most 2 GiB; answer that before allocating it.
  {
    const int64_t floats = batch * num_queries * c.num_hiddens +
                           (request.return_attention()
                                ? batch * c.num_heads * num_queries * num_keys
                                : 0);
    if (floats > kMaxResponseFloats) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "output: the response would hold ", floats, " floats, more than the ",
          kMaxResponseFloats, " a gRPC message can carry; send a smaller batch"));
    }
  }

  // valid_lens and head_mask (counts, ranges, finiteness) are checked by the core's
  // CheckInputs below, the one place those rules live.
  const int vl = request.valid_lens_size();
  out.return_attention = request.return_attention();
  out.inputs = core::AttentionInputs{
      .batch = batch,
      .num_queries = num_queries,
      .num_keys = num_keys,
      .queries = queries.data().data(),
      .keys = request.has_keys() ? request.keys().data().data() : nullptr,
      .values = request.has_keys() ? request.values().data().data() : nullptr,
      .valid_lens = {request.valid_lens().data(), static_cast<size_t>(vl)},
      .causal = request.causal(),
      .head_mask = {request.head_mask().data(),
                    static_cast<size_t>(request.head_mask_size())},
  };
  MHA_RETURN_IF_ERROR(CheckFinite("queries", queries));
  if (request.has_keys()) {
    MHA_RETURN_IF_ERROR(CheckFinite("keys", request.keys()));
    MHA_RETURN_IF_ERROR(CheckFinite("values", request.values()));
  }
  MHA_RETURN_IF_ERROR(model.attention->CheckInputs(out.inputs));
  return out;
}

}  // namespace mha::server

#include "server/attention_v1/session_codec.h"

#include <optional>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"
#include "server/attention_v1/codec.h"
#include "server/serving/session_store.h"

namespace mha::server {
namespace {

using attention::v1::SessionRequest;

// Rank 3, (1, n, features) with n >= min_rows (n named `dim` in messages), data
// length == n * features. Returns n.
absl::StatusOr<int64_t> Rows(absl::string_view field, const TensorView& tensor, int64_t min_rows,
                             int64_t features, absl::string_view dim) {
  const auto& s = tensor.shape;
  if (s.size() != 3 || s[0] != 1 || s[1] < min_rows || s[2] != features) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": expected shape (1, ", dim, ", ",
                                                   features, ") with ", dim, " >= ", min_rows,
                                                   ", got (", absl::StrJoin(s, ", "), ")"));
  }
  // s[1] <= size / features keeps the product from overflowing.
  if (s[1] > tensor.size / features || s[1] * features != tensor.size) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": shape (1, ", s[1], ", ", s[2], ") does not match its ", tensor.size, " values"));
  }
  return s[1];
}

// What a session's first message settles: its kind and causality against the model,
// and return_lse.
absl::Status CheckFirstMessage(const SessionSettings& settings, const Model& model) {
  const core::ModelConfig& c = model.config;
  const bool self = settings.kind == attention::v1::SELF;
  if (settings.kind != attention::v1::SELF && settings.kind != attention::v1::CROSS) {
    return absl::InvalidArgumentError(
        absl::StrCat("kind: expected SELF (0) or CROSS (1), got ", settings.kind));
  }
  if (c.attention_only() && self) {
    return absl::InvalidArgumentError(absl::StrCat(
        "kind: model ", model.name,
        " is attention-only (projections NONE): its sessions are CROSS with causal true, "
        "each step carrying its tokens' projected q, k and v"));
  }
  if (c.attention_only() && !settings.causal) {
    return absl::InvalidArgumentError(absl::StrCat(
        "causal: model ", model.name,
        " is attention-only (projections NONE): its sessions are CROSS with causal true"));
  }
  if (settings.return_lse) MHA_RETURN_IF_ERROR(CheckReturnLse(model));
  if (self && !c.SupportsSelfAttention()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "kind: SELF needs d_k = d_v = d_q, model ", model.name, " has d_q = ", c.query_size,
        ", d_k = ", c.key_size, ", d_v = ", c.value_size, "; use CROSS"));
  }
  if (c.scoring != core::Scoring::kDotProduct) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model: ", model.name, " uses additive scoring; sessions need dot-product scoring"));
  }
  if (!self && c.rope) {
    return absl::InvalidArgumentError(absl::StrCat(
        "kind: CROSS is refused for model ", model.name,
        ", which has rotary positions (rope): its sessions are SELF, token t at position t"));
  }
  return absl::OkStatus();
}

// The step's queries, keys and values: their rows, and which of them it carries.
absl::Status StepTensors(const MessageTensors& tensors, bool self, const core::ModelConfig& c,
                         SessionStepInput* step) {
  const std::optional<TensorView>& queries = tensors.queries;
  const std::optional<TensorView>& keys = tensors.keys;
  const std::optional<TensorView>& values = tensors.values;
  if (queries.has_value()) {
    MHA_ASSIGN_OR_RETURN(step->num_queries,
                         Rows("queries", *queries, self ? 1 : 0, c.query_size, "T"));
    step->queries = queries->data;
  } else if (self) {
    return absl::InvalidArgumentError(
        absl::StrCat("queries: required in a SELF session, shape (1, T, d_q = ", c.query_size,
                     "); they are also the step's keys and values"));
  }
  if (self) {
    if (keys.has_value() || values.has_value()) {
      return absl::InvalidArgumentError(
          absl::StrCat(keys.has_value() ? "keys" : "values",
                       ": absent in a SELF session, whose queries are its keys and values"));
    }
    step->num_keys = step->num_queries;
  } else if (keys.has_value() != values.has_value()) {
    return absl::InvalidArgumentError(keys.has_value() ? "values: required when keys are given"
                                                       : "keys: required when values are given");
  } else if (keys.has_value()) {
    MHA_ASSIGN_OR_RETURN(step->num_keys, Rows("keys", *keys, 0, c.key_size, "T_k"));
    MHA_ASSIGN_OR_RETURN(const int64_t num_values, Rows("values", *values, 0, c.value_size, "T_k"));
    if (num_values != step->num_keys) {
      return absl::InvalidArgumentError(absl::StrCat("values: ", num_values, " rows, keys have ",
                                                     step->num_keys, "; give one value per key"));
    }
    step->keys = keys->data;
    step->values = values->data;
  }
  return absl::OkStatus();
}

}  // namespace

SessionSettings SettingsOf(const SessionRequest& first) {
  return {.kind = first.kind(), .causal = first.causal(), .return_lse = first.return_lse()};
}

absl::StatusOr<SessionStepInput> DecodeSessionStep(const SessionRequest& request, bool first,
                                                   const SessionSettings& settings,
                                                   const Model& model, int64_t cached) {
  const core::ModelConfig& c = model.config;
  const auto bytes = static_cast<int64_t>(request.ByteSizeLong());
  MHA_RETURN_IF_ERROR(CheckRequestBytes(bytes, model));
  if (!first && (!request.model().empty() || !request.model_version().empty())) {
    return absl::InvalidArgumentError(
        "model: set only in a session's first message (a session keeps its model)");
  }
  const bool self = settings.kind == attention::v1::SELF;
  if (first) MHA_RETURN_IF_ERROR(CheckFirstMessage(settings, model));
  MHA_ASSIGN_OR_RETURN(const MessageTensors tensors, ViewTensors(request));
  SessionStepInput step{.raw = !request.queries().raw().empty(), .request_bytes = bytes};
  MHA_RETURN_IF_ERROR(StepTensors(tensors, self, c, &step));
  if (!self && settings.causal && step.num_keys != step.num_queries) {
    return absl::InvalidArgumentError(
        absl::StrCat("keys: a causal CROSS session's step carries as many keys as queries, got ",
                     step.num_keys, " keys for ", step.num_queries, " queries"));
  }
  const int64_t limit = model.limits.session_tokens();
  if (step.num_keys > limit - cached) {
    return WithSessionEnd(
        absl::ResourceExhaustedError(absl::StrCat(
            "context: ", cached, " cached + ", step.num_keys, " new tokens exceed ",
            model.limits.max_session_tokens > 0 ? "max_session_tokens " : "max_sequence_length ",
            limit, " of model ", model.name, " (a session's token limit)")),
        SessionEnd::kTokenLimit);
  }
  if (tensors.queries) MHA_RETURN_IF_ERROR(CheckFiniteValues("queries", *tensors.queries));
  if (tensors.keys) {
    MHA_RETURN_IF_ERROR(CheckFiniteValues("keys", *tensors.keys));
    MHA_RETURN_IF_ERROR(CheckFiniteValues("values", *tensors.values));
  }
  return step;
}

core::PagedStep ToPagedStep(const SessionStepInput& step, const SessionSettings& settings,
                            core::KvSequence* cache, float* output, float* lse) {
  static constexpr float kNoKeys = 0;
  const bool self = settings.kind == attention::v1::SELF;
  return core::PagedStep{
      .num_queries = step.num_queries,
      .queries = step.queries,
      .num_keys = step.num_keys,
      .keys = self ? nullptr : (step.keys != nullptr ? step.keys : &kNoKeys),
      .values = self ? nullptr : (step.values != nullptr ? step.values : &kNoKeys),
      .causal = settings.causal,
      .cache = cache,
      .output = output,
      .lse = lse,
  };
}

float* PrepareSessionResponse(const SessionStepInput& step, const Model& model,
                              attention::v1::SessionResponse* response) {
  attention::v1::Tensor* output = response->mutable_output();
  output->clear_shape();
  for (int64_t d : {int64_t{1}, step.num_queries, model.config.num_hiddens}) output->add_shape(d);
  return AllocateTensor(step.num_queries * model.config.num_hiddens, step.raw, output);
}

float* PrepareSessionLse(const SessionStepInput& step, const Model& model,
                         attention::v1::SessionResponse* response) {
  attention::v1::Tensor* lse = response->mutable_lse();
  lse->clear_shape();
  for (int64_t d : {int64_t{1}, model.config.num_heads, step.num_queries}) lse->add_shape(d);
  return AllocateTensor(model.config.num_heads * step.num_queries, step.raw, lse);
}

}  // namespace mha::server

#include "server/kserve/answers.h"

#include <charconv>
#include <cmath>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "core/config.h"
#include "server/serving/abbreviate.h"

namespace mha::server {
namespace {

using inference::ModelInferRequest;
using inference::ModelInferResponse;

void AddTensor(
    const char* name, const char* datatype, std::initializer_list<int64_t> shape,
    google::protobuf::RepeatedPtrField<inference::ModelMetadataResponse::TensorMetadata>* tensors) {
  inference::ModelMetadataResponse::TensorMetadata* tensor = tensors->Add();
  tensor->set_name(name);
  tensor->set_datatype(datatype);
  for (int64_t d : shape) tensor->add_shape(d);
}

inference::ModelInput* AddInput(inference::ModelConfig* config, const char* name,
                                inference::DataType type, std::initializer_list<int64_t> dims,
                                bool optional) {
  inference::ModelInput* input = config->add_input();
  input->set_name(name);
  input->set_data_type(type);
  for (int64_t d : dims) input->add_dims(d);
  input->set_optional(optional);
  return input;
}

void AddOutput(inference::ModelConfig* config, const char* name,
               std::initializer_list<int64_t> dims) {
  inference::ModelOutput* output = config->add_output();
  output->set_name(name);
  output->set_data_type(inference::TYPE_FP32);
  for (int64_t d : dims) output->add_dims(d);
}

// A decimal that reads back as `value`: whole numbers as integers (500000, where the
// shortest form would be 5e+05), others in their shortest form (StrCat keeps 6
// significant digits: 1234567.5 would read back as 1234570).
std::string ExactDecimal(double value) {
  if (value == std::floor(value) && std::abs(value) < 1e15) {
    return absl::StrCat(static_cast<int64_t>(value));
  }
  char buffer[32];
  const std::to_chars_result result = std::to_chars(buffer, buffer + sizeof(buffer), value);
  return std::string(buffer, result.ptr);
}

void SetDuration(const ModelStatisticsSnapshot::Duration& from, inference::StatisticDuration* to) {
  to->set_count(from.count);
  to->set_ns(from.ns);
}

}  // namespace

absl::StatusOr<Prepared> DecodeInfer(const ModelInferRequest& request, const Model& model,
                                     InferDecoded* decoded, ModelInferResponse* response) {
  MHA_ASSIGN_OR_RETURN(ValidatedRequest validated, DecodeInferRequest(request, model, decoded));
  const OutputViews outputs = PrepareInferResponse(request, validated, *decoded, response);
  return Prepared{.request = validated,
                  .outputs = outputs,
                  .deadline = absl::Now() + decoded->timeout,
                  .finish = FinishSharedMemory(*decoded)};
}

inference::ModelConfig ToTritonConfig(const Model& model) {
  const core::ModelConfig& c = model.config;
  inference::ModelConfig config;
  config.set_name(model.name);
  config.set_platform("mha_attention");
  config.set_backend(kServerName);
  // max_batch_size 0 and full shapes as dims, the batch dimension included: with
  // max_batch_size > 0 Triton's clients take [-1] + dims as the full shape, which
  // would make valid_lens [-1, -1] and head_mask [-1, h]. The dims equal
  // ModelMetadata's shapes; the batch limits are in parameters.
  config.set_max_batch_size(0);
  config.mutable_version_policy()->mutable_latest()->set_num_versions(1);
  AddInput(&config, "queries", inference::TYPE_FP32, {-1, -1, c.query_size}, false);
  AddInput(&config, "keys", inference::TYPE_FP32, {-1, -1, c.key_size}, c.SupportsSelfAttention());
  AddInput(&config, "values", inference::TYPE_FP32, {-1, -1, c.value_size},
           c.SupportsSelfAttention());
  AddInput(&config, "valid_lens", inference::TYPE_INT32, {-1}, true);
  AddInput(&config, "head_mask", inference::TYPE_FP32, {c.num_heads}, true);
  AddOutput(&config, "output", {-1, -1, c.num_hiddens});
  AddOutput(&config, "attention", {-1, c.num_heads, -1, -1});
  if (c.attention_only()) AddOutput(&config, "lse", {-1, c.num_heads, -1});
  inference::ModelInstanceGroup* group = config.add_instance_group();
  group->set_name(model.name);
  group->set_kind(inference::ModelInstanceGroup::KIND_CPU);
  group->set_count(1);
  if (model.batching.enabled) {
    config.mutable_dynamic_batching()->set_max_queue_delay_microseconds(
        static_cast<uint64_t>(absl::ToInt64Microseconds(model.batching.max_queue_delay)));
  }
  auto& parameters = *config.mutable_parameters();
  parameters["num_heads"].set_string_value(absl::StrCat(c.num_heads));
  parameters["num_hiddens"].set_string_value(absl::StrCat(c.num_hiddens));
  parameters["precision"].set_string_value(std::string(core::PrecisionName(c.precision)));
  parameters["scoring"].set_string_value(std::string(core::ScoringName(c.scoring)));
  // Grouped-query heads and rotary positions, resolved as attention.v1's ModelInfo
  // gives them (fields 15-20): G never 0; rope_theta and rotary_dim 0 without rope.
  parameters["num_kv_heads"].set_string_value(absl::StrCat(c.kv_heads()));
  parameters["rope_theta"].set_string_value(ExactDecimal(c.rope ? c.rope_theta() : 0.0));
  parameters["rotary_dim"].set_string_value(absl::StrCat(c.rope ? c.rotary_dim() : 0));
  parameters["rope_interleaved"].set_string_value(c.rope && c.rope->interleaved ? "true" : "false");
  parameters["projections"].set_string_value(c.attention_only() ? "none" : "full");
  parameters["kv_cache_precision"].set_string_value(c.cache_bf16() ? "bf16" : "f32");
  // The limits a request meets (B, Q and K), and the batcher's per call.
  parameters["max_batch_size"].set_string_value(absl::StrCat(model.limits.max_batch_size));
  parameters["max_sequence_length"].set_string_value(
      absl::StrCat(model.limits.max_sequence_length));
  if (model.batching.enabled) {
    parameters["batch_max_rows"].set_string_value(absl::StrCat(model.batching.max_batch_size));
    parameters["batch_max_tokens"].set_string_value(absl::StrCat(model.batching.max_batch_tokens));
    parameters["batch_max_queue_size"].set_string_value(
        absl::StrCat(model.batching.max_queue_size));
  }
  return config;
}

inference::ModelMetadataResponse ToModelMetadata(const Model& model) {
  const core::ModelConfig& c = model.config;
  inference::ModelMetadataResponse metadata;
  metadata.set_name(model.name);
  metadata.add_versions(absl::StrCat(model.version));
  metadata.set_platform("mha_attention");
  AddTensor("queries", "FP32", {-1, -1, c.query_size}, metadata.mutable_inputs());
  AddTensor("keys", "FP32", {-1, -1, c.key_size}, metadata.mutable_inputs());
  AddTensor("values", "FP32", {-1, -1, c.value_size}, metadata.mutable_inputs());
  AddTensor("valid_lens", "INT32", {-1}, metadata.mutable_inputs());
  AddTensor("head_mask", "FP32", {c.num_heads}, metadata.mutable_inputs());
  AddTensor("output", "FP32", {-1, -1, c.num_hiddens}, metadata.mutable_outputs());
  AddTensor("attention", "FP32", {-1, c.num_heads, -1, -1}, metadata.mutable_outputs());
  if (c.attention_only())
    AddTensor("lse", "FP32", {-1, c.num_heads, -1}, metadata.mutable_outputs());
  return metadata;
}

inference::ServerMetadataResponse ToServerMetadata(bool shared_memory) {
  inference::ServerMetadataResponse metadata;
  metadata.set_name(kServerName);
  metadata.set_version(MHA_VERSION);
  for (const char* extension :
       {"binary_tensor_data", "model_configuration", "model_repository",
        "model_repository(unload_dependents)", "parameters", "statistics"}) {
    metadata.add_extensions(extension);
  }
  if (shared_memory) metadata.add_extensions("system_shared_memory");
  return metadata;
}

absl::StatusOr<inference::ModelStatisticsResponse> CollectStatistics(const ModelRepository& models,
                                                                     const Metrics& metrics,
                                                                     absl::string_view name,
                                                                     absl::string_view version) {
  std::vector<std::shared_ptr<const Model>> chosen;
  if (name.empty()) {
    if (!version.empty()) {
      return absl::InvalidArgumentError("version: needs a model name");
    }
    // Counters are per model (every version together): one entry per model, under
    // its newest version.
    for (const auto& model : models.models()) {
      if (!chosen.empty() && chosen.back()->name == model->name) chosen.pop_back();
      chosen.push_back(model);
    }
  } else {
    MHA_ASSIGN_OR_RETURN(std::shared_ptr<const Model> model, models.Find(name, version));
    chosen.push_back(model);
  }
  inference::ModelStatisticsResponse response;
  for (const auto& model : chosen) {
    const ModelMetrics* model_metrics = metrics.Find(model->name);
    if (model_metrics == nullptr) continue;
    const ModelStatisticsSnapshot s = model_metrics->Statistics();
    inference::ModelStatistics* out = response.add_model_stats();
    out->set_name(model->name);
    out->set_version(absl::StrCat(model->version));
    out->set_last_inference(s.last_inference_ms);
    out->set_inference_count(s.inference_count);
    out->set_execution_count(s.execution_count);
    inference::InferStatistics* stats = out->mutable_inference_stats();
    SetDuration(s.success, stats->mutable_success());
    SetDuration(s.fail, stats->mutable_fail());
    SetDuration(s.queue, stats->mutable_queue());
    // Per computed request, as Triton counts them. Inputs are decoded and outputs
    // encoded on the front's thread, not timed apart: compute_input and
    // compute_output count the same requests with 0 ns (their time is in success's).
    const ModelStatisticsSnapshot::Duration untimed{.count = s.request_compute.count, .ns = 0};
    SetDuration(untimed, stats->mutable_compute_input());
    SetDuration(s.request_compute, stats->mutable_compute_infer());
    SetDuration(untimed, stats->mutable_compute_output());
    SetDuration({}, stats->mutable_cache_hit());
    SetDuration({}, stats->mutable_cache_miss());
    for (const auto& [rows, batch] : s.batches) {
      inference::InferBatchStatistics* b = out->add_batch_stats();
      b->set_batch_size(static_cast<uint64_t>(rows));
      SetDuration({.count = batch.count, .ns = 0}, b->mutable_compute_input());
      SetDuration(batch, b->mutable_compute_infer());
      SetDuration({.count = batch.count, .ns = 0}, b->mutable_compute_output());
    }
  }
  return response;
}

absl::Status KserveModels::Readiness(const Model* model) const {
  if (model != nullptr) return states_->Readiness(*model);
  MHA_RETURN_IF_ERROR(states_->Serving());
  for (const auto& m : models_->models()) MHA_RETURN_IF_ERROR(states_->Readiness(*m));
  return absl::OkStatus();
}

inference::RepositoryIndexResponse KserveModels::Index(bool ready_only) const {
  using ModelIndex = inference::RepositoryIndexResponse::ModelIndex;
  // By name, then version (0: a model with no version served).
  std::map<std::pair<std::string, int64_t>, ModelIndex> entries;
  auto add = [&entries](const std::string& name, int64_t version, const std::string& state,
                        const std::string& reason) {
    ModelIndex& entry = entries[{name, version}];
    entry.set_name(name);
    if (version > 0) entry.set_version(absl::StrCat(version));
    entry.set_state(state);
    entry.set_reason(reason);
  };
  std::set<std::string> served;
  for (const auto& model : models_->models()) {
    const ModelStates::IndexEntry state = states_->Index(*model);
    add(model->name, model->version, state.state, state.reason);
    served.insert(model->name);
  }
  // Versions of models not served yet: loading or warming up.
  std::set<std::string> coming;
  for (const ModelStates::Version& v : states_->Versions()) {
    if (served.contains(v.name)) continue;
    add(v.name, v.version, v.entry.state, v.entry.reason);
    coming.insert(v.name);
  }
  // Folders not served; none listed when the repository cannot be read now.
  const std::vector<std::string> on_disk =
      models_->ListDirectory().value_or(std::vector<std::string>{});
  for (const std::string& name : on_disk) {
    if (!served.contains(name) && !coming.contains(name)) add(name, 0, "UNAVAILABLE", "not loaded");
  }
  // A model whose newest files failed to load: the reason on each version still
  // serving (they stay READY), or on the model when none does.
  for (const auto& [name, failure] : models_->Failures()) {
    const std::string reason = absl::StrCat("load failed: ", failure);
    if (!served.contains(name)) {
      add(name, 0, "UNAVAILABLE", reason);
      continue;
    }
    for (auto it = entries.lower_bound({name, 0}); it != entries.end() && it->first.first == name;
         ++it) {
      it->second.set_reason(reason);
    }
  }
  inference::RepositoryIndexResponse index;
  for (auto& [key, entry] : entries) {
    if (ready_only && entry.state() != "READY") continue;
    *index.add_models() = std::move(entry);
  }
  return index;
}

absl::Status KserveModels::ControlModel(bool load, absl::string_view repository_name,
                                        const std::string& model_name,
                                        const std::vector<ControlParameter>& parameters) const {
  if (lifecycle_ == nullptr) {
    return absl::PermissionDeniedError("model control is not available on this server");
  }
  if (lifecycle_->control() != ModelControl::kExplicit) {
    return absl::PermissionDeniedError(
        absl::StrCat("model_control is ", ModelControlName(lifecycle_->control()),
                     ": loading and unloading models needs --model_control=explicit"));
  }
  if (!repository_name.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("repository_name: this server has one repository; leave it empty, got \"",
                     Abbreviate(repository_name), "\""));
  }
  for (const ControlParameter& parameter : parameters) {
    const std::string field = absl::StrCat("parameters.", Abbreviate(parameter.name));
    if (!load && parameter.name == "unload_dependents") {
      // Nothing depends on an attention model: true and false unload the same.
      if (!parameter.is_bool)
        return absl::InvalidArgumentError(absl::StrCat(field, ": expected a bool"));
      continue;
    }
    return absl::InvalidArgumentError(absl::StrCat(
        field, load ? ": not supported; the model loads from its directory in the repository"
                    : ": not supported; unload takes only unload_dependents"));
  }
  return load ? lifecycle_->Load(model_name) : lifecycle_->Unload(model_name);
}

}  // namespace mha::server

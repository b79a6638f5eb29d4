#include "server/models/model_lifecycle.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <set>
#include <utility>
#include <vector>

#include "absl/algorithm/container.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/log.h"
#include "base/status_macros.h"
#include "core/kv_cache.h"
#include "server/serving/abbreviate.h"
#include "server/serving/submit.h"

namespace mha::server {
namespace {

// Zero-filled floats from calloc: a large block comes as fresh zero pages, which a
// warm-up pass only reads (the inputs) and so never brings into memory. A bert_base
// batch of 32 x 256 is 25 MB of queries: a reload's warm-up does not hold it.
struct ZeroFloats {
  explicit ZeroFloats(int64_t n)
      : data(static_cast<float*>(
            std::calloc(static_cast<size_t>(std::max<int64_t>(n, 1)), sizeof(float)))) {}
  ~ZeroFloats() { std::free(data); }
  ZeroFloats(const ZeroFloats&) = delete;
  ZeroFloats& operator=(const ZeroFloats&) = delete;
  float* data;
};

// Submits `item` as a warm-up item and waits for its answer.
absl::Status WarmOnce(Batcher& batcher, const std::shared_ptr<const Model>& model,
                      const WarmupShape& shape) {
  const core::ModelConfig& c = model->config;
  const bool self = shape.num_keys == 0;
  const int64_t keys = self ? shape.num_queries : shape.num_keys;
  const ZeroFloats queries(shape.batch * shape.num_queries * c.query_size);
  const ZeroFloats key_data(self ? 0 : shape.batch * keys * c.key_size);
  const ZeroFloats value_data(self ? 0 : shape.batch * keys * c.value_size);
  const ZeroFloats output(shape.batch * shape.num_queries * c.num_hiddens);
  if (queries.data == nullptr || key_data.data == nullptr || value_data.data == nullptr ||
      output.data == nullptr) {
    return absl::ResourceExhaustedError("cannot allocate the warm-up pass's tensors");
  }
  return SubmitAndWait(batcher, WorkItem{.model = model,
                                         .inputs = {.batch = shape.batch,
                                                    .num_queries = shape.num_queries,
                                                    .num_keys = keys,
                                                    .queries = queries.data,
                                                    .keys = self ? nullptr : key_data.data,
                                                    .values = self ? nullptr : value_data.data,
                                                    .valid_lens = shape.valid_lens},
                                         .output = output.data,
                                         .warmup = true});
}

// Session steps (server/attention_v1/session.h) of 1, 2, 4, ... 64 new tokens (up to the
// batch limit), each on a fresh cache: their projections run on padded row counts
// (core: ForwardPaged), so these are the primitives continuously batched decode
// steps use, made before the first session needs them. Models that cannot serve
// sessions (additive scoring) skip it.
absl::Status WarmSessionSteps(Batcher& batcher, const std::shared_ptr<const Model>& model) {
  const core::ModelConfig& c = model->config;
  if (c.scoring != core::Scoring::kDotProduct) return absl::OkStatus();
  const bool self = c.SupportsSelfAttention();
  if (c.rope && !self) return absl::OkStatus();  // a rotary model's sessions are SELF only
  const int64_t most = std::min<int64_t>(64, model->batching.max_batch_size);
  core::KvCachePool pool(2 * most * c.num_hiddens * int64_t{sizeof(float)} *
                         core::KvCachePool::kBlockTokens);
  for (int64_t rows = 1; rows <= most; rows *= 2) {
    const ZeroFloats queries(rows * c.query_size);
    const ZeroFloats keys(self ? 0 : rows * c.key_size);
    const ZeroFloats values(self ? 0 : rows * c.value_size);
    const ZeroFloats output(rows * c.num_hiddens);
    if (queries.data == nullptr || keys.data == nullptr || values.data == nullptr ||
        output.data == nullptr) {
      return absl::ResourceExhaustedError("cannot allocate the session warm-up's tensors");
    }
    core::KvSequence cache(&pool, c.kv_heads(), c.head_size(), c.cache_bf16());
    MHA_RETURN_IF_ERROR(cache.Reserve(rows));
    const core::PagedStep step{.num_queries = rows,
                               .queries = queries.data,
                               .num_keys = rows,
                               .keys = self ? nullptr : keys.data,
                               .values = self ? nullptr : values.data,
                               .cache = &cache,
                               .output = output.data};
    MHA_RETURN_IF_ERROR(SubmitAndWait(
        batcher, WorkItem{.model = model,
                          .inputs = {.batch = 1, .num_queries = rows, .num_keys = rows},
                          .warmup = true,
                          .step = &step}));
  }
  return absl::OkStatus();
}

void Log(const std::string& line) { mha::log::Info(line); }

}  // namespace

absl::StatusOr<ModelControl> ParseModelControl(absl::string_view text) {
  if (text == "none") return ModelControl::kNone;
  if (text == "poll") return ModelControl::kPoll;
  if (text == "explicit") return ModelControl::kExplicit;
  return absl::InvalidArgumentError(
      absl::StrCat("model_control: expected none, poll or explicit, got \"", text, "\""));
}

absl::string_view ModelControlName(ModelControl control) {
  switch (control) {
    case ModelControl::kNone:
      return "none";
    case ModelControl::kPoll:
      return "poll";
    case ModelControl::kExplicit:
      return "explicit";
  }
  return "none";
}

absl::StatusOr<absl::Duration> WarmUp(Batcher& batcher, const std::shared_ptr<const Model>& model,
                                      size_t passes) {
  const absl::Time start = absl::Now();
  if (passes > 0 && !model->warmup.empty()) {
    // Every primitive a call of a new shape would build (core: Prepare), so that the
    // first request of a shape no pass makes computes like the next ones.
    const int built = model->attention->Prepare(
        model->batching.max_batch_tokens, model->limits.max_sequence_length, Batcher::kThreadRule);
    Log(absl::StrCat(
        "model ", model->name, ": ", built, " oneDNN primitives built in ",
        absl::FormatDuration(absl::Trunc(absl::Now() - start, absl::Milliseconds(1)))));
  }
  // Session steps first: the passes' last is what the first requests find in cache.
  if (absl::Status s = WarmSessionSteps(batcher, model); !s.ok()) {
    return absl::Status(
        s.code(), absl::StrCat("model ", model->name, ": session warm-up steps: ", s.message()));
  }
  for (size_t i = 0; i < std::min(passes, model->warmup.size()); ++i) {
    const WarmupShape& w = model->warmup[i];
    if (absl::Status s = WarmOnce(batcher, model, w); !s.ok()) {
      return absl::Status(
          s.code(), absl::StrCat("model ", model->name, ": warm-up pass ", i, " (batch ", w.batch,
                                 ", num_queries ", w.num_queries, ", num_keys ", w.num_keys,
                                 "): ", s.message()));
    }
  }
  return absl::Now() - start;
}

ModelLifecycle::ModelLifecycle(const Options& options, ModelRepository* models, ModelStates* states,
                               Batcher* batcher, Metrics* metrics)
    : options_(options), models_(models), states_(states), batcher_(batcher), metrics_(metrics) {}

ModelLifecycle::~ModelLifecycle() { Stop(); }

void ModelLifecycle::SetHealth(ServingCallback set_serving) {
  absl::MutexLock lock(&mu_);
  set_serving_ = std::move(set_serving);
}

void ModelLifecycle::StartPolling() {
  if (options_.control != ModelControl::kPoll || poller_.joinable()) return;
  absl::MutexLock lock(&poll_mu_);
  if (stop_polling_) return;  // stopped before the start-up warm-up ended
  poller_ = std::thread(&ModelLifecycle::PollLoop, this);
}

void ModelLifecycle::PollLoop() {
  while (true) {
    {
      absl::MutexLock lock(&poll_mu_);
      poll_mu_.AwaitWithTimeout(absl::Condition(&stop_polling_), options_.poll_interval);
      if (stop_polling_) return;
    }
    Reload(/*log_unchanged=*/false);
  }
}

void ModelLifecycle::Stop() {
  {
    absl::MutexLock lock(&poll_mu_);
    stop_polling_ = true;
  }
  if (poller_.joinable()) poller_.join();
  absl::MutexLock lock(&mu_);
  stopped_ = true;
}

void ModelLifecycle::SetServing(const std::string& name, bool serving) {
  if (set_serving_) set_serving_(name, serving);
}

absl::Status ModelLifecycle::Queue(const std::shared_ptr<const Model>& model) {
  MHA_RETURN_IF_ERROR(states_->Move(*model, ModelState::kLoading));
  MHA_RETURN_IF_ERROR(batcher_->AddModel(model, /*warming=*/true));
  return states_->Move(*model, ModelState::kWarming);
}

void ModelLifecycle::Ready(const Model& model) {
  batcher_->SetReady(&model);
  states_->Move(model, ModelState::kReady).IgnoreError();  // warming: allowed
}

// The batcher's retired queues then hold the last references (RemoveModel).
void ModelLifecycle::Fail(ModelRepository::Versions versions, const absl::Status& status) {
  std::vector<const Model*> failed;
  for (const auto& model : versions) {
    // A version the load did not reach has no state and no queue.
    if (!states_->Move(*model, ModelState::kFailed, status.message()).ok()) continue;
    states_->Forget(*model).IgnoreError();  // failed: allowed
    failed.push_back(model.get());
  }
  versions.clear();
  for (const Model* model : failed) batcher_->RemoveModel(model);
}

void ModelLifecycle::Retire(ModelRepository::Versions versions) {
  std::vector<const Model*> retired;
  for (const auto& model : versions) {
    states_->Move(*model, ModelState::kUnloading).IgnoreError();  // ready: allowed
    states_->Forget(*model).IgnoreError();
    retired.push_back(model.get());
  }
  versions.clear();
  for (const Model* model : retired) batcher_->RemoveModel(model);
}

absl::Status ModelLifecycle::QueueStartUpModels() {
  for (const auto& model : models_->models()) MHA_RETURN_IF_ERROR(Queue(model));
  return absl::OkStatus();
}

absl::StatusOr<std::vector<WarmupReport>> ModelLifecycle::StartUp() {
  std::vector<WarmupReport> reports;
  for (const auto& model : models_->models()) {
    absl::StatusOr<absl::Duration> took = WarmUp(*batcher_, model);
    if (!took.ok()) {
      states_->Move(*model, ModelState::kFailed, took.status().message()).IgnoreError();
      return took.status();
    }
    metrics_->Warmed(model->name, *took);
    reports.push_back({.model = model->name,
                       .passes = static_cast<int64_t>(model->warmup.size()),
                       .took = *took});
    absl::MutexLock lock(&mu_);
    Ready(*model);
    SetServing(model->name, true);
  }
  absl::MutexLock lock(&mu_);
  started_ = true;
  return reports;
}

absl::Status ModelLifecycle::LoadLocked(const std::string& name) {
  // What the served version (if any) warmed up with; no reference is kept: the
  // batcher's retired queue must end up holding its last one.
  bool replacing = false;
  std::optional<std::vector<WarmupShape>> served_default_warmup;
  if (absl::StatusOr<std::shared_ptr<const Model>> served = models_->Find(name); served.ok()) {
    replacing = true;
    if ((*served)->default_warmup) served_default_warmup = (*served)->warmup;
  }
  absl::StatusOr<ModelRepository::Versions> loaded = models_->Load(name);
  absl::Status status = loaded.status();
  if (status.ok()) {
    ModelRepository::Versions versions = *std::move(loaded);
    metrics_->AddModel(name);
    absl::Duration took;
    size_t passes = 0;
    for (const auto& model : versions) {
      status.Update(Queue(model));
      if (!status.ok()) break;
      // The default last pass grows the shared workspaces to the largest batch the
      // batcher may form for this model. When the version it replaces had the same
      // default passes, they are grown already: the passes before it (packing,
      // kernels, the common shapes' primitives) are enough, and the reload does not
      // hold that batch's tensors.
      passes = model->warmup.size();
      if (model->default_warmup && model->warmup == served_default_warmup && passes > 1) {
        passes -= 1;
      }
      absl::StatusOr<absl::Duration> warmed = WarmUp(*batcher_, model, passes);
      status.Update(warmed.status());
      if (!status.ok()) break;
      took += *warmed;
    }
    if (status.ok()) {
      std::vector<int64_t> numbers;
      for (const auto& model : versions) {
        Ready(*model);
        numbers.push_back(model->version);
      }
      const std::string source = versions.back()->weights_source;
      Retire(models_->Swap(std::move(versions)));
      metrics_->Warmed(name, took);
      metrics_->Loaded(name, true);
      SetServing(name, true);
      Log(absl::StrCat("model ", name, ": ", replacing ? "reloaded" : "loaded", ", version(s) ",
                       absl::StrJoin(numbers, ", "), ", weights ", source, ", warm-up ", passes,
                       " pass(es) in ", absl::FormatDuration(took)));
      return absl::OkStatus();
    }
    const std::string fingerprint = versions.front()->fingerprint;
    Fail(std::move(versions), status);
    models_->RecordFailure(name, fingerprint, status);
  }
  metrics_->Loaded(name, false);
  Log(absl::StrCat("model ", name, ": load failed, ",
                   replacing ? "the previous version keeps serving" : "not served", ": ",
                   status.message()));
  return status;
}

void ModelLifecycle::UnloadLocked(const std::string& name) {
  ModelRepository::Versions removed = models_->Remove(name);
  if (removed.empty()) return;
  SetServing(name, false);
  Retire(std::move(removed));
  Log(absl::StrCat("model ", name, ": unloaded"));
}

ModelLifecycle::ReloadReport ModelLifecycle::Reload(bool log_unchanged) {
  ReloadReport report;
  absl::MutexLock lock(&mu_);
  if (stopped_ || models_->options().path.empty()) return report;
  const absl::StatusOr<std::vector<std::string>> on_disk = models_->ListDirectory();
  if (!on_disk.ok()) {
    // Never read an unreadable repository as an empty one: nothing is unloaded.
    Log(absl::StrCat("repository: ", on_disk.status().message(), "; nothing changed"));
    return report;
  }
  const std::set<std::string> present(on_disk->begin(), on_disk->end());
  std::set<std::string> served;
  for (const auto& model : models_->models()) served.insert(model->name);
  const std::set<std::string>& wanted =
      options_.control == ModelControl::kExplicit ? served : present;
  for (const std::string& name : served) {
    if (present.contains(name)) continue;
    UnloadLocked(name);
    ++report.unloaded;
  }
  models_->ForgetFailures(present);
  for (const std::string& name : wanted) {
    if (!present.contains(name) || !models_->Changed(name)) continue;
    if (LoadLocked(name).ok()) {
      ++report.loaded;
    } else {
      ++report.failed;
    }
  }
  if (log_unchanged || report.loaded + report.unloaded + report.failed > 0) {
    Log(absl::StrCat("repository: reload done (loaded ", report.loaded, ", unloaded ",
                     report.unloaded, ", failed ", report.failed, ")"));
  }
  return report;
}

absl::Status ModelLifecycle::Load(const std::string& name) { return Control(name, true); }

absl::Status ModelLifecycle::Unload(const std::string& name) { return Control(name, false); }

absl::Status ModelLifecycle::Control(const std::string& name, bool load) {
  if (options_.control != ModelControl::kExplicit) {
    return absl::PermissionDeniedError(
        absl::StrCat("model_control is ", ModelControlName(options_.control),
                     ": loading and unloading models needs --model_control=explicit"));
  }
  if (!IsModelFolderName(name)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model_name: \"", Abbreviate(name), "\" is not a model folder name in the repository"));
  }
  absl::MutexLock lock(&mu_);
  if (stopped_) return absl::UnavailableError("the server is shutting down");
  if (!started_) {
    return absl::UnavailableError(
        "the server is still warming up its models; retry when its "
        "health is SERVING");
  }
  if (!load) {
    if (!models_->Find(name).ok()) {
      return absl::NotFoundError(
          absl::StrCat("model_name: \"", Abbreviate(name), "\" is not loaded"));
    }
    UnloadLocked(name);
    return absl::OkStatus();
  }
  // Only a folder of the repository: no state (index entry, metric series) is kept
  // for names that are not.
  MHA_ASSIGN_OR_RETURN(const std::vector<std::string> on_disk, models_->ListDirectory());
  if (!absl::c_binary_search(on_disk, name)) {
    return absl::NotFoundError(
        absl::StrCat("model_name: no folder \"", Abbreviate(name), "\" in the model repository"));
  }
  return LoadLocked(name);
}

}  // namespace mha::server

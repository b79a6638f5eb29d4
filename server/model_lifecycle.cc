#include "server/model_lifecycle.h"

#include <cstdio>
#include <optional>
#include <set>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"
#include "server/abbreviate.h"

namespace mha::server {
namespace {

// One warm-up pass through the batcher, as a request would run: fixed inputs in
// [-0.5, 0.5], K 0 = self-attention.
absl::Status WarmOnce(Batcher& batcher, const std::shared_ptr<const Model>& model,
                      const WarmupShape& shape) {
  const core::ModelConfig& c = model->config;
  const bool self = shape.num_keys == 0;
  const int64_t keys = self ? shape.num_queries : shape.num_keys;
  const auto filled = [](int64_t n) {
    std::vector<float> v(static_cast<size_t>(n));
    for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(i % 17) / 16.0f - 0.5f;
    return v;
  };
  const std::vector<float> queries = filled(shape.batch * shape.num_queries * c.query_size);
  const std::vector<float> key_data = filled(self ? 0 : shape.batch * keys * c.key_size);
  const std::vector<float> value_data = filled(self ? 0 : shape.batch * keys * c.value_size);
  std::vector<float> output(static_cast<size_t>(shape.batch * shape.num_queries * c.num_hiddens));
  absl::Mutex mu;
  std::optional<absl::Status> result;
  MHA_RETURN_IF_ERROR(
      batcher.Submit(WorkItem{.model = model,
                              .inputs = {.batch = shape.batch,
                                         .num_queries = shape.num_queries,
                                         .num_keys = keys,
                                         .queries = queries.data(),
                                         .keys = self ? nullptr : key_data.data(),
                                         .values = self ? nullptr : value_data.data()},
                              .output = output.data(),
                              .done =
                                  [&](absl::Status status, const ComputeTiming&) {
                                    absl::MutexLock lock(&mu);
                                    result = std::move(status);
                                  },
                              .warmup = true}));
  absl::MutexLock lock(&mu);
  mu.Await(absl::Condition(
      +[](std::optional<absl::Status>* r) { return r->has_value(); }, &result));
  return *result;
}

void Log(const std::string& line) { std::fprintf(stderr, "%s\n", line.c_str()); }

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

absl::StatusOr<absl::Duration> WarmUp(Batcher& batcher, const std::shared_ptr<const Model>& model) {
  const absl::Time start = absl::Now();
  for (size_t i = 0; i < model->warmup.size(); ++i) {
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

ModelLifecycle::ModelLifecycle(const Options& options, ModelRepository* models, Batcher* batcher,
                               Metrics* metrics)
    : options_(options), models_(models), batcher_(batcher), metrics_(metrics) {}

ModelLifecycle::~ModelLifecycle() { Stop(); }

void ModelLifecycle::SetHealth(grpc::HealthCheckServiceInterface* health) {
  absl::MutexLock lock(&mu_);
  health_ = health;
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
    Reload();
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
  if (health_ != nullptr) health_->SetServingStatus(name, serving);
}

namespace {

// Takes the models' addresses and drops the references: the batcher's queues,
// retired with RemoveModel, then hold the last ones.
std::vector<const Model*> Release(ModelRepository::Versions versions) {
  std::vector<const Model*> released;
  for (const auto& model : versions) released.push_back(model.get());
  return released;
}

}  // namespace

absl::Status ModelLifecycle::LoadLocked(const std::string& name) {
  const bool replacing = models_->Find(name).ok();
  absl::StatusOr<ModelRepository::Versions> loaded = models_->Load(name);
  absl::Status status = loaded.status();
  if (status.ok()) {
    ModelRepository::Versions versions = *std::move(loaded);
    metrics_->AddModel(name);
    absl::Duration took;
    for (const auto& model : versions) {
      status.Update(batcher_->AddModel(model, /*warming=*/true));
      if (!status.ok()) break;
      absl::StatusOr<absl::Duration> warmed = WarmUp(*batcher_, model);
      status.Update(warmed.status());
      if (!status.ok()) break;
      took += *warmed;
    }
    if (status.ok()) {
      std::vector<int64_t> numbers;
      for (const auto& model : versions) {
        batcher_->SetReady(model.get());
        numbers.push_back(model->version);
      }
      const std::string source = versions.back()->weights_source;
      const size_t passes = versions.back()->warmup.size();
      for (const Model* old : Release(models_->Swap(std::move(versions)))) {
        batcher_->RemoveModel(old);
      }
      metrics_->Warmed(name, took);
      metrics_->Loaded(name, true);
      SetServing(name, true);
      Log(absl::StrCat("model ", name, ": ", replacing ? "reloaded" : "loaded", ", version(s) ",
                       absl::StrJoin(numbers, ", "), ", weights ", source, ", warm-up ", passes,
                       " pass(es) in ", absl::FormatDuration(took)));
      return absl::OkStatus();
    }
    const std::string fingerprint = versions.front()->fingerprint;
    for (const Model* model : Release(std::move(versions))) batcher_->RemoveModel(model);
    models_->RecordFailure(name, fingerprint, status);
  }
  metrics_->Loaded(name, false);
  Log(absl::StrCat("model ", name, ": load failed, ",
                   replacing ? "the previous version keeps serving" : "not served", ": ",
                   status.message()));
  return status;
}

void ModelLifecycle::UnloadLocked(const std::string& name) {
  const std::vector<const Model*> removed = Release(models_->Remove(name));
  if (removed.empty()) return;
  SetServing(name, false);
  for (const Model* model : removed) batcher_->RemoveModel(model);
  Log(absl::StrCat("model ", name, ": unloaded"));
}

ModelLifecycle::ReloadReport ModelLifecycle::Reload() {
  ReloadReport report;
  absl::MutexLock lock(&mu_);
  if (stopped_ || models_->options().path.empty()) return report;
  std::set<std::string> served;
  for (const auto& model : models_->models()) served.insert(model->name);
  std::set<std::string> wanted;
  if (options_.control == ModelControl::kExplicit) {
    wanted = served;
  } else {
    for (const std::string& name : models_->ListDirectory()) wanted.insert(name);
  }
  const std::vector<std::string> on_disk = models_->ListDirectory();
  const std::set<std::string> present(on_disk.begin(), on_disk.end());
  for (const std::string& name : served) {
    if (present.contains(name) && wanted.contains(name)) continue;
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
  Log(absl::StrCat("repository: reload done (loaded ", report.loaded, ", unloaded ",
                   report.unloaded, ", failed ", report.failed, ")"));
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
  absl::MutexLock lock(&mu_);
  if (stopped_) return absl::UnavailableError("the server is shutting down");
  if (load) return LoadLocked(name);
  if (!models_->Find(name).ok()) {
    return absl::NotFoundError(absl::StrCat("model: \"", Abbreviate(name), "\" is not loaded"));
  }
  UnloadLocked(name);
  return absl::OkStatus();
}

}  // namespace mha::server

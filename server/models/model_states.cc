#include "server/models/model_states.h"

#include <algorithm>
#include <tuple>

#include "absl/strings/str_cat.h"

namespace mha::server {
namespace {

// Whether `from` may move to `to` (model_states.h's drawing).
bool Allowed(ModelState from, ModelState to) {
  switch (from) {
    case ModelState::kLoading:
      return to == ModelState::kWarming || to == ModelState::kFailed;
    case ModelState::kWarming:
      return to == ModelState::kReady || to == ModelState::kFailed;
    case ModelState::kReady:
      return to == ModelState::kUnloading;
    case ModelState::kUnloading:
    case ModelState::kFailed:
      return false;
  }
  return false;
}

}  // namespace

absl::string_view ModelStateName(ModelState state) {
  switch (state) {
    case ModelState::kLoading:
      return "loading";
    case ModelState::kWarming:
      return "warming";
    case ModelState::kReady:
      return "ready";
    case ModelState::kUnloading:
      return "unloading";
    case ModelState::kFailed:
      return "failed";
  }
  return "unknown";
}

absl::Status ModelStates::Move(const Model& model, ModelState to, absl::string_view reason) {
  absl::MutexLock lock(&mu_);
  const auto it = versions_.find(&model);
  if (it == versions_.end()) {
    if (to != ModelState::kLoading) {
      return absl::FailedPreconditionError(absl::StrCat("model ", model.name, " version ",
                                                        model.version, ": not known, cannot be ",
                                                        ModelStateName(to)));
    }
    versions_.emplace(&model, Entry{.state = to});
    return absl::OkStatus();
  }
  if (!Allowed(it->second.state, to)) {
    return absl::FailedPreconditionError(
        absl::StrCat("model ", model.name, " version ", model.version, ": cannot move from ",
                     ModelStateName(it->second.state), " to ", ModelStateName(to)));
  }
  it->second = Entry{.state = to, .reason = std::string(reason)};
  return absl::OkStatus();
}

absl::Status ModelStates::Forget(const Model& model) {
  absl::MutexLock lock(&mu_);
  const auto it = versions_.find(&model);
  if (it == versions_.end() || (it->second.state != ModelState::kUnloading &&
                                it->second.state != ModelState::kFailed)) {
    return absl::FailedPreconditionError(
        absl::StrCat("model ", model.name, " version ", model.version,
                     ": only an unloading or failed version is forgotten"));
  }
  versions_.erase(it);
  return absl::OkStatus();
}

void ModelStates::ShuttingDown() {
  absl::MutexLock lock(&mu_);
  shutting_down_ = true;
}

absl::Status ModelStates::Serving() const {
  absl::MutexLock lock(&mu_);
  if (shutting_down_) return absl::UnavailableError("the server is shutting down");
  return absl::OkStatus();
}

absl::Status ModelStates::Readiness(const Model& model) const {
  absl::MutexLock lock(&mu_);
  return ReadinessLocked(model);
}

ModelStates::IndexEntry ModelStates::Index(const Model& model) const {
  absl::MutexLock lock(&mu_);
  return IndexLocked(model);
}

std::vector<ModelStates::Version> ModelStates::Versions() const {
  absl::MutexLock lock(&mu_);
  std::vector<Version> versions;
  for (const auto& [model, entry] : versions_) {
    versions.push_back({.name = model->name, .version = model->version, .entry = IndexLocked(*model)});
  }
  std::sort(versions.begin(), versions.end(), [](const Version& a, const Version& b) {
    return std::tie(a.name, a.version) < std::tie(b.name, b.version);
  });
  return versions;
}

absl::Status ModelStates::ReadinessLocked(const Model& model) const {
  if (shutting_down_) return absl::UnavailableError("the server is shutting down");
  const auto it = versions_.find(&model);
  if (it == versions_.end()) {
    return absl::UnavailableError(absl::StrCat("model ", model.name, " is not served"));
  }
  switch (it->second.state) {
    case ModelState::kReady:
      return absl::OkStatus();
    case ModelState::kWarming:
      return absl::UnavailableError(absl::StrCat("model ", model.name, " is warming up"));
    case ModelState::kLoading:
      return absl::UnavailableError(absl::StrCat("model ", model.name, " is loading"));
    case ModelState::kUnloading:
      return absl::UnavailableError(absl::StrCat("model ", model.name, " is unloading"));
    case ModelState::kFailed:
      return absl::UnavailableError(
          absl::StrCat("model ", model.name, " failed to load: ", it->second.reason));
  }
  return absl::UnavailableError(absl::StrCat("model ", model.name, " is not served"));
}

ModelStates::IndexEntry ModelStates::IndexLocked(const Model& model) const {
  const absl::Status readiness = ReadinessLocked(model);
  if (readiness.ok()) return {.state = "READY"};
  const auto it = versions_.find(&model);
  std::string state = "UNAVAILABLE";
  if (!shutting_down_ && it != versions_.end()) {
    if (it->second.state == ModelState::kLoading) state = "LOADING";
    if (it->second.state == ModelState::kUnloading) state = "UNLOADING";
  }
  return {.state = std::move(state), .reason = std::string(readiness.message())};
}

}  // namespace mha::server

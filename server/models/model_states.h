// The state of every model version the server loads, the one place its readiness
// answers read: gRPC health (per model and overall), KServe ServerReady,
// ModelReady and RepositoryIndex over gRPC and HTTP (server/kserve/answers.h).
// server/models/model_lifecycle.h moves versions through it; the batcher's
// warming gate (Batcher::AddModel, SetReady) is set in the same steps.
//
//   loading --> warming --> ready --> unloading --> (forgotten)
//      |           |
//      +-----------+--> failed (with the reason) --> (forgotten)
//
// A version is loading from when its files are read until its warm-up starts, and
// unloading from when it stops being found until its queue is retired.
//
// Readiness answers, and the index's states (Triton's strings):
//   ready      OK                                                  READY
//   warming    UNAVAILABLE "model m is warming up"                 UNAVAILABLE
//   loading    UNAVAILABLE "model m is loading"                    LOADING
//   unloading  UNAVAILABLE "model m is unloading"                  UNLOADING
//   failed     UNAVAILABLE "model m failed to load: <reason>"      UNAVAILABLE
//   unknown    UNAVAILABLE "model m is not served"                 UNAVAILABLE
// and every answer is UNAVAILABLE "the server is shutting down" after ShuttingDown.
//
// Thread safety: thread-safe.
#ifndef MHA_SERVER_MODELS_MODEL_STATES_H_
#define MHA_SERVER_MODELS_MODEL_STATES_H_

#include <map>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "server/serving/model.h"

namespace mha::server {

enum class ModelState { kLoading, kWarming, kReady, kUnloading, kFailed };
absl::string_view ModelStateName(ModelState state);  // "loading", ..., "failed"

class ModelStates {
 public:
  // Moves `model` to `to` (kLoading: a version not known yet; kFailed: with
  // `reason`). FAILED_PRECONDITION naming the model and both states for a move
  // not drawn above; the state is then unchanged.
  absl::Status Move(const Model& model, ModelState to, absl::string_view reason = "");
  // An unloading or failed version is gone; FAILED_PRECONDITION otherwise.
  absl::Status Forget(const Model& model);

  // From now on every readiness answer is UNAVAILABLE (shutdown). Idempotent.
  void ShuttingDown();
  // OK until ShuttingDown; then UNAVAILABLE "the server is shutting down".
  absl::Status Serving() const;

  // OK when `model` is ready; UNAVAILABLE with the reason otherwise (above).
  absl::Status Readiness(const Model& model) const;
  // The index's state of `model` (above) and its reason ("" when ready).
  struct IndexEntry {
    std::string state;
    std::string reason;
  };
  IndexEntry Index(const Model& model) const;
  // Every version known now, by name then version, with its index entry.
  struct Version {
    std::string name;
    int64_t version = 0;
    IndexEntry entry;
  };
  std::vector<Version> Versions() const;

 private:
  struct Entry {
    ModelState state;
    std::string reason;  // kFailed's
  };
  IndexEntry IndexLocked(const Model& model) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status ReadinessLocked(const Model& model) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  mutable absl::Mutex mu_;
  std::map<const Model*, Entry> versions_ ABSL_GUARDED_BY(mu_);
  bool shutting_down_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace mha::server

#endif  // MHA_SERVER_MODELS_MODEL_STATES_H_

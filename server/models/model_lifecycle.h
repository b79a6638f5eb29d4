// Model lifecycle while the server serves: reloading changed models, loading new
// ones and unloading removed ones, without failing a request (Triton's model
// control modes).
//
// Modes (--model_control):
//   none      every model in the repository loads at start-up; SIGHUP (Reload)
//             re-reads the repository directory.
//   poll      as none, and the directory is also re-read every poll interval
//             (--repository_poll_secs).
//   explicit  start-up loads only --load_models (none when empty); the repository
//             RPCs (Load, Unload) load and unload, and Reload re-reads the models
//             that are loaded.
//
// A re-read lists the repository (one that cannot be listed changes nothing) and
// compares each model directory's files (names, sizes, modification times, version
// folders included) with those of the served model:
//   - a changed model loads and warms up beside the old one, then replaces it in
//     one step (ModelRepository::Swap). When both have the default warm-up with the
//     same passes, only the first runs: the second grows the workspaces, which all
//     models share and the old version has grown. Requests that found the old model before
//     the swap finish on it; later ones get the new one. The old model is freed
//     after its last request (server/serving/batcher.h RemoveModel).
//   - a new directory loads, warms up, then serves; its health turns SERVING.
//   - a removed directory stops being found (NOT_FOUND), its queued requests
//     finish, and it is freed after its last request; its health NOT_SERVING.
//   - a model that fails to load or warm up keeps its previous version serving
//     (or stays unserved); the failure is logged with the model and file named,
//     counted in mha_model_loads_total{result="failed"}, and shown by
//     RepositoryIndex with the reason. It is tried again when its files change.
// Each load runs beside serving: its warm-up passes queue with requests on the
// compute workers. One lifecycle change runs at a time.
//
// Log: one line on stderr per change ("model a: reloaded", "model c: loaded",
// "model b: unloaded", "model a: load failed, ...: <error>") and, after a re-read,
// "repository: reload done (loaded L, unloaded U, failed F)".
//
// Thread safety: every method is thread-safe.
#ifndef MHA_SERVER_MODELS_MODEL_LIFECYCLE_H_
#define MHA_SERVER_MODELS_MODEL_LIFECYCLE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/models/model_repository.h"
#include "server/models/model_states.h"
#include "server/serving/batcher.h"
#include "server/serving/metrics.h"

namespace mha::server {

enum class ModelControl { kNone, kPoll, kExplicit };

// "none", "poll" or "explicit"; INVALID_ARGUMENT naming model_control otherwise.
absl::StatusOr<ModelControl> ParseModelControl(absl::string_view text);
absl::string_view ModelControlName(ModelControl control);

// Runs `model`'s first `passes` warm-up passes, in order, through the batcher (they
// run as requests do, on the compute workers), then session steps of 1, 2, 4, ...
// 64 tokens (the row counts continuously batched decode steps run on), returning
// the time they took; the first failure names the model and the pass. The model's
// queue must admit warm-up items. Inputs are zero pages (calloc), never brought
// into memory.
absl::StatusOr<absl::Duration> WarmUp(Batcher& batcher, const std::shared_ptr<const Model>& model,
                                      size_t passes = SIZE_MAX);

// One model's start-up warm-up.
struct WarmupReport {
  std::string model;
  int64_t passes = 0;
  absl::Duration took;
};

class ModelLifecycle {
 public:
  struct Options {
    ModelControl control = ModelControl::kNone;
    absl::Duration poll_interval = absl::Seconds(15);  // kPoll
  };
  struct ReloadReport {
    int loaded = 0;    // new or changed models now serving
    int unloaded = 0;  // removed models
    int failed = 0;    // loads that failed (the previous version keeps serving)
  };

  // The repository, states, batcher and metrics outlive the lifecycle. Every
  // version it loads, warms, serves and unloads moves through `states`
  // (server/models/model_states.h), which every readiness answer reads.
  ModelLifecycle(const Options& options, ModelRepository* models, ModelStates* states,
                 Batcher* batcher, Metrics* metrics);
  ~ModelLifecycle();  // Stop()

  // Called with a model's name and whether it serves as it turns ready or is
  // unloaded, start-up included (the server sets its gRPC health from it).
  using ServingCallback = std::function<void(const std::string& name, bool serving)>;
  void SetHealth(ServingCallback set_serving);

  // Start-up, before serving: queues the models the repository loaded at Create,
  // warming (their requests get UNAVAILABLE naming the warm-up). INVALID_ARGUMENT
  // naming the model and max_queue_size when a queue cannot be made.
  absl::Status QueueStartUpModels();
  // Start-up: warms those models up, in order, as a load does (warming, then
  // ready and SERVING); the first failure stops it, naming the model and the pass
  // (the models not warmed never serve; the caller should shut down). Load and
  // Unload are UNAVAILABLE until it has succeeded.
  absl::StatusOr<std::vector<WarmupReport>> StartUp();
  // kPoll: starts re-reading the repository every poll interval. Otherwise nothing.
  void StartPolling();
  // Stops polling and refuses later changes (shutdown). Idempotent.
  void Stop();

  // SIGHUP: re-reads the repository (kNone, kPoll) or the loaded models (kExplicit).
  // A repository that cannot be listed changes nothing (logged). The summary line is
  // logged when something changed, or always with `log_unchanged` (SIGHUP; the
  // poller passes false).
  ReloadReport Reload(bool log_unchanged = true);
  // The repository RPCs. PERMISSION_DENIED unless kExplicit; INVALID_ARGUMENT
  // naming model_name for a name that is not a plain folder name ("", "../x");
  // UNAVAILABLE until the start-up warm-up has ended (StartUp). Load (re)loads
  // `name` from its folder (NOT_FOUND when the repository has none) and serves it
  // once warm: the load's error, naming the file, when it fails (the previous
  // version keeps serving). Unload: NOT_FOUND when `name` is not served.
  absl::Status Load(const std::string& name);
  absl::Status Unload(const std::string& name);

  ModelControl control() const { return options_.control; }

 private:
  // Load (`load`) or Unload, after their checks.
  absl::Status Control(const std::string& name, bool load);
  // Loads, warms and swaps in `name`; logs the outcome.
  absl::Status LoadLocked(const std::string& name) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void UnloadLocked(const std::string& name) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A version's steps (model_states.h): queued warming; ready and admitted;
  // failed (its queue retired); unloading and gone (its queue retired).
  absl::Status Queue(const std::shared_ptr<const Model>& model);
  void Ready(const Model& model);
  void Fail(ModelRepository::Versions versions, const absl::Status& status);
  void Retire(ModelRepository::Versions versions);
  void SetServing(const std::string& name, bool serving) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void PollLoop();

  const Options options_;
  ModelRepository* const models_;
  ModelStates* const states_;
  Batcher* const batcher_;
  Metrics* const metrics_;
  absl::Mutex mu_;  // one change at a time
  ServingCallback set_serving_ ABSL_GUARDED_BY(mu_);  // empty until SetHealth
  bool started_ ABSL_GUARDED_BY(mu_) = false;         // StartUp succeeded
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  absl::Mutex poll_mu_;
  bool stop_polling_ ABSL_GUARDED_BY(poll_mu_) = false;
  std::thread poller_;
};

}  // namespace mha::server

#endif  // MHA_SERVER_MODELS_MODEL_LIFECYCLE_H_

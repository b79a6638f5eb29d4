// The models layer's store: the models a server serves, read from a repository
// folder into versions (files -> Model), and the served set. Loaded at start-up, then
// reloaded, added and removed while the server serves: server/models/model_lifecycle.h
// decides when and warms them up; this unit reads the files and holds the served set.
// It is the serving layer's ModelSource (server/serving/model_source.h).
//
// Layout of a model repository:
//   <repo>/<name>/config.pbtxt        text-format attention.v1.ModelConfig
//   <repo>/<name>/weights.safetensors unless config.pbtxt declares `seeded { seed }`
//                                      or names another `file`
// or, with versions, numbered folders holding each version's weights:
//   <repo>/<name>/config.pbtxt        applies to every version
//   <repo>/<name>/<n>/weights.safetensors
// config.pbtxt's version_policy picks the versions served (default: the newest);
// a model without version folders is version 1.
// Every sub-directory not starting with '.' is a model. With no repository the
// server serves one embedded model, "default": d2l's toy sizes (p_o 100, h 5,
// d_q = d_k = d_v = 100), SeededWeights(config, kDefaultModelSeed).
//
// Served models are shared: Find hands out a reference that keeps the model (and
// its weights) alive for as long as a request holds it, so a request admitted
// before a Swap or Remove finishes on the model it found, and the old model is
// freed when its last request is answered.
//
// Thread safety: every method is thread-safe.
#ifndef MHA_SERVER_MODELS_MODEL_REPOSITORY_H_
#define MHA_SERVER_MODELS_MODEL_REPOSITORY_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "core/attention.h"
#include "core/config.h"
#include "proto/model_config.pb.h"
#include "server/serving/model.h"
#include "server/serving/model_source.h"

namespace mha::server {

class ModelRepository final : public ModelSource {
 public:
  struct Options {
    std::string path;                 // "" = the embedded default model
    ModelLimits default_limits;       // used for every limit a config leaves at 0
    BatchingPolicy default_batching;  // likewise for `batching { ... }`
    int num_threads = 0;              // OpenMP threads per forward call (0: OpenMP default)
    // A model whose config lists no `warmup` runs DefaultWarmup's passes.
    bool default_warmup = true;
    // Load only these models at Create (explicit model control; may be empty);
    // nullopt = every model directory, at least one.
    std::optional<std::vector<std::string>> only;
    // An empty repository is served (no model yet: poll model control, which loads
    // models as they appear); otherwise it fails Create.
    bool allow_empty = false;
  };

  // Loads the models (Options::only, or every directory). INVALID_ARGUMENT /
  // NOT_FOUND naming the model and the file on any fault: at start-up a model that
  // does not load fails the server.
  static absl::StatusOr<std::unique_ptr<ModelRepository>> Create(const Options& options);

  // name "" resolves to "default" if served, else to the only model; version ""
  // to its newest version served. NOT_FOUND names the unknown model and lists the
  // served ones, or names model_version and lists the model's versions;
  // INVALID_ARGUMENT when "" is ambiguous.
  absl::StatusOr<std::shared_ptr<const Model>> Find(absl::string_view name,
                                                    absl::string_view version = "") const override;

  // The served models, every version, sorted by name then version.
  std::vector<std::shared_ptr<const Model>> models() const;

  // Lifecycle (server/models/model_lifecycle.h). A model's files are its directory's
  // regular files; their names, sizes and modification times are its fingerprint.

  // The model directories on disk now, sorted; empty for the embedded model.
  // Entries that cannot be read (a dangling link) are left out; UNAVAILABLE naming
  // the repository when the directory itself cannot be listed.
  absl::StatusOr<std::vector<std::string>> ListDirectory() const;
  // Whether `name`'s files (its version folders' too) differ from those of its
  // served versions or of its last failed load (true for a model neither served
  // nor tried).
  bool Changed(const std::string& name) const;
  // Reads `name`'s directory into new models, one per version its version_policy
  // serves, not yet served. Every model shares one pool of workspaces
  // (core::MultiHeadAttention::ShareWorkspacesWith): the server holds one per
  // forward call in progress, grown to the largest call of any model, instead of a
  // set per model. On failure the status names the model and
  // the file, and is recorded (Failures). INVALID_ARGUMENT naming `model` for a
  // name that is not a plain directory name (empty, starting with '.', holding '/').
  using Versions = std::vector<std::shared_ptr<const Model>>;  // ascending
  absl::StatusOr<Versions> Load(const std::string& name);
  // Records a failure after Load (the warm-up failed) for files `fingerprint`.
  void RecordFailure(const std::string& name, const std::string& fingerprint,
                     const absl::Status& status);
  // Drops the failures of models neither served nor in `present`.
  void ForgetFailures(const std::set<std::string>& present);
  // Serves `versions` (of one model, from Load) from now on, in place of every
  // version served before; returns those. Clears the model's failure.
  Versions Swap(Versions versions);
  // Stops serving `name` (Find answers NOT_FOUND); returns its versions.
  Versions Remove(const std::string& name);

  // The last failed load of every model whose newest files did not load: name ->
  // the error (naming the file). A served model keeps serving its previous files.
  std::map<std::string, std::string> Failures() const;

  const Options& options() const { return options_; }

 private:
  explicit ModelRepository(const Options& options) : options_(options) {}
  std::string Fingerprint(const std::string& name) const;

  const Options options_;
  mutable absl::Mutex mu_;
  struct Entry {
    Versions versions;               // empty: not served
    std::string fingerprint;         // of the served versions' files
    std::string failed_fingerprint;  // of the last load that failed
    std::string failure;             // its error; "" after a good load
  };
  std::map<std::string, Entry, std::less<>> models_ ABSL_GUARDED_BY(mu_);
};

// Whether `name` can name a model folder of a repository: not empty, not starting
// with '.' (skipped, as hidden), no '/' or NUL (it stays inside the repository).
bool IsModelFolderName(absl::string_view name);

// Parses config.pbtxt text. `source` names the file in error messages.
absl::StatusOr<attention::v1::ModelConfig> ParseModelConfig(absl::string_view text,
                                                            absl::string_view source);

// A parsed config checked for model `name` (its directory name): the core's sizes
// (ModelConfig::Validate passed), the limits and the batching policy with the
// server's defaults (options.default_limits, options.default_batching) filled in for
// every 0. No file access and no allocation proportional to the sizes.
// INVALID_ARGUMENT naming the field, without the model/file context (LoadModel adds it).
struct ResolvedModelConfig {
  core::ModelConfig config;
  ModelLimits limits;
  BatchingPolicy batching;
  std::vector<WarmupShape> warmup;  // each within the limits
  bool default_warmup = false;      // `warmup` is DefaultWarmup's
};
// The warm-up of a model whose config.pbtxt lists none: four passes that leave the
// first real request of each common kind little to set up (docs/service.md, "Warm-up"):
//   1. B 1, Q = min(128, max_sequence_length), self-attention when the model can
//      (else K = Q): packs the weights into the layout the projections use (a 2-3 ms
//      reorder for bert_base), compiles the kernels and creates the common blocks'
//      primitives;
//   2. B 1, Q = that length / 2, K = that length, keys given: cross-attention, K != Q
//      (the separate key/value projections and their packed weights; K > Q so that a
//      rotary model, whose queries are the last Q keys, accepts it);
//   3. B 2, Q 4, K 6 with keys and valid_lens [3, 2] (within the limits):
//      attention_client's default request (d2l's toy request), the small-call path
//      and the per-row key prefix that valid_lens shorter than K project (a 3-D GEMM
//      whose primitive is made per longest valid length);
//   4. the largest call the batcher may form: B = the batching max_batch_size, Q = K =
//      min(max_sequence_length, max_batch_tokens / B), which grows the workspaces to
//      their steady size, so memory does not step up under later load.
// A request of a new shape then costs only its own primitives (tenths of a ms each).
std::vector<WarmupShape> DefaultWarmup(const core::ModelConfig& config, const ModelLimits& limits,
                                       const BatchingPolicy& batching);

absl::StatusOr<ResolvedModelConfig> ResolveModelConfig(const attention::v1::ModelConfig& proto,
                                                       absl::string_view name,
                                                       const ModelRepository::Options& options);

// Loads <dir>/config.pbtxt and the weights of every version it serves, as model
// `name` (the directory name). ModelRepository::Load is this with the
// repository's bookkeeping.
absl::StatusOr<std::vector<std::unique_ptr<Model>>> LoadModelVersions(
    const std::string& dir, const std::string& name, const ModelRepository::Options& options);

}  // namespace mha::server

#endif  // MHA_SERVER_MODELS_MODEL_REPOSITORY_H_

// The models a server serves, loaded once at start-up and immutable afterwards.
//
// Layout of a model repository:
//   <repo>/<name>/config.pbtxt        text-format attention.v1.ModelConfig
//   <repo>/<name>/weights.safetensors unless config.pbtxt declares `seeded { seed }`
//                                      or names another `file`
// Every sub-directory is a model; one that fails to load fails the whole
// repository with a message naming the model and the file. With no repository
// the server serves one embedded model, "default": d2l's toy sizes (p_o 100, h 5,
// d_q = d_k = d_v = 100), SeededWeights(config, kDefaultModelSeed).
//
// Thread safety: immutable after Create; all methods are thread-safe.
#ifndef MHA_SERVER_MODEL_REPOSITORY_H_
#define MHA_SERVER_MODEL_REPOSITORY_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "core/attention.h"
#include "core/config.h"
#include "proto/model_config.pb.h"
#include "server/model.h"

namespace mha::server {

class ModelRepository {
 public:
  struct Options {
    std::string path;                 // "" = the embedded default model
    ModelLimits default_limits;       // used for every limit a config leaves at 0
    BatchingPolicy default_batching;  // likewise for `batching { ... }`
    int num_threads = 0;              // OpenMP threads per forward call (0: OpenMP default)
    // A model whose config lists no `warmup` runs DefaultWarmup's passes.
    bool default_warmup = true;
  };

  // INVALID_ARGUMENT / NOT_FOUND naming the model and the file on any fault.
  static absl::StatusOr<std::unique_ptr<ModelRepository>> Create(const Options& options);

  // name "" resolves to "default" if served, else to the only model. NOT_FOUND
  // names the unknown model and lists the served ones; INVALID_ARGUMENT when ""
  // is ambiguous.
  absl::StatusOr<const Model*> Find(absl::string_view name) const;

  // Sorted by name.
  std::vector<const Model*> models() const;

 private:
  ModelRepository() = default;
  std::map<std::string, std::unique_ptr<Model>, std::less<>> models_;
};

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
};
// The warm-up of a model whose config.pbtxt lists none: two passes that leave the
// first real request little to set up (docs/performance.md, "Warm start"):
//   1. B 1, Q = min(128, max_sequence_length), self-attention when the model can
//      (else K = Q): packs the weights into the layout the projections use (a 2-3 ms
//      reorder for bert_base), compiles the kernels and creates the common blocks'
//      primitives;
//   2. the largest call the batcher may form: B = the batching max_batch_size, Q = K =
//      min(max_sequence_length, max_batch_tokens / B), which grows the workspaces to
//      their steady size, so memory does not step up under later load.
// A request of a new shape then costs only its own primitives (tenths of a ms each).
std::vector<WarmupShape> DefaultWarmup(const core::ModelConfig& config, const ModelLimits& limits,
                                       const BatchingPolicy& batching);

absl::StatusOr<ResolvedModelConfig> ResolveModelConfig(const attention::v1::ModelConfig& proto,
                                                       absl::string_view name,
                                                       const ModelRepository::Options& options);

// Loads <dir>/config.pbtxt and its weights as model `name` (the directory name).
absl::StatusOr<std::unique_ptr<Model>> LoadModel(const std::string& dir, const std::string& name,
                                                 const ModelRepository::Options& options);

}  // namespace mha::server

#endif  // MHA_SERVER_MODEL_REPOSITORY_H_

// What the Open Inference Protocol answers, whichever transport carries it: the gRPC
// front (server/kserve_grpc/) and the HTTP front (server/kserve_http/) both call these,
// so that each call is written once. Messages only (proto/inference/*.pb.h); no gRPC
// service, no HTTP.
//
//   DecodeInfer        decode and validate one infer request for the submit path
//   ToTritonConfig     ModelConfig          (max_batch_size 0, dims = full shapes)
//   ToModelMetadata    ModelMetadata        (-1 for variable dimensions)
//   ToServerMetadata   ServerMetadata       (name "mha-serve", version, extensions)
//   CollectStatistics  ModelStatistics      (from the counters /metrics exposes)
//   KserveModels       ServerReady, ModelReady, RepositoryIndex, and the repository
//                      RPCs (load, unload: explicit model control only,
//                      server/models/model_lifecycle.h, else PERMISSION_DENIED;
//                      unload takes Triton's unload_dependents and ignores it)
//
// Thread safety: thread-safe; the repository, batcher, lifecycle and metrics must
// outlive what uses them.
#ifndef MHA_SERVER_KSERVE_ANSWERS_H_
#define MHA_SERVER_KSERVE_ANSWERS_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "proto/inference/grpc_service.pb.h"
#include "server/kserve/inference_codec.h"
#include "server/models/model_lifecycle.h"
#include "server/models/model_repository.h"
#include "server/models/model_states.h"
#include "server/serving/batcher.h"
#include "server/serving/metrics.h"
#include "server/serving/submit.h"

namespace mha::server {

inline constexpr char kServerName[] = "mha-serve";

// Decodes and validates `request` for `model` (found and admitted by the submit
// path, server/serving/submit.h) into `decoded`, and sizes `response`. Its
// deadline is the `timeout` parameter's.
absl::StatusOr<Prepared> DecodeInfer(const inference::ModelInferRequest& request,
                                     const Model& model, InferDecoded* decoded,
                                     inference::ModelInferResponse* response);

// Triton's ModelConfig and ModelMetadata of a served model.
inference::ModelConfig ToTritonConfig(const Model& model);
inference::ModelMetadataResponse ToModelMetadata(const Model& model);
// ServerMetadata: name, version and the extensions served (system_shared_memory
// only when `shared_memory`: the server has a registry, --shared_memory=system).
inference::ServerMetadataResponse ToServerMetadata(bool shared_memory = false);
// ModelStatistics of `name` ("" = every model, one entry per model under its newest
// version) and `version` ("" = the newest served).
absl::StatusOr<inference::ModelStatisticsResponse> CollectStatistics(const ModelRepository& models,
                                                                     const Metrics& metrics,
                                                                     absl::string_view name,
                                                                     absl::string_view version);

// Readiness, the repository index and model control, for both fronts.
class KserveModels {
 public:
  // `lifecycle` answers load and unload (PERMISSION_DENIED when null).
  // Readiness reads `states` (server/models/model_states.h).
  KserveModels(const ModelRepository* models, const ModelStates* states,
               ModelLifecycle* lifecycle = nullptr)
      : models_(models), states_(states), lifecycle_(lifecycle) {}

  // OK when `model` (nullptr: every model served) is ready; otherwise UNAVAILABLE
  // with the reason (ModelStates::Readiness: shutting down, warming up, ...).
  absl::Status Readiness(const Model* model = nullptr) const;
  // RepositoryIndex: every version served or being loaded, and every folder of the
  // repository directory, by name then version: its state (ModelStates::Index:
  // READY, LOADING, UNLOADING, or UNAVAILABLE with the reason), "not loaded", or
  // "load failed: " and the error naming the file. A model that serves an earlier
  // version while its newest files failed to load is READY with that reason. Only
  // the READY ones when `ready_only`.
  inference::RepositoryIndexResponse Index(bool ready_only) const;
  // A parameter of a load or unload call: its name, and whether its value is a bool.
  struct ControlParameter {
    std::string name;
    bool is_bool = false;
  };
  // The repository RPCs: `load` true loads, false unloads. PERMISSION_DENIED without
  // model control (checked first, whatever the request holds); then INVALID_ARGUMENT
  // naming repository_name (other than "") or a parameter: unload accepts and ignores
  // the bool `unload_dependents` (Triton's clients always send it; nothing depends on
  // an attention model), and refuses any other; load refuses every parameter.
  absl::Status ControlModel(bool load, absl::string_view repository_name,
                            const std::string& model_name,
                            const std::vector<ControlParameter>& parameters) const;

 private:
  const ModelRepository* const models_;
  const ModelStates* const states_;
  ModelLifecycle* const lifecycle_;
};

}  // namespace mha::server

#endif  // MHA_SERVER_KSERVE_ANSWERS_H_

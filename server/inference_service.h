// inference.GRPCInferenceService: the Open Inference Protocol (KServe v2) over gRPC
// with Triton's extensions (ModelStreamInfer, ModelConfig, ModelStatistics, the
// model repository), on the same port, batcher, validation, limits and metrics as
// attention.v1 (protocol label "kserve_grpc"). server/inference_codec.h has the
// tensor names; docs/service.md the whole contract.
//
//   ServerLive       live while the process serves
//   ServerReady      ready until shutdown starts (health turns NOT_SERVING with it)
//   ModelReady       NOT_FOUND for a model (or version) that is not served
//   ServerMetadata   name "mha-serve", the version, the extensions served
//   ModelMetadata    tensors with -1 for variable dimensions
//   ModelInfer       one request, answered in raw_output_contents
//   ModelStreamInfer one response per request, in request order; a failed request
//                    gets error_message (and its id) and the stream goes on
//   ModelConfig      a Triton ModelConfig (dims without the batch dimension)
//   ModelStatistics  from the counters /metrics exposes (ModelStatisticsSnapshot)
//   RepositoryIndex  every served version and every folder not served, with reasons
//   RepositoryModelLoad / RepositoryModelUnload  explicit model control only
//                    (server/model_lifecycle.h), else PERMISSION_DENIED
// RPCs not listed (shared memory, trace) answer UNIMPLEMENTED.
//
// Thread safety: thread-safe; the repository, batcher and metrics must outlive it.
#ifndef MHA_SERVER_INFERENCE_SERVICE_H_
#define MHA_SERVER_INFERENCE_SERVICE_H_

#include <grpcpp/grpcpp.h>

#include <atomic>

#include "absl/status/statusor.h"
#include "proto/inference/grpc_service.grpc.pb.h"
#include "server/batcher.h"
#include "server/front.h"
#include "server/inference_codec.h"
#include "server/metrics.h"
#include "server/model_lifecycle.h"
#include "server/model_repository.h"

namespace mha::server {

inline constexpr char kServerName[] = "mha-serve";

// Finds the model, asks its queue (Batcher::Admit), decodes and validates
// `request` into `decoded` and sizes `response`: the request ready to submit.
// Shared by the gRPC and HTTP fronts.
absl::StatusOr<Admitted> AdmitInfer(const inference::ModelInferRequest& request,
                                    const ModelRepository& models, const Batcher& batcher,
                                    InferDecoded* decoded, inference::ModelInferResponse* response);

// Triton's ModelConfig and ModelMetadata of a served model.
inference::ModelConfig ToTritonConfig(const Model& model);
inference::ModelMetadataResponse ToModelMetadata(const Model& model);
// ServerMetadata: name, version and the extensions served.
inference::ServerMetadataResponse ToServerMetadata();
// ModelStatistics of `name` ("" = every model) and `version` ("" or "1").
absl::StatusOr<inference::ModelStatisticsResponse> CollectStatistics(const ModelRepository& models,
                                                                     const Metrics& metrics,
                                                                     absl::string_view name,
                                                                     absl::string_view version);

class InferenceServiceImpl final : public inference::GRPCInferenceService::CallbackService {
 public:
  // `lifecycle` answers RepositoryModelLoad / Unload (PERMISSION_DENIED when null).
  InferenceServiceImpl(const ModelRepository* models, Batcher* batcher, Metrics* metrics,
                       ModelLifecycle* lifecycle = nullptr)
      : models_(models), batcher_(batcher), metrics_(metrics), lifecycle_(lifecycle) {}

  // ServerReady / ModelReady answer false from now on (shutdown).
  void SetNotReady() { ready_.store(false, std::memory_order_relaxed); }
  // OK when `model` (nullptr: every model) serves; otherwise UNAVAILABLE with the
  // reason: the server is shutting down, or the model is still warming up.
  absl::Status Readiness(const Model* model = nullptr) const;
  // RepositoryIndex: every model served or in the repository directory, by name:
  // READY, or UNAVAILABLE with the reason (warming up, "not loaded", or "load failed:
  // " and the error naming the file). A model that serves an earlier version while
  // its newest files failed to load is READY with that reason. Only the READY ones
  // when `ready_only`.
  inference::RepositoryIndexResponse Index(bool ready_only) const;

  grpc::ServerUnaryReactor* ServerLive(grpc::CallbackServerContext* context,
                                       const inference::ServerLiveRequest* request,
                                       inference::ServerLiveResponse* response) override;
  grpc::ServerUnaryReactor* ServerReady(grpc::CallbackServerContext* context,
                                        const inference::ServerReadyRequest* request,
                                        inference::ServerReadyResponse* response) override;
  grpc::ServerUnaryReactor* ModelReady(grpc::CallbackServerContext* context,
                                       const inference::ModelReadyRequest* request,
                                       inference::ModelReadyResponse* response) override;
  grpc::ServerUnaryReactor* ServerMetadata(grpc::CallbackServerContext* context,
                                           const inference::ServerMetadataRequest* request,
                                           inference::ServerMetadataResponse* response) override;
  grpc::ServerUnaryReactor* ModelMetadata(grpc::CallbackServerContext* context,
                                          const inference::ModelMetadataRequest* request,
                                          inference::ModelMetadataResponse* response) override;
  grpc::ServerUnaryReactor* ModelInfer(grpc::CallbackServerContext* context,
                                       const inference::ModelInferRequest* request,
                                       inference::ModelInferResponse* response) override;
  grpc::ServerBidiReactor<inference::ModelInferRequest, inference::ModelStreamInferResponse>*
  ModelStreamInfer(grpc::CallbackServerContext* context) override;
  grpc::ServerUnaryReactor* ModelConfig(grpc::CallbackServerContext* context,
                                        const inference::ModelConfigRequest* request,
                                        inference::ModelConfigResponse* response) override;
  grpc::ServerUnaryReactor* ModelStatistics(grpc::CallbackServerContext* context,
                                            const inference::ModelStatisticsRequest* request,
                                            inference::ModelStatisticsResponse* response) override;
  grpc::ServerUnaryReactor* RepositoryIndex(grpc::CallbackServerContext* context,
                                            const inference::RepositoryIndexRequest* request,
                                            inference::RepositoryIndexResponse* response) override;
  // Load blocks its gRPC thread until the model serves (its warm-up included).
  grpc::ServerUnaryReactor* RepositoryModelLoad(
      grpc::CallbackServerContext* context, const inference::RepositoryModelLoadRequest* request,
      inference::RepositoryModelLoadResponse* response) override;
  grpc::ServerUnaryReactor* RepositoryModelUnload(
      grpc::CallbackServerContext* context, const inference::RepositoryModelUnloadRequest* request,
      inference::RepositoryModelUnloadResponse* response) override;

  // The repository RPCs, for both fronts: `load` true loads, false unloads.
  // INVALID_ARGUMENT naming repository_name (other than "") or parameters (any).
  absl::Status ControlModel(bool load, absl::string_view repository_name,
                            const std::string& model_name, bool has_parameters) const;

 private:
  const ModelRepository* models_;
  Batcher* batcher_;
  Metrics* metrics_;
  ModelLifecycle* lifecycle_;
  std::atomic<bool> ready_{true};
};

}  // namespace mha::server

#endif  // MHA_SERVER_INFERENCE_SERVICE_H_

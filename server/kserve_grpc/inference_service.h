// inference.GRPCInferenceService: the Open Inference Protocol (KServe v2) over gRPC
// with Triton's extensions (ModelStreamInfer, ModelConfig, ModelStatistics, the
// model repository), on the same port, batcher, validation, limits and metrics as
// attention.v1 (protocol label "kserve_grpc"). server/kserve/inference_codec.h has the
// tensor names, server/kserve/answers.h the answers this front shares with HTTP;
// docs/service.md the whole contract.
//
//   ServerLive       live while the process serves
//   ServerReady      ready until shutdown starts (health turns NOT_SERVING with it)
//   ModelReady       NOT_FOUND for a model (or version) that is not served
//   ServerMetadata   name "mha-serve", the version, the extensions served
//   ModelMetadata    tensors with -1 for variable dimensions
//   ModelInfer       one request, answered in raw_output_contents
//   ModelStreamInfer one response per request, in request order; a failed request
//                    gets error_message (and its id) and the stream goes on
//   ModelConfig      a Triton ModelConfig (max_batch_size 0, dims = full shapes)
//   ModelStatistics  from the counters /metrics exposes (ModelStatisticsSnapshot)
//   RepositoryIndex  every served version and every folder not served, with reasons
//   RepositoryModelLoad / RepositoryModelUnload  explicit model control only
//                    (server/models/model_lifecycle.h), else PERMISSION_DENIED
//   SystemSharedMemoryStatus / Register / Unregister  Triton's system shared
//                    memory (server/serving/shared_memory.h; the registry is the
//                    request path's), restricted group shared-memory; register
//                    from a peer not on loopback is PERMISSION_DENIED unless
//                    --shared_memory_allow_remote. UNIMPLEMENTED (the message of
//                    server/grpc_common/unimplemented_service.h) when the server
//                    has no registry (--shared_memory=none)
// RPCs not listed (CUDA shared memory, trace, log settings) answer UNIMPLEMENTED
// naming the RPC (server/grpc_common/unimplemented_service.h).
//
// Thread safety: thread-safe; the repository, submit path, metrics and answers
// must outlive it.
#ifndef MHA_SERVER_KSERVE_GRPC_INFERENCE_SERVICE_H_
#define MHA_SERVER_KSERVE_GRPC_INFERENCE_SERVICE_H_

#include <grpcpp/grpcpp.h>

#include "proto/inference/grpc_service.grpc.pb.h"
#include "server/kserve/answers.h"
#include "server/models/model_repository.h"
#include "server/serving/metrics.h"
#include "server/serving/submit.h"

namespace mha::server {

class InferenceServiceImpl final : public inference::GRPCInferenceService::CallbackService {
 public:
  // `answers`: readiness, the index and model control (shared with HTTP).
  InferenceServiceImpl(const ModelRepository* models, const RequestPath* path,
                       const Metrics* metrics, const KserveModels* answers)
      : models_(models), path_(path), metrics_(metrics), answers_(answers) {}

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
  grpc::ServerUnaryReactor* SystemSharedMemoryStatus(
      grpc::CallbackServerContext* context,
      const inference::SystemSharedMemoryStatusRequest* request,
      inference::SystemSharedMemoryStatusResponse* response) override;
  grpc::ServerUnaryReactor* SystemSharedMemoryRegister(
      grpc::CallbackServerContext* context,
      const inference::SystemSharedMemoryRegisterRequest* request,
      inference::SystemSharedMemoryRegisterResponse* response) override;
  grpc::ServerUnaryReactor* SystemSharedMemoryUnregister(
      grpc::CallbackServerContext* context,
      const inference::SystemSharedMemoryUnregisterRequest* request,
      inference::SystemSharedMemoryUnregisterResponse* response) override;

 private:
  const ModelRepository* models_;
  const RequestPath* path_;
  const Metrics* metrics_;  // ModelStatistics
  const KserveModels* answers_;
};

}  // namespace mha::server

#endif  // MHA_SERVER_KSERVE_GRPC_INFERENCE_SERVICE_H_

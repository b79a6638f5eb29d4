// attention.v1.AttentionService on gRPC's callback API. Handlers decode, validate
// (server/validation.h) and enqueue on the ComputeQueue; they never block and never
// compute. Workers finish the reactors.
//
// AttendStream answers in request order. It keeps up to kMaxStreamInFlight
// requests of one stream in the queue (reads pause beyond that: flow control).
// The first request that fails ends the stream with its status, its message
// prefixed with "request N (request_id \"...\"): "; the responses of the requests
// before it are written first.
//
// Thread safety: thread-safe; the repository and queue must outlive the service.
#ifndef MHA_SERVER_SERVICE_H_
#define MHA_SERVER_SERVICE_H_

#include <grpcpp/grpcpp.h>

#include "proto/attention.grpc.pb.h"
#include "server/compute_queue.h"
#include "server/model_repository.h"

namespace mha::server {

inline constexpr int kMaxStreamInFlight = 32;

// A model as GetModel and ListModels describe it.
attention::v1::ModelInfo ToModelInfo(const Model& model);

class AttentionServiceImpl final : public attention::v1::AttentionService::CallbackService {
 public:
  AttentionServiceImpl(const ModelRepository* models, ComputeQueue* queue)
      : models_(models), queue_(queue) {}

  grpc::ServerUnaryReactor* Attend(grpc::CallbackServerContext* context,
                                   const attention::v1::AttendRequest* request,
                                   attention::v1::AttendResponse* response) override;
  grpc::ServerBidiReactor<attention::v1::AttendRequest, attention::v1::AttendResponse>*
  AttendStream(grpc::CallbackServerContext* context) override;
  grpc::ServerUnaryReactor* GetModel(grpc::CallbackServerContext* context,
                                     const attention::v1::GetModelRequest* request,
                                     attention::v1::ModelInfo* response) override;
  grpc::ServerUnaryReactor* ListModels(grpc::CallbackServerContext* context,
                                       const attention::v1::ListModelsRequest* request,
                                       attention::v1::ListModelsResponse* response) override;

 private:
  const ModelRepository* models_;
  ComputeQueue* queue_;
};

}  // namespace mha::server

#endif  // MHA_SERVER_SERVICE_H_

// attention.v1.AttentionService on gRPC's callback API. Handlers decode and
// validate (server/attention_v1/codec.h) through the one submit path
// (server/serving/submit.h); they never block and compute only a request small
// enough to run inline. Compute workers finish the reactors.
//
// Every Attend request, and every request on an AttendStream, is counted once when
// it is answered: mha_requests_total{model,code}, mha_request_duration_seconds,
// and mha_tokens_total when OK; mha_inflight_requests covers accepted requests.
//
// AttendStream answers in request order (server/grpc_common/stream_reactor.h). It keeps up to
// kMaxStreamInFlight requests of one stream in the queue (reads pause beyond that).
// The first request that fails ends the stream with its status, its message
// prefixed with "request N (request_id \"...\"): "; the responses of the requests
// before it are written first.
//
// Thread safety: thread-safe; the repository, the submit path and the sessions
// must outlive the service.
#ifndef MHA_SERVER_ATTENTION_V1_SERVICE_H_
#define MHA_SERVER_ATTENTION_V1_SERVICE_H_

#include <grpcpp/grpcpp.h>

#include "proto/attention.grpc.pb.h"
#include "server/attention_v1/session.h"
#include "server/models/model_repository.h"
#include "server/serving/submit.h"

namespace mha::server {

// A model as GetModel and ListModels describe it.
attention::v1::ModelInfo ToModelInfo(const Model& model);

class AttentionServiceImpl final : public attention::v1::AttentionService::CallbackService {
 public:
  // `sessions` serves AttendSession (nullptr: UNIMPLEMENTED).
  AttentionServiceImpl(const ModelRepository* models, const RequestPath* path,
                       SessionManager* sessions)
      : models_(models), path_(path), sessions_(sessions) {}

  grpc::ServerUnaryReactor* Attend(grpc::CallbackServerContext* context,
                                   const attention::v1::AttendRequest* request,
                                   attention::v1::AttendResponse* response) override;
  grpc::ServerBidiReactor<attention::v1::AttendRequest, attention::v1::AttendResponse>*
  AttendStream(grpc::CallbackServerContext* context) override;
  grpc::ServerBidiReactor<attention::v1::SessionRequest, attention::v1::SessionResponse>*
  AttendSession(grpc::CallbackServerContext* context) override;
  grpc::ServerUnaryReactor* GetModel(grpc::CallbackServerContext* context,
                                     const attention::v1::GetModelRequest* request,
                                     attention::v1::ModelInfo* response) override;
  grpc::ServerUnaryReactor* ListModels(grpc::CallbackServerContext* context,
                                       const attention::v1::ListModelsRequest* request,
                                       attention::v1::ListModelsResponse* response) override;

 private:
  const ModelRepository* models_;
  const RequestPath* path_;
  SessionManager* sessions_;
};

}  // namespace mha::server

#endif  // MHA_SERVER_ATTENTION_V1_SERVICE_H_

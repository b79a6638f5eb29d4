#include "server/attention_v1/service.h"

#include <memory>
#include <string>
#include <utility>

#include "base/status_macros.h"
#include "core/config.h"
#include "server/attention_v1/codec.h"
#include "server/grpc_common/deadline.h"
#include "server/grpc_common/grpc_status.h"
#include "server/grpc_common/restricted.h"
#include "server/grpc_common/stream_reactor.h"

namespace mha::server {
namespace {

using attention::v1::AttendRequest;
using attention::v1::AttendResponse;

// Decodes and validates `request` for `model` and sizes `response`.
absl::StatusOr<Prepared> DecodeAttend(const AttendRequest& request, const Model& model,
                                      AttendResponse* response) {
  MHA_ASSIGN_OR_RETURN(ValidatedRequest validated, ValidateRequest(request, model));
  const OutputViews outputs = PrepareResponse(validated, WantsRawResponse(request), response);
  return Prepared{.request = validated, .outputs = outputs};
}

// AttendStream: the first failed request ends the stream (service.h).
struct AttendFront {
  using Request = AttendRequest;
  using Response = AttendResponse;
  struct Decoded {};
  static constexpr Protocol kProtocol = Protocol::kAttentionV1;
  static constexpr bool kEndStreamOnError = true;

  static const std::string& ModelName(const Request& request) { return request.model(); }
  static const std::string& ModelVersion(const Request& request) { return request.model_version(); }
  static const std::string& RequestId(const Request& request) { return request.request_id(); }
  static void Begin(const Request& request, Response* response) {
    response->set_request_id(request.request_id());
  }
  static absl::StatusOr<Prepared> Decode(const Request& request, const Model& model,
                                         Decoded* /*decoded*/, Response* response) {
    return DecodeAttend(request, model, response);
  }
  static void Computed(const ComputeTiming& timing, Response* response) {
    EncodeTiming(timing, response);
  }
  static void Failed(const absl::Status& /*status*/, Response* /*response*/) {}
};

}  // namespace

attention::v1::ModelInfo ToModelInfo(const Model& model) {
  const core::ModelConfig& c = model.config;
  attention::v1::ModelInfo info;
  info.set_name(model.name);
  info.set_version(absl::StrCat(model.version));
  info.set_num_hiddens(c.num_hiddens);
  info.set_num_heads(c.num_heads);
  info.set_head_size(c.head_size());
  info.set_query_size(c.query_size);
  info.set_key_size(c.key_size);
  info.set_value_size(c.value_size);
  info.set_bias(c.bias);
  info.set_precision(std::string(core::PrecisionName(c.precision)));
  info.set_supports_self_attention(c.SupportsSelfAttention());
  info.set_scoring(std::string(core::ScoringName(c.scoring)));
  info.set_additive_hidden(c.additive_hidden);
  info.set_num_kv_heads(c.kv_heads());
  if (c.rope) {
    info.set_rope_theta(c.rope_theta());
    info.set_rotary_dim(c.rotary_dim());
    info.set_rope_interleaved(c.rope->interleaved);
  }
  info.set_projections(c.attention_only() ? "none" : "full");
  info.set_kv_cache_precision(c.cache_bf16() ? "bf16" : "f32");
  attention::v1::ModelLimits* limits = info.mutable_limits();
  limits->set_max_batch_size(model.limits.max_batch_size);
  limits->set_max_sequence_length(model.limits.max_sequence_length);
  limits->set_max_request_bytes(model.limits.max_request_bytes);
  limits->set_max_attention_elements(model.limits.max_attention_elements);
  limits->set_max_session_tokens(model.limits.session_tokens());
  return info;
}

grpc::ServerUnaryReactor* AttentionServiceImpl::Attend(grpc::CallbackServerContext* context,
                                                       const AttendRequest* request,
                                                       AttendResponse* response) {
  if (absl::Status allowed = AllowGrpc(*path_, ApiGroup::kInference, context); !allowed.ok()) {
    grpc::ServerUnaryReactor* refused = context->DefaultReactor();
    refused->Finish(ToGrpcStatus(allowed));
    return refused;
  }
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  AttendFront::Begin(*request, response);
  path_->Submit(
      Call{.protocol = Protocol::kAttentionV1,
           .model = request->model(),
           .version = request->model_version(),
           .deadline = DeadlineOf(context),
           .cancelled = [context] { return context->IsCancelled(); },
           .peer = [context] { return context->peer(); }},
      [&](const Model& model) { return DecodeAttend(*request, model, response); },
      [reactor, response](absl::Status status, const ComputeTiming& timing) {
        if (status.ok()) EncodeTiming(timing, response);
        reactor->Finish(ToGrpcStatus(status));
      });
  return reactor;
}

grpc::ServerBidiReactor<AttendRequest, AttendResponse>* AttentionServiceImpl::AttendStream(
    grpc::CallbackServerContext* context) {
  if (absl::Status allowed = AllowGrpc(*path_, ApiGroup::kInference, context); !allowed.ok()) {
    return new RefusedStream<AttendRequest, AttendResponse>(allowed);
  }
  return new OrderedStreamReactor<AttendFront>(context, path_);
}

grpc::ServerBidiReactor<attention::v1::SessionRequest, attention::v1::SessionResponse>*
AttentionServiceImpl::AttendSession(grpc::CallbackServerContext* context) {
  if (absl::Status allowed = AllowGrpc(*path_, ApiGroup::kInference, context); !allowed.ok()) {
    return new RefusedStream<attention::v1::SessionRequest, attention::v1::SessionResponse>(
        allowed);
  }
  if (sessions_ != nullptr) return sessions_->Open(context);
  return attention::v1::AttentionService::CallbackService::AttendSession(context);  // UNIMPLEMENTED
}

grpc::ServerUnaryReactor* AttentionServiceImpl::GetModel(
    grpc::CallbackServerContext* context, const attention::v1::GetModelRequest* request,
    attention::v1::ModelInfo* response) {
  if (absl::Status allowed = AllowGrpc(*path_, ApiGroup::kMetadata, context); !allowed.ok()) {
    grpc::ServerUnaryReactor* refused = context->DefaultReactor();
    refused->Finish(ToGrpcStatus(allowed));
    return refused;
  }
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  absl::StatusOr<std::shared_ptr<const Model>> model =
      models_->Find(request->model(), request->model_version());
  if (model.ok()) *response = ToModelInfo(**model);
  reactor->Finish(ToGrpcStatus(model.status()));
  return reactor;
}

grpc::ServerUnaryReactor* AttentionServiceImpl::ListModels(
    grpc::CallbackServerContext* context, const attention::v1::ListModelsRequest* /*request*/,
    attention::v1::ListModelsResponse* response) {
  if (absl::Status allowed = AllowGrpc(*path_, ApiGroup::kMetadata, context); !allowed.ok()) {
    grpc::ServerUnaryReactor* refused = context->DefaultReactor();
    refused->Finish(ToGrpcStatus(allowed));
    return refused;
  }
  for (const auto& model : models_->models()) *response->add_models() = ToModelInfo(*model);
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

}  // namespace mha::server

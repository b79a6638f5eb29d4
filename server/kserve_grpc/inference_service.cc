#include "server/kserve_grpc/inference_service.h"

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/grpc_common/deadline.h"
#include "server/grpc_common/grpc_status.h"
#include "server/grpc_common/restricted.h"
#include "server/grpc_common/stream_reactor.h"
#include "server/grpc_common/unimplemented_service.h"
#include "server/serving/abbreviate.h"
#include "server/serving/submit.h"

namespace mha::server {
namespace {

using inference::ModelInferRequest;
using inference::ModelInferResponse;
using inference::ModelStreamInferResponse;

// ModelStreamInfer: a failed request is answered with error_message; the stream
// goes on.
struct InferStreamFront {
  using Request = ModelInferRequest;
  using Response = ModelStreamInferResponse;
  using Decoded = InferDecoded;
  static constexpr Protocol kProtocol = Protocol::kKserveGrpc;
  static constexpr bool kEndStreamOnError = false;

  static const std::string& ModelName(const Request& request) { return request.model_name(); }
  static const std::string& ModelVersion(const Request& request) { return request.model_version(); }
  static const std::string& RequestId(const Request& request) { return request.id(); }
  static void Begin(const Request& request, Response* response) {
    response->mutable_infer_response()->set_id(request.id());
  }
  static absl::StatusOr<Prepared> Decode(const Request& request, const Model& model,
                                         Decoded* decoded, Response* response) {
    return DecodeInfer(request, model, decoded, response->mutable_infer_response());
  }
  static void Computed(const ComputeTiming& /*timing*/, Response* /*response*/) {}
  static void Failed(const absl::Status& status, Response* response) {
    ModelInferResponse* infer = response->mutable_infer_response();
    infer->clear_outputs();
    infer->clear_raw_output_contents();
    response->set_error_message(
        CapMessage(absl::StrCat(absl::StatusCodeToString(status.code()), ": ", status.message())));
  }
};

grpc::ServerUnaryReactor* Reply(grpc::CallbackServerContext* context, const absl::Status& status) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

std::vector<KserveModels::ControlParameter> ControlParameters(
    const google::protobuf::Map<std::string, inference::ModelRepositoryParameter>& parameters) {
  std::vector<KserveModels::ControlParameter> out;
  for (const auto& [name, value] : parameters) {
    out.push_back({.name = name, .is_bool = value.has_bool_param()});
  }
  return out;
}

// The registry, or UNIMPLEMENTED naming the RPC when the extension is off.
absl::StatusOr<SharedMemoryRegistry*> Registry(const RequestPath& path, const char* rpc) {
  if (path.shared_memory() == nullptr) {
    return absl::UnimplementedError(
        UnimplementedMessage(absl::StrCat("/inference.GRPCInferenceService/", rpc)));
  }
  return path.shared_memory();
}

}  // namespace

grpc::ServerUnaryReactor* InferenceServiceImpl::SystemSharedMemoryStatus(
    grpc::CallbackServerContext* context, const inference::SystemSharedMemoryStatusRequest* request,
    inference::SystemSharedMemoryStatusResponse* response) {
  if (absl::Status allowed = AllowGrpc(*path_, ApiGroup::kSharedMemory, context); !allowed.ok()) {
    return Reply(context, allowed);
  }
  absl::StatusOr<SharedMemoryRegistry*> registry = Registry(*path_, "SystemSharedMemoryStatus");
  if (!registry.ok()) return Reply(context, registry.status());
  absl::StatusOr<std::vector<RegionSpec>> regions = (*registry)->Status(request->name());
  if (!regions.ok()) return Reply(context, regions.status());
  for (const RegionSpec& region : *regions) {
    auto& status = (*response->mutable_regions())[region.name];
    status.set_name(region.name);
    status.set_key(region.key);
    status.set_offset(region.offset);
    status.set_byte_size(region.byte_size);
  }
  return Reply(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* InferenceServiceImpl::SystemSharedMemoryRegister(
    grpc::CallbackServerContext* context,
    const inference::SystemSharedMemoryRegisterRequest* request,
    inference::SystemSharedMemoryRegisterResponse* /*response*/) {
  if (absl::Status allowed = AllowGrpc(*path_, ApiGroup::kSharedMemory, context); !allowed.ok()) {
    return Reply(context, allowed);
  }
  absl::StatusOr<SharedMemoryRegistry*> registry = Registry(*path_, "SystemSharedMemoryRegister");
  if (!registry.ok()) return Reply(context, registry.status());
  return Reply(context, (*registry)->Register({.name = request->name(),
                                               .key = request->key(),
                                               .offset = request->offset(),
                                               .byte_size = request->byte_size()},
                                              IsLoopbackPeer(context->peer())));
}

grpc::ServerUnaryReactor* InferenceServiceImpl::SystemSharedMemoryUnregister(
    grpc::CallbackServerContext* context,
    const inference::SystemSharedMemoryUnregisterRequest* request,
    inference::SystemSharedMemoryUnregisterResponse* /*response*/) {
  if (absl::Status allowed = AllowGrpc(*path_, ApiGroup::kSharedMemory, context); !allowed.ok()) {
    return Reply(context, allowed);
  }
  absl::StatusOr<SharedMemoryRegistry*> registry = Registry(*path_, "SystemSharedMemoryUnregister");
  if (!registry.ok()) return Reply(context, registry.status());
  (*registry)->Unregister(request->name());
  return Reply(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* InferenceServiceImpl::ServerLive(
    grpc::CallbackServerContext* context, const inference::ServerLiveRequest* /*request*/,
    inference::ServerLiveResponse* response) {
  if (absl::Status allowed = AllowGrpc(*path_, ApiGroup::kHealth, context); !allowed.ok()) {
    return Reply(context, allowed);
  }
  response->set_live(true);
  return Reply(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* InferenceServiceImpl::ServerReady(
    grpc::CallbackServerContext* context, const inference::ServerReadyRequest* /*request*/,
    inference::ServerReadyResponse* response) {
  if (absl::Status allowed = AllowGrpc(*path_, ApiGroup::kHealth, context); !allowed.ok()) {
    return Reply(context, allowed);
  }
  response->set_ready(answers_->Readiness().ok());
  return Reply(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* InferenceServiceImpl::ModelReady(
    grpc::CallbackServerContext* context, const inference::ModelReadyRequest* request,
    inference::ModelReadyResponse* response) {
  if (absl::Status allowed = AllowGrpc(*path_, ApiGroup::kHealth, context); !allowed.ok()) {
    return Reply(context, allowed);
  }
  absl::StatusOr<std::shared_ptr<const Model>> model =
      models_->Find(request->name(), request->version());
  response->set_ready(model.ok() && answers_->Readiness(model->get()).ok());
  return Reply(context, model.status());
}

grpc::ServerUnaryReactor* InferenceServiceImpl::ServerMetadata(
    grpc::CallbackServerContext* context, const inference::ServerMetadataRequest* /*request*/,
    inference::ServerMetadataResponse* response) {
  if (absl::Status allowed = AllowGrpc(*path_, ApiGroup::kMetadata, context); !allowed.ok()) {
    return Reply(context, allowed);
  }
  *response = ToServerMetadata(path_->shared_memory() != nullptr);
  return Reply(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* InferenceServiceImpl::ModelMetadata(
    grpc::CallbackServerContext* context, const inference::ModelMetadataRequest* request,
    inference::ModelMetadataResponse* response) {
  if (absl::Status allowed = AllowGrpc(*path_, ApiGroup::kMetadata, context); !allowed.ok()) {
    return Reply(context, allowed);
  }
  absl::StatusOr<std::shared_ptr<const Model>> model =
      models_->Find(request->name(), request->version());
  if (model.ok()) *response = ToModelMetadata(**model);
  return Reply(context, model.status());
}

grpc::ServerUnaryReactor* InferenceServiceImpl::ModelInfer(grpc::CallbackServerContext* context,
                                                           const ModelInferRequest* request,
                                                           ModelInferResponse* response) {
  if (absl::Status allowed = AllowGrpc(*path_, ApiGroup::kInference, context); !allowed.ok()) {
    return Reply(context, allowed);
  }
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  auto decoded = std::make_shared<InferDecoded>();  // the converted inputs live until the answer
  response->set_id(request->id());
  path_->Submit(
      Call{.protocol = Protocol::kKserveGrpc,
           .model = request->model_name(),
           .version = request->model_version(),
           .deadline = DeadlineOf(context),
           .cancelled = [context] { return context->IsCancelled(); },
           .peer = [context] { return context->peer(); }},
      [&](const Model& model) { return DecodeInfer(*request, model, decoded.get(), response); },
      [reactor, decoded](absl::Status status, const ComputeTiming& /*timing*/) {
        reactor->Finish(ToGrpcStatus(status));
      });
  return reactor;
}

grpc::ServerBidiReactor<ModelInferRequest, ModelStreamInferResponse>*
InferenceServiceImpl::ModelStreamInfer(grpc::CallbackServerContext* context) {
  if (absl::Status allowed = AllowGrpc(*path_, ApiGroup::kInference, context); !allowed.ok()) {
    return new RefusedStream<ModelInferRequest, ModelStreamInferResponse>(allowed);
  }
  return new OrderedStreamReactor<InferStreamFront>(context, path_);
}

grpc::ServerUnaryReactor* InferenceServiceImpl::ModelConfig(
    grpc::CallbackServerContext* context, const inference::ModelConfigRequest* request,
    inference::ModelConfigResponse* response) {
  if (absl::Status allowed = AllowGrpc(*path_, ApiGroup::kMetadata, context); !allowed.ok()) {
    return Reply(context, allowed);
  }
  absl::StatusOr<std::shared_ptr<const Model>> model =
      models_->Find(request->name(), request->version());
  if (model.ok()) *response->mutable_config() = ToTritonConfig(**model);
  return Reply(context, model.status());
}

grpc::ServerUnaryReactor* InferenceServiceImpl::ModelStatistics(
    grpc::CallbackServerContext* context, const inference::ModelStatisticsRequest* request,
    inference::ModelStatisticsResponse* response) {
  if (absl::Status allowed = AllowGrpc(*path_, ApiGroup::kStatistics, context); !allowed.ok()) {
    return Reply(context, allowed);
  }
  absl::StatusOr<inference::ModelStatisticsResponse> stats =
      CollectStatistics(*models_, *metrics_, request->name(), request->version());
  if (stats.ok()) *response = *std::move(stats);
  return Reply(context, stats.status());
}

grpc::ServerUnaryReactor* InferenceServiceImpl::RepositoryModelLoad(
    grpc::CallbackServerContext* context, const inference::RepositoryModelLoadRequest* request,
    inference::RepositoryModelLoadResponse* /*response*/) {
  if (absl::Status allowed = AllowGrpc(*path_, ApiGroup::kModelRepository, context);
      !allowed.ok()) {
    return Reply(context, allowed);
  }
  return Reply(context,
               answers_->ControlModel(true, request->repository_name(), request->model_name(),
                                      ControlParameters(request->parameters())));
}

grpc::ServerUnaryReactor* InferenceServiceImpl::RepositoryModelUnload(
    grpc::CallbackServerContext* context, const inference::RepositoryModelUnloadRequest* request,
    inference::RepositoryModelUnloadResponse* /*response*/) {
  if (absl::Status allowed = AllowGrpc(*path_, ApiGroup::kModelRepository, context);
      !allowed.ok()) {
    return Reply(context, allowed);
  }
  return Reply(context,
               answers_->ControlModel(false, request->repository_name(), request->model_name(),
                                      ControlParameters(request->parameters())));
}

grpc::ServerUnaryReactor* InferenceServiceImpl::RepositoryIndex(
    grpc::CallbackServerContext* context, const inference::RepositoryIndexRequest* request,
    inference::RepositoryIndexResponse* response) {
  if (absl::Status allowed = AllowGrpc(*path_, ApiGroup::kModelRepository, context);
      !allowed.ok()) {
    return Reply(context, allowed);
  }
  *response = answers_->Index(request->ready());
  return Reply(context, absl::OkStatus());
}

}  // namespace mha::server

#include "client/sdk/connection.h"

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"
#include "client/sdk/kserve.h"
#include "client/sdk/shared_memory.h"
#include "client/sdk/status.h"
#include "proto/attention.grpc.pb.h"
#include "proto/grpc/health/v1/health.grpc.pb.h"
#include "proto/inference/grpc_service.grpc.pb.h"

namespace mha::client {
namespace {

using attention::v1::AttendRequest;
using attention::v1::AttendResponse;
using attention::v1::ModelInfo;

absl::Status CallError(absl::string_view call, const grpc::Status& status) {
  const absl::Status error = FromGrpcStatus(status);
  return absl::Status(error.code(), absl::StrCat(call, ": ", error.message()));
}

class AttentionConnection final : public Connection {
 public:
  AttentionConnection(std::shared_ptr<grpc::Channel> channel, absl::Duration timeout)
      : Connection(Protocol::kAttention),
        stub_(attention::v1::AttentionService::NewStub(channel)),
        timeout_(timeout) {
    channel_ = std::move(channel);
  }

  absl::StatusOr<ModelInfo> GetModel(const std::string& model) override {
    grpc::ClientContext context;
    SetTimeout(&context, timeout_);
    attention::v1::GetModelRequest request;
    request.set_model(model);
    ModelInfo info;
    const grpc::Status status = stub_->GetModel(&context, request, &info);
    if (!status.ok()) return WithModelChoices(CallError("GetModel", status), model);
    return info;
  }

  absl::StatusOr<AttendResponse> Attend(const AttendRequest& request) override {
    grpc::ClientContext context;
    SetTimeout(&context, timeout_);
    AttendResponse response;
    const TrackedCall tracked(group_, &context);
    const grpc::Status status = stub_->Attend(&context, request, &response);
    if (!status.ok()) return CallError("Attend", status);
    return response;
  }

  absl::Status Ready() override {
    grpc::ClientContext context;
    SetTimeout(&context, timeout_);
    grpc::health::v1::HealthCheckResponse response;
    const grpc::Status status = grpc::health::v1::Health::NewStub(channel_)->Check(
        &context, grpc::health::v1::HealthCheckRequest(), &response);
    if (!status.ok()) return CallError("Health/Check", status);
    if (response.status() != grpc::health::v1::HealthCheckResponse::SERVING) {
      return absl::UnavailableError(absl::StrCat(
          "Health/Check: ",
          grpc::health::v1::HealthCheckResponse::ServingStatus_Name(response.status())));
    }
    return absl::OkStatus();
  }

 private:
  // GetModel's "model: required" (several models, none of them "default", and no
  // --model) with the served models as --model values; `error` unchanged otherwise.
  absl::Status WithModelChoices(const absl::Status& error, const std::string& model) {
    if (!model.empty() || error.code() != absl::StatusCode::kInvalidArgument ||
        !absl::StrContains(error.message(), "model: required")) {
      return error;
    }
    grpc::ClientContext context;
    SetTimeout(&context, timeout_);
    attention::v1::ListModelsResponse models;
    if (!stub_->ListModels(&context, attention::v1::ListModelsRequest(), &models).ok()) {
      return error;
    }
    std::vector<std::string> choices;
    for (const ModelInfo& m : models.models()) choices.push_back("--model=" + m.name());
    return absl::Status(error.code(),
                        absl::StrCat(error.message(), "; give ", absl::StrJoin(choices, " or ")));
  }

  std::unique_ptr<attention::v1::AttentionService::Stub> stub_;
  const absl::Duration timeout_;
};

class KServeConnection final : public Connection {
 public:
  KServeConnection(std::shared_ptr<grpc::Channel> channel, absl::Duration timeout,
                   bool shared_memory = false)
      : Connection(Protocol::kKServe),
        stub_(inference::GRPCInferenceService::NewStub(channel)),
        timeout_(timeout),
        shared_memory_(shared_memory) {
    channel_ = std::move(channel);
  }

  absl::StatusOr<ModelInfo> GetModel(const std::string& model) override {
    grpc::ClientContext context;
    SetTimeout(&context, timeout_);
    inference::ModelMetadataRequest request;
    if (model.empty()) {
      MHA_ASSIGN_OR_RETURN(const std::string chosen, ChooseServedModel());
      request.set_name(chosen);
    } else {
      request.set_name(model);
    }
    inference::ModelMetadataResponse metadata;
    const grpc::Status status = stub_->ModelMetadata(&context, request, &metadata);
    if (!status.ok()) return CallError("ModelMetadata", status);
    return ModelInfoFromMetadata(metadata);
  }

  absl::StatusOr<AttendResponse> Attend(const AttendRequest& request) override {
    grpc::ClientContext context;
    SetTimeout(&context, timeout_);
    inference::ModelInferResponse response;
    inference::ModelInferRequest infer = ToModelInferRequest(request);
    if (shared_memory_) {
      MHA_ASSIGN_OR_RETURN(const ModelInfo model, GetModel(request.model()));
      const OutputSizes outputs = OutputSizesOf(infer, model.num_hiddens(), model.num_heads());
      const uint64_t bytes = SharedMemoryBytes(infer, outputs);
      if (slot_ == nullptr || slot_->bytes() < bytes) {
        slot_.reset();
        MHA_ASSIGN_OR_RETURN(slot_, SharedMemorySlot::Create(channel_, bytes, timeout_));
      }
      MHA_ASSIGN_OR_RETURN(infer, slot_->Place(infer, outputs));
    }
    const TrackedCall tracked(group_, &context);
    const grpc::Status status = stub_->ModelInfer(&context, infer, &response);
    if (!status.ok()) return CallError("ModelInfer", status);
    if (slot_ != nullptr) MHA_RETURN_IF_ERROR(slot_->FillOutputs(&response));
    auto attend = ToAttendResponse(response);
    if (!attend.ok()) {
      return absl::Status(attend.status().code(),
                          absl::StrCat("ModelInfer: ", attend.status().message()));
    }
    return attend;
  }

  absl::Status Ready() override {
    grpc::ClientContext context;
    SetTimeout(&context, timeout_);
    inference::ServerReadyResponse response;
    const grpc::Status status =
        stub_->ServerReady(&context, inference::ServerReadyRequest(), &response);
    if (!status.ok()) return CallError("ServerReady", status);
    if (!response.ready()) return absl::UnavailableError("ServerReady: not ready");
    return absl::OkStatus();
  }

 private:
  // The model an empty --model names (ChooseModel) among the ready ones.
  absl::StatusOr<std::string> ChooseServedModel() {
    grpc::ClientContext context;
    SetTimeout(&context, timeout_);
    inference::RepositoryIndexRequest request;
    request.set_ready(true);
    inference::RepositoryIndexResponse index;
    const grpc::Status status = stub_->RepositoryIndex(&context, request, &index);
    if (!status.ok()) return CallError("RepositoryIndex", status);
    std::vector<std::string> names;
    for (const auto& m : index.models()) {
      if (std::find(names.begin(), names.end(), m.name()) == names.end()) names.push_back(m.name());
    }
    auto chosen = ChooseModel(names);
    if (!chosen.ok()) {
      return absl::Status(chosen.status().code(),
                          absl::StrCat("RepositoryIndex: ", chosen.status().message()));
    }
    return chosen;
  }

  std::unique_ptr<inference::GRPCInferenceService::Stub> stub_;
  const absl::Duration timeout_;
  const bool shared_memory_;
  std::unique_ptr<SharedMemorySlot> slot_;  // --shared_memory=system: made on the first call
};

class RestConnection final : public Connection {
 public:
  RestConnection(const HttpEndpoint& endpoint, absl::Duration timeout)
      : Connection(Protocol::kHttp), http_connection_(endpoint, timeout) {
    http_ = endpoint;
  }

  absl::StatusOr<ModelInfo> GetModel(const std::string& model) override {
    std::string name = model;
    if (name.empty()) {
      MHA_ASSIGN_OR_RETURN(const std::vector<std::string> served, http_connection_.ReadyModels());
      auto chosen = ChooseModel(served);
      if (!chosen.ok()) {
        return absl::Status(chosen.status().code(),
                            absl::StrCat("POST /v2/repository/index: ", chosen.status().message()));
      }
      name = *std::move(chosen);
    }
    MHA_ASSIGN_OR_RETURN(const inference::ModelMetadataResponse metadata,
                         http_connection_.ModelMetadata(name));
    return ModelInfoFromMetadata(metadata);
  }

  absl::StatusOr<AttendResponse> Attend(const AttendRequest& request) override {
    const HttpRequest http = ToHttpRequest(ToModelInferRequest(request));
    MHA_ASSIGN_OR_RETURN(const inference::ModelInferResponse response,
                         http_connection_.Infer(http));
    auto attend = ToAttendResponse(response);
    if (!attend.ok()) {
      return absl::Status(attend.status().code(),
                          absl::StrCat("POST ", http.path, ": ", attend.status().message()));
    }
    return attend;
  }

  absl::Status Ready() override { return http_connection_.Ready(); }

 private:
  HttpConnection http_connection_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Connection>> Connection::Open(const ChannelOptions& options) {
  if (options.protocol == Protocol::kHttp) {
    MHA_ASSIGN_OR_RETURN(HttpEndpoint endpoint, ParseHttpTarget(options.target));
    endpoint.tls = options.tls || !options.tls_ca.empty() || !options.tls_cert.empty();
    endpoint.tls_ca = options.tls_ca;
    endpoint.tls_cert = options.tls_cert;
    endpoint.tls_key = options.tls_key;
    return std::make_unique<RestConnection>(endpoint, options.timeout);
  }
  MHA_ASSIGN_OR_RETURN(std::shared_ptr<grpc::Channel> channel, MakeChannel(options));
  if (options.shared_memory) {
    if (options.protocol != Protocol::kKServe) {
      return absl::InvalidArgumentError(
          "--shared_memory=system: registers regions over gRPC; use --protocol=kserve");
    }
    return std::make_unique<KServeConnection>(std::move(channel), options.timeout, true);
  }
  return OverChannel(options.protocol, std::move(channel), options.timeout);
}

absl::StatusOr<std::unique_ptr<Connection>> Connection::OverChannel(
    Protocol protocol, std::shared_ptr<grpc::Channel> channel, absl::Duration timeout) {
  if (protocol == Protocol::kHttp) {
    return absl::InvalidArgumentError("Connection::OverChannel: http has no gRPC channel");
  }
  if (protocol == Protocol::kKServe) {
    return std::make_unique<KServeConnection>(std::move(channel), timeout);
  }
  return std::make_unique<AttentionConnection>(std::move(channel), timeout);
}

}  // namespace mha::client

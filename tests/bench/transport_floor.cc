// The floor under the serving path: a gRPC server that answers attention.v1 Attend with
// a zeroed output of the right shape and does nothing else: no validation, no batching,
// no compute, no metrics. Whatever an Attend costs here is gRPC, protobuf and the
// kernel moving the request's and the response's bytes, which no change to
// attention_server can remove. tests/bench/serving_path.sh --only=floor drives it with
// the same attention_client bench steps as the real server and prints the serving
// path's ratios as they would be with a server that costs nothing of its own.
//
//   transport_floor --models_from=127.0.0.1:PORT [--port=0]
//
// AttendSession is answered the same way: each step with a zeroed output (1, T, p_o)
// in `data` (and a zeroed lse (1, h, T) when the first message asked for it) and the
// context grown by the step's keys (its queries in a self-attention session), one
// answer per step in order, so that attention_client decode against it times a
// decode's round trip with nothing computed and nothing cached: what a session step
// costs in gRPC, protobuf and the kernel on this machine (docs/performance.md,
// issue 35).
//
// GetModel and ListModels are answered with what a real attention_server
// (--models_from) lists, read once at start, so the client builds the same requests.
// Health/Check is gRPC's default health service, as in attention_server. The server
// uses the same builder settings as attention_server (callback API, unlimited
// message sizes, no port reuse) and prints "listening on HOST:PORT" when ready.
#include <pthread.h>

#include <chrono>
#include <climits>
#include <csignal>
#include <cstdio>
#include <functional>
#include <initializer_list>
#include <map>
#include <memory>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "proto/attention.grpc.pb.h"

ABSL_FLAG(int32_t, port, 0, "gRPC port on 127.0.0.1; 0 picks a free one.");
ABSL_FLAG(std::string, models_from, "",
          "host:port of an attention_server whose models this server describes.");

namespace {

using attention::v1::AttendRequest;
using attention::v1::AttendResponse;
using attention::v1::ModelInfo;
using attention::v1::SessionRequest;
using attention::v1::SessionResponse;

// A zeroed tensor of `shape` in `tensor`, its values in raw bytes or in data: what
// attention_server allocates before its forward pass writes into it.
void ZeroTensor(attention::v1::Tensor* tensor, std::initializer_list<int64_t> shape, bool raw) {
  int64_t elements = 1;
  for (int64_t d : shape) {
    tensor->add_shape(d);
    elements *= d;
  }
  if (raw) {
    tensor->mutable_raw()->assign(static_cast<size_t>(elements) * sizeof(float), '\0');
  } else {
    tensor->mutable_data()->Resize(static_cast<int>(elements), 0.0f);
  }
}

// One session: each message read is answered before the next is read.
class SessionFloor final : public grpc::ServerBidiReactor<SessionRequest, SessionResponse> {
 public:
  using FindModel = std::function<const ModelInfo*(const std::string&)>;
  explicit SessionFloor(FindModel find) : find_(std::move(find)) { StartRead(&request_); }

  void OnReadDone(bool ok) override {
    if (!ok) return Finish(grpc::Status::OK);
    if (model_ == nullptr) {
      model_ = find_(request_.model());
      return_lse_ = request_.return_lse();
    }
    const auto& shape = request_.queries().shape();
    const auto& keys = request_.has_keys() ? request_.keys().shape() : shape;  // self: queries'
    if (model_ == nullptr || shape.size() != 3 || keys.size() != 3) {
      return Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                                 "transport_floor: unknown model or queries/keys not 3-d"));
    }
    const int64_t tokens = shape[1];
    context_ += keys[1];
    response_.Clear();
    ZeroTensor(response_.mutable_output(), {1, tokens, model_->num_hiddens()}, /*raw=*/false);
    if (return_lse_) {
      ZeroTensor(response_.mutable_lse(), {1, model_->num_heads(), tokens}, /*raw=*/false);
    }
    response_.set_context_tokens(context_);
    response_.mutable_timing()->set_batch_rows(1);
    StartWrite(&response_);
  }
  void OnWriteDone(bool ok) override {
    if (!ok) return Finish(grpc::Status::OK);
    StartRead(&request_);
  }
  void OnDone() override { delete this; }

 private:
  const FindModel find_;
  const ModelInfo* model_ = nullptr;
  bool return_lse_ = false;
  int64_t context_ = 0;
  SessionRequest request_;
  SessionResponse response_;
};

class FloorService final : public attention::v1::AttentionService::CallbackService {
 public:
  explicit FloorService(attention::v1::ListModelsResponse models) : models_(std::move(models)) {
    for (const ModelInfo& model : models_.models()) by_name_[model.name()] = &model;
    // "" names the model called "default", else the only one, as in attention_server.
    if (auto it = by_name_.find("default"); it != by_name_.end()) {
      by_name_[""] = it->second;
    } else if (models_.models_size() == 1) {
      by_name_[""] = &models_.models(0);
    }
  }

  grpc::ServerUnaryReactor* Attend(grpc::CallbackServerContext* context,
                                   const AttendRequest* request,
                                   AttendResponse* response) override {
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    const ModelInfo* model = Find(request->model());
    const auto& shape = request->queries().shape();
    if (model == nullptr || shape.size() != 3) {
      reactor->Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                                   "transport_floor: unknown model or queries not 3-d"));
      return reactor;
    }
    // Zeroed output (B, Q, p_o), in raw when the queries came in raw.
    ZeroTensor(response->mutable_output(), {shape[0], shape[1], model->num_hiddens()},
               !request->queries().raw().empty());
    response->set_request_id(request->request_id());
    response->mutable_timing()->set_batch_rows(shape[0]);
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }

  grpc::ServerBidiReactor<SessionRequest, SessionResponse>* AttendSession(
      grpc::CallbackServerContext* /*context*/) override {
    return new SessionFloor([this](const std::string& name) { return Find(name); });
  }

  grpc::ServerUnaryReactor* GetModel(grpc::CallbackServerContext* context,
                                     const attention::v1::GetModelRequest* request,
                                     ModelInfo* response) override {
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    const ModelInfo* model = Find(request->model());
    if (model != nullptr) *response = *model;
    reactor->Finish(model != nullptr ? grpc::Status::OK
                                     : grpc::Status(grpc::StatusCode::NOT_FOUND,
                                                    "transport_floor: model not listed"));
    return reactor;
  }

  grpc::ServerUnaryReactor* ListModels(grpc::CallbackServerContext* context,
                                       const attention::v1::ListModelsRequest* /*request*/,
                                       attention::v1::ListModelsResponse* response) override {
    *response = models_;
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }

 private:
  const ModelInfo* Find(const std::string& name) const {
    auto it = by_name_.find(name);
    return it == by_name_.end() ? nullptr : it->second;
  }

  const attention::v1::ListModelsResponse models_;
  std::map<std::string, const ModelInfo*> by_name_;
};

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  // Blocked before gRPC starts its threads, which inherit the mask, so that sigwait
  // below receives SIGTERM and SIGINT.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  const std::string models_from = absl::GetFlag(FLAGS_models_from);
  if (models_from.empty()) {
    std::fprintf(stderr, "--models_from: required (host:port of an attention_server)\n");
    return 2;
  }
  attention::v1::ListModelsResponse models;
  {
    auto stub = attention::v1::AttentionService::NewStub(
        grpc::CreateChannel(models_from, grpc::InsecureChannelCredentials()));
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    const grpc::Status status =
        stub->ListModels(&context, attention::v1::ListModelsRequest(), &models);
    if (!status.ok()) {
      std::fprintf(stderr, "--models_from=%s: ListModels: %s\n", models_from.c_str(),
                   status.error_message().c_str());
      return 1;
    }
  }

  FloorService service(std::move(models));
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.AddListeningPort(absl::StrCat("127.0.0.1:", absl::GetFlag(FLAGS_port)),
                           grpc::InsecureServerCredentials(), &port);
  builder.SetMaxReceiveMessageSize(INT_MAX);
  builder.SetMaxSendMessageSize(INT_MAX);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    std::fprintf(stderr, "could not listen on 127.0.0.1:%d\n", absl::GetFlag(FLAGS_port));
    return 1;
  }
  std::printf("listening on 127.0.0.1:%d\n", port);
  std::fflush(stdout);

  int signal = 0;
  sigwait(&signals, &signal);
  server->Shutdown();
  return 0;
}

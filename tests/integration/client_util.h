// Helpers for tests that call a running attention_server over gRPC.
#ifndef MHA_TESTS_INTEGRATION_CLIENT_UTIL_H_
#define MHA_TESTS_INTEGRATION_CLIENT_UTIL_H_

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/attention.h"
#include "core/config.h"
#include "core/weights.h"
#include "proto/attention.grpc.pb.h"
#include "proto/grpc/health/v1/health.grpc.pb.h"
#include "tests/temp_dir.h"

namespace mha::testing {

using attention::v1::AttendRequest;
using attention::v1::AttendResponse;
using attention::v1::AttentionService;
using attention::v1::Tensor;

// data[i] = sin(0.37 i + offset): deterministic, varied, finite.
inline Tensor MakeTensor(const std::vector<int64_t>& shape, float offset = 0.0f) {
  Tensor tensor;
  int64_t n = 1;
  for (int64_t d : shape) {
    tensor.add_shape(d);
    n *= d;
  }
  for (int64_t i = 0; i < n; ++i) tensor.add_data(std::sin(0.37f * static_cast<float>(i) + offset));
  return tensor;
}

// The seeds' toy request: queries (2, 4, 100), keys = values (2, 6, 100),
// valid_lens [3, 2].
inline AttendRequest ToyRequest() {
  AttendRequest request;
  *request.mutable_queries() = MakeTensor({2, 4, 100}, 0.0f);
  *request.mutable_keys() = MakeTensor({2, 6, 100}, 1.0f);
  *request.mutable_values() = request.keys();
  request.add_valid_lens(3);
  request.add_valid_lens(2);
  request.set_request_id("toy");
  return request;
}

inline std::shared_ptr<grpc::Channel> Channel(
    const std::string& target,
    std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::InsecureChannelCredentials(),
    const std::string& ssl_target_name = "", bool own_connection = false, bool bdp_probe = true) {
  grpc::ChannelArguments args;
  // Channels with equal arguments share one connection; this one gets its own.
  if (own_connection) args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  // false: no BDP probe pings (tests/integration/fault_test.cc says why a drain test's
  // streams need that).
  if (!bdp_probe) args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  if (!ssl_target_name.empty()) args.SetSslTargetNameOverride(ssl_target_name);
  return grpc::CreateCustomChannel(target, credentials, args);
}

inline std::unique_ptr<AttentionService::Stub> Connect(const std::string& target) {
  return AttentionService::NewStub(Channel(target));
}

inline void SetTimeout(grpc::ClientContext* context, std::chrono::milliseconds timeout) {
  context->set_deadline(std::chrono::system_clock::now() + timeout);
}

// grpc.health.v1 Check of `service` ("" = the whole server).
inline grpc::Status CheckHealth(const std::string& target, const std::string& service,
                                grpc::health::v1::HealthCheckResponse* response) {
  auto health = grpc::health::v1::Health::NewStub(Channel(target));
  grpc::ClientContext context;
  SetTimeout(&context, std::chrono::seconds(10));
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(service);
  return health->Check(&context, request, response);
}

inline grpc::Status Attend(AttentionService::Stub& stub, const AttendRequest& request,
                           AttendResponse* response,
                           std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
  grpc::ClientContext context;
  SetTimeout(&context, timeout);
  return stub.Attend(&context, request, response);
}

// The in-process core's answer for `request` on a model with `config` and
// SeededWeights(config, seed).
struct CoreResult {
  std::vector<float> output, attention;
};
inline CoreResult CoreForward(const core::ModelConfig& config, uint64_t seed,
                              const AttendRequest& request) {
  auto mha = core::MultiHeadAttention::Create(config, core::SeededWeights(config, seed)).value();
  const Tensor& q = request.queries();
  const bool cross = request.has_keys();
  core::AttentionInputs in{
      .batch = q.shape(0),
      .num_queries = q.shape(1),
      .num_keys = cross ? request.keys().shape(1) : q.shape(1),
      .queries = q.data().data(),
      .keys = cross ? request.keys().data().data() : nullptr,
      .values = cross ? request.values().data().data() : nullptr,
      .valid_lens = {request.valid_lens().data(), static_cast<size_t>(request.valid_lens_size())},
      .causal = request.causal(),
      .head_mask = {request.head_mask().data(), static_cast<size_t>(request.head_mask_size())},
  };
  CoreResult result;
  result.output.resize(static_cast<size_t>(in.batch * in.num_queries * config.num_hiddens));
  if (request.return_attention()) {
    result.attention.resize(
        static_cast<size_t>(in.batch * config.num_heads * in.num_queries * in.num_keys));
  }
  const absl::Status status = mha->Forward(
      in, result.output.data(), request.return_attention() ? result.attention.data() : nullptr);
  if (!status.ok()) result.output.clear();
  return result;
}

// The validation tests' repository, in-process and over gRPC alike: "default" (the toy
// sizes), "cross" (d_q 4, d_k 6, d_v 3, p_o 8, h 2) and "small_requests" (the toy sizes
// with max_request_bytes 2000).
inline void WriteValidationModels(const TempDir& dir) {
  dir.Write("default/config.pbtxt", "num_hiddens: 100 num_heads: 5 seeded { seed: 0 }");
  dir.Write("cross/config.pbtxt",
            "num_hiddens: 8 num_heads: 2 query_size: 4 key_size: 6 value_size: 3 "
            "seeded { seed: 3 }");
  dir.Write("small_requests/config.pbtxt",
            "num_hiddens: 100 num_heads: 5 seeded { seed: 0 } "
            "limits { max_request_bytes: 2000 }");
}

// (1, count, d): rows from .. from + count of the row-major (n, d) sequence `x`.
inline Tensor Rows(const std::vector<float>& x, int64_t d, int64_t from, int64_t count) {
  Tensor t;
  for (int64_t s : {int64_t{1}, count, d}) t.add_shape(s);
  t.mutable_data()->Add(x.begin() + from * d, x.begin() + (from + count) * d);
  return t;
}

// One open AttendSession stream, used synchronously: a step at a time. The stream
// starts (the server opens its session) when this is made.
class Session {
 public:
  // Step puts `model`, `causal` and `kind` into the stream's first message.
  Session(AttentionService::Stub& stub, const std::string& model, bool causal,
          attention::v1::SessionKind kind = attention::v1::SELF,
          std::chrono::milliseconds timeout = std::chrono::seconds(120))
      : Session(stub, timeout) {
    first_.emplace();
    first_->set_model(model);
    first_->set_causal(causal);
    first_->set_kind(kind);
  }
  // Step sends every message exactly as given (hostile input).
  explicit Session(AttentionService::Stub& stub,
                   std::chrono::milliseconds timeout = std::chrono::seconds(120)) {
    SetTimeout(&context_, timeout);
    stream_ = stub.AttendSession(&context_);
  }

  // Sends `request` and reads its answer; nullopt when the stream ended instead
  // (status() then says why).
  std::optional<attention::v1::SessionResponse> Step(attention::v1::SessionRequest request) {
    if (first_.has_value()) {
      request.set_model(first_->model());
      request.set_causal(first_->causal());
      request.set_kind(first_->kind());
      first_.reset();
    }
    attention::v1::SessionResponse response;
    if (!stream_->Write(request) || !stream_->Read(&response)) return std::nullopt;
    return response;
  }
  // A SELF step of rows from .. from + count of `x`, (n, d).
  std::optional<attention::v1::SessionResponse> SelfStep(const std::vector<float>& x, int64_t d,
                                                         int64_t from, int64_t count) {
    attention::v1::SessionRequest request;
    *request.mutable_queries() = Rows(x, d, from, count);
    return Step(std::move(request));
  }
  // Half-closes, reads what is left and returns the stream's status.
  grpc::Status Close() {
    stream_->WritesDone();
    attention::v1::SessionResponse ignored;
    while (stream_->Read(&ignored)) {
    }
    return stream_->Finish();
  }
  // Reads until the server ends the stream, without half-closing; its status.
  grpc::Status AwaitEnd() {
    attention::v1::SessionResponse ignored;
    while (stream_->Read(&ignored)) {
    }
    return stream_->Finish();
  }
  // Abandons the stream: the client cancels it.
  void Cancel() { context_.TryCancel(); }
  // After a Step returned nullopt, or after Cancel.
  grpc::Status status() { return stream_->Finish(); }

 private:
  grpc::ClientContext context_;
  std::unique_ptr<
      grpc::ClientReaderWriter<attention::v1::SessionRequest, attention::v1::SessionResponse>>
      stream_;
  std::optional<attention::v1::SessionRequest> first_;  // settings, until the first Step
};

template <typename A, typename B>
float MaxAbsDiff(const A& a, const B& b) {
  if (static_cast<size_t>(a.size()) != static_cast<size_t>(b.size())) return INFINITY;
  float diff = 0;
  for (size_t i = 0; i < static_cast<size_t>(a.size()); ++i) {
    diff = std::max(diff, std::abs(a[i] - b[i]));
  }
  return diff;
}

}  // namespace mha::testing

#endif  // MHA_TESTS_INTEGRATION_CLIENT_UTIL_H_

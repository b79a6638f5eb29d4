// One connection to the server in the protocol of ChannelOptions::protocol, for
// calls made one at a time: a model's sizes, one request, the server's readiness.
// infer, heatmap and heads send through it; bench pre-flights through it and
// sends its load with client/load/calls.h to the same channel() or http() endpoint.
//
//   auto connection = Connection::Open({.protocol = Protocol::kKServe}).value();
//   ModelInfo model = connection->GetModel("").value();          // ModelMetadata
//   AttendResponse response = connection->Attend(request).value();  // ModelInfer
//
// Every protocol answers in attention.v1's messages (kserve and http through
// client/sdk/kserve.h). Errors keep the server's code and start with the call:
//   attention  "GetModel: ", "Attend: ", "Health/Check: "
//   kserve     "ModelMetadata: ", "ModelInfer: ", "ServerReady: "
//   http       "GET /v2/models/m: ", "POST /v2/models/m/infer: ", "GET /v2/health/ready: "
// Not thread-safe: threads that call at once open a connection each (OverChannel
// shares one gRPC channel between them).
#ifndef MHA_CLIENT_SDK_CONNECTION_H_
#define MHA_CLIENT_SDK_CONNECTION_H_

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/sdk/call_group.h"
#include "client/sdk/channel.h"
#include "client/sdk/http.h"
#include "proto/attention.pb.h"

namespace mha::client {

class Connection {
 public:
  // INVALID_ARGUMENT for unreadable TLS files, bad --targets (gRPC) or a --target
  // that is not HOST[:PORT] (http). Connects on the first call.
  static absl::StatusOr<std::unique_ptr<Connection>> Open(const ChannelOptions& options);
  // A gRPC connection (kAttention or kKServe) on `channel`, e.g. another
  // connection's channel(): calls with deadline `timeout`. INVALID_ARGUMENT for kHttp.
  static absl::StatusOr<std::unique_ptr<Connection>> OverChannel(
      Protocol protocol, std::shared_ptr<grpc::Channel> channel, absl::Duration timeout);
  virtual ~Connection() = default;

  Protocol protocol() const { return protocol_; }
  // attention and kserve: the channel every call goes on; http: nullptr.
  const std::shared_ptr<grpc::Channel>& channel() const { return channel_; }
  // http: the server; unused otherwise.
  const HttpEndpoint& http() const { return http_; }

  // The sizes of `model`; "" is the server's default model: attention.v1 picks it
  // on the server, kserve and http pick it the same way from the ready models of
  // the repository index (ChooseModel: the only one, else "default", else an error
  // suggesting --model=). kserve and http read the model metadata: no bias,
  // precision or limits, and num_heads 0 when the metadata does not give h.
  virtual absl::StatusOr<attention::v1::ModelInfo> GetModel(const std::string& model) = 0;
  // Sends `request`: Attend, ModelInfer, or POST /v2/models/{model}/infer with
  // binary tensors.
  virtual absl::StatusOr<attention::v1::AttendResponse> Attend(
      const attention::v1::AttendRequest& request) = 0;
  // OK when the server is ready: Health/Check of "" is SERVING, ServerReady is
  // true, or GET /v2/health/ready answers 200 (else UNAVAILABLE or the call's error).
  virtual absl::Status Ready() = 0;

  // gRPC: every later Attend call (Attend or ModelInfer) joins `group` while in
  // flight, so that group->Cancel() ends it CANCELLED (nullptr: no group); GetModel
  // and Ready do not join. http: unused, calls end at their timeout.
  void set_call_group(CallGroup* group) { group_ = group; }

 protected:
  explicit Connection(Protocol protocol) : protocol_(protocol) {}

  const Protocol protocol_;
  std::shared_ptr<grpc::Channel> channel_;
  HttpEndpoint http_;
  CallGroup* group_ = nullptr;
};

}  // namespace mha::client

#endif  // MHA_CLIENT_SDK_CONNECTION_H_

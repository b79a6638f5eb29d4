// Channels to attention_server: plaintext or TLS, gRPC's message-size limits
// raised, and several servers behind one channel with gRPC's round_robin policy;
// and the protocol a verb speaks over them (or over HTTP).
//
//   ChannelOptions options{.target = "127.0.0.1:50051"};
//   auto channel = MakeChannel(options);                  // one server, pick_first
//   options.targets = {"127.0.0.1:50051", "127.0.0.1:50052"};
//   auto spread = MakeChannel(options);                   // round_robin over both
#ifndef MHA_CLIENT_SDK_CHANNEL_H_
#define MHA_CLIENT_SDK_CHANNEL_H_

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace mha::client {

// How infer and bench reach the model: attention.v1 over gRPC, the Open Inference
// Protocol over gRPC (inference.GRPCInferenceService, same port), or its KServe v2
// REST form over HTTP/1.1 or HTTPS (the server's --http_port). client/sdk/kserve.h
// translates requests and responses for the last two.
enum class Protocol { kAttention, kKServe, kHttp };

std::string ProtocolName(Protocol protocol);  // "attention" | "kserve" | "http"
// INVALID_ARGUMENT naming --protocol for anything but those three names.
absl::StatusOr<Protocol> ParseProtocol(absl::string_view name);

struct ChannelOptions {
  Protocol protocol = Protocol::kAttention;
  // gRPC: any gRPC target; http: HOST[:PORT] of the HTTP server (port 8000 when omitted).
  std::string target = "127.0.0.1:50051";
  // When not empty, replaces `target`: "host:port" entries spread with round_robin.
  std::vector<std::string> targets;
  bool tls = false;      // TLS with the system roots, or tls_ca
  std::string tls_ca;    // PEM roots; implies tls
  std::string tls_cert;  // PEM client chain, with tls_key: mutual TLS; implies tls
  std::string tls_key;
  std::string tls_server_name;  // overrides the name checked against the certificate
  // gRPC's client default is 4 MiB receive: too small for real outputs and attention.
  int64_t max_message_bytes = int64_t{256} << 20;
  absl::Duration timeout = absl::Seconds(10);  // the deadline of every call
  // kserve: send tensors through a registered shared-memory region
  // (client/sdk/shared_memory.h) instead of the request; the server must run with
  // --shared_memory=system on this host.
  bool shared_memory = false;
};

// `index` > 0 gives a channel its own connection (a separate subchannel pool), so
// that load can be spread over several HTTP/2 connections to the same server.
// INVALID_ARGUMENT for unreadable TLS files or unparsable targets.
absl::StatusOr<std::shared_ptr<grpc::Channel>> MakeChannel(const ChannelOptions& options,
                                                           int index = 0);

// "127.0.0.1:1,127.0.0.1:2" as one gRPC target: "ipv4:127.0.0.1:1,127.0.0.1:2".
// Host names are resolved once here (getaddrinfo); every entry must resolve to the
// same address family.
absl::StatusOr<std::string> RoundRobinTarget(const std::vector<std::string>& targets);

// `status` (a call's error) with a hint naming the flag when its message shows a
// likely cause, on the same line:
//   plaintext to a TLS server ("Socket closed"), TLS to a plaintext server ("wrong
//   version number"), a server certificate the client does not trust;
//   RESOURCE_EXHAUSTED "... message larger than max (X vs. Y)": the client's
//   --max_message_size, or the server's limit.
absl::Status WithChannelHint(const absl::Status& status, const ChannelOptions& options);

// Sets `context`'s deadline to now + timeout.
void SetTimeout(grpc::ClientContext* context, absl::Duration timeout);

}  // namespace mha::client

#endif  // MHA_CLIENT_SDK_CHANNEL_H_

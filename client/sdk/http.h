// The KServe v2 REST calls attention_client makes, over HTTP/1.1 or HTTPS (server
// verified with a CA bundle or the system roots, optional client certificate): one
// keep-alive connection, one request at a time. Bodies are built and read by
// client/sdk/kserve.h. Plain HTTP has its own transport (a request is one writev, a
// response usually one recv: a load generator's cost per request is mostly its
// syscalls; docs/performance.md); HTTPS goes through cpp-httplib.
//
//   HttpConnection http(ParseHttpTarget("127.0.0.1:8000").value(), absl::Seconds(10));
//   auto metadata = http.ModelMetadata("default");  // GET /v2/models/default
//   auto response = http.Infer(ToHttpRequest(ToModelInferRequest(request)));
//
// Errors carry the canonical code and start with the method and path, e.g.
// "NOT_FOUND: GET /v2/models/nope: unknown model (HTTP 404)". HTTP statuses map
// as CodeFromHttpStatus; a connection that cannot be made or breaks is
// UNAVAILABLE, a socket operation that outlasts the timeout DEADLINE_EXCEEDED, a
// response that is not HTTP/1.1 INTERNAL. A kept-alive connection the server has
// closed is replaced, and the request sent again, when nothing of an answer came.
#ifndef MHA_CLIENT_SDK_HTTP_H_
#define MHA_CLIENT_SDK_HTTP_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "client/sdk/kserve.h"
#include "proto/inference/grpc_service.pb.h"

namespace httplib {
class Client;
}  // namespace httplib

namespace mha::client {

class PlainHttpTransport;

inline constexpr int kDefaultHttpPort = 8000;

struct HttpEndpoint {
  std::string host = "127.0.0.1";
  int port = kDefaultHttpPort;
  // HTTPS: the server's certificate is checked against tls_ca (PEM; empty: the
  // system roots) and must name `host`; tls_cert + tls_key (PEM) are sent when
  // the server asks for a client certificate.
  bool tls = false;
  std::string tls_ca, tls_cert, tls_key;
};

// "HOST:PORT", "HOST" (port 8000), "[V6]:PORT" or "[V6]". INVALID_ARGUMENT naming
// --target otherwise (e.g. a gRPC scheme such as "dns:").
absl::StatusOr<HttpEndpoint> ParseHttpTarget(absl::string_view target);

// "HOST:PORT" ("[V6]:PORT").
std::string HttpTargetString(const HttpEndpoint& endpoint);

// Not thread-safe: one caller at a time (bench gives every concurrent slot its own).
class HttpConnection {
 public:
  // Connects on the first call; `timeout` bounds connecting and each read or write.
  HttpConnection(const HttpEndpoint& endpoint, absl::Duration timeout);
  ~HttpConnection();
  HttpConnection(const HttpConnection&) = delete;
  HttpConnection& operator=(const HttpConnection&) = delete;

  // POST request.path with the binary tensor data extension.
  absl::StatusOr<inference::ModelInferResponse> Infer(const HttpRequest& request);
  // GET /v2/models/{model}.
  absl::StatusOr<inference::ModelMetadataResponse> ModelMetadata(const std::string& model);
  // GET /v2/health/ready: OK when the server answers 200.
  absl::Status Ready();
  // POST /v2/repository/index {"ready": true}: the names of the models ready.
  absl::StatusOr<std::vector<std::string>> ReadyModels();

 private:
  const HttpEndpoint endpoint_;
  const absl::Duration timeout_;
  std::unique_ptr<httplib::Client> client_;   // HTTPS
  std::unique_ptr<PlainHttpTransport> plain_;  // HTTP
};

}  // namespace mha::client

#endif  // MHA_CLIENT_SDK_HTTP_H_

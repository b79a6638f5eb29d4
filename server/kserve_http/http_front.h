// The Open Inference Protocol over HTTP/REST (KServe v2, with Triton's binary
// tensor data extension), on its own port, through the same admission, validation,
// batcher and metrics as the gRPC fronts (protocol label "kserve_http").
//
//   GET  /v2/health/live                 200 while the process serves
//   GET  /v2/health/ready                200, or 503 once shutdown starts
//   GET  /v2                             server metadata
//   GET  /v2/models/{m}[/versions/{v}]   model metadata
//   GET  /v2/models/{m}[/versions/{v}]/ready    200, 503 while not ready
//   GET  /v2/models/{m}[/versions/{v}]/config   Triton ModelConfig (protobuf JSON)
//   GET  /v2/models/stats                Triton ModelStatistics of every model
//   GET  /v2/models/{m}[/versions/{v}]/stats    Triton ModelStatistics (numbers, as Triton)
//   POST /v2/models/{m}[/versions/{v}]/infer    JSON or JSON + binary
//   (server/kserve_http/http_codec.h) POST /v2/repository/index            [{"name", "version",
//   "state", "reason"}] Triton's shared memory, CUDA shared memory, trace and logging routes: 501
// Errors: {"error": "..."} with the status of the canonical code (HttpStatusOf),
// every one: an unknown route is 404, a known route with another method 405 with
// Allow, a body over max_body_bytes 413 (before it is read) naming the limit.
// A body is read as sent whatever its Content-Type (as Triton does): cpp-httplib
// would parse a form-encoded one (curl -d's default) as a form, 413 past 8 KiB.
//
// Infer requests go through the one submit path (server/serving/submit.h), as
// the gRPC fronts' do. Served by cpp-httplib: a pool of `threads` threads, one per
// connection being served (a keep-alive connection holds its thread for up to 100 requests or 5 s
// idle; connections beyond `threads` wait their turn in the accept queue).
// An infer request waits on its thread for the batcher's answer; compute runs on
// the compute workers as for gRPC.
//
// Thread safety: Start and Stop from one thread; the repository, submit path, metrics
// and the answers it shares with the gRPC front (server/kserve/answers.h) must
// outlive the front.
#ifndef MHA_SERVER_KSERVE_HTTP_HTTP_FRONT_H_
#define MHA_SERVER_KSERVE_HTTP_HTTP_FRONT_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "server/kserve/answers.h"
#include "server/models/model_repository.h"
#include "server/serving/metrics.h"
#include "server/serving/restricted_api.h"
#include "server/serving/submit.h"

namespace httplib {
class Server;
struct Request;
struct Response;
}  // namespace httplib

namespace mha::server {

// The HTTP status of a canonical code: INVALID_ARGUMENT 400, PERMISSION_DENIED 403,
// NOT_FOUND 404, RESOURCE_EXHAUSTED 429, UNAVAILABLE 503, DEADLINE_EXCEEDED 504,
// UNIMPLEMENTED 501, OK 200, anything else 500.
int HttpStatusOf(absl::StatusCode code);

// The restricted API group (server/serving/restricted_api.h) of a request path:
// /v2/health/* and .../ready health, .../infer inference, .../stats statistics,
// /v2/repository/* model-repository, /v2/{system,cuda}sharedmemory/* shared-memory,
// anything else metadata.
ApiGroup ApiGroupOfPath(absl::string_view path);

class HttpFront {
 public:
  struct Options {
    std::string host = "127.0.0.1";
    int32_t port = 8000;  // 0 = pick a free port
    int threads = 64;
    int64_t max_body_bytes = int64_t{64} << 20;
    // PEM paths: cert + key serve HTTPS; client_ca also requires client certificates.
    std::string tls_cert, tls_key, tls_client_ca;
  };
  struct Services {
    const ModelRepository* models;
    const RequestPath* path;      // infer
    const Metrics* metrics;       // statistics
    const KserveModels* answers;  // readiness, the index, model control
  };

  // Binds (UNAVAILABLE "HOST:PORT (--http_port)" when the port is in use) and serves.
  static absl::StatusOr<std::unique_ptr<HttpFront>> Start(const Options& options,
                                                          const Services& services);
  ~HttpFront();  // Stop()

  // Stops accepting, finishes the requests being served, joins the threads.
  void Stop();

  int port() const { return port_; }

 private:
  HttpFront() = default;
  void Route();  // every route below
  // Health, server and model metadata, model config and statistics (GET).
  void RouteMetadata();
  // /v2/repository/index, and .../models/{name}/load and /unload (Triton's
  // repository extension; the body may hold {"parameters": {}} and nothing else).
  void RouteRepository();
  // .../infer (POST): the HTTP thread waits for the batcher's forward pass.
  void RouteInfer();

  // Registers `handler` for `method` ("GET" or "POST") and `pattern`, and keeps the
  // pattern for the 405 answer of the error handler.
  void Handle(const std::string& method, const std::string& pattern,
              std::function<void(const httplib::Request&, httplib::Response&)> handler);
  // The {"error": ...} bodies of the answers cpp-httplib gives itself (404, 413,
  // 400), and 405 for a known route asked with another method.
  void RouteErrors(int64_t max_body_bytes);
  // Triton's routes this server does not serve: 501 naming them.
  void RouteUnimplemented();

  struct RouteEntry {
    std::string method;
    std::regex pattern;
  };
  std::vector<RouteEntry> routes_;
  Services services_{};
  std::unique_ptr<httplib::Server> server_;
  std::thread thread_;
  int port_ = 0;
  int listener_ = -1;  // the listening socket, owned by server_
};

}  // namespace mha::server

#endif  // MHA_SERVER_KSERVE_HTTP_HTTP_FRONT_H_

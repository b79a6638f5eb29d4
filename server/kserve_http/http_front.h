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
//   POST /v2/repository/index            [{"name", "version", "state", "reason"}]
//   GET  /v2/systemsharedmemory[/region/{r}]/status, POST .../region/{r}/register,
//   POST /v2/systemsharedmemory[/region/{r}]/unregister   (server/kserve/shared_memory_answers.h)
//   Triton's CUDA shared memory, trace and logging routes: 501
// (the routes: server/kserve_http/http_routes.h; the bodies: http_codec.h).
// Errors: {"error": "..."} with the status of the canonical code (HttpStatusOf),
// every one: an unknown route is 404, a known route with another method 405 with
// Allow; framing, limits and timeouts are the transport's (event_server.h: 400,
// 408, 413 before the body is read, 415, 417, 431, 503 past max_connections).
// A body is read as sent whatever its Content-Type (as Triton does).
//
// Served by an event-driven server (event_server.h): `threads` event-loop threads
// hold every connection, idle or computing. An infer request is parsed on its
// loop thread and submitted through the one submit path (server/serving/submit.h),
// as the gRPC fronts' are. Compute runs on the compute workers, except the
// batcher's inline path (server/serving/batcher.h: a request within
// --inline_max_flops, tens of microseconds, when nothing else is queued or
// computing), which runs on the loop as it runs on a gRPC thread (docs/service.md
// says why; --inline_max_flops=0 keeps all compute off the loops). A computed
// answer is encoded on the thread that computed it and written by the loop. A
// client that closes its connection before the answer gets none, and the request
// is counted CANCELLED.
//
// Thread safety: Start and Stop from one thread; the repository, submit path, metrics
// and the answers it shares with the gRPC front (server/kserve/answers.h) must
// outlive the front.
#ifndef MHA_SERVER_KSERVE_HTTP_HTTP_FRONT_H_
#define MHA_SERVER_KSERVE_HTTP_HTTP_FRONT_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "server/kserve/answers.h"
#include "server/kserve_http/event_server.h"
#include "server/models/model_repository.h"
#include "server/serving/metrics.h"
#include "server/serving/restricted_api.h"
#include "server/serving/submit.h"

namespace mha::server {

// The HTTP status of a canonical code: INVALID_ARGUMENT, ALREADY_EXISTS and
// FAILED_PRECONDITION 400, PERMISSION_DENIED 403,
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
    int threads = 1;      // event-loop threads
    int64_t max_body_bytes = int64_t{64} << 20;
    absl::Duration header_timeout = absl::Seconds(10);
    absl::Duration idle_timeout = absl::Seconds(60);
    int64_t max_connections = 10000;
    absl::Duration drain_timeout = absl::Seconds(30);
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

  // Stops accepting, answers the requests being computed, closes every connection.
  void Stop();

  int port() const { return server_->port(); }

 private:
  HttpFront() = default;
  // Every request: the route, its method, its API group, then its answer.
  void Serve(HttpRequest request, HttpResponder responder) const;
  void Infer(HttpRequest& request, std::string model, std::string version,
             const HttpResponder& responder) const;

  Services services_{};
  std::unique_ptr<EventHttpServer> server_;
};

}  // namespace mha::server

#endif  // MHA_SERVER_KSERVE_HTTP_HTTP_FRONT_H_

// The attention server: model repository + batcher + gRPC services (attention.v1
// and inference.GRPCInferenceService), health and reflection on one port, and Prometheus /metrics
// on another.
//
//   ServerOptions options;            // defaults: 127.0.0.1:50051, embedded model
//   options.port = 0;                 // pick a free port
//   auto server = Server::Create(options).value();   // serving when this returns
//   std::printf("listening on %s\n", server->address().c_str());
//   ...
//   server->Shutdown();               // drain: see below
//
// Thread safety: Shutdown may be called from any thread, once.
#ifndef MHA_SERVER_SERVER_H_
#define MHA_SERVER_SERVER_H_

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/batcher.h"
#include "server/http_front.h"
#include "server/inference_service.h"
#include "server/metrics.h"
#include "server/model_repository.h"
#include "server/service.h"

namespace mha::server {

struct ServerOptions {
  std::string host = "127.0.0.1";          // loopback by default; "0.0.0.0" to serve the network
  int32_t port = 50051;                    // 0 = pick a free port (see Server::port())
  std::string model_repository;            // "" = the embedded "default" model
  int compute_threads = 0;                 // total OpenMP threads for compute; 0 = AvailableCpus()
  int compute_workers = 1;                 // concurrent forward calls; each gets threads/workers
  ModelLimits limits;                      // defaults for limits a model config leaves at 0
  BatchingPolicy batching;                 // likewise for `batching { ... }`
  std::string metrics_host = "127.0.0.1";  // /metrics: loopback unless asked
  int32_t metrics_port = -1;               // -1 = no metrics endpoint; 0 = pick a free port
  // KServe v2 HTTP/REST (server/http_front.h) on `host`, with the TLS below.
  int32_t http_port = -1;  // -1 = off; 0 = pick a free port
  int http_threads = 64;   // connections served at once
  absl::Duration drain_timeout = absl::Seconds(10);
  // TLS: PEM file paths. cert + key enable TLS; client_ca also requires and
  // verifies client certificates (mutual TLS). All empty: plaintext.
  std::string tls_cert;
  std::string tls_key;
  std::string tls_client_ca;

  // Every field's range, and the TLS fields' combinations: INVALID_ARGUMENT whose
  // message starts with the field's name as written here, e.g.
  // "limits.max_batch_size: expected >= 1, got 0". Server::Create calls it.
  absl::Status Validate() const;
};

class Server {
 public:
  // Loads every model (any failure is returned, naming the model and file), binds
  // the port and starts serving with health SERVING overall ("") and per model name.
  static absl::StatusOr<std::unique_ptr<Server>> Create(const ServerOptions& options);
  ~Server();  // Shutdown()

  // Health NOT_SERVING, stop accepting calls (HTTP first: its requests being
  // served finish, idle keep-alive connections close within 5 s), let in-flight calls finish for up
  // to drain_timeout (then cancel the rest), run what is queued, stop the workers. /metrics stays
  // up until the server is destroyed.
  void Shutdown();

  int port() const { return port_; }
  std::string address() const;  // "host:port"
  // The bound /metrics port; 0 when metrics_port was -1.
  int metrics_port() const { return exposer_ != nullptr ? exposer_->port() : 0; }
  std::string metrics_address() const;                                    // "host:port"
  int http_port() const { return http_ != nullptr ? http_->port() : 0; }  // 0: HTTP off
  std::string http_address() const;                                       // "host:port"
  const ModelRepository& models() const { return *models_; }
  int threads_per_worker() const { return threads_per_worker_; }

 private:
  Server() = default;

  ServerOptions options_;
  int port_ = 0;
  int threads_per_worker_ = 1;
  std::unique_ptr<ModelRepository> models_;
  std::unique_ptr<Metrics> metrics_;
  std::unique_ptr<MetricsExposer> exposer_;
  std::unique_ptr<Batcher> batcher_;
  std::unique_ptr<AttentionServiceImpl> service_;
  std::unique_ptr<InferenceServiceImpl> inference_service_;
  std::unique_ptr<grpc::Server> grpc_server_;
  std::unique_ptr<HttpFront> http_;
  bool shut_down_ = false;
};

}  // namespace mha::server

#endif  // MHA_SERVER_SERVER_H_

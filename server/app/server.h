// The attention server process, wiring the layers together: the models
// (server/models/), the serving layer (server/serving/), the fronts (attention.v1 and
// inference.GRPCInferenceService with health and reflection on one gRPC port, KServe
// HTTP on another) and Prometheus /metrics on a third.
//
//   ServerOptions options;            // defaults: 127.0.0.1:50051, embedded model
//   options.port = 0;                 // pick a free port
//   auto server = Server::Create(options).value();   // listening, warming up
//   server->WaitUntilReady().value();                  // serving
//   std::printf("listening on %s\n", server->address().c_str());
//   ...
//   server->Shutdown();               // drain: see below
//
// Thread safety: Shutdown may be called from any thread, once.
#ifndef MHA_SERVER_APP_SERVER_H_
#define MHA_SERVER_APP_SERVER_H_

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/app/memory_trimmer.h"
#include "server/app/metrics_exposer.h"
#include "server/attention_v1/service.h"
#include "server/attention_v1/session.h"
#include "server/grpc_common/unimplemented_service.h"
#include "server/kserve/answers.h"
#include "server/kserve_grpc/inference_service.h"
#include "server/kserve_http/http_front.h"
#include "server/models/model_lifecycle.h"
#include "server/models/model_repository.h"
#include "server/models/model_states.h"
#include "server/serving/batcher.h"
#include "server/serving/metrics.h"
#include "server/serving/shared_memory.h"
#include "server/serving/submit.h"

namespace mha::server {

struct ServerOptions {
  std::string host = "127.0.0.1";  // loopback by default; "0.0.0.0" to serve the network
  int32_t port = 50051;            // 0 = pick a free port (see Server::port())
  std::string model_repository;    // "" = the embedded "default" model
  int compute_threads = 0;         // total OpenMP threads for compute; 0 = AvailableCpus()
  int compute_workers = 1;         // concurrent forward calls; each gets threads/workers
  // A request of at most this much work runs on the thread that received it when
  // compute is idle (server/serving/batcher.h); 0 = never.
  double inline_max_flops = 2e6;
  // AttendSession steps answered as the core finishes each, while their call computes
  // the others; false: when their call has ended (server/serving/batcher.h).
  bool session_answers_as_steps_end = false;
  // A model whose config.pbtxt lists no `warmup` runs the default passes
  // (server/models/model_repository.h DefaultWarmup); false: no warm-up for it.
  bool default_warmup = true;
  // Model lifecycle (server/models/model_lifecycle.h): none, poll or explicit.
  ModelControl model_control = ModelControl::kNone;
  absl::Duration repository_poll = absl::Seconds(15);  // poll's interval
  std::vector<std::string> load_models;                // explicit: the models loaded at start
  ModelLimits limits;                      // defaults for limits a model config leaves at 0
  BatchingPolicy batching;                 // likewise for `batching { ... }`
  std::string metrics_host = "127.0.0.1";  // /metrics: loopback unless asked
  int32_t metrics_port = -1;               // -1 = no metrics endpoint; 0 = pick a free port
  // KServe v2 HTTP/REST (server/kserve_http/http_front.h) on `host`, with the TLS below.
  int32_t http_port = -1;  // -1 = off; 0 = pick a free port
  int http_threads = 0;    // event-loop threads; 0 = one per available CPU
  absl::Duration http_header_timeout = absl::Seconds(10);  // a request head's deadline
  absl::Duration http_idle_timeout = absl::Seconds(60);    // keep-alive, and between body reads
  int64_t http_max_connections = 10000;                    // beyond: 503 and close
  absl::Duration drain_timeout = absl::Seconds(10);
  // malloc_trim(0) at this interval, so that memory freed after a burst goes back to
  // the system (server/app/memory_trimmer.h); 0 = never.
  absl::Duration malloc_trim_interval = absl::Seconds(2);
  // Attention sessions (server/attention_v1/session.h): the K/V cache's byte budget (0 = a
  // quarter of AvailableMemoryBytes, server/app/cpu.h) and the idle timeout.
  int64_t session_cache_bytes = 0;
  absl::Duration session_idle_timeout = absl::Seconds(60);
  // TLS: PEM file paths. cert + key enable TLS; client_ca also requires and
  // verifies client certificates (mutual TLS). All empty: plaintext.
  std::string tls_cert;
  std::string tls_key;
  std::string tls_client_ca;
  // Restricted API groups, "GROUP[,GROUP]:KEY=VALUE[;...]" (server/serving/restricted_api.h);
  // "" restricts none.
  std::string restricted_api;
  // One access-log line (base/log.h) per request answered and per session ended.
  bool log_requests = false;
  // Triton's system shared memory (server/serving/shared_memory.h): off by default
  // (--shared_memory=none); on, the KServe fronts register regions and read inputs
  // from / write outputs into them, within these limits.
  bool shared_memory = false;
  SharedMemoryOptions shared_memory_options;

  // Every field's range, and the TLS fields' combinations: INVALID_ARGUMENT whose
  // message starts with the field's name as written here, e.g.
  // "limits.max_batch_size: expected >= 1, got 0". Server::Create calls it.
  absl::Status Validate() const;
};

class Server {
 public:
  // Loads every model (any failure is returned, naming the model and file), binds
  // the ports and starts the warm-up: each model's `warmup` passes run, in order,
  // through the batcher on the compute workers, so its primitives, workspaces and
  // threads are ready before the first request. Meanwhile health (gRPC, and the OIP
  // ready checks) is NOT_SERVING for the model and overall, and its requests get
  // UNAVAILABLE naming the warm-up. As each model's warm-up ends it turns SERVING;
  // overall ("") turns SERVING last, once every model is ready.
  static absl::StatusOr<std::unique_ptr<Server>> Create(const ServerOptions& options);

  // Blocks until the warm-up has ended: each model's passes and the time they took,
  // or the first failure, naming the model and the pass (the server then serves no
  // model that had not warmed up; the caller should shut it down).
  absl::StatusOr<std::vector<WarmupReport>> WaitUntilReady();
  ~Server();  // Shutdown()

  // Health NOT_SERVING, stop accepting calls (HTTP first: its requests being
  // served finish, idle keep-alive connections close within 5 s), let in-flight calls finish for up
  // to drain_timeout (then cancel the rest), run what is queued, stop the workers. /metrics stays
  // up until the server is destroyed.
  void Shutdown();

  // SIGHUP: re-reads the model repository (server/models/model_lifecycle.h); logs each
  // change and a summary on stderr.
  ModelLifecycle::ReloadReport Reload() { return lifecycle_->Reload(); }

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
  std::unique_ptr<RestrictedApis> restricted_;  // read by path_
  std::unique_ptr<SharedMemoryRegistry> shared_memory_;  // read by path_; null when off
  std::unique_ptr<RequestPath> path_;           // every front's way to the batcher
  std::unique_ptr<ModelStates> states_;         // every readiness answer's
  std::unique_ptr<ModelLifecycle> lifecycle_;
  std::unique_ptr<SessionManager> sessions_;     // destroyed after grpc_server_
  std::unique_ptr<KserveModels> kserve_models_;  // both KServe fronts' readiness
  std::unique_ptr<AttentionServiceImpl> service_;
  std::unique_ptr<InferenceServiceImpl> inference_service_;
  UnimplementedService unimplemented_;  // every method not declared
  std::unique_ptr<grpc::Server> grpc_server_;
  std::unique_ptr<HttpFront> http_;
  std::unique_ptr<MemoryTrimmer> trimmer_;
  bool shut_down_ = false;

  // Create's steps after the models and metrics: each sets members or fails.
  absl::Status StartServices();
  // Each returns UNAVAILABLE naming its flag and address when its port cannot be bound;
  // Create tries every one and reports all the busy ones in one message.
  absl::Status StartGrpc(const std::shared_ptr<grpc::ServerCredentials>& credentials,
                         int64_t max_receive);
  absl::Status StartHttp(int64_t max_receive);  // when options_.http_port >= 0

  // The warm-up thread and what it found.
  void Warm();
  std::thread warmup_thread_;
  absl::Mutex warmup_mu_;
  bool warmed_ ABSL_GUARDED_BY(warmup_mu_) = false;
  absl::StatusOr<std::vector<WarmupReport>> warmup_ ABSL_GUARDED_BY(warmup_mu_);
};

}  // namespace mha::server

#endif  // MHA_SERVER_APP_SERVER_H_

#include "server/app/server.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include <algorithm>
#include <climits>
#include <fstream>
#include <optional>
#include <sstream>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/log.h"
#include "base/status_macros.h"
#include "server/app/cpu.h"

namespace mha::server {
namespace {

absl::StatusOr<std::string> ReadFile(absl::string_view flag, const std::string& path) {
  std::ifstream file(path);
  if (!file) return absl::NotFoundError(absl::StrCat(flag, ": cannot read ", path));
  std::stringstream text;
  text << file.rdbuf();
  return text.str();
}

// The first certificate of `cert_pem` and the key of `key_pem` parse and belong
// together; INVALID_ARGUMENT naming the flag and the file otherwise. gRPC and cpp-httplib
// would only find out when binding, in words about the port.
absl::Status CheckKeyPair(const ServerOptions& options, const std::string& cert_pem,
                          const std::string& key_pem) {
  BIO* cert_bio = BIO_new_mem_buf(cert_pem.data(), static_cast<int>(cert_pem.size()));
  X509* cert = PEM_read_bio_X509(cert_bio, nullptr, nullptr, nullptr);
  BIO_free(cert_bio);
  BIO* key_bio = BIO_new_mem_buf(key_pem.data(), static_cast<int>(key_pem.size()));
  // No passphrase (OpenSSL's default callback would prompt on the terminal): an
  // encrypted key reads as none, which gRPC could not use either.
  pem_password_cb* no_passphrase = [](char*, int, int, void*) { return 0; };
  EVP_PKEY* key = PEM_read_bio_PrivateKey(key_bio, nullptr, no_passphrase, nullptr);
  BIO_free(key_bio);
  absl::Status status;
  if (cert == nullptr) {
    status = absl::InvalidArgumentError(absl::StrCat(
        "tls_cert: ", options.tls_cert, " holds no PEM certificate (BEGIN CERTIFICATE)"));
  } else if (key == nullptr) {
    status = absl::InvalidArgumentError(absl::StrCat(
        "tls_key: ", options.tls_key, " holds no unencrypted PEM private key (BEGIN PRIVATE KEY)"));
  } else if (X509_check_private_key(cert, key) != 1) {
    status = absl::InvalidArgumentError(
        absl::StrCat("tls_key: the key in ", options.tls_key, " does not match the certificate in ",
                     options.tls_cert,
                     " (its public key is another); give the key the certificate was made for"));
  }
  ERR_clear_error();
  X509_free(cert);
  EVP_PKEY_free(key);
  return status;
}

// Options::Validate has checked the fields' combinations.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeCredentials(
    const ServerOptions& options) {
  if (options.tls_cert.empty()) return grpc::InsecureServerCredentials();
  grpc::SslServerCredentialsOptions ssl;
  grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
  MHA_ASSIGN_OR_RETURN(pair.cert_chain, ReadFile("tls_cert", options.tls_cert));
  MHA_ASSIGN_OR_RETURN(pair.private_key, ReadFile("tls_key", options.tls_key));
  MHA_RETURN_IF_ERROR(CheckKeyPair(options, pair.cert_chain, pair.private_key));
  ssl.pem_key_cert_pairs.push_back(std::move(pair));
  if (!options.tls_client_ca.empty()) {
    MHA_ASSIGN_OR_RETURN(ssl.pem_root_certs, ReadFile("tls_client_ca", options.tls_client_ca));
    ssl.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  return grpc::SslServerCredentials(ssl);
}

absl::Status AtLeast(absl::string_view field, int64_t value, int64_t least) {
  if (value >= least) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(field, ": expected >= ", least, ", got ", value));
}

absl::Status NotNegative(absl::string_view field, absl::Duration value) {
  if (value >= absl::ZeroDuration()) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": expected >= 0, got ", absl::ToInt64Microseconds(value), " us"));
}

absl::Status PortInRange(absl::string_view field, int32_t port, int32_t least) {
  if (port >= least && port <= 65535) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": expected ", least, " to 65535, got ", port));
}

// --log_requests: the access line of one answer (base/log.h's format).
void LogAccess(const AccessRecord& r) {
  log::Access({{"front", std::string(ProtocolLabel(r.protocol))},
               {"call", std::string(r.session ? "session" : "request")},
               {"model", std::string(r.model)},
               {"version", r.version},
               {"batch", r.batch},
               {"queries", r.queries},
               {"keys", r.keys},
               {"steps", r.steps},
               {"code", absl::StatusCodeToString(r.code)},
               {"queue_us", absl::ToInt64Microseconds(r.queue)},
               {"compute_us", absl::ToInt64Microseconds(r.compute)},
               {"total_us", absl::ToInt64Microseconds(r.total)},
               {"peer", std::string(r.peer)}});
}

std::string HostPort(const std::string& host, int port) {
  return absl::StrContains(host, ':') ? absl::StrCat("[", host, "]:", port)
                                      : absl::StrCat(host, ":", port);
}

}  // namespace

absl::Status ServerOptions::Validate() const {
  MHA_RETURN_IF_ERROR(PortInRange("port", port, 0));
  MHA_RETURN_IF_ERROR(PortInRange("metrics_port", metrics_port, -1));
  MHA_RETURN_IF_ERROR(PortInRange("http_port", http_port, -1));
  MHA_RETURN_IF_ERROR(AtLeast("http_threads", http_threads, 0));
  MHA_RETURN_IF_ERROR(AtLeast("http_max_connections", http_max_connections, 1));
  if (http_header_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("http_header_timeout: expected > 0");
  }
  if (http_idle_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("http_idle_timeout: expected > 0");
  }
  MHA_RETURN_IF_ERROR(AtLeast("compute_threads", compute_threads, 0));
  MHA_RETURN_IF_ERROR(AtLeast("compute_workers", compute_workers, 1));
  if (!(inline_max_flops >= 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("inline_max_flops: expected >= 0, got ", inline_max_flops));
  }
  for (auto [field, value] : {std::pair{"limits.max_batch_size", limits.max_batch_size},
                              {"limits.max_sequence_length", limits.max_sequence_length},
                              {"limits.max_request_bytes", limits.max_request_bytes},
                              {"limits.max_attention_elements", limits.max_attention_elements},
                              {"batching.max_batch_size", batching.max_batch_size},
                              {"batching.max_batch_tokens", batching.max_batch_tokens},
                              {"batching.max_queue_size", batching.max_queue_size}}) {
    MHA_RETURN_IF_ERROR(AtLeast(field, value, 1));
  }
  MHA_RETURN_IF_ERROR(NotNegative("batching.max_queue_delay", batching.max_queue_delay));
  MHA_RETURN_IF_ERROR(NotNegative("batching.max_queue_wait", batching.max_queue_wait));
  MHA_RETURN_IF_ERROR(NotNegative("batching.session_gather", batching.session_gather));
  MHA_RETURN_IF_ERROR(NotNegative("drain_timeout", drain_timeout));
  MHA_RETURN_IF_ERROR(NotNegative("malloc_trim_interval", malloc_trim_interval));
  MHA_RETURN_IF_ERROR(AtLeast("session_cache_bytes", session_cache_bytes, 0));
  MHA_RETURN_IF_ERROR(
      AtLeast("shared_memory_options.max_regions", shared_memory_options.max_regions, 1));
  MHA_RETURN_IF_ERROR(
      AtLeast("shared_memory_options.max_bytes", shared_memory_options.max_bytes, 1));
  if (session_idle_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat("session_idle_timeout: expected > 0, got ",
                                                   absl::FormatDuration(session_idle_timeout)));
  }
  if (repository_poll < absl::Seconds(1)) {
    return absl::InvalidArgumentError(absl::StrCat("repository_poll: expected >= 1 s, got ",
                                                   absl::FormatDuration(repository_poll)));
  }
  if (model_control != ModelControl::kExplicit && !load_models.empty()) {
    return absl::InvalidArgumentError(
        "load_models: needs model_control explicit (the other modes load every model)");
  }
  if (model_control != ModelControl::kNone && model_repository.empty()) {
    return absl::InvalidArgumentError(
        "model_control: poll and explicit need a model_repository to read");
  }
  if (tls_cert.empty() != tls_key.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(tls_cert.empty() ? "tls_cert" : "tls_key",
                     ": tls_cert and tls_key go together; give both or neither"));
  }
  if (!tls_client_ca.empty() && tls_cert.empty()) {
    return absl::InvalidArgumentError("tls_client_ca: needs tls_cert and tls_key");
  }
  // Parses the rules and reads their secrets (again at Create).
  if (absl::StatusOr<std::unique_ptr<RestrictedApis>> restricted =
          RestrictedApis::Create(restricted_api, nullptr);
      !restricted.ok()) {
    return restricted.status();
  }
  return absl::OkStatus();
}

// The batcher, the models' lifecycle, the session manager and the RPC services.
absl::Status Server::StartServices() {
  MHA_ASSIGN_OR_RETURN(
      batcher_, Batcher::Create({.num_workers = options_.compute_workers,
                                 .inline_max_flops = options_.inline_max_flops,
                                 .answer_steps_as_they_end = options_.session_answers_as_steps_end},
                                metrics_.get()));
  states_ = std::make_unique<ModelStates>();
  lifecycle_ = std::make_unique<ModelLifecycle>(
      ModelLifecycle::Options{.control = options_.model_control,
                              .poll_interval = options_.repository_poll},
      models_.get(), states_.get(), batcher_.get(), metrics_.get());
  MHA_RETURN_IF_ERROR(lifecycle_->QueueStartUpModels());
  sessions_ = std::make_unique<SessionManager>(
      SessionOptions{.cache_bytes = options_.session_cache_bytes > 0 ? options_.session_cache_bytes
                                                                     : AvailableMemoryBytes() / 4,
                     .idle_timeout = options_.session_idle_timeout},
      models_.get(), batcher_.get(), *metrics_->registry(),
      options_.log_requests ? AccessLog(LogAccess) : nullptr);
  MHA_ASSIGN_OR_RETURN(restricted_,
                       RestrictedApis::Create(options_.restricted_api, metrics_->registry().get()));
  if (options_.shared_memory) {
    shared_memory_ = std::make_unique<SharedMemoryRegistry>(options_.shared_memory_options);
  }
  path_ = std::make_unique<RequestPath>(
      models_.get(), batcher_.get(), metrics_.get(), restricted_.get(),
      options_.log_requests ? AccessLog(LogAccess) : nullptr, shared_memory_.get());
  service_ = std::make_unique<AttentionServiceImpl>(models_.get(), path_.get(), sessions_.get());
  kserve_models_ = std::make_unique<KserveModels>(models_.get(), states_.get(), lifecycle_.get());
  inference_service_ = std::make_unique<InferenceServiceImpl>(models_.get(), path_.get(),
                                                              metrics_.get(), kserve_models_.get());
  return absl::OkStatus();
}

// Builds and starts the gRPC server on options_.host:port with both services;
// UNAVAILABLE naming the address when it cannot listen.
absl::Status Server::StartGrpc(const std::shared_ptr<grpc::ServerCredentials>& credentials,
                               int64_t max_receive) {
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  // gRPC sets SO_REUSEPORT by default, which would let a second server bind a busy
  // port and take half of its connections; a port in use fails start-up instead.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.AddListeningPort(HostPort(options_.host, options_.port), credentials, &port_);
  builder.SetMaxReceiveMessageSize(static_cast<int>(std::min<int64_t>(max_receive, INT_MAX)));
  builder.SetMaxSendMessageSize(INT_MAX);
  builder.RegisterService(service_.get());
  builder.RegisterService(inference_service_.get());
  builder.RegisterCallbackGenericService(&unimplemented_);
  grpc_server_ = builder.BuildAndStart();
  if (grpc_server_ == nullptr || port_ == 0) {
    grpc_server_ = nullptr;
    return absl::UnavailableError(
        absl::StrCat(HostPort(options_.host, options_.port), " (--port)"));
  }
  return absl::OkStatus();
}

absl::Status Server::StartHttp(int64_t max_receive) {
  if (options_.http_port < 0) return absl::OkStatus();
  if (options_.http_threads > AvailableCpus()) {
    log::Warning(absl::StrCat("--http_threads=", options_.http_threads, ": more event loops than ",
                              AvailableCpus(), " CPUs; one loop serves any number of connections"));
  }
  MHA_ASSIGN_OR_RETURN(http_, HttpFront::Start({.host = options_.host,
                                                .port = options_.http_port,
                                                .threads = options_.http_threads > 0
                                                               ? options_.http_threads
                                                               : AvailableCpus(),
                                                .max_body_bytes = max_receive,
                                                .header_timeout = options_.http_header_timeout,
                                                .idle_timeout = options_.http_idle_timeout,
                                                .max_connections = options_.http_max_connections,
                                                .drain_timeout = options_.drain_timeout,
                                                .tls_cert = options_.tls_cert,
                                                .tls_key = options_.tls_key,
                                                .tls_client_ca = options_.tls_client_ca},
                                               {.models = models_.get(),
                                                .path = path_.get(),
                                                .metrics = metrics_.get(),
                                                .answers = kserve_models_.get()}));
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Server>> Server::Create(const ServerOptions& options) {
  MHA_RETURN_IF_ERROR(options.Validate());
  std::unique_ptr<Server> server(new Server());
  server->options_ = options;
  // TLS files are read before anything is loaded or bound: a bad path fails fast.
  MHA_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ServerCredentials> credentials,
                       MakeCredentials(options));
  const int threads = options.compute_threads > 0 ? options.compute_threads : AvailableCpus();
  server->threads_per_worker_ = std::max(1, threads / options.compute_workers);

  MHA_ASSIGN_OR_RETURN(
      server->models_,
      ModelRepository::Create({.path = options.model_repository,
                               .default_limits = options.limits,
                               .default_batching = options.batching,
                               .num_threads = server->threads_per_worker_,
                               .default_warmup = options.default_warmup,
                               .only = options.model_control == ModelControl::kExplicit
                                           ? std::optional(options.load_models)
                                           : std::nullopt,
                               .allow_empty = options.model_control == ModelControl::kPoll}));
  std::vector<std::string> names;
  for (const auto& model : server->models_->models()) names.push_back(model->name);
  server->metrics_ = std::make_unique<Metrics>(names);
  // Every listener is tried; the ports that cannot be bound are named together.
  std::vector<std::string> busy;
  auto bound = [&busy](const absl::Status& status) {
    if (status.code() != absl::StatusCode::kUnavailable) return status;
    busy.emplace_back(status.message());
    return absl::OkStatus();
  };
  if (options.metrics_port >= 0) {
    absl::StatusOr<std::unique_ptr<MetricsExposer>> exposer = MetricsExposer::Start(
        HostPort(options.metrics_host, options.metrics_port), server->metrics_->registry());
    if (exposer.ok()) {
      server->exposer_ = *std::move(exposer);
    } else {
      MHA_RETURN_IF_ERROR(bound(absl::UnavailableError(absl::StrCat(
          HostPort(options.metrics_host, options.metrics_port), " (--metrics_port)"))));
    }
  }
  MHA_RETURN_IF_ERROR(server->StartServices());
  // The transport refuses bigger messages itself; each model's own limit is
  // checked in validation, so the transport allows the largest of them (of the
  // models loaded at start-up: a model loaded later that allows more is held to
  // this until a restart).
  int64_t max_receive = options.limits.max_request_bytes;
  for (const auto& model : server->models_->models()) {
    max_receive = std::max(max_receive, model->limits.max_request_bytes);
  }
  MHA_RETURN_IF_ERROR(bound(server->StartGrpc(credentials, max_receive)));
  MHA_RETURN_IF_ERROR(bound(server->StartHttp(max_receive)));
  if (!busy.empty()) {
    return absl::UnavailableError(absl::StrCat(
        "cannot listen on ", absl::StrJoin(busy, ", "),
        ": address in use (another server?) or not an address of this host; change the flag, "
        "or give 0 to pick a free port"));
  }
  // gRPC's health service starts with "" SERVING: not so until the warm-up is done.
  grpc::HealthCheckServiceInterface* health = server->grpc_server_->GetHealthCheckService();
  health->SetServingStatus(false);
  for (const auto& model : server->models_->models()) {
    health->SetServingStatus(model->name, false);
  }
  // Each model turns SERVING as it turns ready, at start-up and later.
  server->lifecycle_->SetHealth(
      [health](const std::string& name, bool serving) { health->SetServingStatus(name, serving); });
  server->warmup_thread_ = std::thread(&Server::Warm, server.get());
  server->trimmer_ = std::make_unique<MemoryTrimmer>(options.malloc_trim_interval);
  return server;
}

void Server::Warm() {
  absl::StatusOr<std::vector<WarmupReport>> reports = lifecycle_->StartUp();
  if (reports.ok()) {
    // Overall last: every model is ready.
    grpc_server_->GetHealthCheckService()->SetServingStatus(true);
    lifecycle_->StartPolling();
  }
  absl::MutexLock lock(&warmup_mu_);
  warmed_ = true;
  warmup_ = std::move(reports);
}

absl::StatusOr<std::vector<WarmupReport>> Server::WaitUntilReady() {
  absl::MutexLock lock(&warmup_mu_);
  warmup_mu_.Await(absl::Condition(&warmed_));
  return warmup_;
}

Server::~Server() { Shutdown(); }

void Server::Shutdown() {
  if (shut_down_) return;
  shut_down_ = true;
  // No reload starts from here on; one in progress finishes first.
  if (lifecycle_ != nullptr) lifecycle_->Stop();
  if (states_ != nullptr) states_->ShuttingDown();
  if (http_ != nullptr) http_->Stop();
  // Sessions waiting for their next message end now; computing ones after their
  // step's response (server/attention_v1/session.h). gRPC's shutdown below waits for them.
  if (sessions_ != nullptr) sessions_->Shutdown();
  if (grpc_server_ != nullptr) {
    // Turns every status NOT_SERVING and ignores later updates.
    if (auto* health = grpc_server_->GetHealthCheckService()) health->Shutdown();
    grpc_server_->Shutdown(absl::ToChronoTime(absl::Now() + options_.drain_timeout));
  }
  if (batcher_ != nullptr) batcher_->Shutdown();
  // After the batcher: a warm-up pass still queued has been computed, or refused.
  if (warmup_thread_.joinable()) warmup_thread_.join();
  if (grpc_server_ != nullptr) grpc_server_->Wait();
  if (trimmer_ != nullptr) trimmer_->Stop();
}

std::string Server::address() const { return HostPort(options_.host, port_); }

std::string Server::http_address() const { return HostPort(options_.host, http_port()); }

std::string Server::metrics_address() const {
  return HostPort(options_.metrics_host, metrics_port());
}

}  // namespace mha::server

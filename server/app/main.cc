// attention_server: serves attention.v1.AttentionService and the Open Inference
// Protocol (KServe v2) over gRPC, and KServe v2 over HTTP when --http_port is set
// (docs/service.md). Every flag lives here and fills ServerOptions.
#include <grpc/support/log.h>
#include <malloc.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "base/command_line.h"
#include "base/log.h"
#include "base/mutex_mode.h"
#include "core/config.h"
#include "server/app/cpu.h"
#include "server/app/server.h"

namespace {
const mha::server::ServerOptions kDefaults;
const mha::server::ModelLimits kLimits;

// libgomp lets a thread spin for 300000 iterations after a parallel region before it
// sleeps; a server shares its cores with gRPC's threads, so it spins for less
// (docs/performance.md has the measurements). libgomp reads the variable when it
// loads, before main, so the server sets it and runs itself again. An operator's
// OMP_WAIT_POLICY or GOMP_SPINCOUNT is left alone.
void ShortenOpenMpSpin(char** argv) {
  if (std::getenv("OMP_WAIT_POLICY") != nullptr || std::getenv("GOMP_SPINCOUNT") != nullptr) {
    return;
  }
  // The binary's own path, not /proc/self/exe: the process name (ps, pgrep, pkill)
  // comes from the path exec is given.
  char self[4096];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n > 0) {
    self[n] = '\0';
    setenv("GOMP_SPINCOUNT", "10000", 1);
    execv(self, argv);
    unsetenv("GOMP_SPINCOUNT");
  }
  // No /proc, or exec refused: carry on with libgomp's default.
  std::fprintf(stderr, "note: could not re-run with GOMP_SPINCOUNT=10000; OpenMP spins long\n");
}
// gRPC's own messages go to the server's log, at --log_verbose 1 (errors) or 2 (the
// rest): a handshake a client failed is the client's problem, and start-up failures
// are reported in the server's own words.
void GrpcLog(gpr_log_func_args* args) {
  absl::string_view file = args->file != nullptr ? args->file : "";
  if (const size_t slash = file.rfind('/'); slash != absl::string_view::npos) {
    file = file.substr(slash + 1);
  }
  mha::log::Verbose(args->severity == GPR_LOG_SEVERITY_ERROR ? 1 : 2, "grpc",
                    absl::StrCat(args->message, " (", file, ":", args->line, ")"));
}

// ServerOptions fields and the flags that fill them, where the names differ.
constexpr std::pair<absl::string_view, absl::string_view> kFlagOfField[] = {
    {"limits.max_batch_size", "max_batch_size"},
    {"limits.max_sequence_length", "max_sequence_length"},
    {"limits.max_request_bytes", "max_request_bytes"},
    {"limits.max_attention_elements", "max_attention_elements"},
    {"batching.max_batch_size", "max_batch_size"},
    {"batching.max_batch_tokens", "max_batch_tokens"},
    {"batching.max_queue_size", "max_queue_size"},
    {"batching.max_queue_delay", "max_queue_delay_us"},
    {"batching.max_queue_wait", "max_queue_wait_us"},
    {"batching.session_gather", "session_gather_us"},
    {"repository_poll", "repository_poll_secs"},
    {"shared_memory_options.max_regions", "shared_memory_max_regions"},
    {"shared_memory_options.max_bytes", "shared_memory_max_bytes"},
};

// "field: problem" from ServerOptions::Validate, as "--flag: problem".
std::string NameTheFlag(absl::string_view message) {
  const size_t colon = message.find(':');
  if (colon == absl::string_view::npos) return std::string(message);
  absl::string_view flag = message.substr(0, colon);
  for (const auto& [field, name] : kFlagOfField) {
    if (field == flag) flag = name;
  }
  return absl::StrCat("--", flag, message.substr(colon));
}
}  // namespace

ABSL_FLAG(std::string, host, kDefaults.host,
          "Address to listen on; 127.0.0.1 (loopback) by default, 0.0.0.0 for all.");
ABSL_FLAG(int32_t, port, kDefaults.port,
          "gRPC port; 0 picks a free one, and makes --http_port and --metrics_port 0 too "
          "unless they are given. The bound address is printed as 'listening on HOST:PORT'.");
ABSL_FLAG(int32_t, metrics_port, 9464,
          "Prometheus /metrics port; 0 picks a free one, -1 turns metrics off. The bound "
          "address is printed as 'metrics on HOST:PORT'.");
ABSL_FLAG(int32_t, http_port, 8000,
          "KServe v2 HTTP/REST port (same host and TLS flags as gRPC); 0 picks a free one, "
          "-1 turns HTTP off. The bound address is printed as 'http on HOST:PORT'.");
ABSL_FLAG(std::string, log_format, "text",
          "text: log lines as plain text; json: one JSON object a line (time, level, msg; "
          "the access log's fields). stdout's 'metrics on', 'http on' and 'listening on' "
          "lines keep their form either way.");
ABSL_FLAG(int32_t, log_verbose, 0,
          "0: the server's own lines; 1: also gRPC's and civetweb's error messages; 2: also "
          "gRPC's informational ones.");
ABSL_FLAG(bool, log_requests, false,
          "Access log: one line per inference request answered (unary, or each request of "
          "a stream) and per session at its end, not per step: time, front, model, version, "
          "shape, code, queue/compute/total us, peer.");
ABSL_FLAG(std::string, restricted_api, "",
          "Restricted API groups, as Triton's --grpc-restricted-protocol: "
          "\"GROUP[,GROUP]:KEY=VALUE[;...]\". A call of a listed group needs the HTTP header "
          "KEY (gRPC metadata KEY or triton-grpc-protocol-KEY) with VALUE, else "
          "PERMISSION_DENIED / 403. VALUE @FILE or $ENV reads the secret from a file or the "
          "environment. Groups: inference, metadata, health, statistics, model-repository, "
          "shared-memory (docs/service.md).");
ABSL_FLAG(std::string, shared_memory, "none",
          "Triton's system shared memory extension: system (clients on this host register "
          "POSIX shared-memory regions and name them for inputs and outputs; "
          "docs/service.md, docs/deploy.md) or none (its RPCs and routes answer "
          "UNIMPLEMENTED).");
ABSL_FLAG(bool, shared_memory_allow_remote, kDefaults.shared_memory_options.allow_remote,
          "Let a peer that is not on loopback register shared-memory regions (a region is "
          "a file of this host's /dev/shm: only a client on this host can use one, e.g. a "
          "sidecar reaching the pod IP).");
ABSL_FLAG(int64_t, shared_memory_max_regions, kDefaults.shared_memory_options.max_regions,
          "Shared-memory regions registered at once; one more is RESOURCE_EXHAUSTED.");
ABSL_FLAG(int64_t, shared_memory_max_bytes, kDefaults.shared_memory_options.max_bytes,
          "Bytes of shared-memory regions registered at once (their byte_size summed); "
          "more is RESOURCE_EXHAUSTED.");
ABSL_FLAG(int32_t, http_threads, kDefaults.http_threads,
          "HTTP event-loop threads; 0: one per available CPU. Each serves any number of "
          "connections, idle or computing (values above the CPU count are accepted with a "
          "warning).");
ABSL_FLAG(absl::Duration, http_header_timeout, kDefaults.http_header_timeout,
          "An HTTP request's head (request line and headers) must arrive within this of its "
          "first byte, else 408 and the connection closes.");
ABSL_FLAG(absl::Duration, http_idle_timeout, kDefaults.http_idle_timeout,
          "An idle keep-alive HTTP connection closes after this; a request body that stalls "
          "this long is answered 408.");
ABSL_FLAG(int64_t, http_max_connections, kDefaults.http_max_connections,
          "HTTP connections held at once; one more is answered 503 and closed.");
ABSL_FLAG(std::string, metrics_host, kDefaults.metrics_host,
          "Address /metrics listens on; loopback by default, 0.0.0.0 for all.");
ABSL_FLAG(std::string, model_repository, kDefaults.model_repository,
          "Directory of <name>/config.pbtxt models; empty serves the embedded 'default' "
          "model (p_o 100, h 5, d_q = d_k = d_v = 100, seeded weights).");
ABSL_FLAG(std::string, model_control, "none",
          "none: load every model at start, and re-read the repository on SIGHUP; poll: "
          "also re-read it every --repository_poll_secs; explicit: load --load_models at "
          "start, then only the RepositoryModelLoad/Unload calls load and unload (SIGHUP "
          "re-reads the loaded ones). A changed model warms up beside the old one and "
          "replaces it without failing a request.");
ABSL_FLAG(int32_t, repository_poll_secs, 15,
          "With --model_control=poll: seconds between re-reads of the repository.");
ABSL_FLAG(std::vector<std::string>, load_models, {},
          "With --model_control=explicit: the models (comma-separated) loaded at start.");
ABSL_FLAG(int32_t, compute_threads, kDefaults.compute_threads,
          "OpenMP threads for compute in total; 0 = the CPUs this process may use "
          "(affinity mask and cgroup quota).");
ABSL_FLAG(int32_t, compute_workers, kDefaults.compute_workers,
          "Forward calls run concurrently; each gets compute_threads / compute_workers "
          "threads.");
ABSL_FLAG(double, inline_max_flops, kDefaults.inline_max_flops,
          "A request of at most this many FLOPs (the toy model's (2, 4, 100) request is 0.8M) "
          "runs on the thread that received it when no compute is queued or running; larger "
          "ones go to the compute workers. 0 = always hand off.");
ABSL_FLAG(std::string, session_answers, "call_end",
          "When AttendSession steps computed together are answered: call_end (each when "
          "their call has ended) or step_end (each as the core finishes it, while the call "
          "computes the others; attention-only models). On a machine whose cores the "
          "compute fills, step_end's answers and next steps take cores from the call.");
ABSL_FLAG(bool, default_warmup, kDefaults.default_warmup,
          "Warm up a model whose config.pbtxt lists no warmup passes with the default ones "
          "(B 1 x Q 128 self-attention, B 1 x Q 64 x K 128 with keys, the client's default "
          "B 2 x Q 4 x K 6, and the largest batch the batcher may form), so its first "
          "requests and later load find weights packed, primitives made and workspaces "
          "grown.");
ABSL_FLAG(int64_t, max_queue_size, kDefaults.batching.max_queue_size,
          "Requests waiting for compute, per model, before new ones get RESOURCE_EXHAUSTED.");
ABSL_FLAG(bool, batching, kDefaults.batching.enabled,
          "Merge concurrent requests of a model into one forward call (dynamic batching); "
          "false runs each request on its own.");
ABSL_FLAG(int64_t, max_queue_delay_us,
          absl::ToInt64Microseconds(kDefaults.batching.max_queue_delay),
          "How long the oldest queued request waits for others to fill its batch; 0 merges "
          "only what is already queued.");
ABSL_FLAG(int64_t, max_queue_wait_us, absl::ToInt64Microseconds(kDefaults.batching.max_queue_wait),
          "Refuse (RESOURCE_EXHAUSTED) a request whose expected queue wait, the work queued "
          "ahead of it at the model's recent compute speed, is longer; 0 = no bound in time.");
ABSL_FLAG(int64_t, session_gather_us, absl::ToInt64Microseconds(kDefaults.batching.session_gather),
          "AttendSession: how long queued steps wait for the sessions of the model's "
          "previous session call that stepped promptly to send their next steps, so that "
          "sessions decoding together keep running as one call, and how long an idle "
          "worker polls for the server's only session's next step; 0 = neither.");
ABSL_FLAG(int64_t, max_batch_tokens, kDefaults.batching.max_batch_tokens,
          "Limit on rows x padded sequence length of a merged forward call.");
ABSL_FLAG(int64_t, max_batch_size, kLimits.max_batch_size,
          "Default limit on B per request, and on the rows of a merged forward call (a "
          "model's config.pbtxt may override either).");
ABSL_FLAG(int64_t, max_sequence_length, kLimits.max_sequence_length,
          "Default limit on Q and K per request.");
ABSL_FLAG(int64_t, max_request_bytes, kLimits.max_request_bytes,
          "Default limit on a serialized request; gRPC's receive limit is set to match.");
ABSL_FLAG(int64_t, max_attention_elements, kLimits.max_attention_elements,
          "Default limit on B*h*Q*K attention weights returned by return_attention.");
ABSL_FLAG(absl::Duration, drain_timeout, kDefaults.drain_timeout,
          "On SIGTERM/SIGINT: how long in-flight calls may take to finish.");
ABSL_FLAG(absl::Duration, malloc_trim_interval, kDefaults.malloc_trim_interval,
          "Give the memory malloc holds free back to the system (malloc_trim) this often, so "
          "that RSS returns to the working set after a burst; 0 = never.");
ABSL_FLAG(int32_t, malloc_arena_max, 0,
          "glibc malloc arenas at most (M_ARENA_MAX): fewer arenas keep the requests' freed "
          "buffers in fewer places. 0 = the CPUs this process may use; -1 = glibc's default "
          "(8 per core).");
ABSL_FLAG(int64_t, session_cache_bytes, 0,
          "AttendSession: bytes of projected keys and values every session together may "
          "cache; a step over it gets RESOURCE_EXHAUSTED. 0 = a quarter of the memory the "
          "process may use (cgroup limit or RAM).");
ABSL_FLAG(absl::Duration, session_idle_timeout, kDefaults.session_idle_timeout,
          "AttendSession: a session with no message for this long after its last response "
          "ends with DEADLINE_EXCEEDED and its cache is released.");
ABSL_FLAG(std::string, tls_cert, "", "PEM server certificate chain; enables TLS with --tls_key.");
ABSL_FLAG(std::string, tls_key, "", "PEM server private key.");
ABSL_FLAG(std::string, tls_client_ca, "",
          "PEM CA bundle; requires and verifies client certificates (mutual TLS).");

int main(int argc, char** argv) {
  ShortenOpenMpSpin(argv);
  mha::SkipMutexDeadlockDetectionInRelease();
  // --help lists this file's flags (absl's default looks for <program>.cc).
  absl::FlagsUsageConfig usage;
  usage.contains_help_flags = [](absl::string_view file) {
    return absl::EndsWith(file, "server/app/main.cc");
  };
  usage.contains_helpshort_flags = usage.contains_help_flags;
  absl::SetFlagsUsageConfig(usage);
  absl::SetProgramUsageMessage(
      "Serves multi-head attention over gRPC (attention.v1.AttentionService and\n"
      "inference.GRPCInferenceService) and, with --http_port, KServe v2 over HTTP.\n"
      "Usage: attention_server [--port=50051] [--model_repository=DIR] ...");
  const std::vector<std::string> args = mha::ParseCommandLineOrExit(argc, argv);
  if (!args.empty()) {
    mha::ExitWithUsageError(absl::StrCat("unexpected argument '", args[0],
                                         "': attention_server takes flags only, --name=value "
                                         "(--help lists them)"));
  }

  absl::StatusOr<mha::log::Format> log_format =
      mha::log::ParseFormat(absl::GetFlag(FLAGS_log_format));
  if (!log_format.ok()) mha::ExitWithUsageError(NameTheFlag(log_format.status().message()));
  if (absl::GetFlag(FLAGS_log_verbose) < 0) {
    mha::ExitWithUsageError(
        absl::StrCat("--log_verbose: expected >= 0, got ", absl::GetFlag(FLAGS_log_verbose)));
  }
  mha::log::Configure(*log_format, absl::GetFlag(FLAGS_log_verbose));
  gpr_set_log_function(GrpcLog);
  gpr_set_log_verbosity(absl::GetFlag(FLAGS_log_verbose) >= 2 ? GPR_LOG_SEVERITY_INFO
                                                              : GPR_LOG_SEVERITY_ERROR);

  mha::server::ServerOptions options;
  options.log_requests = absl::GetFlag(FLAGS_log_requests);
  options.host = absl::GetFlag(FLAGS_host);
  options.port = absl::GetFlag(FLAGS_port);
  options.model_repository = absl::GetFlag(FLAGS_model_repository);
  options.compute_threads = absl::GetFlag(FLAGS_compute_threads);
  options.compute_workers = absl::GetFlag(FLAGS_compute_workers);
  options.inline_max_flops = absl::GetFlag(FLAGS_inline_max_flops);
  options.default_warmup = absl::GetFlag(FLAGS_default_warmup);
  if (auto control = mha::server::ParseModelControl(absl::GetFlag(FLAGS_model_control));
      control.ok()) {
    options.model_control = *control;
  } else {
    mha::ExitWithUsageError(NameTheFlag(control.status().message()));
  }
  options.repository_poll = absl::Seconds(absl::GetFlag(FLAGS_repository_poll_secs));
  options.load_models = absl::GetFlag(FLAGS_load_models);
  options.metrics_host = absl::GetFlag(FLAGS_metrics_host);
  options.metrics_port = absl::GetFlag(FLAGS_metrics_port);
  options.http_port = absl::GetFlag(FLAGS_http_port);
  // --port=0 alone: every port picked free, so that a second server starts beside the first.
  // (Flags read from a --flagfile do not count as given.)
  const std::vector<std::string> on_command_line = mha::FlagsOnCommandLine(argc, argv);
  auto given = [&on_command_line](absl::string_view name) {
    return std::find(on_command_line.begin(), on_command_line.end(), name) != on_command_line.end();
  };
  if (options.port == 0) {
    if (!given("metrics_port")) options.metrics_port = 0;
    if (!given("http_port")) options.http_port = 0;
  }
  if (const std::string answers = absl::GetFlag(FLAGS_session_answers); answers == "step_end") {
    options.session_answers_as_steps_end = true;
  } else if (answers != "call_end") {
    mha::ExitWithUsageError(
        absl::StrCat("--session_answers: expected call_end or step_end, got \"", answers, "\""));
  }
  options.restricted_api = absl::GetFlag(FLAGS_restricted_api);
  if (const std::string shm = absl::GetFlag(FLAGS_shared_memory); shm == "system") {
    options.shared_memory = true;
  } else if (shm != "none") {
    mha::ExitWithUsageError(
        absl::StrCat("--shared_memory: expected system or none, got \"", shm, "\""));
  }
  options.shared_memory_options.allow_remote = absl::GetFlag(FLAGS_shared_memory_allow_remote);
  options.shared_memory_options.max_regions = absl::GetFlag(FLAGS_shared_memory_max_regions);
  options.shared_memory_options.max_bytes = absl::GetFlag(FLAGS_shared_memory_max_bytes);
  options.http_threads = absl::GetFlag(FLAGS_http_threads);
  options.http_header_timeout = absl::GetFlag(FLAGS_http_header_timeout);
  options.http_idle_timeout = absl::GetFlag(FLAGS_http_idle_timeout);
  options.http_max_connections = absl::GetFlag(FLAGS_http_max_connections);
  options.batching.enabled = absl::GetFlag(FLAGS_batching);
  options.batching.max_queue_size = absl::GetFlag(FLAGS_max_queue_size);
  options.batching.max_queue_delay = absl::Microseconds(absl::GetFlag(FLAGS_max_queue_delay_us));
  options.batching.max_queue_wait = absl::Microseconds(absl::GetFlag(FLAGS_max_queue_wait_us));
  options.batching.session_gather = absl::Microseconds(absl::GetFlag(FLAGS_session_gather_us));
  options.batching.max_batch_tokens = absl::GetFlag(FLAGS_max_batch_tokens);
  options.limits.max_batch_size = absl::GetFlag(FLAGS_max_batch_size);
  options.batching.max_batch_size = options.limits.max_batch_size;
  options.limits.max_sequence_length = absl::GetFlag(FLAGS_max_sequence_length);
  options.limits.max_request_bytes = absl::GetFlag(FLAGS_max_request_bytes);
  options.limits.max_attention_elements = absl::GetFlag(FLAGS_max_attention_elements);
  options.drain_timeout = absl::GetFlag(FLAGS_drain_timeout);
  options.malloc_trim_interval = absl::GetFlag(FLAGS_malloc_trim_interval);
  options.session_cache_bytes = absl::GetFlag(FLAGS_session_cache_bytes);
  options.session_idle_timeout = absl::GetFlag(FLAGS_session_idle_timeout);
  options.tls_cert = absl::GetFlag(FLAGS_tls_cert);
  options.tls_key = absl::GetFlag(FLAGS_tls_key);
  options.tls_client_ca = absl::GetFlag(FLAGS_tls_client_ca);
  if (const absl::Status valid = options.Validate(); !valid.ok()) {
    mha::ExitWithUsageError(NameTheFlag(valid.message()));
  }

  // Before any thread starts: arenas are made per thread as threads first allocate.
  if (const int arenas = absl::GetFlag(FLAGS_malloc_arena_max); arenas >= 0) {
    mallopt(M_ARENA_MAX, arenas > 0 ? arenas : mha::server::AvailableCpus());
  } else if (arenas < -1) {
    mha::ExitWithUsageError(
        absl::StrCat("--malloc_arena_max: expected -1, 0 or a count, got ", arenas));
  }

  // Signals are taken synchronously by sigwait below; block them before any
  // thread starts so every thread inherits the mask.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  auto server = mha::server::Server::Create(options);
  if (!server.ok()) {
    mha::log::Error(server.status().message());
    return 1;
  }
  for (const auto& model : (*server)->models().models()) {
    const mha::core::ModelConfig& c = model->config;
    mha::log::Info(absl::StrCat(
        "model ", model->name, ": p_o ", c.num_hiddens, ", h ", c.num_heads, ", d_q ", c.query_size,
        ", d_k ", c.key_size, ", d_v ", c.value_size, ", bias ", c.bias ? "on" : "off", ", ",
        mha::core::PrecisionName(c.precision),
        model->attention->GemmPrecision() == c.precision ? "" : " (its GEMMs in f32 on this CPU)",
        ", weights ", model->weights_source, ", max_batch_size ", model->limits.max_batch_size,
        ", max_sequence_length ", model->limits.max_sequence_length));
  }
  mha::log::Info(absl::StrCat(
      "compute: ", options.compute_workers, " worker(s) x ", (*server)->threads_per_worker(),
      " thread(s); batching ",
      options.batching.enabled
          ? absl::StrCat("on (max_queue_delay ",
                         absl::FormatDuration(options.batching.max_queue_delay), ")")
          : "off",
      options.tls_client_ca.empty() ? (options.tls_cert.empty() ? "" : ", TLS") : ", mutual TLS"));
  if ((*server)->metrics_port() != 0) {
    std::printf("metrics on %s\n", (*server)->metrics_address().c_str());
  }
  if ((*server)->http_port() != 0) {
    std::printf("http on %s\n", (*server)->http_address().c_str());
  }
  // Health answers from here on (NOT_SERVING); "listening on" means serving.
  std::printf("warming up on %s\n", (*server)->address().c_str());
  std::fflush(stdout);
  const auto warmed = (*server)->WaitUntilReady();
  if (!warmed.ok()) {
    mha::log::Error(warmed.status().message());
    (*server)->Shutdown();
    return 1;
  }
  for (const mha::server::WarmupReport& report : *warmed) {
    if (report.passes == 0) continue;
    mha::log::Info(absl::StrCat("model ", report.model, ": warm-up, ", report.passes,
                                " pass(es) in ", absl::FormatDuration(report.took)));
  }
  std::printf("listening on %s\n", (*server)->address().c_str());
  std::fflush(stdout);

  int signal_number = 0;
  // SIGHUP re-reads the repository (server/models/model_lifecycle.h logs what changed);
  // SIGTERM and SIGINT drain and stop.
  while (sigwait(&signals, &signal_number) == 0 && signal_number == SIGHUP) {
    mha::log::Info("received SIGHUP: re-reading the model repository");
    (*server)->Reload();
  }
  mha::log::Info(absl::StrCat("received ", signal_number == SIGTERM ? "SIGTERM" : "SIGINT",
                              ": draining (up to ", absl::FormatDuration(options.drain_timeout),
                              ")"));
  (*server)->Shutdown();
  // Every listener, /metrics included, is closed before "stopped": a script may start
  // the next server on the same ports at once.
  server->reset();
  mha::log::Info("stopped");
  return 0;
}

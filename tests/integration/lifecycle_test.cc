// Start-up, model repositories, TLS and shutdown of the real server process.
#include <signal.h>
#include <sys/wait.h>

#include <atomic>
#include <cstdlib>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "core/safetensors.h"
#include "gtest/gtest.h"
#include "proto/inference/grpc_service.grpc.pb.h"
#include "server/models/model_repository.h"
#include "tests/integration/client_util.h"
#include "tests/integration/metrics_scrape.h"
#include "tests/integration/server_process.h"

namespace mha::testing {
namespace {

using ::grpc::health::v1::Health;
using ::grpc::health::v1::HealthCheckRequest;
using ::grpc::health::v1::HealthCheckResponse;

TEST(StartupTest, HelpListsEveryFlagWithItsDefault) {
  const RunResult run = RunServer({"--help"});
  for (const char* flag :
       {"--host", "--port", "--metrics_port", "--model_repository", "--compute_threads",
        "--compute_workers", "--max_queue_size", "--max_queue_wait_us", "--session_gather_us",
        "--max_batch_size", "--max_sequence_length", "--max_request_bytes",
        "--max_attention_elements", "--drain_timeout", "--tls_cert", "--tls_key",
        "--tls_client_ca"}) {
    EXPECT_TRUE(absl::StrContains(run.out, flag)) << flag << "\n" << run.out;
  }
  EXPECT_TRUE(absl::StrContains(run.out, "default: 50051"));
  EXPECT_TRUE(absl::StrContains(run.out, "default: \"127.0.0.1\""));
}

TEST(StartupTest, BadModelFailsStartNamingModelAndFile) {
  TempDir repository;
  repository.Write("good/config.pbtxt", "num_hiddens: 100 num_heads: 5 seeded { seed: 0 }");
  const std::string config =
      repository.Write("bad/config.pbtxt", "num_hiddens: 100 num_heads: 7 seeded { seed: 0 }");
  const RunResult run = RunServer({"--port=0", "--model_repository=" + repository.path()});
  EXPECT_NE(run.exit_code, 0);
  EXPECT_FALSE(absl::StrContains(run.out, "listening on"));
  EXPECT_TRUE(absl::StrContains(run.err, "model bad (" + config + ")")) << run.err;
  EXPECT_TRUE(absl::StrContains(run.err, "num_heads")) << run.err;
}

TEST(StartupTest, NegativeMaxQueueWaitFailsStartNamingIt) {
  TempDir repository;
  repository.Write("m/config.pbtxt",
                   "num_hiddens: 100 num_heads: 5 seeded { seed: 0 } "
                   "batching { max_queue_wait_us: -1 }");
  const RunResult config = RunServer({"--port=0", "--model_repository=" + repository.path()});
  EXPECT_NE(config.exit_code, 0);
  EXPECT_TRUE(absl::StrContains(config.err, "batching.max_queue_wait_us: expected >= 0"))
      << config.err;
  const RunResult flag = RunServer({"--port=0", "--max_queue_wait_us=-5"});
  EXPECT_EQ(flag.exit_code, 2);
  EXPECT_TRUE(absl::StrContains(flag.err, "--max_queue_wait_us: expected >= 0, got -5"))
      << flag.err;
}

TEST(StartupTest, MissingWeightsFileFailsStartNamingIt) {
  TempDir repository;
  repository.Write("real/config.pbtxt", "num_hiddens: 100 num_heads: 5");
  const RunResult run = RunServer({"--port=0", "--model_repository=" + repository.path()});
  EXPECT_NE(run.exit_code, 0);
  EXPECT_FALSE(absl::StrContains(run.out, "listening on"));
  EXPECT_TRUE(
      absl::StrContains(run.err, "model real (" + repository.path() + "/real/weights.safetensors)"))
      << run.err;
}

// One server per port: a second server on the gRPC, HTTP or metrics port of a
// running one exits non-zero naming the port, and the first keeps serving.
// config.pbtxt warm-up passes run before the model serves: health is NOT_SERVING from
// the first poll and requests get UNAVAILABLE naming the warm-up, then both turn; the
// time is logged and exported.
TEST(WarmupTest, HealthIsNotServingUntilTheWarmupHasRun) {
  TempDir repository;
  std::string config = "num_hiddens: 256 num_heads: 4 seeded { seed: 0 }";
  // About a second of compute here: the checks below run well inside it.
  for (int i = 0; i < 40; ++i) config += " warmup { batch: 8 num_queries: 512 }";
  repository.Write("warm/config.pbtxt", config);
  auto server = ServerProcess::Start({"--port=0", "--model_repository=" + repository.path()},
                                     absl::Seconds(120), "warming up on ");
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string target = (*server)->target();
  HealthCheckResponse health;
  ASSERT_TRUE(CheckHealth(target, "", &health).ok());
  EXPECT_EQ(health.status(), HealthCheckResponse::NOT_SERVING);
  ASSERT_TRUE(CheckHealth(target, "warm", &health).ok());
  EXPECT_EQ(health.status(), HealthCheckResponse::NOT_SERVING);
  AttendRequest request;
  *request.mutable_queries() = MakeTensor({1, 4, 256});
  AttendResponse response;
  auto stub = Connect(target);
  grpc::Status status = Attend(*stub, request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_TRUE(absl::StrContains(status.error_message(), "model warm is warming up (40 warm-up"))
      << status.error_message();

  const absl::Time deadline = absl::Now() + absl::Seconds(120);
  while (CheckHealth(target, "", &health).ok() && health.status() != HealthCheckResponse::SERVING &&
         absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  ASSERT_EQ(health.status(), HealthCheckResponse::SERVING);
  ASSERT_TRUE(CheckHealth(target, "warm", &health).ok());
  EXPECT_EQ(health.status(), HealthCheckResponse::SERVING);
  status = Attend(*stub, request, &response);
  EXPECT_TRUE(status.ok()) << status.error_message();
  const std::string metrics = ScrapeMetrics((*server)->metrics_port()).value();
  EXPECT_GT(MetricValue(metrics, "mha_model_warmup_seconds{model=\"warm\"}"), 0.0) << metrics;
  // Warm-up passes are not requests: the batch histogram counts the one request only.
  EXPECT_EQ(MetricValue(metrics, "mha_batch_size_count{model=\"warm\"}"), 1.0);
  // "listening on" follows the warm-up; the log says what it took.
  const absl::Time logged = absl::Now() + absl::Seconds(10);
  while (!absl::StrContains((*server)->log(), "model warm: warm-up, 40 pass(es) in") &&
         absl::Now() < logged) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_TRUE(absl::StrContains((*server)->log(), "model warm: warm-up, 40 pass(es) in"))
      << (*server)->log();
}

TEST(WarmupTest, WarmupOutsideTheLimitsFailsStartNamingIt) {
  TempDir repository;
  const std::string config = repository.Write(
      "warm/config.pbtxt",
      "num_hiddens: 8 num_heads: 2 seeded { seed: 0 } limits { max_sequence_length: 16 } "
      "warmup { batch: 1 num_queries: 8 } warmup { batch: 1 num_queries: 32 }");
  const RunResult run = RunServer({"--port=0", "--model_repository=" + repository.path()});
  EXPECT_EQ(run.exit_code, 1);
  EXPECT_FALSE(absl::StrContains(run.out, "listening on"));
  EXPECT_TRUE(absl::StrContains(run.err, "model warm (" + config +
                                             "): warmup[1].num_queries: expected 1 to 16 "
                                             "(max_sequence_length), got 32"))
      << run.err;
}

TEST(StartupTest, BusyPortFailsStartNamingIt) {
  auto first = ServerProcess::Start({"--port=0", "--metrics_port=0", "--http_port=0"});
  ASSERT_TRUE(first.ok()) << first.status();
  const std::string grpc_port = std::to_string((*first)->port());
  const std::string metrics_port = std::to_string((*first)->metrics_port());
  const std::string http_port = std::to_string((*first)->http_port());
  const std::string advice =
      ": address in use (another server?) or not an address of this host; change the flag, "
      "or give 0 to pick a free port";
  const RunResult grpc = RunServer({"--port=" + grpc_port, "--metrics_port=-1", "--http_port=-1"});
  EXPECT_EQ(grpc.exit_code, 1);
  EXPECT_FALSE(absl::StrContains(grpc.out, "listening on"));
  EXPECT_TRUE(absl::StrContains(
      grpc.err, "error: cannot listen on 127.0.0.1:" + grpc_port + " (--port)" + advice))
      << grpc.err;
  const RunResult metrics = RunServer({"--port=0", "--metrics_port=" + metrics_port});
  EXPECT_EQ(metrics.exit_code, 1);
  EXPECT_TRUE(absl::StrContains(metrics.err, "error: cannot listen on 127.0.0.1:" + metrics_port +
                                                 " (--metrics_port)" + advice))
      << metrics.err;
  // cpp-httplib would set SO_REUSEPORT and share the port; the server turns it off.
  const RunResult http = RunServer({"--port=0", "--metrics_port=-1", "--http_port=" + http_port});
  EXPECT_EQ(http.exit_code, 1);
  EXPECT_FALSE(absl::StrContains(http.out, "listening on"));
  EXPECT_TRUE(absl::StrContains(
      http.err, "error: cannot listen on 127.0.0.1:" + http_port + " (--http_port)" + advice))
      << http.err;
  // All three busy: one message names them all, with their flags.
  const RunResult all = RunServer(
      {"--port=" + grpc_port, "--metrics_port=" + metrics_port, "--http_port=" + http_port});
  EXPECT_EQ(all.exit_code, 1);
  EXPECT_TRUE(absl::StrContains(all.err, "error: cannot listen on 127.0.0.1:" + metrics_port +
                                             " (--metrics_port), 127.0.0.1:" + grpc_port +
                                             " (--port), 127.0.0.1:" + http_port +
                                             " (--http_port)" + advice + "\n"))
      << all.err;
  EXPECT_FALSE(absl::StrContains(all.err, "CivetServer")) << all.err;
  HealthCheckResponse health;
  ASSERT_TRUE(CheckHealth((*first)->target(), "", &health).ok());
  EXPECT_EQ(health.status(), HealthCheckResponse::SERVING);
}

TEST(StartupTest, ConfigSyntaxErrorNamesLine) {
  TempDir repository;
  repository.Write("typo/config.pbtxt", "num_hiddens: 100\nnum_head: 5\n");
  const RunResult run = RunServer({"--port=0", "--model_repository=" + repository.path()});
  EXPECT_NE(run.exit_code, 0);
  EXPECT_TRUE(absl::StrContains(run.err, "typo/config.pbtxt): line 2")) << run.err;
  EXPECT_TRUE(absl::StrContains(run.err, "num_head")) << run.err;
}

TEST(StartupTest, SafetensorsWeightsAreServed) {
  // A d2l-named export with biases and d_k != d_q, written by the core's writer.
  const core::ModelConfig config{.num_hiddens = 16,
                                 .num_heads = 4,
                                 .query_size = 8,
                                 .key_size = 12,
                                 .value_size = 6,
                                 .bias = true};
  const core::Weights w = core::SeededWeights(config, 42);
  TempDir repository;
  repository.Write("export/config.pbtxt",
                   "num_hiddens: 16 num_heads: 4 query_size: 8 key_size: 12 value_size: 6 "
                   "bias: true");
  repository.Write(
      "export/weights.safetensors",
      core::SerializeSafetensors(
          {core::F32Tensor("W_q.weight", {16, 8}, w.w_q),
           core::F32Tensor("W_k.weight", {16, 12}, w.w_k),
           core::F32Tensor("W_v.weight", {16, 6}, w.w_v),
           core::F32Tensor("W_o.weight", {16, 16}, w.w_o), core::F32Tensor("W_q.bias", {16}, w.b_q),
           core::F32Tensor("W_k.bias", {16}, w.b_k), core::F32Tensor("W_v.bias", {16}, w.b_v),
           core::F32Tensor("W_o.bias", {16}, w.b_o)}));
  auto server = ServerProcess::Start({"--port=0", "--model_repository=" + repository.path()});
  ASSERT_TRUE(server.ok()) << server.status();
  AttendRequest request;
  *request.mutable_queries() = MakeTensor({2, 3, 8});
  *request.mutable_keys() = MakeTensor({2, 5, 12}, 1.0f);
  *request.mutable_values() = MakeTensor({2, 5, 6}, 2.0f);
  AttendResponse response;
  auto stub = Connect((*server)->target());
  const grpc::Status status = Attend(*stub, request, &response);  // "" = the only model
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_LE(MaxAbsDiff(response.output().data(), CoreForward(config, 42, request).output), 1e-5f);
}

TEST(DeployModelsTest, ServesToyBertBaseAndDecoder) {
  auto server = ServerProcess::Start(
      {"--port=0", "--model_repository=" + std::string(MHA_SOURCE_DIR) + "/deploy/models"});
  ASSERT_TRUE(server.ok()) << server.status();
  auto stub = Connect((*server)->target());
  grpc::ClientContext list_context;
  attention::v1::ListModelsResponse list;
  ASSERT_TRUE(stub->ListModels(&list_context, {}, &list).ok());
  ASSERT_EQ(list.models_size(), 3);
  EXPECT_EQ(list.models(0).name(), "bert_base");
  EXPECT_EQ(list.models(0).num_hiddens(), 768);
  EXPECT_EQ(list.models(0).num_heads(), 12);
  EXPECT_TRUE(list.models(0).bias());
  EXPECT_EQ(list.models(0).limits().max_sequence_length(), 512);
  EXPECT_EQ(list.models(1).name(), "decoder");
  EXPECT_EQ(list.models(1).num_hiddens(), 768);
  EXPECT_EQ(list.models(1).num_heads(), 12);
  EXPECT_TRUE(list.models(1).bias());
  EXPECT_EQ(list.models(1).limits().max_sequence_length(), 4096);
  EXPECT_EQ(list.models(1).limits().max_session_tokens(), 4096);
  EXPECT_EQ(list.models(2).name(), "toy");

  AttendRequest toy = ToyRequest();
  toy.set_model("toy");
  AttendResponse response;
  ASSERT_TRUE(Attend(*stub, toy, &response).ok());
  EXPECT_LE(MaxAbsDiff(response.output().data(), CoreForward(core::ModelConfig{}, 0, toy).output),
            1e-5f);

  AttendRequest bert;
  bert.set_model("bert_base");
  *bert.mutable_queries() = MakeTensor({2, 16, 768});
  bert.add_valid_lens(16);
  bert.add_valid_lens(9);
  ASSERT_TRUE(Attend(*stub, bert, &response).ok());
  EXPECT_EQ(response.output().data_size(), 2 * 16 * 768);
  const core::ModelConfig bert_config{.num_hiddens = 768,
                                      .num_heads = 12,
                                      .query_size = 768,
                                      .key_size = 768,
                                      .value_size = 768,
                                      .bias = true};
  EXPECT_LE(MaxAbsDiff(response.output().data(), CoreForward(bert_config, 1, bert).output), 1e-4f);

  AttendRequest unnamed = ToyRequest();  // two models, neither "default"
  const grpc::Status status = Attend(*stub, unnamed, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StrContains(status.error_message(), "model: required"))
      << status.error_message();

  for (const char* name : {"", "toy", "bert_base"}) {
    HealthCheckResponse reply;
    ASSERT_TRUE(CheckHealth((*server)->target(), name, &reply).ok()) << name;
    EXPECT_EQ(reply.status(), HealthCheckResponse::SERVING) << name;
  }
}

// Certificates made by openssl for this test: a CA, a server certificate for
// localhost / 127.0.0.1 and a client certificate, all signed by the CA.
class TlsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir();
    if (const absl::Status made = MakeTestCertificates(dir_->path()); !made.ok()) {
      certs_error_ = new std::string(made.ToString());
    }
  }
  // A failure in SetUpTestSuite would only skip the tests; fail each one instead.
  void SetUp() override { ASSERT_EQ(certs_error_, nullptr) << *certs_error_; }
  static void TearDownTestSuite() { delete dir_; }

  static std::string File(const std::string& name) { return dir_->path() + "/" + name; }

  static std::shared_ptr<grpc::ChannelCredentials> TlsCredentials(bool with_client_cert) {
    grpc::SslCredentialsOptions options;
    options.pem_root_certs = ReadFile(File("ca.pem"));
    if (with_client_cert) {
      options.pem_private_key = ReadFile(File("client.key"));
      options.pem_cert_chain = ReadFile(File("client.pem"));
    }
    return grpc::SslCredentials(options);
  }

  static grpc::Status Call(const std::string& target,
                           std::shared_ptr<grpc::ChannelCredentials> credentials) {
    auto stub = AttentionService::NewStub(Channel(target, credentials));
    AttendResponse response;
    return Attend(*stub, ToyRequest(), &response, std::chrono::seconds(10));
  }

  static TempDir* dir_;
  static std::string* certs_error_;
};

TempDir* TlsTest::dir_ = nullptr;
std::string* TlsTest::certs_error_ = nullptr;

TEST_F(TlsTest, TlsServerAcceptsTlsClientsAndRefusesPlaintext) {
  auto server = ServerProcess::Start(
      {"--port=0", "--tls_cert=" + File("server.pem"), "--tls_key=" + File("server.key")});
  ASSERT_TRUE(server.ok()) << server.status();
  const grpc::Status tls = Call((*server)->target(), TlsCredentials(false));
  EXPECT_TRUE(tls.ok()) << tls.error_message();
  EXPECT_EQ(Call((*server)->target(), grpc::InsecureChannelCredentials()).error_code(),
            grpc::StatusCode::UNAVAILABLE);
}

TEST_F(TlsTest, MutualTlsRefusesClientsWithoutCertificate) {
  auto server = ServerProcess::Start({"--port=0", "--tls_cert=" + File("server.pem"),
                                      "--tls_key=" + File("server.key"),
                                      "--tls_client_ca=" + File("ca.pem")});
  ASSERT_TRUE(server.ok()) << server.status();
  const grpc::Status with_cert = Call((*server)->target(), TlsCredentials(true));
  EXPECT_TRUE(with_cert.ok()) << with_cert.error_message();
  EXPECT_EQ(Call((*server)->target(), TlsCredentials(false)).error_code(),
            grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(Call((*server)->target(), grpc::InsecureChannelCredentials()).error_code(),
            grpc::StatusCode::UNAVAILABLE);
}

// The repository RPCs are calls like any other: with mutual TLS, only a client
// with a certificate loads a model.
TEST_F(TlsTest, MutualTlsGuardsModelLoad) {
  TempDir repository;
  repository.Write("m/config.pbtxt", "num_hiddens: 100 num_heads: 5 seeded { seed: 1 }");
  auto server =
      ServerProcess::Start({"--port=0", "--tls_cert=" + File("server.pem"),
                            "--tls_key=" + File("server.key"), "--tls_client_ca=" + File("ca.pem"),
                            "--model_repository=" + repository.path(), "--model_control=explicit"});
  ASSERT_TRUE(server.ok()) << server.status();
  const auto load = [&](bool with_cert) {
    auto stub = inference::GRPCInferenceService::NewStub(
        Channel((*server)->target(), TlsCredentials(with_cert), "", /*own_connection=*/true));
    grpc::ClientContext context;
    SetTimeout(&context, std::chrono::seconds(30));
    inference::RepositoryModelLoadRequest request;
    request.set_model_name("m");
    inference::RepositoryModelLoadResponse response;
    return stub->RepositoryModelLoad(&context, request, &response);
  };
  EXPECT_EQ(load(false).error_code(), grpc::StatusCode::UNAVAILABLE);
  const grpc::Status loaded = load(true);
  EXPECT_TRUE(loaded.ok()) << loaded.error_message();
  EXPECT_TRUE(Call((*server)->target(), TlsCredentials(true)).ok());  // "" = the only model, m
}

// A key that is not the certificate's fails start-up before any port is bound,
// saying so (not "address in use"), for gRPC and HTTP alike.
TEST_F(TlsTest, MismatchedKeyFailsStartNamingBothFiles) {
  const RunResult run = RunServer({"--port=0", "--http_port=0", "--tls_cert=" + File("server.pem"),
                                   "--tls_key=" + File("client.key")});
  EXPECT_EQ(run.exit_code, 1);
  EXPECT_FALSE(absl::StrContains(run.out, "metrics on")) << run.out;
  EXPECT_TRUE(absl::StrContains(run.err, "error: tls_key: the key in " + File("client.key") +
                                             " does not match the certificate in " +
                                             File("server.pem")))
      << run.err;
  const RunResult swapped = RunServer(
      {"--port=0", "--tls_cert=" + File("server.key"), "--tls_key=" + File("server.pem")});
  EXPECT_EQ(swapped.exit_code, 1);
  EXPECT_TRUE(absl::StrContains(swapped.err,
                                "tls_cert: " + File("server.key") + " holds no PEM certificate"))
      << swapped.err;
  // An encrypted key: refused in words, without prompting for a passphrase.
  const RunResult made =
      RunProgram("/usr/bin/openssl",
                 {"genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-aes256",
                  "-pass", "pass:secret", "-out", File("encrypted.key")},
                 absl::Seconds(30));
  ASSERT_EQ(made.exit_code, 0) << made.err;
  const RunResult encrypted = RunServer(
      {"--port=0", "--tls_cert=" + File("server.pem"), "--tls_key=" + File("encrypted.key")},
      absl::Seconds(10));
  EXPECT_EQ(encrypted.exit_code, 1);
  EXPECT_TRUE(absl::StrContains(
      encrypted.err, "tls_key: " + File("encrypted.key") + " holds no unencrypted PEM private key"))
      << encrypted.err;
}

// gRPC's own messages (a plaintext client's failed handshake) go through the server's
// log: hidden at --log_verbose=0, one JSON line with source "grpc" at 1, never gRPC's
// own "E1125 ... ssl_transport_security.cc" format.
TEST_F(TlsTest, GrpcMessagesGoThroughTheServersLog) {
  for (const int verbose : {0, 1}) {
    auto server = ServerProcess::Start({"--port=0", "--tls_cert=" + File("server.pem"),
                                        "--tls_key=" + File("server.key"), "--log_format=json",
                                        "--log_verbose=" + std::to_string(verbose)});
    ASSERT_TRUE(server.ok()) << server.status();
    EXPECT_EQ(Call((*server)->target(), grpc::InsecureChannelCredentials()).error_code(),
              grpc::StatusCode::UNAVAILABLE);
    const absl::Time deadline = absl::Now() + absl::Seconds(verbose == 1 ? 10 : 1);
    while (!absl::StrContains((*server)->log(), "\"source\":\"grpc\"") && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(20));
    }
    const std::string log = (*server)->log();
    EXPECT_EQ(absl::StrContains(log, "\"source\":\"grpc\""), verbose == 1) << log;
    for (absl::string_view line : absl::StrSplit(log, '\n', absl::SkipEmpty())) {
      EXPECT_TRUE(absl::StartsWith(line, "{\"time\":")) << line;
    }
  }
}

TEST_F(TlsTest, MissingKeyFileFailsStart) {
  const RunResult run = RunServer(
      {"--port=0", "--tls_cert=" + File("server.pem"), "--tls_key=" + File("absent.key")});
  EXPECT_NE(run.exit_code, 0);
  EXPECT_TRUE(absl::StrContains(run.err, "tls_key: cannot read")) << run.err;
}

// SIGTERM under load: health turns NOT_SERVING, an accepted stream's requests
// are all answered, every unary call ends OK or with an explicit refusal, and
// the process exits 0. Refusals: UNAVAILABLE once the listener is closed, or
// CANCELLED (message "CANCELLED", from gRPC core) for a call that reached the
// server in the instant shutdown began, before any handler took it; neither was
// computed. (These clients never cancel, so CANCELLED cannot come from them.)
TEST(ShutdownTest, SigtermDrainsInFlightWorkAndExitsZero) {
  auto started = ServerProcess::Start({"--port=0", "--compute_threads=2", "--drain_timeout=20s"});
  ASSERT_TRUE(started.ok()) << started.status();
  ServerProcess& server = **started;
  // One connection each for the stream, the unary load and the health watch, so
  // that the load's frames do not share the stream's connection.
  const auto own = [&] {
    return Channel(server.target(), grpc::InsecureChannelCredentials(), "", true);
  };
  auto stream_stub = AttentionService::NewStub(own());
  auto stub = AttentionService::NewStub(own());

  // Health watch, opened before the signal.
  auto health = Health::NewStub(own());
  grpc::ClientContext watch_context;
  HealthCheckRequest watch_request;
  auto watch = health->Watch(&watch_context, watch_request);
  HealthCheckResponse health_update;
  ASSERT_TRUE(watch->Read(&health_update));
  EXPECT_EQ(health_update.status(), HealthCheckResponse::SERVING);

  // An accepted stream: its first response has arrived.
  grpc::ClientContext stream_context;
  SetTimeout(&stream_context, std::chrono::seconds(60));
  auto stream = stream_stub->AttendStream(&stream_context);
  AttendRequest heavy;  // large keys and values, small output
  *heavy.mutable_queries() = MakeTensor({2, 8, 100});
  *heavy.mutable_keys() = MakeTensor({2, 2048, 100}, 1.0f);
  *heavy.mutable_values() = MakeTensor({2, 2048, 100}, 2.0f);
  ASSERT_TRUE(stream->Write(heavy));
  AttendResponse response;
  ASSERT_TRUE(stream->Read(&response));

  // Unary load from four threads until the server refuses.
  std::atomic<bool> stop{false};
  absl::Mutex mu;
  int ok = 0, refused = 0;
  std::vector<std::string> unexpected;
  std::vector<std::thread> clients;
  for (int t = 0; t < 4; ++t) {
    clients.emplace_back([&] {
      while (!stop.load()) {
        AttendResponse reply;
        const grpc::Status status = Attend(*stub, ToyRequest(), &reply, std::chrono::seconds(30));
        absl::MutexLock lock(&mu);
        if (status.ok()) {
          ++ok;
        } else if (status.error_code() == grpc::StatusCode::UNAVAILABLE ||
                   status.error_code() == grpc::StatusCode::CANCELLED) {
          ++refused;
        } else {
          unexpected.push_back(absl::StrCat("code ", status.error_code(), " message \"",
                                            status.error_message(), "\" details \"",
                                            status.error_details(), "\""));
        }
      }
    });
  }
  {
    absl::MutexLock lock(&mu);
    mu.Await(absl::Condition(
        +[](int* n) { return *n >= 50; }, &ok));
  }
  constexpr int kStreamRequests = 10;
  for (int i = 0; i < kStreamRequests; ++i) {
    heavy.set_request_id(absl::StrCat("after-", i));
    ASSERT_TRUE(stream->Write(heavy));
  }
  server.Signal(SIGTERM);

  ASSERT_TRUE(watch->Read(&health_update));
  EXPECT_EQ(health_update.status(), HealthCheckResponse::NOT_SERVING);
  watch_context.TryCancel();
  watch->Finish();

  stream->WritesDone();
  int answered = 0;
  while (stream->Read(&response)) {
    EXPECT_EQ(response.request_id(), absl::StrCat("after-", answered));
    ++answered;
  }
  const grpc::Status stream_status = stream->Finish();
  EXPECT_TRUE(stream_status.ok()) << stream_status.error_message();
  EXPECT_EQ(answered, kStreamRequests);

  const std::optional<int> exit = server.WaitForExit(absl::Seconds(30));
  stop = true;
  for (std::thread& client : clients) client.join();
  ASSERT_TRUE(exit.has_value()) << "server did not exit";
  EXPECT_TRUE(WIFEXITED(*exit) && WEXITSTATUS(*exit) == 0) << server.log();
  EXPECT_TRUE(unexpected.empty()) << (unexpected.empty() ? "" : unexpected.front()) << server.log();
  EXPECT_GE(ok, 50);
  EXPECT_GT(refused, 0);  // the load went on past the listener closing
}

}  // namespace
}  // namespace mha::testing

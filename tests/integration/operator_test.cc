// What an operator meets first (issue 39): ports that a second server and a restart
// can share, and restricted API groups on both transports.
#include <signal.h>
#include <stdlib.h>

#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "proto/inference/grpc_service.grpc.pb.h"
#include "tests/integration/client_util.h"
#include "tests/integration/metrics_scrape.h"
#include "tests/integration/net_util.h"
#include "tests/integration/server_process.h"

namespace mha::testing {
namespace {

using ::grpc::health::v1::HealthCheckResponse;

struct HttpReply {
  int status = 0;
  std::string text;  // status line, headers and body
};

// One HTTP/1.1 request on its own connection (closed after the answer).
HttpReply HttpCall(int port, const std::string& method, const std::string& path,
                   const std::string& headers = "", const std::string& body = "") {
  RawConnection connection(port);
  HttpReply reply;
  if (!connection.ok()) return reply;
  connection.Send(absl::StrCat(method, " ", path, " HTTP/1.1\r\nHost: 127.0.0.1\r\n", headers,
                               "Content-Length: ", body.size(), "\r\nConnection: close\r\n\r\n",
                               body));
  bool closed = false;
  reply.text = connection.ReadFor(absl::Seconds(10), &closed);
  if (absl::StartsWith(reply.text, "HTTP/1.1 ")) {
    (void)absl::SimpleAtoi(reply.text.substr(9, 3), &reply.status);
  }
  return reply;
}

bool WaitForLog(const ServerProcess& server, const std::string& text, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (!absl::StrContains(server.log(), text)) {
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return true;
}

// --port=0 and nothing else: HTTP and /metrics pick free ports too, so a second
// server starts beside the first with the same command.
TEST(PortsTest, PortZeroAloneStartsTwoServersSideBySide) {
  auto first = ServerProcess::StartExactly({"--port=0"});
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = ServerProcess::StartExactly({"--port=0"});
  ASSERT_TRUE(second.ok()) << second.status();
  for (const auto* server : {&**first, &**second}) {
    EXPECT_NE(server->http_port(), 8000);
    EXPECT_NE(server->metrics_port(), 9464);
    EXPECT_EQ(HttpCall(server->http_port(), "GET", "/v2/health/ready").status, 200);
    EXPECT_TRUE(ScrapeMetrics(server->metrics_port()).ok());
    HealthCheckResponse health;
    ASSERT_TRUE(CheckHealth(server->target(), "", &health).ok());
    EXPECT_EQ(health.status(), HealthCheckResponse::SERVING);
  }
  EXPECT_NE((*first)->http_port(), (*second)->http_port());
  EXPECT_NE((*first)->metrics_port(), (*second)->metrics_port());
}

// Once `stopped` is printed every listener is closed: a restart on the same three
// ports succeeds at once, after a scrape and with HTTP keep-alive clients connected.
TEST(PortsTest, RestartOnTheSamePortsRightAfterStopped) {
  auto first = ServerProcess::StartExactly({"--port=0"});
  ASSERT_TRUE(first.ok()) << first.status();
  const int grpc_port = (*first)->port();
  const int http_port = (*first)->http_port();
  const int metrics_port = (*first)->metrics_port();
  ASSERT_TRUE(ScrapeMetrics(metrics_port).ok());
  std::vector<std::unique_ptr<RawConnection>> keep_alive;
  for (int i = 0; i < 3; ++i) {
    keep_alive.push_back(std::make_unique<RawConnection>(http_port));
    ASSERT_TRUE(keep_alive.back()->Send(
        "GET /v2/health/live HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: keep-alive\r\n\r\n"));
    bool closed = false;
    const std::string answer = keep_alive.back()->ReadFor(absl::Milliseconds(300), &closed);
    ASSERT_TRUE(absl::StartsWith(answer, "HTTP/1.1 200")) << answer;
    ASSERT_FALSE(closed);
  }
  HealthCheckResponse health;
  ASSERT_TRUE(CheckHealth((*first)->target(), "", &health).ok());

  (*first)->Signal(SIGTERM);
  ASSERT_TRUE(WaitForLog(**first, "stopped\n", absl::Seconds(30))) << (*first)->log();
  auto second = ServerProcess::StartExactly({"--port=" + std::to_string(grpc_port),
                                             "--http_port=" + std::to_string(http_port),
                                             "--metrics_port=" + std::to_string(metrics_port)});
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ((*second)->port(), grpc_port);
  EXPECT_EQ((*second)->http_port(), http_port);
  EXPECT_EQ((*second)->metrics_port(), metrics_port);
  EXPECT_TRUE(ScrapeMetrics(metrics_port).ok());
  EXPECT_EQ(HttpCall(http_port, "GET", "/v2/health/ready").status, 200);
  const std::optional<int> status = (*first)->WaitForExit(absl::Seconds(15));
  ASSERT_TRUE(status.has_value());
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0) << *status;
}

class RestrictedApiTest : public ::testing::Test {
 protected:
  void SetUp() override {
    secret_file_ = dir_.Write("admin.secret", "s3cret-admin\n");
    setenv("MHA_TEST_INFER_KEY", "s3cret-infer", 1);
    auto server =
        ServerProcess::Start({"--port=0", "--http_port=0",
                              "--restricted_api=model-repository,health:Admin-Key=@" +
                                  secret_file_ + "; inference:infer-key=$MHA_TEST_INFER_KEY"});
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
  }

  grpc::Status ServerLive(const std::string& key, const std::string& value) {
    auto stub = inference::GRPCInferenceService::NewStub(Channel(server_->target()));
    grpc::ClientContext context;
    SetTimeout(&context, std::chrono::seconds(10));
    if (!key.empty()) context.AddMetadata(key, value);
    inference::ServerLiveRequest request;
    inference::ServerLiveResponse response;
    return stub->ServerLive(&context, request, &response);
  }

  TempDir dir_;
  std::string secret_file_;
  std::unique_ptr<ServerProcess> server_;
};

TEST_F(RestrictedApiTest, GrpcNeedsTheKeyInEitherSpelling) {
  grpc::Status status = ServerLive("", "");
  EXPECT_EQ(status.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_TRUE(absl::StrContains(status.error_message(), "the health API is restricted"))
      << status.error_message();
  EXPECT_TRUE(absl::StrContains(status.error_message(), "'admin-key'")) << status.error_message();
  EXPECT_FALSE(absl::StrContains(status.error_message(), "s3cret")) << status.error_message();
  EXPECT_EQ(ServerLive("admin-key", "wrong").error_code(), grpc::StatusCode::PERMISSION_DENIED);
  status = ServerLive("admin-key", "s3cret-admin");  // from @FILE, its newline dropped
  EXPECT_TRUE(status.ok()) << status.error_message();
  status = ServerLive("triton-grpc-protocol-admin-key", "s3cret-admin");
  EXPECT_TRUE(status.ok()) << status.error_message();

  // inference, from $ENV: Attend, AttendStream and ModelInfer.
  auto stub = Connect(server_->target());
  AttendResponse response;
  EXPECT_EQ(Attend(*stub, ToyRequest(), &response).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  {
    grpc::ClientContext context;
    SetTimeout(&context, std::chrono::seconds(10));
    context.AddMetadata("infer-key", "s3cret-infer");
    const grpc::Status attended = stub->Attend(&context, ToyRequest(), &response);
    EXPECT_TRUE(attended.ok()) << attended.error_message();
  }
  {
    grpc::ClientContext context;
    SetTimeout(&context, std::chrono::seconds(10));
    auto stream = stub->AttendStream(&context);
    stream->WritesDone();
    EXPECT_FALSE(stream->Read(&response));
    EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::PERMISSION_DENIED);
  }
  // metadata is not restricted.
  auto kserve = inference::GRPCInferenceService::NewStub(Channel(server_->target()));
  grpc::ClientContext context;
  SetTimeout(&context, std::chrono::seconds(10));
  inference::ServerMetadataRequest request;
  inference::ServerMetadataResponse metadata;
  EXPECT_TRUE(kserve->ServerMetadata(&context, request, &metadata).ok());
  // grpc.health.v1 stays open to probes.
  HealthCheckResponse health;
  EXPECT_TRUE(CheckHealth(server_->target(), "", &health).ok());

  const std::string metrics = ScrapeMetrics(server_->metrics_port()).value();
  EXPECT_EQ(MetricValue(metrics, "mha_restricted_refusals_total{group=\"health\"}"), 2.0)
      << metrics;
  EXPECT_EQ(MetricValue(metrics, "mha_restricted_refusals_total{group=\"inference\"}"), 2.0)
      << metrics;
}

TEST_F(RestrictedApiTest, HttpNeedsTheHeader) {
  const int port = server_->http_port();
  HttpReply reply = HttpCall(port, "GET", "/v2/health/live");
  EXPECT_EQ(reply.status, 403) << reply.text;
  EXPECT_TRUE(absl::StrContains(reply.text, "{\"error\":\"the health API is restricted"))
      << reply.text;
  EXPECT_EQ(HttpCall(port, "GET", "/v2/health/live", "admin-key: nope\r\n").status, 403);
  EXPECT_EQ(HttpCall(port, "GET", "/v2/health/live", "ADMIN-KEY: s3cret-admin\r\n").status, 200);
  EXPECT_EQ(HttpCall(port, "GET", "/v2/models/default/ready").status, 403);
  EXPECT_EQ(HttpCall(port, "POST", "/v2/repository/index", "", "{}").status, 403);
  EXPECT_EQ(
      HttpCall(port, "POST", "/v2/repository/index", "Admin-Key: s3cret-admin\r\n", "{}").status,
      200);
  const std::string infer =
      R"({"inputs":[{"name":"queries","datatype":"FP32","shape":[1,1,100],"data":[)" +
      [] {
        std::string zeros;
        for (int i = 0; i < 100; ++i) zeros += i == 0 ? "0" : ",0";
        return zeros;
      }() +
      "]}]}";
  EXPECT_EQ(HttpCall(port, "POST", "/v2/models/default/infer", "", infer).status, 403);
  reply = HttpCall(port, "POST", "/v2/models/default/infer", "infer-key: s3cret-infer\r\n", infer);
  EXPECT_EQ(reply.status, 200) << reply.text;
  EXPECT_EQ(HttpCall(port, "GET", "/v2").status, 200);  // metadata: open
  const std::string metrics = ScrapeMetrics(server_->metrics_port()).value();
  EXPECT_EQ(MetricValue(metrics, "mha_restricted_refusals_total{group=\"health\"}"), 3.0);
  EXPECT_EQ(MetricValue(metrics, "mha_restricted_refusals_total{group=\"model-repository\"}"), 1.0);
  EXPECT_EQ(MetricValue(metrics, "mha_restricted_refusals_total{group=\"inference\"}"), 1.0);
}

// --log_requests: one access line per request and one per session (not per step),
// each with time, front, model, version, shape, code, queue/compute us and peer.
// Returns the server's stderr once `lines` access lines are there.
std::string LogAccessOfEachFront(const std::string& format, int lines) {
  auto server = ServerProcess::Start(
      {"--port=0", "--http_port=0", "--log_requests", "--log_format=" + format});
  EXPECT_TRUE(server.ok()) << server.status();
  if (!server.ok()) return "";
  auto stub = Connect((*server)->target());
  AttendResponse response;
  EXPECT_TRUE(Attend(*stub, ToyRequest(), &response).ok());
  AttendRequest unknown = ToyRequest();
  unknown.set_model("nope");
  EXPECT_EQ(Attend(*stub, unknown, &response).error_code(), grpc::StatusCode::NOT_FOUND);
  std::string zeros;
  for (int i = 0; i < 300; ++i) zeros += i == 0 ? "0" : ",0";
  EXPECT_EQ(
      HttpCall((*server)->http_port(), "POST", "/v2/models/default/infer", "",
               R"({"inputs":[{"name":"queries","datatype":"FP32","shape":[1,3,100],"data":[)" +
                   zeros + "]}]}")
          .status,
      200);
  {  // a session of two steps: one line, at its end
    grpc::ClientContext context;
    SetTimeout(&context, std::chrono::seconds(30));
    auto session = stub->AttendSession(&context);
    const std::vector<float> x(300, 0.5f);
    for (int64_t rows : {2, 1}) {
      attention::v1::SessionRequest step;
      *step.mutable_queries() = Rows(x, 100, 0, rows);
      EXPECT_TRUE(session->Write(step));
      attention::v1::SessionResponse answer;
      EXPECT_TRUE(session->Read(&answer));
    }
    session->WritesDone();
    const grpc::Status ended = session->Finish();
    EXPECT_TRUE(ended.ok()) << ended.error_message();
  }
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  std::string log;
  do {
    log = (*server)->log();
    int found = 0;
    for (size_t at = 0; (at = log.find("access", at)) != std::string::npos; ++at) ++found;
    if (found >= lines) break;
    absl::SleepFor(absl::Milliseconds(10));
  } while (absl::Now() < deadline);
  return log;
}

TEST(AccessLogTest, TextLinesCarryEveryField) {
  const std::string log = LogAccessOfEachFront("text", 4);
  const std::vector<std::string> lines = absl::StrSplit(log, '\n');
  std::vector<std::string> access;
  for (const std::string& line : lines) {
    if (absl::StartsWith(line, "access ")) access.push_back(line);
  }
  ASSERT_EQ(access.size(), 4u) << log;
  const auto has = [](const std::string& line, const std::string& text) {
    return absl::StrContains(line, text);
  };
  EXPECT_TRUE(has(access[0],
                  " front=attention_v1 call=request model=default version=1 batch=2 "
                  "queries=4 keys=6 steps=0 code=OK queue_us="))
      << access[0];
  EXPECT_TRUE(has(access[0], " compute_us=")) << access[0];
  EXPECT_TRUE(has(access[0], " peer=ipv4:127.0.0.1:")) << access[0];
  EXPECT_TRUE(absl::StartsWith(access[0], "access time=20")) << access[0];
  EXPECT_TRUE(has(access[1],
                  " front=attention_v1 call=request model=nope version=0 batch=0 "
                  "queries=0 keys=0 steps=0 code=NOT_FOUND "))
      << access[1];
  EXPECT_TRUE(has(access[2],
                  " front=kserve_http call=request model=default version=1 batch=1 "
                  "queries=3 keys=3 steps=0 code=OK "))
      << access[2];
  EXPECT_TRUE(has(access[2], " peer=127.0.0.1:")) << access[2];
  EXPECT_TRUE(has(access[3],
                  " front=attention_v1 call=session model=default version=1 batch=1 "
                  "queries=3 keys=3 steps=2 code=OK "))
      << access[3];
}

TEST(AccessLogTest, JsonLinesCarryEveryFieldAndEveryLineIsJson) {
  const std::string log = LogAccessOfEachFront("json", 4);
  std::vector<nlohmann::json> access;
  for (const absl::string_view line : absl::StrSplit(log, '\n', absl::SkipEmpty())) {
    nlohmann::json parsed = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    ASSERT_FALSE(parsed.is_discarded()) << "not JSON: " << line;
    EXPECT_TRUE(parsed.contains("time") && parsed.contains("level")) << line;
    if (parsed.value("log", "") == "access") access.push_back(std::move(parsed));
  }
  ASSERT_EQ(access.size(), 4u) << log;
  for (const auto& record : access) {
    for (const char* field :
         {"time", "front", "call", "model", "version", "batch", "queries", "keys", "steps", "code",
          "queue_us", "compute_us", "total_us", "peer"}) {
      EXPECT_TRUE(record.contains(field)) << field << " in " << record.dump();
    }
  }
  EXPECT_EQ(access[0]["front"], "attention_v1");
  EXPECT_EQ(access[0]["model"], "default");
  EXPECT_EQ(access[0]["version"], 1);
  EXPECT_EQ(access[0]["batch"], 2);
  EXPECT_EQ(access[0]["queries"], 4);
  EXPECT_EQ(access[0]["keys"], 6);
  EXPECT_EQ(access[0]["code"], "OK");
  EXPECT_TRUE(access[0]["queue_us"].is_number_integer());
  EXPECT_TRUE(access[0]["compute_us"].is_number_integer());
  EXPECT_TRUE(absl::StartsWith(access[0]["peer"].get<std::string>(), "ipv4:127.0.0.1:"));
  EXPECT_EQ(access[1]["code"], "NOT_FOUND");
  EXPECT_EQ(access[2]["front"], "kserve_http");
  EXPECT_EQ(access[3]["call"], "session");
  EXPECT_EQ(access[3]["model"], "default");
  EXPECT_EQ(access[3]["queries"], 3);
  EXPECT_EQ(access[3]["steps"], 2);
}

TEST(AccessLogTest, OffByDefaultAndBadFormatNamesTheFlag) {
  auto server = ServerProcess::Start({"--port=0"});
  ASSERT_TRUE(server.ok()) << server.status();
  auto stub = Connect((*server)->target());
  AttendResponse response;
  EXPECT_TRUE(Attend(*stub, ToyRequest(), &response).ok());
  EXPECT_FALSE(absl::StrContains((*server)->log(), "access")) << (*server)->log();
  const RunResult run = RunServer({"--port=0", "--log_format=yaml"});
  EXPECT_EQ(run.exit_code, 2);
  EXPECT_TRUE(absl::StrContains(run.err, "--log_format: expected text or json, got \"yaml\""))
      << run.err;
}

TEST(SessionAnswersFlagTest, ABadValueFailsStartNamingTheFlag) {
  const RunResult run = RunServer({"--port=0", "--session_answers=early"});
  EXPECT_EQ(run.exit_code, 2);
  EXPECT_TRUE(
      absl::StrContains(run.err, "--session_answers: expected call_end or step_end, got \"early\""))
      << run.err;
}

// Poll model control serves an empty repository and loads the models that appear in it;
// with no --model_repository at all it is still a usage error.
TEST(PollTest, EmptyRepositoryStartsAndLoadsModelsAsTheyAppear) {
  TempDir repository;
  auto server =
      ServerProcess::Start({"--port=0", "--model_control=poll", "--repository_poll_secs=1",
                            "--model_repository=" + repository.path()});
  ASSERT_TRUE(server.ok()) << server.status();
  auto stub = Connect((*server)->target());
  AttendRequest request = ToyRequest();
  request.set_model("late");
  AttendResponse response;
  EXPECT_EQ(Attend(*stub, request, &response).error_code(), grpc::StatusCode::NOT_FOUND);
  repository.Write("late/config.pbtxt", "num_hiddens: 100 num_heads: 5 seeded { seed: 3 }");
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  grpc::Status status;
  do {
    absl::SleepFor(absl::Milliseconds(200));
    status = Attend(*stub, request, &response);
  } while (!status.ok() && absl::Now() < deadline);
  EXPECT_TRUE(status.ok()) << status.error_message() << "\n" << (*server)->log();

  const RunResult run = RunServer({"--port=0", "--model_control=poll"});
  EXPECT_EQ(run.exit_code, 2);
  EXPECT_TRUE(absl::StrContains(run.err,
                                "--model_control: poll and explicit need a "
                                "model_repository"))
      << run.err;
}

TEST(RestrictedApiFlagTest, BadRulesFailStartNamingTheFlag) {
  for (const auto& [spec, says] : std::vector<std::pair<std::string, std::string>>{
           {"inferense:k=v", "unknown group \"inferense\""},
           {"inference=v", "no ':' after the groups"},
           {"inference:k", "no '=' between KEY and VALUE"},
           {"inference:k=$MHA_TEST_UNSET_VARIABLE", "MHA_TEST_UNSET_VARIABLE is not set"},
           {"inference:k=@/nonexistent/secret", "cannot read the secret file /nonexistent/secret"},
           {"inference:k=a;inference:j=b", "group inference is named by an earlier rule"}}) {
    const RunResult run = RunServer({"--port=0", "--restricted_api=" + spec});
    EXPECT_EQ(run.exit_code, 2) << spec;
    EXPECT_TRUE(absl::StrContains(run.err, "--restricted_api: rule")) << run.err;
    EXPECT_TRUE(absl::StrContains(run.err, says)) << run.err;
  }
}

}  // namespace
}  // namespace mha::testing

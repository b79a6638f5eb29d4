// What an operator meets first (issue 39): ports that a second server and a restart
// can share, and restricted API groups on both transports.
#include <signal.h>
#include <stdlib.h>

#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
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

// The client SDK (client/sdk) as a program uses it: this binary links mha::client_sdk
// and nothing else of the client (no load tools, no heat-map renderer, no cairo).
// One real attention_server on loopback, a Connection over each protocol
// (attention.v1 gRPC, KServe v2 gRPC, KServe v2 HTTP), the same request sent over
// each: the answers have the request's shape, agree between protocols, and their
// attention weights are softmax rows that respect the mask.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/sdk/call_group.h"
#include "client/sdk/channel.h"
#include "client/sdk/connection.h"
#include "client/sdk/http.h"
#include "client/sdk/request.h"
#include "client/sdk/status.h"
#include "gtest/gtest.h"
#include "proto/attention.pb.h"
#include "tests/integration/net_util.h"
#include "tests/integration/server_process.h"

namespace mha::testing {
namespace {

using attention::v1::AttendRequest;
using attention::v1::AttendResponse;
using attention::v1::ModelInfo;
using client::Connection;
using client::Protocol;

// The protocols answer from the same f32 computation on the same server; only the
// encoding differs (repeated floats, raw little-endian bytes, HTTP binary data).
constexpr double kTolerance = 1e-5;

const Protocol kProtocols[] = {Protocol::kAttention, Protocol::kKServe, Protocol::kHttp};

class ClientSdkTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto server = ServerProcess::Start({"--port=0", "--http_port=0"});
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server).release();
    ASSERT_GT(server_->http_port(), 0);
  }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
  }

  // A connection to the server over `protocol`.
  static std::unique_ptr<Connection> Open(Protocol protocol) {
    client::ChannelOptions options;
    options.protocol = protocol;
    options.target = protocol == Protocol::kHttp ? server_->http_target() : server_->target();
    absl::StatusOr<std::unique_ptr<Connection>> connection = Connection::Open(options);
    EXPECT_TRUE(connection.ok()) << connection.status();
    return connection.ok() ? *std::move(connection) : nullptr;
  }

  static ServerProcess* server_;
};

ServerProcess* ClientSdkTest::server_ = nullptr;

// The default request (request.h: B 2, Q 4, K 6, valid_lens [3, 2]) with the
// attention weights asked for.
AttendRequest ToyRequest(const ModelInfo& model) {
  client::RequestOptions options;
  options.return_attention = true;
  absl::StatusOr<AttendRequest> request = client::MakeRequest(options, model);
  EXPECT_TRUE(request.ok()) << request.status();
  return request.value_or(AttendRequest());
}

std::vector<int64_t> Shape(const attention::v1::Tensor& tensor) {
  return {tensor.shape().begin(), tensor.shape().end()};
}

TEST_F(ClientSdkTest, EveryProtocolAnswersTheSameRequestAlike) {
  std::map<Protocol, AttendResponse> responses;
  for (Protocol protocol : kProtocols) {
    SCOPED_TRACE(client::ProtocolName(protocol));
    std::unique_ptr<Connection> connection = Open(protocol);
    ASSERT_NE(connection, nullptr);
    EXPECT_EQ(connection->protocol(), protocol);
    ASSERT_TRUE(connection->Ready().ok());

    absl::StatusOr<ModelInfo> model = connection->GetModel("");
    ASSERT_TRUE(model.ok()) << model.status();
    EXPECT_EQ(model->num_hiddens(), 100);  // the toy model: p_o 100, d_q = d_k = d_v = 100
    EXPECT_EQ(model->query_size(), 100);
    EXPECT_EQ(model->key_size(), 100);
    EXPECT_EQ(model->value_size(), 100);

    const AttendRequest request = ToyRequest(*model);
    absl::StatusOr<AttendResponse> response = connection->Attend(request);
    ASSERT_TRUE(response.ok()) << response.status();
    EXPECT_EQ(Shape(response->output()), (std::vector<int64_t>{2, 4, 100}));
    ASSERT_EQ(response->output().data_size(), 2 * 4 * 100);
    double norm = 0;
    for (float v : response->output().data()) {
      ASSERT_TRUE(std::isfinite(v));
      norm += std::abs(v);
    }
    EXPECT_GT(norm, 0) << "an all-zero output";

    // (B, h, Q, K) weights: each row a softmax over the keys its valid_len leaves.
    const attention::v1::Tensor& weights = response->attention();
    ASSERT_EQ(weights.shape_size(), 4);
    const int64_t heads = weights.shape(1);
    ASSERT_GT(heads, 0);
    EXPECT_EQ(Shape(weights), (std::vector<int64_t>{2, heads, 4, 6}));
    ASSERT_EQ(weights.data_size(), 2 * heads * 4 * 6);
    for (int64_t b = 0; b < 2; ++b) {
      for (int64_t h = 0; h < heads; ++h) {
        for (int64_t q = 0; q < 4; ++q) {
          double sum = 0;
          for (int64_t k = 0; k < 6; ++k) {
            const float w = weights.data(static_cast<int>(((b * heads + h) * 4 + q) * 6 + k));
            if (client::IsMasked(request, b, q, k)) {
              EXPECT_EQ(w, 0) << "b " << b << " h " << h << " q " << q << " k " << k;
            }
            sum += w;
          }
          EXPECT_NEAR(sum, 1.0, kTolerance) << "b " << b << " h " << h << " q " << q;
        }
      }
    }
    responses[protocol] = *std::move(response);
  }

  // Element by element, every protocol's answer against attention.v1's.
  const AttendResponse& reference = responses[Protocol::kAttention];
  for (Protocol protocol : {Protocol::kKServe, Protocol::kHttp}) {
    SCOPED_TRACE(client::ProtocolName(protocol));
    const AttendResponse& response = responses[protocol];
    ASSERT_EQ(response.output().data_size(), reference.output().data_size());
    double max_diff = 0;
    for (int i = 0; i < reference.output().data_size(); ++i) {
      max_diff = std::max<double>(max_diff,
                                  std::abs(response.output().data(i) - reference.output().data(i)));
    }
    EXPECT_LE(max_diff, kTolerance);
    ASSERT_EQ(response.attention().data_size(), reference.attention().data_size());
    for (int i = 0; i < reference.attention().data_size(); ++i) {
      EXPECT_NEAR(response.attention().data(i), reference.attention().data(i), kTolerance) << i;
    }
  }
}

// Errors keep the server's code and start with the call that failed.
TEST_F(ClientSdkTest, AnUnknownModelIsNotFoundNamingTheCall) {
  const std::map<Protocol, std::string> calls = {{Protocol::kAttention, "GetModel: "},
                                                 {Protocol::kKServe, "ModelMetadata: "},
                                                 {Protocol::kHttp, "GET /v2/models/nope: "}};
  for (Protocol protocol : kProtocols) {
    SCOPED_TRACE(client::ProtocolName(protocol));
    std::unique_ptr<Connection> connection = Open(protocol);
    ASSERT_NE(connection, nullptr);
    const absl::StatusOr<ModelInfo> model = connection->GetModel("nope");
    EXPECT_EQ(model.status().code(), absl::StatusCode::kNotFound) << model.status();
    EXPECT_TRUE(absl::StartsWith(model.status().message(), calls.at(protocol))) << model.status();
  }
}

// A request the model refuses: INVALID_ARGUMENT over every protocol, nothing sent
// back as an output.
TEST_F(ClientSdkTest, ARequestThatDisagreesWithTheModelIsInvalidOverEveryProtocol) {
  for (Protocol protocol : kProtocols) {
    SCOPED_TRACE(client::ProtocolName(protocol));
    std::unique_ptr<Connection> connection = Open(protocol);
    ASSERT_NE(connection, nullptr);
    absl::StatusOr<ModelInfo> model = connection->GetModel("");
    ASSERT_TRUE(model.ok()) << model.status();
    AttendRequest request = ToyRequest(*model);
    request.set_valid_lens(1, 9);  // more keys than the 6 sent
    const absl::StatusOr<AttendResponse> response = connection->Attend(request);
    EXPECT_EQ(response.status().code(), absl::StatusCode::kInvalidArgument) << response.status();
  }
}

// A cancelled CallGroup ends the gRPC calls of a connection in it at once, and a
// second connection over the same channel (OverChannel) works on untouched.
TEST_F(ClientSdkTest, ACancelledCallGroupEndsItsConnectionsCalls) {
  for (Protocol protocol : {Protocol::kAttention, Protocol::kKServe}) {
    SCOPED_TRACE(client::ProtocolName(protocol));
    std::unique_ptr<Connection> connection = Open(protocol);
    ASSERT_NE(connection, nullptr);
    absl::StatusOr<ModelInfo> model = connection->GetModel("");
    ASSERT_TRUE(model.ok()) << model.status();
    const AttendRequest request = ToyRequest(*model);

    absl::StatusOr<std::unique_ptr<Connection>> other =
        Connection::OverChannel(protocol, connection->channel(), absl::Seconds(10));
    ASSERT_TRUE(other.ok()) << other.status();
    client::CallGroup group;
    (*other)->set_call_group(&group);
    ASSERT_TRUE((*other)->Attend(request).ok());
    group.Cancel();
    EXPECT_TRUE(group.cancelled());
    EXPECT_EQ((*other)->Attend(request).status().code(), absl::StatusCode::kCancelled);
    EXPECT_TRUE(connection->Attend(request).ok());
  }
  EXPECT_EQ(Connection::OverChannel(Protocol::kHttp, nullptr, absl::Seconds(1)).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// The plain HTTP transport (client/sdk/http.h) against a real server that closes an
// idle kept-alive connection: the next call goes out on a new connection and succeeds.
TEST(HttpTransportTest, AConnectionTheServerClosedWhileIdleIsReplaced) {
  auto server = ServerProcess::Start({"--port=0", "--http_port=0", "--http_idle_timeout=200ms"});
  ASSERT_TRUE(server.ok()) << server.status();
  absl::StatusOr<client::HttpEndpoint> endpoint = client::ParseHttpTarget((*server)->http_target());
  ASSERT_TRUE(endpoint.ok()) << endpoint.status();
  client::HttpConnection http(*endpoint, absl::Seconds(10));
  for (int call = 0; call < 3; ++call) {
    const absl::Status ready = http.Ready();
    EXPECT_TRUE(ready.ok()) << call << ": " << ready;
    absl::StatusOr<std::vector<std::string>> names = http.ReadyModels();
    ASSERT_TRUE(names.ok()) << call << ": " << names.status();
    EXPECT_EQ(*names, std::vector<std::string>{"default"});
    absl::SleepFor(absl::Milliseconds(600));  // past the server's idle timeout
  }
}

client::HttpEndpoint Endpoint(const RawServer& server) {
  return {.host = "127.0.0.1", .port = server.port()};
}

// What the plain transport makes of servers that fail: each a canonical code and a
// message naming the call and the target.
TEST(HttpTransportTest, BrokenServersGetCanonicalCodesNamingTheCallAndTarget) {
  {  // nothing listens (a port just freed)
    client::HttpEndpoint endpoint = Endpoint(RawServer(""));
    client::HttpConnection http(endpoint, absl::Seconds(5));
    const absl::Status status = http.Ready();
    EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
    EXPECT_TRUE(absl::StartsWith(status.message(), "GET /v2/health/ready: HTTP connection error"))
        << status;
  }
  {  // a listener that never answers: the read timeout
    RawServer silent("");
    client::HttpConnection http(Endpoint(silent), absl::Milliseconds(300));
    const absl::Time start = absl::Now();
    const absl::Status status = http.Ready();
    EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded) << status;
    EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  }
  const struct {
    std::string reply;
    absl::StatusCode code;
    std::string says;
  } cases[] = {
      {"SSH-2.0-OpenSSH_9.2\r\n\r\n", absl::StatusCode::kInternal, "bad status line"},
      {"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nshort", absl::StatusCode::kUnavailable,
       "before the body's end"},
      {"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 21\r\n\r\n{\"error\": \"draining\"}",
       absl::StatusCode::kUnavailable, "draining"},
      {"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n", absl::StatusCode::kOk, ""},
  };
  for (const auto& c : cases) {
    RawServer raw(c.reply);
    client::HttpConnection http(Endpoint(raw), absl::Seconds(5));
    const absl::Status status = http.Ready();
    EXPECT_EQ(status.code(), c.code) << c.reply << ": " << status;
    EXPECT_NE(status.message().find(c.says), std::string::npos) << status;
    if (!status.ok()) {
      EXPECT_TRUE(absl::StartsWith(status.message(), "GET /v2/health/ready: ")) << status;
    }
  }
}

}  // namespace
}  // namespace mha::testing

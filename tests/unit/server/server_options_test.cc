// ServerOptions::Validate and the status mapping at the RPC edge.
#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "server/grpc_common/grpc_status.h"
#include "server/app/server.h"

namespace mha::server {
namespace {

TEST(ServerOptionsTest, DefaultsAreValid) { EXPECT_TRUE(ServerOptions{}.Validate().ok()); }

TEST(ServerOptionsTest, EachBadFieldIsNamed) {
  struct Case {
    void (*mutate)(ServerOptions&);
    std::string message;
  };
  const Case cases[] = {
      {[](ServerOptions& o) { o.port = 70000; }, "port: expected 0 to 65535, got 70000"},
      {[](ServerOptions& o) { o.metrics_port = -2; }, "metrics_port: expected -1 to 65535"},
      {[](ServerOptions& o) { o.compute_workers = 0; }, "compute_workers: expected >= 1, got 0"},
      {[](ServerOptions& o) { o.limits.max_batch_size = 0; },
       "limits.max_batch_size: expected >= 1, got 0"},
      {[](ServerOptions& o) { o.limits.max_attention_elements = -3; },
       "limits.max_attention_elements: expected >= 1, got -3"},
      {[](ServerOptions& o) { o.batching.max_queue_size = 0; },
       "batching.max_queue_size: expected >= 1, got 0"},
      {[](ServerOptions& o) { o.batching.max_queue_wait = absl::Microseconds(-5); },
       "batching.max_queue_wait: expected >= 0, got -5 us"},
      {[](ServerOptions& o) { o.batching.session_gather = absl::Microseconds(-1); },
       "batching.session_gather: expected >= 0, got -1 us"},
      {[](ServerOptions& o) { o.malloc_trim_interval = absl::Seconds(-1); },
       "malloc_trim_interval: expected >= 0, got -1000000 us"},
      {[](ServerOptions& o) { o.tls_cert = "c.pem"; }, "tls_key: tls_cert and tls_key go together"},
      {[](ServerOptions& o) { o.tls_client_ca = "ca.pem"; },
       "tls_client_ca: needs tls_cert and tls_key"},
  };
  for (const Case& c : cases) {
    ServerOptions options;
    c.mutate(options);
    const absl::Status status = options.Validate();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << c.message;
    EXPECT_TRUE(absl::StrContains(status.message(), c.message))
        << status << "\nexpected: " << c.message;
  }
}

TEST(ServerOptionsTest, CreateRefusesInvalidOptionsBeforeLoadingAnything) {
  ServerOptions options;
  options.compute_workers = 0;
  EXPECT_EQ(Server::Create(options).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(GrpcStatusTest, KeepsCodeAndMessage) {
  const grpc::Status s = ToGrpcStatus(absl::ResourceExhaustedError("limit x"));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(s.error_message(), "limit x");
  EXPECT_TRUE(ToGrpcStatus(absl::OkStatus()).ok());
  for (int code = 1; code <= 16; ++code) {
    EXPECT_EQ(
        static_cast<int>(
            ToGrpcStatus(absl::Status(static_cast<absl::StatusCode>(code), "m")).error_code()),
        code);
  }
}

}  // namespace
}  // namespace mha::server

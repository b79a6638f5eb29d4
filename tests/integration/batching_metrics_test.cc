// The real server on loopback: dynamic batching seen from a caller (batched and
// unbatched answers agree; a full queue and an expired deadline answer at once
// with their codes) and /metrics agreeing with what the test sent.
#include <atomic>
#include <chrono>
#include <cmath>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/integration/client_util.h"
#include "tests/integration/metrics_scrape.h"
#include "tests/integration/server_process.h"

namespace mha::testing {
namespace {

// Mixed lengths and mask kinds for the toy model; request i differs from the
// others in Q, K or valid_lens. Rows in total: 12.
std::vector<AttendRequest> MixedRequests() {
  struct Shape {
    int64_t b, q, k;
    std::vector<int32_t> lens;
  };
  const std::vector<Shape> shapes = {
      {2, 4, 6, {3, 2}},    {1, 7, 13, {}},  {1, 5, 9, {1, 2, 3, 9, 0}},
      {3, 1, 2, {2, 0, 1}}, {1, 16, 4, {4}}, {2, 9, 9, {9, 1}},
      {1, 3, 30, {}},       {1, 12, 5, {5}},
  };
  std::vector<AttendRequest> requests;
  for (size_t i = 0; i < shapes.size(); ++i) {
    const Shape& s = shapes[i];
    AttendRequest request;
    *request.mutable_queries() = MakeTensor({s.b, s.q, 100}, 0.1f * static_cast<float>(i));
    *request.mutable_keys() = MakeTensor({s.b, s.k, 100}, 1.0f + static_cast<float>(i));
    *request.mutable_values() = MakeTensor({s.b, s.k, 100}, 2.0f + static_cast<float>(i));
    for (int32_t len : s.lens) request.add_valid_lens(len);
    request.set_request_id(absl::StrCat("mixed-", i));
    requests.push_back(std::move(request));
  }
  return requests;
}

// Sends every request at once, one thread each; returns the responses.
std::vector<AttendResponse> SendConcurrently(const std::string& target,
                                             const std::vector<AttendRequest>& requests) {
  std::vector<AttendResponse> responses(requests.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < requests.size(); ++i) {
    threads.emplace_back([&, i] {
      const auto channel =
          Channel(target, grpc::InsecureChannelCredentials(), "", /*own_connection=*/true);
      // Connected first: a connect that fails once (it happened in a CI run, one of
      // eight, "No such file or directory") is retried instead of failing the call,
      // which would leave the batch a request short.
      EXPECT_TRUE(
          channel->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(30)))
          << i;
      auto stub = AttentionService::NewStub(channel);
      const grpc::Status status = Attend(*stub, requests[i], &responses[i]);
      EXPECT_TRUE(status.ok()) << i << ": " << status.error_message();
    });
  }
  for (std::thread& t : threads) t.join();
  return responses;
}

TEST(BatchingTest, ConcurrentMixedLengthRequestsGetTheSameAnswerBatchedOrNot) {
  const std::vector<AttendRequest> requests = MixedRequests();
  // Batched: a batch is due when all 12 rows are queued (max_batch_size 12), or
  // after 5 s; so the 8 concurrent requests become one forward call.
  auto batched =
      ServerProcess::Start({"--port=0", "--max_batch_size=12", "--max_queue_delay_us=5000000"})
          .value();
  auto unbatched = ServerProcess::Start({"--port=0", "--batching=false"}).value();
  const std::vector<AttendResponse> merged = SendConcurrently(batched->target(), requests);
  const std::vector<AttendResponse> alone = SendConcurrently(unbatched->target(), requests);
  for (size_t i = 0; i < requests.size(); ++i) {
    SCOPED_TRACE(requests[i].request_id());
    EXPECT_EQ(merged[i].timing().batch_rows(), 12);
    EXPECT_EQ(alone[i].timing().batch_rows(), requests[i].queries().shape(0));
    ASSERT_EQ(merged[i].output().data_size(), alone[i].output().data_size());
    EXPECT_LE(MaxAbsDiff(merged[i].output().data(), alone[i].output().data()), 1e-5f);
  }
  const std::string text = ScrapeMetrics(batched->metrics_port()).value();
  EXPECT_EQ(MetricValue(text, R"(mha_batch_size_count{model="default"})"), 1);
  EXPECT_EQ(MetricValue(text, R"(mha_batch_size_sum{model="default"})"), 12);
  EXPECT_EQ(MetricValue(text, R"(mha_compute_duration_seconds_count{model="default"})"), 1);
  EXPECT_EQ(MetricValue(text, R"(mha_queue_duration_seconds_count{model="default"})"), 8);
  // The warm-up's passes ran at once: nothing can join them, so none waited the 5 s
  // batching delay for company.
  EXPECT_LT(MetricValue(text, R"(mha_model_warmup_seconds{model="default"})"), 5.0);
}

TEST(BatchingTest, FullQueueAndExpiredDeadlineAnswerWithTheirCodes) {
  // Queued requests wait up to 3 s for company; the queue holds 2.
  auto server =
      ServerProcess::Start({"--port=0", "--max_queue_delay_us=3000000", "--max_queue_size=2"})
          .value();
  auto stub = Connect(server->target());
  const AttendRequest request = ToyRequest();
  AttendResponse first_response;
  grpc::Status first, expired;
  std::thread first_call(
      [&] { first = Attend(*stub, request, &first_response, std::chrono::seconds(30)); });
  std::thread expiring_call([&] {
    AttendResponse response;
    expired = Attend(*stub, request, &response, std::chrono::milliseconds(300));
  });
  // Both are queued once the queue depth says so.
  const absl::Time give_up = absl::Now() + absl::Seconds(2);
  while (absl::Now() < give_up && MetricValue(ScrapeMetrics(server->metrics_port()).value(),
                                              R"(mha_queue_depth{model="default"})") < 2) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  AttendResponse response;
  const absl::Time sent = absl::Now();
  const grpc::Status full = Attend(*stub, request, &response);
  EXPECT_EQ(full.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << full.error_message();
  EXPECT_NE(full.error_message().find("max_queue_size 2"), std::string::npos);
  EXPECT_LT(absl::Now() - sent, absl::Seconds(2));  // not after the 3 s batch delay
  first_call.join();
  expiring_call.join();
  EXPECT_TRUE(first.ok()) << first.error_message();
  EXPECT_GE(first_response.timing().queue_us(), 2'000'000);
  EXPECT_EQ(expired.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);

  // The expired request was dropped when the batch formed: counted, not computed.
  const std::string text = ScrapeMetrics(server->metrics_port()).value();
  EXPECT_EQ(
      MetricValue(text, R"(mha_requests_total{code="OK",model="default",protocol="attention_v1"})"),
      1);
  EXPECT_EQ(
      MetricValue(
          text,
          R"(mha_requests_total{code="RESOURCE_EXHAUSTED",model="default",protocol="attention_v1"})"),
      1);
  EXPECT_EQ(
      MetricValue(
          text,
          R"(mha_requests_total{code="DEADLINE_EXCEEDED",model="default",protocol="attention_v1"})"),
      1);
  EXPECT_EQ(MetricValue(text, R"(mha_compute_duration_seconds_count{model="default"})"), 1);
  EXPECT_EQ(MetricValue(text, R"(mha_batch_size_sum{model="default"})"), 2);
  EXPECT_EQ(MetricValue(text, R"(mha_queue_depth{model="default"})"), 0);
  EXPECT_EQ(MetricValue(text, R"(mha_inflight_requests{model="default"})"), 0);
}

TEST(MetricsTest, CountersAndHistogramsMatchWhatWasSent) {
  auto server = ServerProcess::Start({"--port=0", "--max_queue_delay_us=0"}).value();
  auto stub = Connect(server->target());
  const AttendRequest toy = ToyRequest();
  int ok = 0, invalid = 0, unknown = 0;
  for (int i = 0; i < 5; ++i, ++ok) {
    AttendResponse response;
    ASSERT_TRUE(Attend(*stub, toy, &response).ok());
  }
  {  // a stream of three
    grpc::ClientContext context;
    SetTimeout(&context, std::chrono::seconds(30));
    auto stream = stub->AttendStream(&context);
    for (int i = 0; i < 3; ++i, ++ok) ASSERT_TRUE(stream->Write(toy));
    stream->WritesDone();
    AttendResponse response;
    int read = 0;
    while (stream->Read(&response)) ++read;
    EXPECT_EQ(read, 3);
    ASSERT_TRUE(stream->Finish().ok());
  }
  for (int i = 0; i < 3; ++i, ++invalid) {
    AttendRequest bad = toy;
    bad.mutable_queries()->set_shape(2, 99);
    AttendResponse response;
    EXPECT_EQ(Attend(*stub, bad, &response).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  }
  for (int i = 0; i < 2; ++i, ++unknown) {
    AttendRequest bad = toy;
    bad.set_model(absl::StrCat("no-such-model-", i));
    AttendResponse response;
    EXPECT_EQ(Attend(*stub, bad, &response).error_code(), grpc::StatusCode::NOT_FOUND);
  }

  const std::string text = ScrapeMetrics(server->metrics_port()).value();
  auto value = [&](const std::string& series) { return MetricValue(text, series); };
  EXPECT_EQ(value(R"(mha_requests_total{code="OK",model="default",protocol="attention_v1"})"), ok);
  EXPECT_EQ(
      value(
          R"(mha_requests_total{code="INVALID_ARGUMENT",model="default",protocol="attention_v1"})"),
      invalid);
  EXPECT_EQ(
      value(R"(mha_requests_total{code="NOT_FOUND",model="_unknown",protocol="attention_v1"})"),
      unknown);
  EXPECT_EQ(value(R"(mha_request_duration_seconds_count{model="default",protocol="attention_v1"})"),
            ok + invalid);
  EXPECT_EQ(
      value(
          R"(mha_request_duration_seconds_bucket{model="default",protocol="attention_v1",le="+Inf"})"),
      ok + invalid);
  EXPECT_EQ(
      value(R"(mha_request_duration_seconds_count{model="_unknown",protocol="attention_v1"})"),
      unknown);
  EXPECT_EQ(value(R"(mha_queue_duration_seconds_count{model="default"})"), ok);
  // Every computed row and token is in exactly one forward call (the stream's
  // requests may share calls).
  const double calls = value(R"(mha_compute_duration_seconds_count{model="default"})");
  EXPECT_GE(calls, 5 + 1);
  EXPECT_LE(calls, ok);
  EXPECT_EQ(value(R"(mha_batch_size_count{model="default"})"), calls);
  EXPECT_EQ(value(R"(mha_batch_size_sum{model="default"})"), 2 * ok);
  EXPECT_EQ(value(R"(mha_batch_tokens_sum{model="default"})"), 8 * ok);
  EXPECT_EQ(value(R"(mha_tokens_total{model="default"})"), 8 * ok);
  EXPECT_EQ(value(R"(mha_inflight_requests{model="default"})"), 0);
  EXPECT_EQ(value(R"(mha_queue_depth{model="default"})"), 0);
  // Histogram buckets are cumulative and end at the count.
  EXPECT_LE(
      value(
          R"(mha_request_duration_seconds_bucket{model="default",protocol="attention_v1",le="0.001"})"),
      value(
          R"(mha_request_duration_seconds_bucket{model="default",protocol="attention_v1",le="10"})"));
  EXPECT_EQ(
      value(
          R"(mha_request_duration_seconds_bucket{model="default",protocol="attention_v1",le="10"})"),
      ok + invalid);
  // process_* from /proc.
  EXPECT_GT(value("process_resident_memory_bytes"), 1 << 20);
  EXPECT_GE(value("process_threads"), 2);
  EXPECT_GT(value("process_open_fds"), 2);
  const double started = value("process_start_time_seconds");
  EXPECT_LT(std::abs(started - absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch())), 600);
  EXPECT_GT(FindMetric(text, "process_cpu_seconds_total").value_or(-1), 0);
}

TEST(MetricsTest, MetricsPortMinusOneTurnsMetricsOff) {
  auto off = ServerProcess::Start({"--port=0", "--metrics_port=-1"}).value();
  EXPECT_EQ(off->metrics_port(), 0);
  auto on = ServerProcess::Start({"--port=0"}).value();
  ASSERT_GT(on->metrics_port(), 0);
  EXPECT_TRUE(ScrapeMetrics(on->metrics_port()).ok());
  EXPECT_NE(on->log().find("batching on"), std::string::npos) << on->log();
}

}  // namespace
}  // namespace mha::testing

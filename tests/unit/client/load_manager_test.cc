#include "client/load/load_manager.h"

#include <chrono>
#include <cmath>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace mha::client {
namespace {

using std::chrono::steady_clock;

// A target no server listens on: every call fails with UNAVAILABLE, no network needed.
LoadTarget DeadTarget(const attention::v1::AttendRequest* request) {
  LoadTarget target;
  target.calls.channels = {grpc::CreateChannel("unix:/nonexistent/mha_client_load_test.sock",
                                               grpc::InsecureChannelCredentials())};
  target.calls.request = request;
  return target;
}

bool WaitExhausted(const LoadManager& load) {
  const auto end = steady_clock::now() + std::chrono::seconds(10);
  while (!load.exhausted() && steady_clock::now() < end) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return load.exhausted();
}

TEST(RequestScheduleTest, ConstantIntervalsAreOneOverTheRate) {
  RequestSchedule schedule(4, /*poisson=*/false, 7);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(schedule.NextInterval(), std::chrono::milliseconds(250));
  RequestSchedule thirds(3, /*poisson=*/false, 0);
  EXPECT_EQ(thirds.NextInterval(), std::chrono::nanoseconds(333333333));
}

TEST(RequestScheduleTest, PoissonIntervalsAreExponentialAndRepeatWithTheSeed) {
  constexpr double kRate = 200;
  constexpr int kCount = 20000;
  RequestSchedule schedule(kRate, /*poisson=*/true, 1), same(kRate, true, 1), other(kRate, true, 2);
  std::vector<double> seconds;
  bool differs = false;
  for (int i = 0; i < kCount; ++i) {
    const auto interval = schedule.NextInterval();
    EXPECT_EQ(interval, same.NextInterval());
    differs |= interval != other.NextInterval();
    seconds.push_back(std::chrono::duration<double>(interval).count());
  }
  EXPECT_TRUE(differs);
  double mean = 0, var = 0;
  for (double s : seconds) mean += s / kCount;
  for (double s : seconds) var += (s - mean) * (s - mean) / kCount;
  // An exponential distribution's standard deviation equals its mean, 1 / rate.
  EXPECT_NEAR(mean, 1 / kRate, 0.03 / kRate);
  EXPECT_NEAR(std::sqrt(var), 1 / kRate, 0.05 / kRate);
}

TEST(LoadManagerTest, CreateRejectsBadLoadsNamingWhatIsWrong) {
  const attention::v1::AttendRequest request;
  Recorder recorder;
  const LoadTarget target = DeadTarget(&request);
  auto message = [](const absl::Status& status) { return std::string(status.message()); };

  EXPECT_EQ(message(ConcurrencyManager::Create(target, 0, &recorder).status()),
            "concurrency: expected >= 1, got 0");
  EXPECT_EQ(message(RequestRateManager::Create(target, 0, false, 0, &recorder).status()),
            "request rate: expected > 0, got 0");
  LoadTarget no_streams = target;
  no_streams.calls.mode = Mode::kStream;
  no_streams.rate_streams = 0;
  EXPECT_EQ(message(RequestRateManager::Create(no_streams, 10, false, 0, &recorder).status()),
            "--streams: expected >= 1");
  LoadTarget health_stream = target;
  health_stream.calls.rpc = Rpc::kHealth;
  health_stream.calls.mode = Mode::kStream;
  EXPECT_EQ(message(ConcurrencyManager::Create(health_stream, 1, &recorder).status()),
            "--rpc=health is unary only (Health/Check)");
  LoadTarget no_channel = target;
  no_channel.calls.channels.clear();
  EXPECT_EQ(ConcurrencyManager::Create(no_channel, 1, &recorder).status().code(),
            absl::StatusCode::kInvalidArgument);
  LoadTarget no_request = target;
  no_request.calls.request = nullptr;
  EXPECT_EQ(ConcurrencyManager::Create(no_request, 1, &recorder).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(recorder.completed(), 0);
}

// A dead target whose failures are expected: no backoff, requests as fast as they fail.
LoadTarget DeadTargetExpected(const attention::v1::AttendRequest* request) {
  LoadTarget target = DeadTarget(request);
  target.allowed_errors = {grpc::StatusCode::UNAVAILABLE};
  return target;
}

// Polls `done` for up to 10 s.
template <typename Done>
bool WaitFor(Done done) {
  const auto end = steady_clock::now() + std::chrono::seconds(10);
  while (!done() && steady_clock::now() < end) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return done();
}

TEST(BackoffTest, DoublesFromOneMillisecondToAtMostAHundred) {
  using std::chrono::milliseconds;
  EXPECT_EQ(BackoffDelay(0), milliseconds(0));
  EXPECT_EQ(BackoffDelay(1), milliseconds(1));
  EXPECT_EQ(BackoffDelay(2), milliseconds(2));
  EXPECT_EQ(BackoffDelay(7), milliseconds(64));
  EXPECT_EQ(BackoffDelay(8), milliseconds(100));
  EXPECT_EQ(BackoffDelay(int64_t{1} << 40), milliseconds(100));
}

TEST(LoadManagerTest, FailuresBackOffInsteadOfATightLoop) {
  const attention::v1::AttendRequest request;
  Recorder recorder;
  auto load = ConcurrencyManager::Create(DeadTarget(&request), 4, &recorder);
  ASSERT_TRUE(load.ok()) << load.status();
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  (*load)->Stop();
  // 4 slots, each waiting 1, 2, 4, ... then 100 ms after a failure: a few dozen in
  // 500 ms, where a tight loop sends thousands.
  EXPECT_GE((*load)->sent(), 4);
  EXPECT_LT((*load)->sent(), 60);
  EXPECT_EQ(recorder.completed(), (*load)->sent());
  EXPECT_EQ(recorder.errors(), (std::map<std::string, int64_t>{{"UNAVAILABLE", (*load)->sent()}}));
}

TEST(LoadManagerTest, MaxErrorsStopsSending) {
  const attention::v1::AttendRequest request;
  LoadTarget target = DeadTarget(&request);
  target.max_errors = 5;
  Recorder recorder;
  auto load = ConcurrencyManager::Create(target, 1, &recorder);
  ASSERT_TRUE(load.ok()) << load.status();
  ASSERT_TRUE(WaitFor([&] { return (*load)->failing(); }));
  (*load)->Stop();
  EXPECT_EQ((*load)->sent(), 5);
  EXPECT_FALSE((*load)->exhausted());

  // Failures the run expects do not count.
  target = DeadTargetExpected(&request);
  target.max_errors = 1;
  Recorder expected;
  load = ConcurrencyManager::Create(target, 1, &expected);
  ASSERT_TRUE(load.ok()) << load.status();
  ASSERT_TRUE(WaitFor([&] { return (*load)->sent() > 20; }));
  EXPECT_FALSE((*load)->failing());
  (*load)->Stop();
}

TEST(LoadManagerTest, WarmupIsNotCountedInMaxRequests) {
  const attention::v1::AttendRequest request;
  LoadTarget target = DeadTargetExpected(&request);
  target.warmup = true;
  target.max_requests = 20;
  Recorder recorder;
  auto load = ConcurrencyManager::Create(target, 2, &recorder);
  ASSERT_TRUE(load.ok()) << load.status();
  ASSERT_TRUE(WaitFor([&] { return (*load)->sent() > 20; }));
  EXPECT_FALSE((*load)->exhausted()) << "the warm-up has no budget";
  const int64_t warmup_sent = (*load)->sent();
  (*load)->EndWarmup();  // drops the warm-up's samples
  ASSERT_TRUE(WaitExhausted(**load));
  (*load)->Stop();
  // Exactly max_requests finished after the warm-up: those in flight then (at most
  // the concurrency, 2, already counted in warmup_sent), and the rest.
  EXPECT_EQ(recorder.Take().size(), 20u);
  EXPECT_GE((*load)->sent(), warmup_sent + 20 - 2);
}

TEST(LoadManagerTest, ConcurrencyRefillsFinishedSlotsUpToMaxRequests) {
  const attention::v1::AttendRequest request;
  LoadTarget target = DeadTargetExpected(&request);
  target.max_requests = 50;
  Recorder recorder;
  auto load = ConcurrencyManager::Create(target, 4, &recorder);
  ASSERT_TRUE(load.ok()) << load.status();
  ASSERT_TRUE(WaitExhausted(**load));
  (*load)->Stop();
  EXPECT_EQ((*load)->sent(), 50);
  const std::vector<Sample> samples = recorder.Take();
  ASSERT_EQ(samples.size(), 50u);
  for (const Sample& sample : samples) EXPECT_EQ(sample.code, grpc::StatusCode::UNAVAILABLE);
}

TEST(LoadManagerTest, RequestRateSendsAtTheRateUpToMaxRequests) {
  const attention::v1::AttendRequest request;
  LoadTarget target = DeadTargetExpected(&request);
  target.max_requests = 20;
  Recorder recorder;
  const auto start = steady_clock::now();
  auto load = RequestRateManager::Create(target, 1000, /*poisson=*/false, 0, &recorder);
  ASSERT_TRUE(load.ok()) << load.status();
  ASSERT_TRUE(WaitExhausted(**load));
  // The 20th request starts 20 intervals of 1 ms after the start, never sooner.
  EXPECT_GE(steady_clock::now() - start, std::chrono::milliseconds(19));
  (*load)->Stop();
  EXPECT_EQ((*load)->sent(), 20);
  EXPECT_EQ(recorder.completed(), 20);
}

TEST(LoadManagerTest, RequestRateBacksOffAfterFailures) {
  const attention::v1::AttendRequest request;
  Recorder recorder;
  auto load = RequestRateManager::Create(DeadTarget(&request), 1000, false, 0, &recorder);
  ASSERT_TRUE(load.ok()) << load.status();
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  (*load)->Stop();
  // 1000/s would send 500; the backoff holds it near 10/s once failures pile up.
  EXPECT_LT((*load)->sent(), 40);
}

TEST(LoadManagerTest, StopWakesTheRateSchedulerAtOnce) {
  const attention::v1::AttendRequest request;
  Recorder recorder;
  auto load = RequestRateManager::Create(DeadTarget(&request), 0.1, false, 0, &recorder);
  ASSERT_TRUE(load.ok()) << load.status();
  const auto start = steady_clock::now();
  (*load)->Stop();  // the first request would start in 10 s
  EXPECT_LT(steady_clock::now() - start, std::chrono::seconds(2));
  EXPECT_EQ((*load)->sent(), 0);
}

TEST(LoadManagerTest, ConcurrencyOverStreamsRecordsEveryRequestSent) {
  const attention::v1::AttendRequest request;
  LoadTarget target = DeadTarget(&request);
  target.calls.mode = Mode::kStream;
  target.max_requests = 100;
  Recorder recorder;
  auto load = ConcurrencyManager::Create(target, 4, &recorder);
  ASSERT_TRUE(load.ok()) << load.status();
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  (*load)->Stop();  // returns once every stream has ended
  EXPECT_GE((*load)->sent(), 4);
  EXPECT_EQ(recorder.completed(), (*load)->sent());
}

}  // namespace
}  // namespace mha::client

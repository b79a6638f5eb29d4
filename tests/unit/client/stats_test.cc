#include "client/load/stats.h"

#include <vector>

#include "gtest/gtest.h"

namespace mha::client {
namespace {

Window MakeWindow(const std::vector<int64_t>& latencies_us, int64_t duration_ms, int errors = 0) {
  Window window;
  window.duration_ns = duration_ms * 1000000;
  for (int64_t us : latencies_us) {
    window.samples.push_back(
        {.latency_ns = us * 1000, .queue_us = 10, .compute_us = 30, .batch_rows = 2});
  }
  for (int i = 0; i < errors; ++i) {
    window.samples.push_back({.latency_ns = 5, .code = grpc::StatusCode::UNAVAILABLE});
  }
  return window;
}

TEST(StatsTest, PercentileIsNearestRank) {
  std::vector<int64_t> values;
  for (int64_t i = 1; i <= 100; ++i) values.push_back(i);
  EXPECT_EQ(Percentile(values, 50), 50);
  EXPECT_EQ(Percentile(values, 90), 90);
  EXPECT_EQ(Percentile(values, 99), 99);
  EXPECT_EQ(Percentile(values, 100), 100);
  EXPECT_EQ(Percentile(values, 0), 1);
  EXPECT_EQ(Percentile(std::vector<int64_t>{7}, 99), 7);
  EXPECT_EQ(Percentile(std::vector<int64_t>{}, 50), 0);
  // 10 values: p95 is the 10th (ceil(9.5)), p50 the 5th.
  const std::vector<int64_t> ten = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
  EXPECT_EQ(Percentile(ten, 95), 10);
  EXPECT_EQ(Percentile(ten, 50), 5);
}

TEST(StatsTest, SummarizeCountsOkAndErrorsApart) {
  const std::vector<Window> windows = {MakeWindow({100, 200, 300, 400}, 1000, 2),
                                       MakeWindow({500, 600, 700, 800, 900, 1000}, 1000)};
  const StepStats stats = Summarize(windows, 8);
  EXPECT_EQ(stats.requests, 12);
  EXPECT_EQ(stats.ok, 10);
  EXPECT_DOUBLE_EQ(stats.duration_s, 2.0);
  EXPECT_DOUBLE_EQ(stats.requests_per_s, 5.0);
  EXPECT_DOUBLE_EQ(stats.tokens_per_s, 40.0);
  EXPECT_EQ(stats.errors.at("UNAVAILABLE"), 2);
  EXPECT_DOUBLE_EQ(stats.latency.mean_us, 550);
  EXPECT_DOUBLE_EQ(stats.latency.p50_us, 500);
  EXPECT_DOUBLE_EQ(stats.latency.p90_us, 900);
  EXPECT_DOUBLE_EQ(stats.latency.max_us, 1000);
  EXPECT_DOUBLE_EQ(stats.server_batch_rows, 2);
  EXPECT_DOUBLE_EQ(stats.server_queue_us, 10);
  EXPECT_DOUBLE_EQ(stats.server_compute_us, 30);
}

TEST(StatsTest, StableWhenTheLastWindowsAgree) {
  std::vector<Window> windows = {MakeWindow({1000}, 1000), MakeWindow({100, 100}, 1000),
                                 MakeWindow({100, 100}, 1000)};
  EXPECT_FALSE(IsStable(windows, 3, 0.1));  // the first differs
  EXPECT_TRUE(IsStable(windows, 2, 0.1));
  windows.push_back(MakeWindow({105, 100}, 1000));
  EXPECT_TRUE(IsStable(windows, 3, 0.1));
  windows.push_back(MakeWindow({100, 100, 100}, 1000));  // throughput 3 vs 2
  EXPECT_FALSE(IsStable(windows, 3, 0.1));
  EXPECT_FALSE(IsStable({MakeWindow({}, 1000), MakeWindow({}, 1000)}, 2, 0.1))
      << "empty windows are never stable";
  EXPECT_FALSE(IsStable(windows, 10, 0.1)) << "too few windows";
  EXPECT_EQ(LastWindows(windows, 2).size(), 2u);
  EXPECT_EQ(LastWindows(windows, 20).size(), windows.size());
}

}  // namespace
}  // namespace mha::client

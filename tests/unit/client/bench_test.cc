#include "client/load/bench.h"

#include "client/sdk/status.h"
#include "gtest/gtest.h"

namespace mha::client {
namespace {

std::vector<double> Sweep(absl::string_view text) {
  auto values = ParseSweep(text, "concurrency");
  EXPECT_TRUE(values.ok()) << values.status();
  return values.ok() ? *values : std::vector<double>{};
}

TEST(BenchTest, ParsesSweeps) {
  EXPECT_EQ(Sweep("8"), (std::vector<double>{8}));
  EXPECT_EQ(Sweep("1:4"), (std::vector<double>{1, 2, 3, 4}));
  EXPECT_EQ(Sweep("1:64:x2"), (std::vector<double>{1, 2, 4, 8, 16, 32, 64}));
  EXPECT_EQ(Sweep("1:50:x2"), (std::vector<double>{1, 2, 4, 8, 16, 32}));
  EXPECT_EQ(Sweep("10:40:10"), (std::vector<double>{10, 20, 30, 40}));
  EXPECT_EQ(Sweep("0.5:2:x2"), (std::vector<double>{0.5, 1, 2}));
}

TEST(BenchTest, RejectsBadSweepsNamingTheFlag) {
  for (const char* bad :
       {"", "0", "-1", "4:1", "1:4:x1", "1:4:0", "1:4:x", "a", "1:2:3:4", "1:100000:0.01"}) {
    auto values = ParseSweep(bad, "request_rate");
    ASSERT_FALSE(values.ok()) << bad;
    EXPECT_TRUE(IsUsageError(values.status()));
    EXPECT_NE(values.status().message().find("--request_rate"), absl::string_view::npos);
  }
}

TEST(BenchTest, OptionsAreCheckedAsUsageErrorsNamingTheFlag) {
  EXPECT_TRUE(CheckBenchOptions(BenchOptions(), Protocol::kAttention).ok());
  auto message = [](const BenchOptions& options, Protocol protocol = Protocol::kAttention) {
    const absl::Status status = CheckBenchOptions(options, protocol);
    EXPECT_TRUE(IsUsageError(status)) << status;
    return std::string(status.message());
  };
  BenchOptions options;
  options.warmup = absl::Seconds(2);
  options.duration = absl::Seconds(2);
  EXPECT_EQ(message(options), "--duration: must be longer than --warmup (2s) to measure, got 2s");
  options = BenchOptions();
  options.max_errors = -1;
  EXPECT_EQ(message(options), "--max_errors: must be >= 0, got -1");
  options = BenchOptions();
  options.window = absl::ZeroDuration();
  EXPECT_EQ(message(options), "--window: must be > 0, got 0");
  options = BenchOptions();
  options.request_rates = {10};
  options.rate_streams = 0;
  EXPECT_EQ(message(options, Protocol::kHttp), "--streams: must be >= 1, got 0");
  options = BenchOptions();
  options.mode = Mode::kStream;
  EXPECT_EQ(message(options, Protocol::kHttp),
            "--mode=stream: HTTP has no streams; use --protocol=kserve (ModelStreamInfer)");
}

}  // namespace
}  // namespace mha::client

#include "client/load/report.h"

#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "client/sdk/status.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace mha::client {
namespace {

StepReport ConcurrencyStep() {
  StepReport step;
  step.rpc = Rpc::kAttend;
  step.concurrency = 4;
  return step;
}

StepStats Stats(double requests_per_s, double p50_us, double p99_us) {
  StepStats stats;
  stats.requests_per_s = requests_per_s;
  stats.latency.p50_us = p50_us;
  stats.latency.p99_us = p99_us;
  return stats;
}

// `step` as the runner leaves it once its load has stopped.
void End(const std::string& reason, int windows, const StepStats& stats, StepReport& step) {
  step.stable = reason == "stable";
  step.end_reason = reason;
  step.windows = windows;
  step.stats = stats;
}

TEST(BenchProgressTest, PrintsALinePerWindowAndPerStep) {
  std::ostringstream out;
  BenchProgress progress(out, /*interactive=*/false);
  StepReport step = ConcurrencyStep();
  StepStats window = Stats(812.44, 4812, 6020);
  window.errors = {{"UNAVAILABLE", 2}, {"DEADLINE_EXCEEDED", 1}};
  progress.WindowDone(step, 2, window);
  End("stable", 3, Stats(809.9, 4822, 6100), step);
  progress.StepDone(step);
  EXPECT_EQ(out.str(),
            "[attend concurrency 4] window 2: 812.4 req/s, p50 4.812 ms, p99 6.020 ms, errors 3\n"
            "[attend concurrency 4] stable after 3 window(s): 809.9 req/s, p50 4.822 ms, "
            "p99 6.100 ms, errors 0\n");
}

TEST(BenchProgressTest, NamesWhyAStepIsNotStable) {
  std::ostringstream out;
  BenchProgress progress(out, /*interactive=*/false);
  StepReport step;
  step.rpc = Rpc::kHealth;
  step.request_rate = 2.5;
  End("max_windows", 10, Stats(2.5, 150, 900), step);
  progress.StepDone(step);
  EXPECT_EQ(out.str(),
            "[health rate 2.5/s] NOT stable (max_windows) after 10 window(s): 2.5 req/s, "
            "p50 0.150 ms, p99 0.900 ms, errors 0\n");
}

TEST(BenchProgressTest, InteractiveWindowLinesRewriteOneLine) {
  std::ostringstream out;
  BenchProgress progress(out, /*interactive=*/true);
  StepReport step = ConcurrencyStep();
  progress.WindowDone(step, 1, Stats(100, 1000, 2000));
  progress.WindowDone(step, 2, Stats(200, 1000, 2000));
  End("duration", 2, StepStats(), step);
  progress.StepDone(step);
  // A step whose load never started (no end reason) wrote no line to clear.
  StepReport failed = ConcurrencyStep();
  failed.stats.errors["INVALID_ARGUMENT"] = 1;
  failed.all_errors = failed.stats.errors;  // as RunStep leaves it
  progress.StepDone(failed);
  EXPECT_EQ(out.str(),
            "\r\033[K[attend concurrency 4] window 1: 100.0 req/s, p50 1.000 ms, p99 2.000 ms, "
            "errors 0"
            "\r\033[K[attend concurrency 4] window 2: 200.0 req/s, p50 1.000 ms, p99 2.000 ms, "
            "errors 0"
            "\r\033[K[attend concurrency 4] NOT stable (duration) after 2 window(s): 0.0 req/s, "
            "p50 0.000 ms, p99 0.000 ms, errors 0\n"
            "[attend concurrency 4] NOT stable () after 0 window(s): 0.0 req/s, p50 0.000 ms, "
            "p99 0.000 ms, errors 1\n");
}

StepReport Step(Rpc rpc, int concurrency, double p50_us) {
  StepReport step;
  step.rpc = rpc;
  step.concurrency = concurrency;
  step.stats = Stats(1000, p50_us, 2 * p50_us);
  return step;
}

TEST(ReportTest, PairsEachHealthStepWithTheAttendStepAtItsLoad) {
  BenchReport report;
  report.options.rpc = Rpc::kHealth;
  // Concurrency 1: a pair. Health at 2 then Attend at 4: not the same load, no ratio.
  report.steps = {Step(Rpc::kHealth, 1, 100), Step(Rpc::kAttend, 1, 300),
                  Step(Rpc::kHealth, 2, 100), Step(Rpc::kAttend, 4, 500)};
  std::ostringstream table;
  PrintTable(report, table);
  EXPECT_NE(table.str().find("concurrency 1: Attend / Health p50 latency 3.00x, p99 3.00x; "
                             "Attend throughput 1.00x of Health's\n"),
            std::string::npos)
      << table.str();
  EXPECT_EQ(table.str().find("concurrency 4: Attend / Health"), std::string::npos);

  const nlohmann::json json = nlohmann::json::parse(ToJson(report));
  ASSERT_EQ(json["steps"].size(), 4u);
  ASSERT_EQ(json["health_ratios"].size(), 1u);
  EXPECT_EQ(json["health_ratios"][0]["concurrency"], 1);
  EXPECT_DOUBLE_EQ(json["health_ratios"][0]["attend_over_health_p50"].get<double>(), 3.0);
  EXPECT_EQ(json["steps"][3]["rpc"], "attend");
  EXPECT_DOUBLE_EQ(json["steps"][3]["latency_us"]["p50"].get<double>(), 500);
}

// A report of one step at concurrency 4 that measured `requests` and failed with
// `errors` over the whole step.
BenchReport OneStep(int64_t requests, const std::map<std::string, int64_t>& errors,
                    const std::string& end_reason = "duration") {
  BenchReport report;
  StepReport step = ConcurrencyStep();
  StepStats stats = Stats(100, 1000, 2000);
  stats.requests = requests;
  End(end_reason, 3, stats, step);
  step.all_errors = errors;
  report.steps.push_back(step);
  return report;
}

TEST(CheckBenchReportTest, ErrorsFailTheRunUnlessTheRunExpectsThem) {
  EXPECT_TRUE(CheckBenchReport(OneStep(300, {})).ok());

  BenchReport failed = OneStep(300, {{"RESOURCE_EXHAUSTED", 7}, {"UNAVAILABLE", 12}});
  absl::Status status = CheckBenchReport(failed);
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable);  // the most frequent
  EXPECT_FALSE(IsUsageError(status));
  EXPECT_EQ(status.message(),
            "bench: attend concurrency 4: 19 failed request(s) (RESOURCE_EXHAUSTED=7;"
            "UNAVAILABLE=12) not allowed by --allow_errors");

  failed.options.allowed_errors = {grpc::StatusCode::RESOURCE_EXHAUSTED};
  EXPECT_EQ(CheckBenchReport(failed).message(),
            "bench: attend concurrency 4: 12 failed request(s) (UNAVAILABLE=12) not allowed by "
            "--allow_errors");
  failed.options.allowed_errors.insert(grpc::StatusCode::UNAVAILABLE);
  EXPECT_TRUE(CheckBenchReport(failed).ok());

  const BenchReport ended = OneStep(3, {{"UNAVAILABLE", 10}}, "max_errors");
  EXPECT_EQ(CheckBenchReport(ended).message(),
            "bench: attend concurrency 4: 10 failed request(s) (UNAVAILABLE=10) not allowed by "
            "--allow_errors; --max_errors=10 ended the step and the run");
}

TEST(CheckBenchReportTest, AStepThatMeasuredNothingFailsTheRun) {
  const absl::Status status = CheckBenchReport(OneStep(0, {}, "max_windows"));
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(status.message(),
            "bench: attend concurrency 4: measured nothing: no request finished in its last 3 "
            "window(s) of 2s (a longer --window, or is the server answering?)");
}

// The table's errors column, its last line and CheckBenchReport's line count the
// same failures: every one of the step (warm-up and drain too), not only the last
// windows' (a server that died mid-run fails requests in all of them).
TEST(ReportTest, TheTableAndTheErrorLineGiveOneErrorCount) {
  BenchReport report = OneStep(300, {{"UNAVAILABLE", 5}});
  report.protocol = Protocol::kKServe;
  report.attend_requests = 301;
  ASSERT_TRUE(report.steps[0].stats.errors.empty());  // none in the windows measured
  std::ostringstream table;
  PrintTable(report, table);
  EXPECT_NE(table.str().find(" UNAVAILABLE=5 "), std::string::npos) << table.str();
  EXPECT_NE(table.str().find("requests sent: 301 ModelInfer; failed: 5\n"), std::string::npos)
      << table.str();
  EXPECT_NE(std::string(CheckBenchReport(report).message())
                .find("5 failed request(s) (UNAVAILABLE=5) not allowed"),
            std::string::npos);
  const std::vector<std::string> csv = {ToCsv(report)};
  EXPECT_NE(csv[0].find(",5,UNAVAILABLE=5,"), std::string::npos) << csv[0];
}

}  // namespace
}  // namespace mha::client

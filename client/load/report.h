// Reporting for the load tools, `bench` and `decode`: a table for people, JSON (and
// CSV for bench) for scripts, built from the same columns and objects. The same
// numbers in each; latencies in the tables in milliseconds, in files in microseconds.
#ifndef MHA_CLIENT_LOAD_REPORT_H_
#define MHA_CLIENT_LOAD_REPORT_H_

#include <optional>
#include <ostream>
#include <string>

#include "absl/status/status.h"
#include "client/load/bench.h"
#include "client/load/decode.h"
#include "nlohmann/json_fwd.hpp"

namespace mha::client {

// Progress of a bench run, for people watching it (stderr): a line per measurement
// window and one per step.
//
//   [attend concurrency 4] window 2: 812.4 req/s, p50 4.812 ms, p99 6.020 ms, errors 0
//   [attend concurrency 4] stable after 3 window(s): 809.9 req/s, p50 4.822 ms, ...
//   [health rate 100/s] NOT stable (max_windows) after 10 window(s): ...
//
// When `interactive` (a terminal), window lines rewrite one line in place and the
// step's line replaces it. Not thread-safe.
class BenchProgress {
 public:
  BenchProgress(std::ostream& out, bool interactive) : out_(out), interactive_(interactive) {}
  // `window` counts from 1; `stats` are that window's alone.
  void WindowDone(const StepReport& step, int window, const StepStats& stats);
  void StepDone(const StepReport& step);

 private:
  std::ostream& out_;
  const bool interactive_;
};

// One row per step and RPC; with --rpc=health also the Attend/Health ratios.
void PrintTable(const BenchReport& report, std::ostream& out);

std::string ToJson(const BenchReport& report);
std::string ToCsv(const BenchReport& report);

// OK when every step measured something and no request failed with a code outside
// report.options.allowed_errors; else why not, on one line, naming the step:
//   UNAVAILABLE: bench: attend concurrency 4: 12 failed requests (UNAVAILABLE=12) not
//   allowed by --allow_errors; --max_errors=10 ended the step and the run
// with the most frequent of those codes (FAILED_PRECONDITION when a step measured
// nothing).
absl::Status CheckBenchReport(const BenchReport& report);

// "p_o 100, h 5, f32"; models described by Open Inference Protocol metadata may
// lack h ("?") and precision (left out).
std::string ModelSizes(const attention::v1::ModelInfo& model);

// The "model" object of the JSON reports (bench, decode): name and sizes.
nlohmann::json ModelJson(const attention::v1::ModelInfo& model);

// decode: the header line, one row for the prefill and one per context bucket
// (count, p50/p90/p99/max ms, the server's mean queue and compute), then decode
// tokens/s.
void PrintDecodeTable(const DecodeReport& report, std::ostream& out);

// decode --check: two runs of the same tokens, one over sessions and one stateless
// (in either order), compared.
struct DecodeCheck {
  double session_sum = 0, stateless_sum = 0;  // DecodeReport::output_sum of each
  double difference = 0;                      // |session_sum - stateless_sum|
  double relative_tolerance = 0;
  double tolerance = 0;  // relative_tolerance x the session run's output_abs_sum
  bool match = false;    // difference <= tolerance
  // The session run's decode tokens/s over the stateless run's.
  double speedup = 0;
};
DecodeCheck CompareDecodeRuns(const DecodeReport& first, const DecodeReport& second,
                              double relative_tolerance);
// "check: output sums 1.234 (AttendSession) and 1.234 (Attend): match, |difference|
// 2e-07 <= tolerance 3e-04 (1e-05 x the sum of |output|, 30.1); AttendSession decode
// tokens/s 3.52x stateless Attend's"
std::string DecodeCheckLine(const DecodeCheck& check);

// decode: the same numbers for scripts (latencies in microseconds), as bench's --json;
// with `check`, a "check" object.
std::string DecodeJson(const DecodeReport& report,
                       const std::optional<DecodeCheck>& check = std::nullopt);

// Writes `text` to `path`; INVALID_ARGUMENT naming the path on failure.
absl::Status WriteText(const std::string& path, const std::string& text);

}  // namespace mha::client

#endif  // MHA_CLIENT_LOAD_REPORT_H_

// Measurement for `bench`: samples grouped into windows, latency percentiles, and
// perf_analyzer's stability rule (the last windows agree within a tolerance).
//
//   std::vector<Window> windows = ...;             // each: samples + its length
//   if (IsStable(windows, 3, 0.10)) ...            // last 3 within +-10% of their mean
//   StepStats stats = Summarize(LastWindows(windows, 3), tokens_per_request);
//   stats.latency.p99_us, stats.requests_per_s, stats.errors["UNAVAILABLE"]
#ifndef MHA_CLIENT_LOAD_STATS_H_
#define MHA_CLIENT_LOAD_STATS_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/types/span.h"
#include "client/load/calls.h"

namespace mha::client {

struct Window {
  std::vector<Sample> samples;  // requests that finished in the window
  int64_t duration_ns = 0;
};

struct LatencyStats {  // successful requests only, microseconds
  int64_t count = 0;
  double mean_us = 0, p50_us = 0, p90_us = 0, p95_us = 0, p99_us = 0, max_us = 0;
};

struct StepStats {
  double duration_s = 0;
  int64_t requests = 0;       // finished in the windows, any status
  int64_t ok = 0;             // of which successful
  double requests_per_s = 0;  // successful responses per second
  double tokens_per_s = 0;    // requests_per_s * tokens per request (B * Q)
  LatencyStats latency;
  std::map<std::string, int64_t> errors;  // code name -> count
  // Means over successful Attend responses (AttendResponse.timing); 0 for health.
  double server_batch_rows = 0, server_queue_us = 0, server_compute_us = 0;
};

// Nearest-rank percentile (q in [0, 100]) of an ascending vector; 0 when empty.
double Percentile(absl::Span<const int64_t> sorted, double q);

StepStats Summarize(absl::Span<const Window> windows, int64_t tokens_per_request);

// The last `count` windows (all of them when there are fewer).
absl::Span<const Window> LastWindows(absl::Span<const Window> windows, int count);

// True when there are at least `count` windows and, over the last `count`, both
// the successful-request throughput and the mean latency of each window lie within
// +-tolerance of their average (Triton perf_analyzer's rule), with no empty window.
bool IsStable(absl::Span<const Window> windows, int count, double tolerance);

}  // namespace mha::client

#endif  // MHA_CLIENT_LOAD_STATS_H_

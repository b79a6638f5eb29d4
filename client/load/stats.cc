#include "client/load/stats.h"

#include <algorithm>
#include <cmath>

#include "client/sdk/status.h"

namespace mha::client {

double Percentile(absl::Span<const int64_t> sorted, double q) {
  if (sorted.empty()) return 0;
  // Nearest rank: the smallest value with at least q% of the samples at or below it.
  const double rank = std::ceil(q / 100.0 * static_cast<double>(sorted.size()));
  const size_t index =
      static_cast<size_t>(std::clamp(rank, 1.0, static_cast<double>(sorted.size()))) - 1;
  return static_cast<double>(sorted[index]);
}

StepStats Summarize(absl::Span<const Window> windows, int64_t tokens_per_request) {
  StepStats stats;
  std::vector<int64_t> latencies_ns;
  int64_t duration_ns = 0;
  double batch_rows = 0, queue_us = 0, compute_us = 0;
  for (const Window& window : windows) {
    duration_ns += window.duration_ns;
    for (const Sample& sample : window.samples) {
      ++stats.requests;
      if (sample.code != grpc::StatusCode::OK) {
        ++stats.errors[CodeName(sample.code)];
        continue;
      }
      latencies_ns.push_back(sample.latency_ns);
      batch_rows += static_cast<double>(sample.batch_rows);
      queue_us += static_cast<double>(sample.queue_us);
      compute_us += static_cast<double>(sample.compute_us);
    }
  }
  stats.ok = static_cast<int64_t>(latencies_ns.size());
  stats.duration_s = static_cast<double>(duration_ns) * 1e-9;
  if (stats.duration_s > 0) {
    stats.requests_per_s = static_cast<double>(stats.ok) / stats.duration_s;
    stats.tokens_per_s = stats.requests_per_s * static_cast<double>(tokens_per_request);
  }
  if (stats.ok == 0) return stats;
  const double ok = static_cast<double>(stats.ok);
  stats.server_batch_rows = batch_rows / ok;
  stats.server_queue_us = queue_us / ok;
  stats.server_compute_us = compute_us / ok;
  std::sort(latencies_ns.begin(), latencies_ns.end());
  double sum = 0;
  for (int64_t ns : latencies_ns) sum += static_cast<double>(ns);
  LatencyStats& l = stats.latency;
  l.count = stats.ok;
  l.mean_us = sum / ok * 1e-3;
  l.p50_us = Percentile(latencies_ns, 50) * 1e-3;
  l.p90_us = Percentile(latencies_ns, 90) * 1e-3;
  l.p95_us = Percentile(latencies_ns, 95) * 1e-3;
  l.p99_us = Percentile(latencies_ns, 99) * 1e-3;
  l.max_us = static_cast<double>(latencies_ns.back()) * 1e-3;
  return stats;
}

absl::Span<const Window> LastWindows(absl::Span<const Window> windows, int count) {
  const size_t n = std::min(windows.size(), static_cast<size_t>(std::max(count, 0)));
  return windows.subspan(windows.size() - n);
}

bool IsStable(absl::Span<const Window> windows, int count, double tolerance) {
  if (count < 1 || windows.size() < static_cast<size_t>(count)) return false;
  std::vector<double> throughput, latency;
  for (const Window& window : LastWindows(windows, count)) {
    const StepStats stats = Summarize(absl::MakeConstSpan(&window, 1), 0);
    if (stats.ok == 0) return false;
    throughput.push_back(stats.requests_per_s);
    latency.push_back(stats.latency.mean_us);
  }
  for (const std::vector<double>* values : {&throughput, &latency}) {
    double mean = 0;
    for (double v : *values) mean += v;
    mean /= static_cast<double>(values->size());
    for (double v : *values) {
      if (std::abs(v - mean) > tolerance * mean) return false;
    }
  }
  return true;
}

}  // namespace mha::client

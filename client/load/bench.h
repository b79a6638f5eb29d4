// `bench`: a load test shaped like Triton's perf_analyzer. For each step of a sweep
// (fixed concurrency, or fixed request rate) it warms up, then measures windows until
// the last `stable_windows` agree within `stability` (or a bound is hit), and
// summarises those windows: throughput, latency percentiles, errors by code and the
// server's own timing (batch rows, queue and compute time).
//
//   BenchOptions options;
//   options.concurrency = ParseIntSweep("1:64:x2").value();  // 1, 2, 4, ..., 64
//   auto connection = Connection::Open(channel_options).value();
//   BenchReport report =
//       RunBench(options, *connection, {connection->channel()}, request, ...).value();
//   PrintTable(report, std::cout);                           // report.h
//
// Every step is bounded by `duration` (warm-up included), `max_requests` (measured
// requests: the warm-up's do not count) and `max_errors` (failures with codes not in
// `allowed_errors`; such a step ends the run). Failures back off (load_manager.h). A run
// succeeds when every step measured something and failed only with allowed codes
// (CheckBenchReport, report.h). The protocol is the connection's: the request is
// translated once (client/sdk/kserve.h) and the same load runs over attention.v1, the
// Open Inference Protocol or HTTP.
#ifndef MHA_CLIENT_LOAD_BENCH_H_
#define MHA_CLIENT_LOAD_BENCH_H_

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <map>
#include <memory>
#include <ostream>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/load/calls.h"
#include "client/load/stats.h"
#include "client/sdk/connection.h"
#include "proto/attention.pb.h"

namespace mha::client {

struct BenchOptions {
  // kHealth measures grpc.health.v1.Health/Check and then Attend at every step,
  // so the table shows the floor any RPC pays beside Attend, as a ratio.
  Rpc rpc = Rpc::kAttend;
  Mode mode = Mode::kUnary;
  std::vector<int> concurrency = {1};  // closed-loop steps, unless request_rates is set
  std::vector<double> request_rates;   // open-loop steps (requests/s)
  bool poisson = false;                // request_rates: exponential intervals
  int rate_streams = 4;                // request_rates with Mode::kStream
  int channels = 1;                    // separate connections per server
  absl::Duration warmup = absl::Seconds(1);
  absl::Duration window = absl::Seconds(2);
  int stable_windows = 3;
  double stability = 0.10;
  int max_windows = 10;
  absl::Duration duration = absl::Seconds(60);  // per step, warm-up included
  int64_t max_requests = 0;  // measured requests per step (after the warm-up); 0 = no limit
  // Codes the run expects (refusals); any other failure fails the run.
  std::set<grpc::StatusCode> allowed_errors;
  int64_t max_errors = 10;                     // per step, of other codes; 0 = no limit
  absl::Duration timeout = absl::Seconds(10);  // per unary call
  uint64_t seed = 0;                           // Poisson intervals
  // --shared_memory=system (kserve, unary, closed loop): inputs and outputs in a
  // registered region per concurrency slot (client/sdk/shared_memory.h).
  bool shared_memory = false;
};

struct StepReport {
  Rpc rpc = Rpc::kAttend;
  int concurrency = 0;      // closed loop, else 0
  double request_rate = 0;  // open loop, else 0
  int windows = 0;          // measured
  bool stable = false;
  // Why the step ended: "stable", "max_windows", "duration", "max_requests" or
  // "max_errors".
  std::string end_reason;
  int64_t sent = 0;      // requests sent in the step: warm-up, windows and drain
  int64_t measured = 0;  // requests that finished in the windows, all of them
  StepStats stats;       // over the last stable_windows windows
  // Every failed request of the step (warm-up, windows and drain), by code name.
  std::map<std::string, int64_t> all_errors;
};

struct BenchReport {
  BenchOptions options;
  Protocol protocol = Protocol::kAttention;
  std::string target;  // as given
  attention::v1::ModelInfo model;
  int64_t batch = 0, num_queries = 0, num_keys = 0, tokens_per_request = 0;
  std::vector<StepReport> steps;  // a step that ended on max_errors is the last
  // Every request sent, the pre-flight calls included: what the server's request
  // counters (mha_requests_total) see from this run.
  int64_t attend_requests = 0, health_requests = 0;
};

// "8" -> {8}; "1:4" -> {1, 2, 3, 4}; "1:64:x2" -> {1, 2, 4, ..., 64}; "10:40:10" ->
// {10, 20, 30, 40}. INVALID_ARGUMENT naming `flag` on bad syntax or an empty range.
absl::StatusOr<std::vector<double>> ParseSweep(absl::string_view text, absl::string_view flag);

// A usage error (client/sdk/status.h) naming the flag when `options` cannot run over `protocol`.
absl::Status CheckBenchOptions(const BenchOptions& options, Protocol protocol);

// Runs every step in `connection`'s protocol: over gRPC the load is spread over
// `channels` (the connection's channel first), over HTTP it opens connections of
// its own to connection.http(). `progress` gets one line per window (or a line
// rewritten in place when `interactive`). Fails only when the pre-flight call
// (on `connection`) fails, with its status, or the options are invalid; errors
// under load are reported (CheckBenchReport judges them).
absl::StatusOr<BenchReport> RunBench(const BenchOptions& options, Connection& connection,
                                     const std::vector<std::shared_ptr<grpc::Channel>>& channels,
                                     const attention::v1::AttendRequest& request,
                                     std::ostream& progress, bool interactive);

}  // namespace mha::client

#endif  // MHA_CLIENT_LOAD_BENCH_H_

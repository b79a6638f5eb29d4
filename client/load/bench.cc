#include "client/load/bench.h"

#include <algorithm>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/load/load_manager.h"
#include "client/load/report.h"
#include "client/sdk/channel.h"
#include "client/sdk/kserve.h"
#include "client/sdk/request.h"
#include "client/sdk/shared_memory.h"
#include "client/sdk/status.h"

namespace mha::client {
namespace {

using attention::v1::AttendRequest;

// Closed loop when `concurrency` > 0, else open loop at `rate`.
absl::StatusOr<std::unique_ptr<LoadManager>> StartLoad(const BenchOptions& options,
                                                       const LoadTarget& target, int concurrency,
                                                       double rate, uint64_t seed,
                                                       Recorder* recorder) {
  if (concurrency > 0) return ConcurrencyManager::Create(target, concurrency, recorder);
  return RequestRateManager::Create(target, rate, options.poisson, seed, recorder);
}

// True once the load sends no more: max_requests sent, or max_errors failed.
bool SendsNoMore(const LoadManager& load) { return load.exhausted() || load.failing(); }

// Sleeps until `until`, returning early once the load sends no more.
void WaitUntil(absl::Time until, const LoadManager& load) {
  const absl::Duration tick = absl::Milliseconds(50);
  for (absl::Time now = absl::Now(); now < until && !SendsNoMore(load); now = absl::Now()) {
    absl::SleepFor(std::min(tick, until - now));
  }
}

// Measures windows until the last stable_windows agree (then `step` is stable),
// `end` passes, max_windows are measured, or the load sends no more.
std::vector<Window> MeasureWindows(const BenchOptions& options, absl::Time end, LoadManager& load,
                                   Recorder& recorder, StepReport& step, BenchProgress& progress) {
  std::vector<Window> windows;
  bool stopped = false;
  while (!stopped && absl::Now() < end && static_cast<int>(windows.size()) < options.max_windows) {
    const int64_t window_start = SteadyNowNs();
    WaitUntil(std::min(absl::Now() + options.window, end), load);
    if (SendsNoMore(load)) {  // the last requests finish inside this window
      load.Stop();
      stopped = true;
    }
    Window window;
    window.samples = recorder.Take();
    window.duration_ns = SteadyNowNs() - window_start;
    windows.push_back(std::move(window));
    progress.WindowDone(step, static_cast<int>(windows.size()),
                        Summarize(LastWindows(windows, 1), 0));
    if (IsStable(windows, options.stable_windows, options.stability)) {
      step.stable = true;
      break;
    }
  }
  return windows;
}

// One step: warm-up, then windows until stable or a bound, summarised over the
// last stable_windows windows.
StepReport RunStep(const BenchOptions& options, const LoadTarget& target, int concurrency,
                   double rate, uint64_t seed, BenchProgress& progress) {
  StepReport step;
  step.rpc = target.calls.rpc;
  step.concurrency = concurrency;
  step.request_rate = rate;
  Recorder recorder;
  const absl::Time start = absl::Now();
  const absl::Time end = start + options.duration;
  auto started = StartLoad(options, target, concurrency, rate, seed, &recorder);
  if (!started.ok()) {  // options were checked before; keep the failure visible anyway
    step.stats.errors[std::string(absl::StatusCodeToString(started.status().code()))] = 1;
    step.all_errors = step.stats.errors;
    return step;
  }
  std::unique_ptr<LoadManager> load = *std::move(started);
  if (target.warmup) {
    WaitUntil(std::min(start + options.warmup, end), *load);
    load->EndWarmup();  // warm-up: sent and counted, not measured
  }
  const std::vector<Window> windows = MeasureWindows(options, end, *load, recorder, step, progress);
  step.end_reason = step.stable          ? "stable"
                    : load->failing()    ? "max_errors"
                    : load->exhausted()  ? "max_requests"
                    : absl::Now() >= end ? "duration"
                                         : "max_windows";
  load->Stop();
  step.sent = load->sent();
  step.all_errors = recorder.errors();
  step.windows = static_cast<int>(windows.size());
  for (const Window& window : windows) step.measured += static_cast<int64_t>(window.samples.size());
  step.stats = Summarize(LastWindows(windows, options.stable_windows), 0);
  return step;
}

// Pre-flight calls, one per RPC measured, so that a wrong model or shape fails
// fast with the server's message instead of a table full of errors; counted in
// `report` like the load's.
absl::Status Preflight(const std::vector<Rpc>& rpcs, Connection& connection,
                       const AttendRequest& request, BenchReport& report) {
  for (Rpc rpc : rpcs) {
    const absl::Status status =
        rpc == Rpc::kHealth ? connection.Ready() : connection.Attend(request).status();
    (rpc == Rpc::kHealth ? report.health_requests : report.attend_requests) += 1;
    if (!status.ok()) {
      return absl::Status(status.code(), absl::StrCat("pre-flight ", status.message()));
    }
  }
  return absl::OkStatus();
}

// What every call of a run sends, in each protocol's form.
struct Payloads {
  const AttendRequest* attend = nullptr;
  inference::ModelInferRequest infer;
  HttpRequest http;
  // --shared_memory=system: a region and a request naming it per concurrency slot.
  std::vector<std::unique_ptr<SharedMemorySlot>> slots;
  std::vector<inference::ModelInferRequest> slot_requests;
};

// (concurrency, 0) per closed-loop step, or (0, rate) per open-loop step.
std::vector<std::pair<int, double>> StepLoads(const BenchOptions& options) {
  std::vector<std::pair<int, double>> loads;
  if (!options.request_rates.empty()) {
    for (double rate : options.request_rates) loads.emplace_back(0, rate);
  } else {
    for (int c : options.concurrency) loads.emplace_back(c, 0.0);
  }
  return loads;
}

LoadTarget StepTarget(Rpc rpc, const BenchOptions& options, const Connection& connection,
                      const std::vector<std::shared_ptr<grpc::Channel>>& channels,
                      const Payloads& payloads) {
  LoadTarget target;
  target.calls.channels = channels;
  target.calls.protocol = connection.protocol();
  target.calls.http = connection.http();
  target.calls.request = payloads.attend;
  target.calls.infer_request = &payloads.infer;
  if (!payloads.slot_requests.empty()) target.calls.slot_infer_requests = &payloads.slot_requests;
  target.calls.http_request = &payloads.http;
  target.calls.rpc = rpc;
  target.calls.mode = rpc == Rpc::kHealth ? Mode::kUnary : options.mode;
  target.calls.timeout = options.timeout;
  target.calls.stream_deadline = options.duration + options.timeout;
  target.warmup = options.warmup > absl::ZeroDuration();
  target.max_requests = options.max_requests;
  target.allowed_errors = options.allowed_errors;
  target.max_errors = options.max_errors;
  target.rate_streams = options.rate_streams;
  return target;
}

}  // namespace

absl::StatusOr<std::vector<double>> ParseSweep(absl::string_view text, absl::string_view flag) {
  auto bad = [&](absl::string_view why) {
    return UsageError(
        absl::StrCat("--", flag, ": ", why, " in \"", text,
                     "\"; expected N, START:END, START:END:STEP or START:END:xFACTOR"));
  };
  const std::vector<std::string> parts = absl::StrSplit(text, ':');
  if (parts.empty() || parts.size() > 3) return bad("wrong number of fields");
  double start = 0, end = 0, step = 1;
  bool multiply = false;
  if (!absl::SimpleAtod(parts[0], &start) || !(start > 0)) return bad("bad start");
  end = start;
  if (parts.size() >= 2 && (!absl::SimpleAtod(parts[1], &end) || end < start)) {
    return bad("bad end (must be >= start)");
  }
  if (parts.size() == 3) {
    absl::string_view step_text = parts[2];
    multiply = absl::ConsumePrefix(&step_text, "x");
    if (!absl::SimpleAtod(step_text, &step) || (multiply ? !(step > 1) : !(step > 0))) {
      return bad("bad step (x factor > 1, or increment > 0)");
    }
  }
  std::vector<double> values;
  for (double v = start; v <= end * (1 + 1e-9); v = multiply ? v * step : v + step) {
    values.push_back(v);
    if (values.size() > 1000) return bad("more than 1000 steps");
  }
  return values;
}

absl::Status CheckBenchOptions(const BenchOptions& options, Protocol protocol) {
  if (options.shared_memory) {
    if (protocol != Protocol::kKServe) {
      return UsageError(
          "--shared_memory=system: registers regions over gRPC; use --protocol=kserve");
    }
    if (options.mode != Mode::kUnary || !options.request_rates.empty() ||
        options.rpc != Rpc::kAttend) {
      return UsageError(
          "--shared_memory=system: a region per concurrency slot needs unary calls at a "
          "fixed --concurrency (no --mode=stream, --request_rate or --rpc=health)");
    }
  }
  if (protocol == Protocol::kHttp && options.mode == Mode::kStream) {
    return UsageError(
        "--mode=stream: HTTP has no streams; use --protocol=kserve (ModelStreamInfer)");
  }
  if (options.rpc == Rpc::kHealth && options.mode == Mode::kStream) {
    return UsageError("--rpc=health measures the unary Health/Check; use --mode=unary");
  }
  MHA_RETURN_IF_ERROR(CheckPositive("window", options.window));
  MHA_RETURN_IF_ERROR(CheckPositive("duration", options.duration));
  if (options.duration <= options.warmup) {
    return UsageError(absl::StrCat("--duration: must be longer than --warmup (",
                                   absl::FormatDuration(options.warmup), ") to measure, got ",
                                   absl::FormatDuration(options.duration)));
  }
  MHA_RETURN_IF_ERROR(CheckAtLeast("max_windows", options.max_windows, 1));
  MHA_RETURN_IF_ERROR(CheckAtLeast("stable_windows", options.stable_windows, 1));
  if (!(options.stability > 0)) {
    return UsageError(absl::StrCat("--stability: must be > 0, got ", options.stability));
  }
  MHA_RETURN_IF_ERROR(CheckAtLeast("channels", options.channels, 1));
  MHA_RETURN_IF_ERROR(CheckAtLeast("max_requests", options.max_requests, 0));
  MHA_RETURN_IF_ERROR(CheckAtLeast("max_errors", options.max_errors, 0));
  if (!options.request_rates.empty() &&
      (options.mode == Mode::kStream || protocol == Protocol::kHttp)) {
    MHA_RETURN_IF_ERROR(CheckAtLeast("streams", options.rate_streams, 1));
  }
  return absl::OkStatus();
}

absl::StatusOr<BenchReport> RunBench(const BenchOptions& options, Connection& connection,
                                     const std::vector<std::shared_ptr<grpc::Channel>>& channels,
                                     const AttendRequest& request, std::ostream& progress,
                                     bool interactive) {
  MHA_RETURN_IF_ERROR(CheckBenchOptions(options, connection.protocol()));
  if (connection.protocol() != Protocol::kHttp && channels.empty()) {
    return absl::InvalidArgumentError("bench: no channel");
  }
  BenchReport report;
  report.options = options;
  report.protocol = connection.protocol();
  const AttendRequest& q = request;
  report.batch = q.queries().shape(0);
  report.num_queries = q.queries().shape(1);
  report.num_keys = q.has_keys() ? q.keys().shape(1) : report.num_queries;
  report.tokens_per_request = TokenCount(request);

  std::vector<Rpc> rpcs = {Rpc::kAttend};
  if (options.rpc == Rpc::kHealth) rpcs = {Rpc::kHealth, Rpc::kAttend};
  MHA_RETURN_IF_ERROR(Preflight(rpcs, connection, request, report));
  Payloads payloads{.attend = &request};
  if (connection.protocol() != Protocol::kAttention) {
    payloads.infer = ToModelInferRequest(request);
    if (connection.protocol() == Protocol::kHttp) payloads.http = ToHttpRequest(payloads.infer);
  }
  if (options.shared_memory) {
    // A region per slot, created, registered and unlinked now, unregistered when
    // the run ends (payloads' destruction).
    MHA_ASSIGN_OR_RETURN(const attention::v1::ModelInfo model,
                         connection.GetModel(request.model()));
    const OutputSizes outputs =
        OutputSizesOf(payloads.infer, model.num_hiddens(), model.num_heads());
    const uint64_t bytes = SharedMemoryBytes(payloads.infer, outputs);
    const int slots = *std::max_element(options.concurrency.begin(), options.concurrency.end());
    for (int i = 0; i < slots; ++i) {
      MHA_ASSIGN_OR_RETURN(std::unique_ptr<SharedMemorySlot> slot,
                           SharedMemorySlot::Create(channels[0], bytes, options.timeout));
      MHA_ASSIGN_OR_RETURN(inference::ModelInferRequest placed,
                           slot->Place(payloads.infer, outputs));
      payloads.slot_requests.push_back(std::move(placed));
      payloads.slots.push_back(std::move(slot));
    }
  }

  BenchProgress bench_progress(progress, interactive);
  uint64_t seed = options.seed;
  for (const auto& [concurrency, rate] : StepLoads(options)) {
    for (Rpc rpc : rpcs) {
      StepReport step = RunStep(options, StepTarget(rpc, options, connection, channels, payloads),
                                concurrency, rate, seed++, bench_progress);
      (rpc == Rpc::kHealth ? report.health_requests : report.attend_requests) += step.sent;
      step.stats.tokens_per_s =
          rpc == Rpc::kAttend
              ? step.stats.requests_per_s * static_cast<double>(report.tokens_per_request)
              : 0;
      bench_progress.StepDone(step);
      const bool failing = step.end_reason == "max_errors";
      report.steps.push_back(std::move(step));
      if (failing) return report;  // the run has failed: later steps are not run
    }
  }
  return report;
}

}  // namespace mha::client

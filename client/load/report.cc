#include "client/load/report.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <initializer_list>
#include <map>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/sdk/status.h"
#include "nlohmann/json.hpp"

namespace mha::client {
namespace {

std::string LoadLabel(const StepReport& step) {
  return step.concurrency > 0 ? absl::StrCat("concurrency ", step.concurrency)
                              : absl::StrFormat("rate %g/s", step.request_rate);
}

int64_t ErrorCount(const std::map<std::string, int64_t>& errors) {
  int64_t total = 0;
  for (const auto& [code, count] : errors) total += count;
  return total;
}

// "UNAVAILABLE=3;INTERNAL=1", or "0".
std::string ErrorText(const std::map<std::string, int64_t>& errors) {
  if (errors.empty()) return "0";
  std::vector<std::string> parts;
  for (const auto& [code, count] : errors) parts.push_back(absl::StrCat(code, "=", count));
  return absl::StrJoin(parts, ";");
}

// (Health, Attend) step pairs: each Health step with the Attend step measured at
// the same load right after it.
std::vector<std::pair<const StepReport*, const StepReport*>> HealthPairs(
    const BenchReport& report) {
  std::vector<std::pair<const StepReport*, const StepReport*>> pairs;
  for (size_t i = 0; i + 1 < report.steps.size(); ++i) {
    const StepReport& health = report.steps[i];
    const StepReport& next = report.steps[i + 1];
    if (health.rpc == Rpc::kHealth && next.rpc == Rpc::kAttend &&
        next.concurrency == health.concurrency && next.request_rate == health.request_rate) {
      pairs.emplace_back(&health, &next);
    }
  }
  return pairs;
}

double Ratio(double a, double b) { return b > 0 ? a / b : 0; }

// The call that carries each request, e.g. "ModelStreamInfer".
std::string CallName(Protocol protocol, Mode mode) {
  const bool stream = mode == Mode::kStream;
  switch (protocol) {
    case Protocol::kKServe:
      return stream ? "ModelStreamInfer" : "ModelInfer";
    case Protocol::kHttp:
      return "POST /v2/models/{model}/infer, binary tensors";
    default:
      return stream ? "AttendStream" : "Attend";
  }
}

// What one request of a step is, as the table's rpc column and its last line name
// it: "Attend", "ModelStreamInfer", "ServerReady" (the health RPCs are unary).
std::string CallLabel(Protocol protocol, Mode mode, Rpc rpc) {
  const bool stream = mode == Mode::kStream;
  switch (protocol) {
    case Protocol::kKServe:
      return rpc == Rpc::kHealth ? "ServerReady" : stream ? "ModelStreamInfer" : "ModelInfer";
    case Protocol::kHttp:
      return rpc == Rpc::kHealth ? "GET ready" : "POST infer";
    default:
      return rpc == Rpc::kHealth ? "Health" : stream ? "AttendStream" : "Attend";
  }
}

constexpr char kClearLine[] = "\r\033[K";

// Latency columns of the tables: each value (microseconds) in milliseconds, "%8.3f".
std::string MsColumns(std::initializer_list<double> values_us) {
  std::vector<std::string> columns;
  for (double us : values_us) columns.push_back(absl::StrFormat("%8.3f", us * 1e-3));
  return absl::StrJoin(columns, " ");
}

// The server's timing columns of the tables: mean batch rows, queue and compute
// microseconds, or "-" without `timing`.
std::string ServerHeader() {
  return absl::StrFormat("%6s %9s %10s", "batch", "queue us", "compute us");
}
std::string ServerColumns(const StepStats& s, bool timing) {
  return absl::StrFormat("%6s %9s %10s",
                         timing ? absl::StrFormat("%.2f", s.server_batch_rows) : "-",
                         timing ? absl::StrFormat("%.0f", s.server_queue_us) : "-",
                         timing ? absl::StrFormat("%.0f", s.server_compute_us) : "-");
}

// The JSON reports' latency object (microseconds) and the server's timing.
nlohmann::json LatencyUsJson(const LatencyStats& l) {
  return {{"mean", l.mean_us}, {"p50", l.p50_us}, {"p90", l.p90_us},
          {"p95", l.p95_us},   {"p99", l.p99_us}, {"max", l.max_us}};
}
nlohmann::json ServerJson(const StepStats& s) {
  return {{"batch_rows", s.server_batch_rows},
          {"queue_us", s.server_queue_us},
          {"compute_us", s.server_compute_us}};
}

}  // namespace

void BenchProgress::WindowDone(const StepReport& step, int window, const StepStats& stats) {
  out_ << (interactive_ ? kClearLine : "")
       << absl::StrFormat("[%s %s] window %d: %.1f req/s, p50 %.3f ms, p99 %.3f ms, errors %d",
                          RpcName(step.rpc), LoadLabel(step), window, stats.requests_per_s,
                          stats.latency.p50_us * 1e-3, stats.latency.p99_us * 1e-3,
                          ErrorCount(stats.errors))
       << (interactive_ ? "" : "\n") << std::flush;
}

void BenchProgress::StepDone(const StepReport& step) {
  // A step that ran (it has an end reason) may have left a window line in place.
  if (interactive_ && !step.end_reason.empty()) out_ << kClearLine << std::flush;
  const StepStats& s = step.stats;
  out_ << absl::StrFormat(
              "[%s %s] %s after %d window(s): %.1f req/s, p50 %.3f ms, p99 %.3f ms, errors %d\n",
              RpcName(step.rpc), LoadLabel(step),
              step.stable ? "stable" : absl::StrCat("NOT stable (", step.end_reason, ")"),
              step.windows, s.requests_per_s, s.latency.p50_us * 1e-3, s.latency.p99_us * 1e-3,
              ErrorCount(step.all_errors))
       << std::flush;
}

void PrintTable(const BenchReport& report, std::ostream& out) {
  const BenchOptions& o = report.options;
  out << absl::StrFormat(
      "protocol %s (%s); model %s (%s); request B %d, Q %d, K %d (%d tokens); %s; %s\n",
      ProtocolName(report.protocol), CallName(report.protocol, o.mode), report.model.name(),
      ModelSizes(report.model), report.batch, report.num_queries, report.num_keys,
      report.tokens_per_request, ModeName(o.mode),
      o.request_rates.empty() ? "fixed concurrency"
                              : (o.poisson ? "fixed rate, Poisson" : "fixed rate, constant"));
  // errors: every failed request of the step (warm-up, windows and drain), the
  // count CheckBenchReport judges; the latencies and req/s are the last windows'.
  out << absl::StrFormat("%-17s %-16s %10s %11s %8s %8s %8s %8s %8s %8s %s %s\n", "load", "rpc",
                         "req/s", "tokens/s", "p50 ms", "p90 ms", "p95 ms", "p99 ms", "max ms",
                         "errors", ServerHeader(), "stable");
  for (const StepReport& step : report.steps) {
    const StepStats& s = step.stats;
    const bool attend = step.rpc == Rpc::kAttend;
    // Open Inference Protocol responses carry the server's timing only as optional
    // parameters: "-" when none did.
    const bool timing =
        attend && (report.protocol == Protocol::kAttention || s.server_batch_rows > 0);
    const LatencyStats& l = s.latency;
    out << absl::StrFormat("%-17s %-16s %10.1f %11s %s %8s %s %s\n", LoadLabel(step),
                           CallLabel(report.protocol, o.mode, step.rpc), s.requests_per_s,
                           attend ? absl::StrFormat("%.0f", s.tokens_per_s) : "-",
                           MsColumns({l.p50_us, l.p90_us, l.p95_us, l.p99_us, l.max_us}),
                           ErrorText(step.all_errors), ServerColumns(s, timing),
                           step.stable ? "yes" : absl::StrFormat("no, %s", step.end_reason));
  }
  const std::string attend_call = CallLabel(report.protocol, o.mode, Rpc::kAttend);
  const std::string health_call = CallLabel(report.protocol, o.mode, Rpc::kHealth);
  for (const auto& [health, attend] : HealthPairs(report)) {
    const StepStats& h = health->stats;
    const StepStats& a = attend->stats;
    out << absl::StrFormat(
        "%s: %s / %s p50 latency %.2fx, p99 %.2fx; %s throughput %.2fx of %s's\n",
        LoadLabel(*attend), attend_call, health_call, Ratio(a.latency.p50_us, h.latency.p50_us),
        Ratio(a.latency.p99_us, h.latency.p99_us), attend_call,
        Ratio(a.requests_per_s, h.requests_per_s), health_call);
  }
  int64_t errors = 0;
  for (const StepReport& step : report.steps) errors += ErrorCount(step.all_errors);
  out << absl::StrFormat(
      "requests sent: %d %s%s; failed: %d\n", report.attend_requests, attend_call,
      report.health_requests > 0 ? absl::StrFormat(", %d %s", report.health_requests, health_call)
                                 : "",
      errors);
}

namespace {

nlohmann::json StepJson(const StepReport& step) {
  const StepStats& s = step.stats;
  return {
      {"rpc", RpcName(step.rpc)},
      {"concurrency", step.concurrency},
      {"request_rate", step.request_rate},
      {"stable", step.stable},
      {"end_reason", step.end_reason},
      {"windows", step.windows},
      {"sent", step.sent},
      {"measured", step.measured},
      {"duration_s", s.duration_s},
      {"requests", s.requests},
      {"ok", s.ok},
      {"requests_per_s", s.requests_per_s},
      {"tokens_per_s", s.tokens_per_s},
      {"latency_us", LatencyUsJson(s.latency)},
      {"errors", s.errors},
      {"all_errors", step.all_errors},
      {"server", ServerJson(s)},
  };
}

nlohmann::json HealthRatioJson(const StepReport& health, const StepReport& attend) {
  const StepStats& h = health.stats;
  const StepStats& a = attend.stats;
  return {{"concurrency", attend.concurrency},
          {"request_rate", attend.request_rate},
          {"attend_over_health_p50", Ratio(a.latency.p50_us, h.latency.p50_us)},
          {"attend_over_health_p99", Ratio(a.latency.p99_us, h.latency.p99_us)},
          {"attend_over_health_throughput", Ratio(a.requests_per_s, h.requests_per_s)}};
}

}  // namespace

std::string ToJson(const BenchReport& report) {
  using nlohmann::json;
  const BenchOptions& o = report.options;
  const attention::v1::ModelInfo& m = report.model;
  json root = {
      {"protocol", ProtocolName(report.protocol)},
      {"target", report.target},
      {"model", ModelJson(m)},
      {"request",
       {{"batch", report.batch},
        {"num_queries", report.num_queries},
        {"num_keys", report.num_keys},
        {"tokens", report.tokens_per_request}}},
      {"mode", ModeName(o.mode)},
      {"rpc", RpcName(o.rpc)},
      {"load", o.request_rates.empty() ? "concurrency" : "request_rate"},
      {"distribution", o.poisson ? "poisson" : "constant"},
      {"attend_requests", report.attend_requests},
      {"health_requests", report.health_requests},
      {"steps", json::array()},
      {"health_ratios", json::array()},
  };
  for (const StepReport& step : report.steps) root["steps"].push_back(StepJson(step));
  for (const auto& [health, attend] : HealthPairs(report)) {
    root["health_ratios"].push_back(HealthRatioJson(*health, *attend));
  }
  return root.dump(2) + "\n";
}

std::string ToCsv(const BenchReport& report) {
  std::string csv =
      "rpc,mode,concurrency,request_rate,requests_per_s,tokens_per_s,p50_us,p90_us,p95_us,"
      "p99_us,max_us,mean_us,requests,ok,errors,errors_by_code,server_batch_rows,"
      "server_queue_us,server_compute_us,stable,end_reason,windows,sent,protocol\n";
  for (const StepReport& step : report.steps) {
    const StepStats& s = step.stats;
    const LatencyStats& l = s.latency;
    absl::StrAppend(
        &csv, absl::StrFormat(
                  "%s,%s,%d,%g,%.3f,%.3f,%.1f,%.1f,%.1f,%.1f,%.1f,%.1f,%d,%d,%d,%s,%.3f,"
                  "%.1f,%.1f,%s,%s,%d,%d,%s\n",
                  RpcName(step.rpc),
                  ModeName(step.rpc == Rpc::kHealth ? Mode::kUnary : report.options.mode),
                  step.concurrency, step.request_rate, s.requests_per_s, s.tokens_per_s, l.p50_us,
                  l.p90_us, l.p95_us, l.p99_us, l.max_us, l.mean_us, s.requests, s.ok,
                  ErrorCount(step.all_errors),
                  step.all_errors.empty() ? "" : ErrorText(step.all_errors), s.server_batch_rows,
                  s.server_queue_us, s.server_compute_us, step.stable ? "true" : "false",
                  step.end_reason, step.windows, step.sent, ProtocolName(report.protocol)));
  }
  return csv;
}

namespace {

// The errors of `step` whose codes `options` does not allow.
std::map<std::string, int64_t> ErrorsNotAllowed(const StepReport& step,
                                                const BenchOptions& options) {
  std::map<std::string, int64_t> errors;
  for (const auto& entry : step.all_errors) {
    const std::string& code = entry.first;
    const bool allowed = std::any_of(options.allowed_errors.begin(), options.allowed_errors.end(),
                                     [&](grpc::StatusCode c) { return CodeName(c) == code; });
    if (!allowed) errors[code] = entry.second;
  }
  return errors;
}

// Why `step` measured nothing, for a step whose last windows finished no request.
std::string NothingMeasured(const StepReport& step, const BenchOptions& options) {
  if (step.windows == 0) {
    return absl::StrCat("the step ended (", step.end_reason, ") before its first window");
  }
  return absl::StrCat("no request finished in its last ",
                      std::min(step.windows, options.stable_windows), " window(s) of ",
                      absl::FormatDuration(options.window),
                      " (a longer --window, or is the server answering?)");
}

}  // namespace

absl::Status CheckBenchReport(const BenchReport& report) {
  const BenchOptions& options = report.options;
  for (const StepReport& step : report.steps) {
    const std::string step_name = absl::StrCat("bench: ", RpcName(step.rpc), " ", LoadLabel(step));
    const std::map<std::string, int64_t> errors = ErrorsNotAllowed(step, options);
    if (!errors.empty()) {
      int64_t failed = 0;
      for (const auto& [code, count] : errors) failed += count;
      const auto most =
          std::max_element(errors.begin(), errors.end(),
                           [](const auto& a, const auto& b) { return a.second < b.second; });
      std::string message = absl::StrCat(step_name, ": ", failed, " failed request(s) (",
                                         ErrorText(errors), ") not allowed by --allow_errors");
      if (step.end_reason == "max_errors") {
        absl::StrAppend(&message, "; --max_errors=", options.max_errors,
                        " ended the step and the run");
      }
      return absl::Status(CodeFromName(most->first).value_or(absl::StatusCode::kUnknown), message);
    }
    if (step.stats.requests == 0) {
      return absl::FailedPreconditionError(
          absl::StrCat(step_name, ": measured nothing: ", NothingMeasured(step, options)));
    }
  }
  return absl::OkStatus();
}

nlohmann::json ModelJson(const attention::v1::ModelInfo& m) {
  return {{"name", m.name()},           {"num_hiddens", m.num_hiddens()},
          {"num_heads", m.num_heads()}, {"query_size", m.query_size()},
          {"key_size", m.key_size()},   {"value_size", m.value_size()},
          {"precision", m.precision()}};
}

std::string ModelSizes(const attention::v1::ModelInfo& m) {
  std::string sizes = absl::StrFormat("p_o %d, h %s", m.num_hiddens(),
                                      m.num_heads() > 0 ? absl::StrCat(m.num_heads()) : "?");
  if (!m.precision().empty()) absl::StrAppend(&sizes, ", ", m.precision());
  return sizes;
}

namespace {

// A group of decode steps: their count, latencies and the server's timing.
nlohmann::json DecodeStepsJson(const StepStats& s) {
  return {{"count", s.latency.count},
          {"latency_us", LatencyUsJson(s.latency)},
          {"server", ServerJson(s)}};
}

// The call that carries decode's steps.
std::string DecodeCall(const DecodeOptions& options) {
  return options.stateless ? "Attend" : "AttendSession";
}

}  // namespace

void PrintDecodeTable(const DecodeReport& report, std::ostream& out) {
  const DecodeOptions& o = report.options;
  out << absl::StrFormat(
      "protocol attention (%s%s); model %s (%s); %d session(s), prefill %d + decode %d tokens "
      "each; seed %d\n",
      DecodeCall(o),
      o.stateless              ? ", stateless: keys and values resent each step"
      : IsWorker(report.model) ? ", CROSS causal: each step sends its q, k and v"
                               : ", SELF causal",
      report.model.name(), ModelSizes(report.model), o.sessions, o.prefill, o.decode_tokens,
      o.seed);
  out << absl::StrFormat("%-8s %-9s %8s %8s %8s %8s %8s %s\n", "step", "context", "count", "p50 ms",
                         "p90 ms", "p99 ms", "max ms", ServerHeader());
  auto row = [&](absl::string_view step, const std::string& context, const StepStats& s) {
    const LatencyStats& l = s.latency;
    out << absl::StrFormat("%-8s %-9s %8d %s %s\n", step, context, l.count,
                           MsColumns({l.p50_us, l.p90_us, l.p99_us, l.max_us}),
                           ServerColumns(s, /*timing=*/true));
  };
  row("prefill", absl::StrCat(o.prefill), report.prefill);
  for (const ContextBucket& bucket : report.buckets) row("decode", bucket.label, bucket.stats);
  out << absl::StrFormat(
      "decode: %d tokens in %.3f s: %.1f tokens/s over %d session(s); p50 %.3f ms a step\n",
      report.decode_tokens, report.decode.duration_s, report.decode_tokens_per_s, o.sessions,
      report.decode.latency.p50_us * 1e-3);
  out << absl::StrFormat("output sum of the decode steps: %.6g\n", report.output_sum);
  if (IsWorker(report.model)) {
    out << absl::StrFormat(
        "cache read: %.0f bytes per decode step on average (%s cache), %.3f GB/s over the "
        "decode phase\n",
        report.cache_bytes_per_step,
        report.model.kv_cache_precision().empty() ? "f32" : report.model.kv_cache_precision(),
        report.cache_gb_per_s);
  }
  out << (o.stateless ? absl::StrFormat("calls: %d Attend\n", report.calls)
                      : absl::StrFormat("calls: %d AttendSession stream(s), %d steps\n",
                                        report.calls, o.sessions * (1 + o.decode_tokens)));
}

DecodeCheck CompareDecodeRuns(const DecodeReport& first, const DecodeReport& second,
                              double relative_tolerance) {
  const DecodeReport& session = first.options.stateless ? second : first;
  const DecodeReport& stateless = first.options.stateless ? first : second;
  DecodeCheck check;
  check.session_sum = session.output_sum;
  check.stateless_sum = stateless.output_sum;
  check.difference = std::abs(check.session_sum - check.stateless_sum);
  check.relative_tolerance = relative_tolerance;
  check.tolerance = relative_tolerance * session.output_abs_sum;
  check.match = check.difference <= check.tolerance;
  check.speedup = Ratio(session.decode_tokens_per_s, stateless.decode_tokens_per_s);
  return check;
}

std::string DecodeCheckLine(const DecodeCheck& c) {
  return absl::StrFormat(
      "check: output sums %.9g (AttendSession) and %.9g (stateless Attend): %s, |difference| "
      "%.3g %s tolerance %.3g (%g x the sum of |output|); AttendSession decode tokens/s %.2fx "
      "stateless Attend's",
      c.session_sum, c.stateless_sum, c.match ? "match" : "DO NOT MATCH", c.difference,
      c.match ? "<=" : ">", c.tolerance, c.relative_tolerance, c.speedup);
}

std::string DecodeJson(const DecodeReport& report, const std::optional<DecodeCheck>& check) {
  using nlohmann::json;
  const DecodeOptions& o = report.options;
  const attention::v1::ModelInfo& m = report.model;
  json root = {
      {"protocol", "attention"},
      {"call", DecodeCall(o)},
      {"target", report.target},
      {"model", ModelJson(m)},
      {"sessions", o.sessions},
      {"prefill", o.prefill},
      {"decode_tokens", o.decode_tokens},
      {"stateless", o.stateless},
      {"seed", o.seed},
      {"prefill_steps", DecodeStepsJson(report.prefill)},
      {"decode_buckets", json::array()},
      {"decode",
       {{"tokens", report.decode_tokens},
        {"duration_s", report.decode.duration_s},
        {"tokens_per_s", report.decode_tokens_per_s},
        {"steps", DecodeStepsJson(report.decode)}}},
      {"output_sum", report.output_sum},
      {"output_abs_sum", report.output_abs_sum},
      {"calls", report.calls},
  };
  if (IsWorker(report.model)) {
    root["cache_bytes_per_step"] = report.cache_bytes_per_step;
    root["cache_gb_per_s"] = report.cache_gb_per_s;
  }
  if (check) {
    root["check"] = {{"session_output_sum", check->session_sum},
                     {"stateless_output_sum", check->stateless_sum},
                     {"difference", check->difference},
                     {"tolerance", check->tolerance},
                     {"relative_tolerance", check->relative_tolerance},
                     {"match", check->match},
                     {"speedup", check->speedup}};
  }
  for (const ContextBucket& bucket : report.buckets) {
    json entry = DecodeStepsJson(bucket.stats);
    entry["label"] = bucket.label;
    entry["max_context"] = bucket.max_context;
    root["decode_buckets"].push_back(std::move(entry));
  }
  return root.dump(2) + "\n";
}

absl::Status WriteText(const std::string& path, const std::string& text) {
  std::ofstream file(path, std::ios::binary | std::ios::trunc);
  file << text;
  file.close();
  if (!file) return absl::InvalidArgumentError(absl::StrCat(path, ": cannot write the file"));
  return absl::OkStatus();
}

}  // namespace mha::client

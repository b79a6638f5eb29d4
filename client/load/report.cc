#include "client/load/report.h"

#include <algorithm>
#include <fstream>
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

int64_t ErrorCount(const StepStats& stats) {
  int64_t errors = 0;
  for (const auto& [code, count] : stats.errors) errors += count;
  return errors;
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

constexpr char kClearLine[] = "\r\033[K";

}  // namespace

void BenchProgress::WindowDone(const StepReport& step, int window, const StepStats& stats) {
  out_ << (interactive_ ? kClearLine : "")
       << absl::StrFormat("[%s %s] window %d: %.1f req/s, p50 %.3f ms, p99 %.3f ms, errors %d",
                          RpcName(step.rpc), LoadLabel(step), window, stats.requests_per_s,
                          stats.latency.p50_us * 1e-3, stats.latency.p99_us * 1e-3,
                          ErrorCount(stats))
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
              ErrorCount(s))
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
  out << absl::StrFormat("%-17s %-6s %10s %11s %8s %8s %8s %8s %8s %8s %6s %9s %10s %s\n", "load",
                         "rpc", "req/s", "tokens/s", "p50 ms", "p90 ms", "p95 ms", "p99 ms",
                         "max ms", "errors", "batch", "queue us", "compute us", "stable");
  for (const StepReport& step : report.steps) {
    const StepStats& s = step.stats;
    const bool attend = step.rpc == Rpc::kAttend;
    // Open Inference Protocol responses carry the server's timing only as optional
    // parameters: "-" when none did.
    const bool timing =
        attend && (report.protocol == Protocol::kAttention || s.server_batch_rows > 0);
    out << absl::StrFormat(
        "%-17s %-6s %10.1f %11s %8.3f %8.3f %8.3f %8.3f %8.3f %8s %6s %9s %10s %s\n",
        LoadLabel(step), RpcName(step.rpc), s.requests_per_s,
        attend ? absl::StrFormat("%.0f", s.tokens_per_s) : "-", s.latency.p50_us * 1e-3,
        s.latency.p90_us * 1e-3, s.latency.p95_us * 1e-3, s.latency.p99_us * 1e-3,
        s.latency.max_us * 1e-3, ErrorText(s.errors),
        timing ? absl::StrFormat("%.2f", s.server_batch_rows) : "-",
        timing ? absl::StrFormat("%.0f", s.server_queue_us) : "-",
        timing ? absl::StrFormat("%.0f", s.server_compute_us) : "-",
        step.stable ? "yes" : absl::StrFormat("no, %s", step.end_reason));
  }
  for (const auto& [health, attend] : HealthPairs(report)) {
    const StepStats& h = health->stats;
    const StepStats& a = attend->stats;
    out << absl::StrFormat(
        "%s: Attend / Health p50 latency %.2fx, p99 %.2fx; Attend throughput %.2fx of Health's\n",
        LoadLabel(*attend), Ratio(a.latency.p50_us, h.latency.p50_us),
        Ratio(a.latency.p99_us, h.latency.p99_us), Ratio(a.requests_per_s, h.requests_per_s));
  }
  out << absl::StrFormat("requests sent: %d Attend%s\n", report.attend_requests,
                         report.health_requests > 0
                             ? absl::StrFormat(", %d Health/Check", report.health_requests)
                             : "");
}

namespace {

nlohmann::json StepJson(const StepReport& step) {
  const StepStats& s = step.stats;
  const LatencyStats& l = s.latency;
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
      {"latency_us",
       {{"mean", l.mean_us},
        {"p50", l.p50_us},
        {"p90", l.p90_us},
        {"p95", l.p95_us},
        {"p99", l.p99_us},
        {"max", l.max_us}}},
      {"errors", s.errors},
      {"all_errors", step.all_errors},
      {"server",
       {{"batch_rows", s.server_batch_rows},
        {"queue_us", s.server_queue_us},
        {"compute_us", s.server_compute_us}}},
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
                  ErrorCount(s), s.errors.empty() ? "" : ErrorText(s.errors), s.server_batch_rows,
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

absl::Status WriteText(const std::string& path, const std::string& text) {
  std::ofstream file(path, std::ios::binary | std::ios::trunc);
  file << text;
  file.close();
  if (!file) return absl::InvalidArgumentError(absl::StrCat(path, ": cannot write the file"));
  return absl::OkStatus();
}

}  // namespace mha::client

#include "server/serving/metrics.h"

#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"

namespace mha::server {
namespace {

using prometheus::Counter;
using prometheus::Family;
using prometheus::Gauge;
using prometheus::Histogram;

std::vector<double> PowersOfTwo(double from, double to) {
  std::vector<double> bounds;
  for (double b = from; b <= to; b *= 2) bounds.push_back(b);
  return bounds;
}

}  // namespace

std::vector<double> DurationBuckets() {
  return {50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3,
          50e-3, 100e-3, 250e-3, 500e-3, 1,    2.5,    5,    10};
}

const char* ProtocolLabel(Protocol protocol) {
  switch (protocol) {
    case Protocol::kAttentionV1:
      return "attention_v1";
    case Protocol::kKserveGrpc:
      return "kserve_grpc";
    case Protocol::kKserveHttp:
      return "kserve_http";
  }
  return "unknown";
}

ModelMetrics::ModelMetrics(const std::string& model, Family<Counter>& requests,
                           Family<Histogram>& request_duration, Family<Histogram>& queue_duration,
                           Family<Histogram>& compute_duration, Family<Histogram>& batch_size,
                           Family<Histogram>& batch_tokens, Family<Gauge>& queue_depth,
                           Family<Gauge>& inflight, Family<Counter>& tokens)
    : model_(model),
      requests_family_(requests),
      queue_duration_(queue_duration.Add({{"model", model}}, DurationBuckets())),
      compute_duration_(compute_duration.Add({{"model", model}}, DurationBuckets())),
      batch_size_(batch_size.Add({{"model", model}}, PowersOfTwo(1, 1024))),
      batch_tokens_(batch_tokens.Add({{"model", model}}, PowersOfTwo(16, 1 << 20))),
      queue_depth_(queue_depth.Add({{"model", model}})),
      inflight_(inflight.Add({{"model", model}})),
      tokens_(tokens.Add({{"model", model}})) {
  for (int p = 0; p < kNumProtocols; ++p) {
    const std::string protocol = ProtocolLabel(static_cast<Protocol>(p));
    request_duration_[p] =
        &request_duration.Add({{"model", model}, {"protocol", protocol}}, DurationBuckets());
    // OK exists from the start so rate() and the dashboards see a series at once.
    requests_[p][0] =
        &requests_family_.Add({{"model", model_}, {"code", "OK"}, {"protocol", protocol}});
  }
}

void ModelMetrics::Answered(Protocol protocol, absl::StatusCode code, absl::Duration duration,
                            int64_t rows) {
  const int p = static_cast<int>(protocol);
  const size_t index = static_cast<size_t>(code) < requests_[p].size()
                           ? static_cast<size_t>(code)
                           : static_cast<size_t>(absl::StatusCode::kUnknown);
  Counter* counter = requests_[p][index].load(std::memory_order_acquire);
  if (counter == nullptr) {
    // Several threads may get here for one code; Add returns the same child.
    std::string name = absl::StatusCodeToString(static_cast<absl::StatusCode>(index));
    counter = &requests_family_.Add(
        {{"model", model_}, {"code", std::move(name)}, {"protocol", ProtocolLabel(protocol)}});
    requests_[p][index].store(counter, std::memory_order_release);
  }
  counter->Increment();
  request_duration_[p]->Observe(absl::ToDoubleSeconds(duration));
  Totals& totals = code == absl::StatusCode::kOk ? success_ : fail_;
  totals.count.fetch_add(1, std::memory_order_relaxed);
  totals.ns.fetch_add(static_cast<uint64_t>(absl::ToInt64Nanoseconds(duration)),
                      std::memory_order_relaxed);
  if (code == absl::StatusCode::kOk) {
    inference_count_.fetch_add(static_cast<uint64_t>(rows), std::memory_order_relaxed);
  }
  last_inference_ms_.store(absl::ToUnixMillis(absl::Now()), std::memory_order_relaxed);
}

void ModelMetrics::Batch(int64_t requests, int64_t rows, int64_t tokens, absl::Duration compute) {
  const auto ns = static_cast<uint64_t>(absl::ToInt64Nanoseconds(compute));
  request_compute_.count.fetch_add(static_cast<uint64_t>(requests), std::memory_order_relaxed);
  request_compute_.ns.fetch_add(static_cast<uint64_t>(requests) * ns, std::memory_order_relaxed);
  batch_size_.Observe(static_cast<double>(rows));
  batch_tokens_.Observe(static_cast<double>(tokens));
  compute_duration_.Observe(absl::ToDoubleSeconds(compute));
  absl::MutexLock lock(&batches_mu_);
  ModelStatisticsSnapshot::Duration& batch = batches_[rows];
  ++batch.count;
  batch.ns += ns;
}

namespace {

// A histogram's count and sum (seconds) as a count and nanoseconds.
ModelStatisticsSnapshot::Duration CountAndSum(const Histogram& histogram) {
  const prometheus::ClientMetric metric = histogram.Collect();
  return {.count = metric.histogram.sample_count,
          .ns = static_cast<uint64_t>(std::llround(metric.histogram.sample_sum * 1e9))};
}

}  // namespace

ModelStatisticsSnapshot ModelMetrics::Statistics() const {
  ModelStatisticsSnapshot out;
  out.success = {success_.count.load(std::memory_order_relaxed),
                 success_.ns.load(std::memory_order_relaxed)};
  out.fail = {fail_.count.load(std::memory_order_relaxed),
              fail_.ns.load(std::memory_order_relaxed)};
  out.queue = CountAndSum(queue_duration_);
  out.compute = CountAndSum(compute_duration_);
  out.request_compute = {request_compute_.count.load(std::memory_order_relaxed),
                         request_compute_.ns.load(std::memory_order_relaxed)};
  out.execution_count = out.compute.count;
  out.inference_count = inference_count_.load(std::memory_order_relaxed);
  out.last_inference_ms = static_cast<uint64_t>(last_inference_ms_.load(std::memory_order_relaxed));
  absl::MutexLock lock(&batches_mu_);
  out.batches = batches_;
  return out;
}

Metrics::Metrics(const std::vector<std::string>& model_names)
    : registry_(std::make_shared<prometheus::Registry>()) {
  auto& requests = prometheus::BuildCounter()
                       .Name("mha_requests_total")
                       .Help(
                           "Requests answered, by model, canonical status code and "
                           "protocol (attention_v1, kserve_grpc, kserve_http).")
                       .Register(*registry_);
  auto& request_duration = prometheus::BuildHistogram()
                               .Name("mha_request_duration_seconds")
                               .Help("Time from receiving a request to answering it.")
                               .Register(*registry_);
  auto& queue_duration = prometheus::BuildHistogram()
                             .Name("mha_queue_duration_seconds")
                             .Help("Time a computed request waited in the batcher's queue.")
                             .Register(*registry_);
  auto& compute_duration = prometheus::BuildHistogram()
                               .Name("mha_compute_duration_seconds")
                               .Help("Forward pass time of each batch.")
                               .Register(*registry_);
  auto& batch_size = prometheus::BuildHistogram()
                         .Name("mha_batch_size")
                         .Help("Batch rows (B) per forward call, after merging requests.")
                         .Register(*registry_);
  auto& batch_tokens = prometheus::BuildHistogram()
                           .Name("mha_batch_tokens")
                           .Help("Query tokens per forward call, padding included.")
                           .Register(*registry_);
  auto& queue_depth = prometheus::BuildGauge()
                          .Name("mha_queue_depth")
                          .Help("Requests waiting in the batcher's queue.")
                          .Register(*registry_);
  auto& inflight = prometheus::BuildGauge()
                       .Name("mha_inflight_requests")
                       .Help("Requests accepted and not yet answered.")
                       .Register(*registry_);
  auto& tokens = prometheus::BuildCounter()
                     .Name("mha_tokens_total")
                     .Help("Query tokens (B*Q) of requests answered OK.")
                     .Register(*registry_);
  warmup_ = &prometheus::BuildGauge()
                 .Name("mha_model_warmup_seconds")
                 .Help("Time the model's warm-up passes took before it served.")
                 .Register(*registry_);
  loads_ = &prometheus::BuildCounter()
                .Name("mha_model_loads_total")
                .Help(
                    "Model loads after start-up (reloads, new models, explicit loads), by "
                    "result: ok, or failed (the previous version, if any, keeps serving).")
                .Register(*registry_);
  // Pointers, not references: the lambda outlives this constructor's locals.
  make_ = [requests = &requests, request_duration = &request_duration,
           queue_duration = &queue_duration, compute_duration = &compute_duration,
           batch_size = &batch_size, batch_tokens = &batch_tokens, queue_depth = &queue_depth,
           inflight = &inflight, tokens = &tokens](const std::string& name) {
    return std::make_unique<ModelMetrics>(name, *requests, *request_duration, *queue_duration,
                                          *compute_duration, *batch_size, *batch_tokens,
                                          *queue_depth, *inflight, *tokens);
  };
  for (const std::string& name : model_names) AddModel(name);
  unknown_ = make_(kUnknownModelLabel);
}

void Metrics::AddModel(const std::string& name) {
  absl::MutexLock lock(&models_mu_);
  if (!models_.contains(name)) models_.emplace(name, make_(name));
}

void Metrics::Loaded(const std::string& model, bool ok) {
  loads_->Add({{"model", model}, {"result", ok ? "ok" : "failed"}}).Increment();
}

void Metrics::Warmed(const std::string& model, absl::Duration took) {
  warmup_->Add({{"model", model}}).Set(absl::ToDoubleSeconds(took));
}

ModelMetrics& Metrics::ForModel(absl::string_view name) {
  absl::ReaderMutexLock lock(&models_mu_);
  auto it = models_.find(name);
  return it == models_.end() ? *unknown_ : *it->second;
}

const ModelMetrics* Metrics::Find(absl::string_view name) const {
  absl::ReaderMutexLock lock(&models_mu_);
  auto it = models_.find(name);
  return it == models_.end() ? nullptr : it->second.get();
}

}  // namespace mha::server

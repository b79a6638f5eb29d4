// The serving layer's Prometheus metrics (prometheus-cpp 1.0, its core library
// only): the families and each model's children. The binary serves them in text
// format at /metrics on their own port (server/app/metrics_exposer.h, which also
// adds the process_* figures).
//
// Families are registered once, when Metrics is made; each served model's
// children are created then too and cached in its ModelMetrics, so recording is a
// pointer dereference and an atomic add. Request counters by code are created on
// first use of a code (prometheus::Family::Add is thread-safe and idempotent).
//
//   mha_requests_total{model,code,protocol}    counter, every answered request
//   mha_request_duration_seconds{model,protocol} histogram, handler entry to answer
//   mha_queue_duration_seconds{model}      histogram, enqueue to compute start
//   mha_compute_duration_seconds{model}    histogram, the batch's forward pass
//   mha_batch_size{model}                  histogram, rows (B) per forward call
//   mha_batch_tokens{model}                histogram, padded query tokens per call
//   mha_queue_depth{model}                 gauge, requests waiting for compute
//   mha_inflight_requests{model}           gauge, accepted and not yet answered
//   mha_tokens_total{model}                counter, query tokens (B*Q) answered OK
// `protocol` is the front a request came through: attention_v1, kserve_grpc or
// kserve_http. The other families count forward calls and queues, which the
// fronts share, so they carry no protocol.
// A request whose model cannot be resolved is counted under model="_unknown", so
// callers cannot grow the label set with made-up names.
//
// Thread safety: everything is thread-safe once constructed.
#ifndef MHA_SERVER_SERVING_METRICS_H_
#define MHA_SERVER_SERVING_METRICS_H_

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace mha::server {

inline constexpr char kUnknownModelLabel[] = "_unknown";

// The front a request came through (the `protocol` label).
enum class Protocol { kAttentionV1 = 0, kKserveGrpc = 1, kKserveHttp = 2 };
inline constexpr int kNumProtocols = 3;
const char* ProtocolLabel(Protocol protocol);  // "attention_v1", "kserve_grpc", "kserve_http"

// Cumulative figures of one model, as Triton's ModelStatistics reports them; read
// from the same counters and histograms /metrics exposes, so the two agree.
struct ModelStatisticsSnapshot {
  struct Duration {
    uint64_t count = 0;
    uint64_t ns = 0;
  };
  Duration success;                     // requests answered OK: count, request duration
  Duration fail;                        // every other answer
  Duration queue;                       // computed requests: mha_queue_duration_seconds
  Duration compute;                     // forward calls: mha_compute_duration_seconds
  Duration request_compute;             // computed requests, each its call's time
  uint64_t inference_count = 0;         // batch rows (B) answered OK
  uint64_t execution_count = 0;         // forward calls
  uint64_t last_inference_ms = 0;       // Unix ms of the last answer; 0 = none yet
  std::map<int64_t, Duration> batches;  // by rows per forward call: calls, compute
};

// One model's children of every family.
class ModelMetrics {
 public:
  ModelMetrics(const std::string& model, prometheus::Family<prometheus::Counter>& requests,
               prometheus::Family<prometheus::Histogram>& request_duration,
               prometheus::Family<prometheus::Histogram>& queue_duration,
               prometheus::Family<prometheus::Histogram>& compute_duration,
               prometheus::Family<prometheus::Histogram>& batch_size,
               prometheus::Family<prometheus::Histogram>& batch_tokens,
               prometheus::Family<prometheus::Gauge>& queue_depth,
               prometheus::Family<prometheus::Gauge>& inflight,
               prometheus::Family<prometheus::Counter>& tokens);

  // An answered request of `rows` batch rows: mha_requests_total{code,protocol},
  // mha_request_duration_seconds{protocol} and the statistics.
  void Answered(Protocol protocol, absl::StatusCode code, absl::Duration duration, int64_t rows);
  // A forward call of `requests` requests, `rows` rows and `tokens` padded query
  // tokens.
  void Batch(int64_t requests, int64_t rows, int64_t tokens, absl::Duration compute);

  prometheus::Histogram& queue_duration() { return queue_duration_; }
  prometheus::Gauge& queue_depth() { return queue_depth_; }
  prometheus::Gauge& inflight() { return inflight_; }
  prometheus::Counter& tokens() { return tokens_; }

  ModelStatisticsSnapshot Statistics() const;

 private:
  struct Totals {
    std::atomic<uint64_t> count{0};
    std::atomic<uint64_t> ns{0};
  };

  const std::string model_;
  prometheus::Family<prometheus::Counter>& requests_family_;
  // By protocol, then absl::StatusCode.
  std::array<std::array<std::atomic<prometheus::Counter*>, 17>, kNumProtocols> requests_{};
  std::array<prometheus::Histogram*, kNumProtocols> request_duration_{};
  prometheus::Histogram& queue_duration_;
  prometheus::Histogram& compute_duration_;
  prometheus::Histogram& batch_size_;
  prometheus::Histogram& batch_tokens_;
  prometheus::Gauge& queue_depth_;
  prometheus::Gauge& inflight_;
  prometheus::Counter& tokens_;
  Totals success_, fail_, request_compute_;
  std::atomic<uint64_t> inference_count_{0};
  std::atomic<int64_t> last_inference_ms_{0};
  mutable absl::Mutex batches_mu_;
  std::map<int64_t, ModelStatisticsSnapshot::Duration> batches_ ABSL_GUARDED_BY(batches_mu_);
};

class Metrics {
 public:
  explicit Metrics(const std::vector<std::string>& model_names);

  // The model's metrics; the "_unknown" ones for a name that is not served.
  ModelMetrics& ForModel(absl::string_view name);
  // nullptr for a name that is not served.
  const ModelMetrics* Find(absl::string_view name) const;
  // Metrics for a model loaded after start-up. A model's metrics stay when it is
  // unloaded (counters never go back), and serve it again if it comes back.
  void AddModel(const std::string& name);

  const std::shared_ptr<prometheus::Registry>& registry() const { return registry_; }

  // mha_model_warmup_seconds{model}: how long the model's warm-up took.
  void Warmed(const std::string& model, absl::Duration took);
  // mha_model_loads_total{model, result="ok"|"failed"}: loads after start-up (reloads
  // of a changed model, new models, explicit loads) and how they ended.
  void Loaded(const std::string& model, bool ok);

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Family<prometheus::Gauge>* warmup_ = nullptr;
  prometheus::Family<prometheus::Counter>* loads_ = nullptr;
  std::function<std::unique_ptr<ModelMetrics>(const std::string&)> make_;
  mutable absl::Mutex models_mu_;
  std::map<std::string, std::unique_ptr<ModelMetrics>, std::less<>> models_
      ABSL_GUARDED_BY(models_mu_);
  std::unique_ptr<ModelMetrics> unknown_;
};

// Latency buckets: 50 us to 10 s in 1-2.5-5 steps.
std::vector<double> DurationBuckets();

}  // namespace mha::server

#endif  // MHA_SERVER_SERVING_METRICS_H_

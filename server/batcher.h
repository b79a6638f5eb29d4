// The dynamic batcher and compute scheduler: one queue per model and a fixed set
// of compute workers. gRPC threads only Submit; everything that decides which
// requests run together, and on which threads, is here.
//
// Batching (per model, BatchingPolicy; shaped like Triton's dynamic batcher):
//   - A worker takes the model whose oldest queued request is oldest. If that
//     model's queue holds less than a full batch (max_batch_size rows or
//     max_batch_tokens tokens), the worker waits until it does, or until the oldest
//     request has waited max_queue_delay, whichever is first.
//   - It then forms one forward call from the oldest request and every later one
//     that can share it, in arrival order, up to max_batch_size rows and
//     max_batch_tokens = rows x max(Q, K) (the first request always fits).
//     Requests share a call when they agree on self- vs cross-attention, causal
//     and head_mask, and neither asks for attention weights (those run alone, as
//     their (B, h, Q, K) output is per request). Q and K may differ: shorter
//     requests are zero-padded and their keys masked through valid_lens, so each
//     request's output equals its output when run alone (the mask makes padding
//     exact; differences are float rounding, <= 1e-5 in the tests).
//   - Expired and cancelled requests met while forming a batch are answered
//     DEADLINE_EXCEEDED / CANCELLED and never computed.
//   - A full queue (max_queue_size) answers RESOURCE_EXHAUSTED at Submit, and so does
//     a queue whose expected wait is over max_queue_wait (when set): the padded
//     tokens queued for the model and in its forward calls in progress, times its
//     compute time per token (a moving average over its recent calls), over the
//     workers. An idle model admits any request; until it has computed once, only
//     max_queue_size applies.
//   - policy.enabled = false: one request per forward call, no waiting.
//
// Scheduling: `num_workers` workers, each running one forward call at a time on
// threads_per_worker OpenMP threads (the models are created with that count).
// The default is one worker on every core: the lowest latency for a single
// large request, and with batching the same throughput at high concurrency as
// one single-threaded worker per core (README, "Batching", measured both ways).
// Several single-threaded workers (--compute_workers=N --compute_threads=N) win
// when batching is off and requests are small.
//
//   auto batcher = Batcher::Create({.num_workers = 1}, *models, &metrics).value();
//   absl::Status s = batcher->Submit(WorkItem{.request = validated, .response = &r,
//                                             .done = [&](absl::Status s) { ... }});
//   // s not OK (queue full, shutting down): `done` will never be called.
//
// Each computed request's response gets output, attention (when asked) and
// timing {queue_us, compute_us, batch_rows}. The request behind `request.inputs`
// and `response` must stay alive until `done` is called.
//
// Thread safety: Submit and Shutdown are thread-safe. `done` runs on a worker
// thread and must not block for long.
#ifndef MHA_SERVER_BATCHER_H_
#define MHA_SERVER_BATCHER_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "proto/attention.pb.h"
#include "server/metrics.h"
#include "server/model_repository.h"
#include "server/validation.h"

namespace mha::server {

struct WorkItem {
  ValidatedRequest request;
  attention::v1::AttendResponse* response = nullptr;  // output, attention, timing
  absl::Time deadline = absl::InfiniteFuture();
  std::function<bool()> cancelled;         // optional; polled at batch formation
  std::function<void(absl::Status)> done;  // called exactly once if Submit is OK
  absl::Time enqueued;                     // set by Submit
};

class Batcher {
 public:
  struct Options {
    int num_workers = 1;
  };

  // One queue per model of `models` (which must outlive the batcher), with the
  // model's BatchingPolicy. `metrics` may be null.
  static absl::StatusOr<std::unique_ptr<Batcher>> Create(const Options& options,
                                                         const ModelRepository& models,
                                                         Metrics* metrics);
  ~Batcher();  // Shutdown()

  // OK: queued, `done` will be called. RESOURCE_EXHAUSTED naming the model and
  // max_queue_size or max_queue_wait when over either; UNAVAILABLE after Shutdown.
  // Never blocks on compute.
  absl::Status Submit(WorkItem item);

  // What Submit would answer now for a request of `model`, without queueing: lets a
  // caller refuse before it validates (reads) the request. Submit checks again.
  absl::Status Admit(const Model* model) const;

  // Stops accepting, computes everything queued (batched, without waiting;
  // deadlines and cancellation still apply), then joins the workers. Idempotent.
  void Shutdown();

  int64_t queue_size() const;  // all models

 private:
  struct ModelQueue {
    const Model* model = nullptr;
    ModelMetrics* metrics = nullptr;
    std::deque<WorkItem> items;
    int64_t rows = 0;    // sum of B over items
    int64_t tokens = 0;  // sum of B * max(Q, K) over items
    // Compute time per padded token of this model's forward calls: an exponential
    // moving average (weight 1/4 on the newest call); 0 until the first call.
    double seconds_per_token = 0;
    int64_t computing_tokens = 0;  // in forward calls taken from this queue, not done
  };
  struct Batch {
    const Model* model = nullptr;
    ModelMetrics* metrics = nullptr;
    std::vector<WorkItem> items;     // computed together
    std::vector<WorkItem> expired;   // answered DEADLINE_EXCEEDED
    std::vector<WorkItem> cancelled; // answered CANCELLED
    int64_t tokens = 0;              // rows x padded length of the forward call
  };
  // A worker's reusable staging buffers for merged calls (grown, never shrunk,
  // so steady-state batches touch no new pages).
  struct Staging {
    std::vector<float> queries, keys, values, output;
    std::vector<int32_t> valid_lens;
  };

  explicit Batcher(const Options& options) : options_(options) {}
  void WorkerLoop();
  // Blocks until a batch is due (or stopping with nothing left: empty batch).
  Batch NextBatch();
  // Admit's and Submit's checks on the model's queue (nullptr: a model not served).
  absl::Status AdmitLocked(const ModelQueue* queue) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  ModelQueue* OldestQueue() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool Full(const ModelQueue& queue) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  Batch TakeBatch(ModelQueue& queue) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Run(Batch& batch, Staging& staging);
  // The batch's forward call is over: its tokens leave computing_tokens and, if it
  // computed, its time per token enters the model's average.
  void BatchDone(const Batch& batch, absl::Duration elapsed, bool computed);

  const Options options_;
  mutable absl::Mutex mu_;
  std::map<const Model*, ModelQueue> queues_ ABSL_GUARDED_BY(mu_);
  int64_t queued_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> workers_;
};

// One request's forward pass on the calling thread, straight into its response.
absl::Status RunForward(const ValidatedRequest& request,
                        attention::v1::AttendResponse* response);

}  // namespace mha::server

#endif  // MHA_SERVER_BATCHER_H_

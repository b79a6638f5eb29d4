// The dynamic batcher and compute scheduler: one queue per model and a fixed set
// of compute workers. Fronts only Submit work items (server/serving/work_item.h); this
// unit decides which items run together, and on which threads. It moves items,
// never tensor bytes: merging and splitting are server/serving/batch_merge.h's.
//
// Batching (per model, BatchingPolicy; shaped like Triton's dynamic batcher):
//   - A worker takes the model whose oldest queued request is oldest. If that
//     model's queue holds less than a full batch (max_batch_size rows or
//     max_batch_tokens tokens), the worker waits until it does, or until the oldest
//     request has waited max_queue_delay, whichever is first.
//   - It then forms one forward call from the oldest request and every later one
//     that can share it, in arrival order, up to max_batch_size rows and
//     max_batch_tokens = rows x max(Q, K) (the first request always fits).
//     Requests share a call when batch_merge's CanMerge allows it and neither
//     asks for attention weights (those run alone, as their (B, h, Q, K) output
//     is per request). Q and K may differ (batch_merge pads and masks).
//   - A merged call runs on no more OpenMP threads than the largest of its requests
//     would use alone (core::MultiHeadAttention::Threads): merging saves per-call
//     overhead, and on a small machine the fronts need the other cores for the
//     calls' RPCs (docs/performance.md, "Merging that never costs").
//   - Expired and cancelled requests met while forming a batch are answered
//     DEADLINE_EXCEEDED / CANCELLED and never computed.
//   - A full queue (max_queue_size) answers RESOURCE_EXHAUSTED at Submit, and so does
//     a queue whose expected wait is over max_queue_wait (when set): the padded
//     tokens queued for the model and in its forward calls in progress, times its
//     compute time per token (a moving average over its recent calls), over the
//     workers. An idle model admits any request; until it has computed once, only
//     max_queue_size applies.
//   - Session steps (WorkItem::step, server/serving/session_store.h) of different sessions of a
//     model merge with each other, never with requests: continuous batching, one
//     core::MultiHeadAttention::ForwardPaged call whose projections are one GEMM
//     over every step's new tokens and whose attention runs per session over its
//     own cached blocks, unpadded.
//   - Gathering session steps (policy.session_gather; the state is each queue's
//     SessionPacing, server/serving/session_pacing.h): a session whose last step
//     came within session_gather of the answer to the step before (a client
//     decoding in a loop) is prompt. When a session call ends, its prompt sessions
//     are awaited, and queued steps wait until every awaited session has queued
//     its next step (or ended: SessionEnded), or until session_gather has passed
//     since the later of that call's end and the oldest step's arrival. Sessions
//     decoding together then keep stepping as one call, instead of splitting into
//     the steps that arrived during the previous call and the rest. A session's
//     first step is not prompt; a session that goes quiet costs at most one such
//     wait (with several workers, one per session call that ends meanwhile: each
//     call's end replaces the awaited set) and is not awaited again until it steps
//     promptly; a lone session never waits. While the server's only session is
//     awaited and nothing is queued, one idle worker polls for its step (yielding
//     the core between looks) instead of sleeping, for at most session_gather after
//     its answer: a decode step then starts without a thread wake-up.
//     Steps wait only while nothing but steps is queued, for any model; warm-up
//     steps are neither awaited nor wait; an awaited session's step never runs
//     inline (below), so that it joins the others.
//   - policy.enabled = false: one request per forward call, no waiting.
//
// Inline execution (Options::inline_max_flops): a request of at most that much
// work (core::MultiHeadAttention::Flops; 2 MFLOP in the server, the toy model's
// (2, 4, 100) request is 0.8) runs on the thread that calls Submit, and `done` is
// called before Submit returns, when nothing is queued or computing for any model,
// the model is not warming up, its policy would not wait for company (batching
// off, or max_queue_delay 0) and, for a session step, no session is awaited. Then a worker could
// only have taken it alone and at once; inline it skips two thread hand-offs. Anything larger, or
// arriving while compute is busy, is queued, so a front's thread never computes
// for longer than a small request takes (tens of microseconds) and requests that
// arrive under load still merge. One inline call at a time: it counts as compute.
//
// Scheduling: `num_workers` workers, each running one forward call at a time on
// threads_per_worker OpenMP threads (the models are created with that count).
// One worker on every core gives the lowest latency for a single large request;
// several single-threaded workers suit small requests without batching.
//
//   auto batcher = Batcher::Create({.num_workers = 1}, &metrics).value();
//   batcher->AddModel(model);  // every model, before the first Submit
//   absl::Status s = batcher->Submit(WorkItem{
//       .model = model, .inputs = views, .output = out,
//       .done = [&](absl::Status s, const ComputeTiming& t) { ... }});
//   // s not OK (queue full, shutting down): `done` will never be called.
//
// A computed item's `output` (and `attention`, when set) is written before
// `done` is called with OK and its timing.
//
// Session steps are answered when their call has ended (Options::
// answer_steps_as_they_end false, the default): every step of the call, one after
// another on the worker's thread, each recorded for the gathering as answered when
// its own answer goes out. With answer_steps_as_they_end, a step's `done` may come
// before its call has ended: the core reports an attention-only model's decode steps
// done as it finishes each (ForwardPaged's step_done), and they are answered then,
// from the thread that finished them, so that their sessions' next steps queue while
// the call computes the others. Which is faster depends on the machine: where the
// call's threads fill every core, each answer and next step then take a core from
// the call (docs/performance.md, "Session steps answered at the call's end").
//
// Thread safety: Submit, SessionEnded and Shutdown are thread-safe. `done` runs on a worker
// thread (with answer_steps_as_they_end, or one of its call's OpenMP threads) and
// must not block for long.
#ifndef MHA_SERVER_SERVING_BATCHER_H_
#define MHA_SERVER_SERVING_BATCHER_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "core/attention.h"
#include "server/serving/batch_merge.h"
#include "server/serving/metrics.h"
#include "server/serving/model.h"
#include "server/serving/session_pacing.h"
#include "server/serving/work_item.h"

namespace mha::server {

class Batcher {
 public:
  // How Compute counts a forward call's threads, and what a model's warm-up prepares
  // for (server/models/model_lifecycle.cc): no more cores than the call's arithmetic
  // asks for, since the fronts need them for the other requests' RPCs. A lone small
  // call's extra threads (kAlone) cut its latency on idle cores but cost throughput
  // and tail latency under load (docs/performance.md, "One region for a small call").
  static constexpr core::MultiHeadAttention::ThreadRule kThreadRule =
      core::MultiHeadAttention::ThreadRule::kBeside;

  struct Options {
    int num_workers = 1;
    double inline_max_flops = 0;  // 0: never inline (see above)
    // Session steps answered as the core finishes each (see above); false: when
    // their call has ended.
    bool answer_steps_as_they_end = false;
  };

  // `metrics` may be null. INVALID_ARGUMENT naming num_workers when < 1.
  static absl::StatusOr<std::unique_ptr<Batcher>> Create(const Options& options, Metrics* metrics);

  // Adds a queue for `model` with its BatchingPolicy. INVALID_ARGUMENT naming the
  // model and max_queue_size when < 1. A `warming` model admits only warm-up items
  // (WorkItem::warmup) until SetReady; other requests get UNAVAILABLE naming the
  // warm-up. This is the admission gate only: the model's state, which readiness
  // answers read, is the models layer's (server/models/model_states.h), whose
  // lifecycle calls SetReady as the version turns ready.
  absl::Status AddModel(std::shared_ptr<const Model> model, bool warming = false);
  void SetReady(const Model* model);
  // Retires `model`'s queue (a reload replaced the model, or removed it): requests
  // that found the model before still queue and compute; the queue and the
  // batcher's reference go once it is empty, no forward call of it runs and no one
  // else holds the model (checked here, after every forward call, and every second
  // by an idle worker while a retired queue remains), and its pages go back to the
  // system.
  void RemoveModel(const Model* model);
  bool IsReady(const Model* model) const;  // queued and not warming up (admits requests)
  // True while an idle worker polls for a lone session's next step (the gather window
  // after its answer; see "Gathering session steps" above).
  bool polling() const;
  ~Batcher();  // Shutdown()

  // OK: queued, `done` will be called (or, inline, was called). RESOURCE_EXHAUSTED
  // naming the model and max_queue_size or max_queue_wait when over either;
  // UNAVAILABLE after Shutdown. Never waits for other requests' compute; computes
  // only an inline request.
  absl::Status Submit(WorkItem item);

  // What Submit would answer now for a request of `model`, without queueing: lets a
  // caller refuse before it validates (reads) the request. Submit checks again.
  absl::Status Admit(const Model* model) const;

  // The session whose steps are `step` (WorkItem::step) sends no more: queued steps
  // of `model` stop awaiting it.
  void SessionEnded(const Model* model, const core::PagedStep* step);

  // Stops accepting, computes everything queued (batched, without waiting;
  // deadlines and cancellation still apply), joins the workers and waits for inline
  // calls in progress. Idempotent.
  void Shutdown();

  int64_t queue_size() const;  // all models

 private:
  struct ModelQueue {
    std::shared_ptr<const Model> owner;
    const Model* model = nullptr;  // owner.get()
    ModelMetrics* metrics = nullptr;
    std::deque<WorkItem> items;
    int64_t rows = 0;    // sum of B over items
    int64_t tokens = 0;  // sum of B * max(Q, K) over items
    // Compute time per padded token of this model's forward calls: an exponential
    // moving average (weight 1/4 on the newest call); 0 until the first call.
    double seconds_per_token = 0;
    int64_t computing_tokens = 0;  // in forward calls taken from this queue, not done
    bool warming = false;          // admits warm-up items only
    bool retiring = false;         // RemoveModel'd: erased once unused
    int waiters = 0;               // workers awaiting a condition that reads this queue
    SessionPacing pacing;          // its sessions' steps (gathering, above)
  };
  struct Batch {
    const Model* model = nullptr;
    ModelMetrics* metrics = nullptr;
    std::vector<WorkItem> items;      // computed together
    std::vector<WorkItem> expired;    // answered DEADLINE_EXCEEDED
    std::vector<WorkItem> cancelled;  // answered CANCELLED
    int64_t tokens = 0;               // rows x padded length of the forward call
    bool sweep = false;               // nothing to run: the worker sweeps retired queues
  };
  Batcher(const Options& options, Metrics* metrics) : options_(options), metrics_(metrics) {}
  void WorkerLoop();
  // Blocks until a batch is due (or stopping with nothing left: empty batch).
  Batch NextBatch();
  // Erases the retiring queues no one uses any more; returns their models, to be
  // freed outside mu_.
  std::vector<std::shared_ptr<const Model>> SweepLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // SweepLocked, then frees those models and returns their memory to the system.
  void Sweep();
  // Admit's and Submit's checks on the model's queue (nullptr: a model not served).
  absl::Status AdmitLocked(const ModelQueue* queue, bool warmup) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  ModelQueue* OldestQueue() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool Full(const ModelQueue& queue) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether the queue's steps wait for awaited sessions now (gathering, above).
  bool Gathers(const ModelQueue& queue) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  Batch TakeBatch(ModelQueue& queue) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether `item`, admitted to `queue`, runs inline (see above).
  bool RunsInline(const ModelQueue& queue, const WorkItem& item) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A worker's reusable state for merged calls.
  struct Worker {
    BatchMerger merger;
    std::vector<BatchPart> parts;
    std::vector<core::PagedStep> steps;
  };
  void Run(Batch& batch, Worker* worker);
  // Answers the batch's expired and cancelled items; they are never computed.
  void AnswerDropped(Batch& batch, absl::Time now);
  // The batch's items as one forward call, merged (in `worker`) when there are
  // several; `worker` may be null for a batch of one.
  // Session steps the core is done with are passed to step_done (by their index in
  // batch.items) as they end.
  absl::Status Compute(const Batch& batch, Worker* worker,
                       absl::FunctionRef<void(size_t)> step_done);
  // The batch's forward call is over: its tokens leave computing_tokens and, if it
  // computed, its time per token enters the model's average. A session call's
  // steps were answered before, if it computed (Run).
  void BatchDone(const Batch& batch, absl::Duration elapsed, bool computed);
  // When the server's only session is awaited: the time until which an idle worker
  // polls for its step (see above); else InfinitePast. NextBatch asks only when the
  // worker has nothing to do.
  absl::Time LoneSessionPoll() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Options options_;
  Metrics* const metrics_;
  mutable absl::Mutex mu_;
  std::map<const Model*, ModelQueue> queues_ ABSL_GUARDED_BY(mu_);
  int64_t queued_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t computing_ ABSL_GUARDED_BY(mu_) = 0;        // forward calls in progress, inline too
  int64_t retiring_ ABSL_GUARDED_BY(mu_) = 0;         // queues marked retiring
  std::atomic<bool> any_retiring_{false};             // retiring_ > 0, read without mu_
  bool wake_for_sweep_ ABSL_GUARDED_BY(mu_) = false;  // RemoveModel wakes an idle worker
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  // Bumped by whatever gives an idle worker something to do (an item queued, a
  // sweep, Shutdown), so that a polling worker sees it without mu_.
  std::atomic<int64_t> wakes_{0};
  bool polling_ ABSL_GUARDED_BY(mu_) = false;  // one worker polls at a time
  std::vector<std::thread> workers_;
};

}  // namespace mha::server

#endif  // MHA_SERVER_SERVING_BATCHER_H_

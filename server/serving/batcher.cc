#include "server/serving/batcher.h"

#include <malloc.h>

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace mha::server {
namespace {

bool CanShare(const WorkItem& a, const WorkItem& b) {
  // Session steps share a call with each other only (ForwardPaged), never padded.
  if ((a.step != nullptr) != (b.step != nullptr)) return false;
  if (a.step != nullptr) return true;
  if (a.attention != nullptr || b.attention != nullptr) return false;
  if (a.lse != nullptr || b.lse != nullptr) return false;
  return CanMerge(a.inputs, b.inputs, a.model != nullptr && a.model->config.rope.has_value());
}

}  // namespace

absl::StatusOr<std::unique_ptr<Batcher>> Batcher::Create(const Options& options, Metrics* metrics) {
  if (options.num_workers < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_workers: expected >= 1, got ", options.num_workers));
  }
  std::unique_ptr<Batcher> batcher(new Batcher(options, metrics));
  for (int i = 0; i < options.num_workers; ++i) {
    batcher->workers_.emplace_back([b = batcher.get()] { b->WorkerLoop(); });
  }
  return batcher;
}

absl::Status Batcher::AddModel(std::shared_ptr<const Model> model, bool warming) {
  if (model->batching.max_queue_size < 1) {
    return absl::InvalidArgumentError(absl::StrCat("model ", model->name,
                                                   ": max_queue_size: expected >= 1, got ",
                                                   model->batching.max_queue_size));
  }
  absl::MutexLock lock(&mu_);
  ModelQueue& queue = queues_[model.get()];
  queue.model = model.get();
  queue.metrics = metrics_ != nullptr ? &metrics_->ForModel(model->name) : nullptr;
  queue.warming = warming;
  queue.owner = std::move(model);
  return absl::OkStatus();
}

void Batcher::RemoveModel(const Model* model) {
  {
    absl::MutexLock lock(&mu_);
    const auto it = queues_.find(model);
    if (it == queues_.end() || it->second.retiring) return;
    it->second.retiring = true;
    ++retiring_;
    any_retiring_.store(true, std::memory_order_relaxed);
    wake_for_sweep_ = true;  // an idle worker then looks every second until it goes
    wakes_.fetch_add(1, std::memory_order_release);
  }
  Sweep();
}

std::vector<std::shared_ptr<const Model>> Batcher::SweepLocked() {
  std::vector<std::shared_ptr<const Model>> unused;
  for (auto it = queues_.begin(); it != queues_.end();) {
    ModelQueue& queue = it->second;
    // use_count 1: only this queue holds the model, and no one can copy it anew.
    if (queue.retiring && queue.items.empty() && queue.computing_tokens == 0 &&
        queue.waiters == 0 && queue.owner.use_count() == 1) {
      unused.push_back(std::move(queue.owner));
      it = queues_.erase(it);
      --retiring_;
    } else {
      ++it;
    }
  }
  any_retiring_.store(retiring_ > 0, std::memory_order_relaxed);
  return unused;
}

void Batcher::Sweep() {
  if (!any_retiring_.load(std::memory_order_relaxed)) return;
  std::vector<std::shared_ptr<const Model>> unused;
  {
    absl::MutexLock lock(&mu_);
    unused = SweepLocked();
  }
  if (unused.empty()) return;
  unused.clear();  // frees the models (milliseconds for large ones) outside mu_
  // Their weights were large blocks: give the pages back, so RSS after a reload is
  // what it was before it.
  malloc_trim(0);
}

void Batcher::SetReady(const Model* model) {
  absl::MutexLock lock(&mu_);
  if (const auto it = queues_.find(model); it != queues_.end()) it->second.warming = false;
}

bool Batcher::IsReady(const Model* model) const {
  absl::MutexLock lock(&mu_);
  const auto it = queues_.find(model);
  return it != queues_.end() && !it->second.warming;
}

bool Batcher::polling() const {
  absl::MutexLock lock(&mu_);
  return polling_;
}

Batcher::~Batcher() { Shutdown(); }

absl::Status Batcher::Admit(const Model* model) const {
  absl::MutexLock lock(&mu_);
  const auto it = queues_.find(model);
  return AdmitLocked(it == queues_.end() ? nullptr : &it->second, /*warmup=*/false);
}

absl::Status Batcher::AdmitLocked(const ModelQueue* found, bool warmup) const {
  if (stopping_) return absl::UnavailableError("server is shutting down");
  if (found == nullptr) {
    return absl::InternalError("request for a model the batcher does not serve");
  }
  const ModelQueue& queue = *found;
  if (queue.warming && !warmup) {
    return absl::UnavailableError(
        absl::StrCat("model ", queue.model->name, " is warming up (", queue.model->warmup.size(),
                     " warm-up pass(es)); retry when its health is SERVING"));
  }
  const int64_t limit = queue.model->batching.max_queue_size;
  if (static_cast<int64_t>(queue.items.size()) >= limit) {
    return absl::ResourceExhaustedError(absl::StrCat("queue full for model ", queue.model->name,
                                                     ": max_queue_size ", limit,
                                                     " requests waiting; retry later"));
  }
  const absl::Duration max_wait = queue.model->batching.max_queue_wait;
  if (max_wait > absl::ZeroDuration() && queue.seconds_per_token > 0) {
    const absl::Duration wait =
        absl::Seconds(static_cast<double>(queue.tokens + queue.computing_tokens) *
                      queue.seconds_per_token / options_.num_workers);
    if (wait > max_wait) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "queue for model ", queue.model->name, " would take about ",
          absl::ToInt64Microseconds(wait), " us to reach this request: over max_queue_wait_us ",
          absl::ToInt64Microseconds(max_wait), "; retry later"));
    }
  }
  return absl::OkStatus();
}

bool Batcher::RunsInline(const ModelQueue& queue, const WorkItem& item) const {
  if (options_.inline_max_flops <= 0 || queued_ > 0 || computing_ > 0 || item.warmup ||
      !item.may_run_inline) {
    return false;
  }
  // Awaited sessions' steps are gathered by a worker (batcher.h).
  if (item.step != nullptr && queue.pacing.awaiting()) return false;
  const BatchingPolicy& policy = queue.model->batching;
  if (policy.enabled && policy.max_queue_delay > absl::ZeroDuration()) return false;
  const core::AttentionInputs& in = item.inputs;
  double flops =
      core::MultiHeadAttention::Flops(queue.model->config, in.batch, in.num_queries, in.num_keys);
  if (item.step != nullptr) {  // its queries also attend to every cached key
    flops += 4.0 * static_cast<double>(in.num_queries * item.step->cache->size() *
                                       queue.model->config.num_hiddens);
  }
  return flops <= options_.inline_max_flops;
}

absl::Status Batcher::Submit(WorkItem item) {
  Batch inline_batch;
  {
    absl::MutexLock lock(&mu_);
    const auto it = queues_.find(item.model.get());
    MHA_RETURN_IF_ERROR(AdmitLocked(it == queues_.end() ? nullptr : &it->second, item.warmup));
    ModelQueue& queue = it->second;
    item.enqueued = absl::Now();
    if (item.step != nullptr && !item.warmup) {
      queue.pacing.Queued(item.step, item.enqueued, queue.model->batching.session_gather);
    }
    if (!RunsInline(queue, item)) {
      queue.rows += item.rows();
      queue.tokens += item.rows() * item.length();
      queue.items.push_back(std::move(item));
      ++queued_;
      wakes_.fetch_add(1, std::memory_order_release);
      if (queue.metrics != nullptr) {
        queue.metrics->queue_depth().Set(static_cast<double>(queue.items.size()));
      }
      return absl::OkStatus();
    }
    inline_batch = Batch{
        .model = queue.model, .metrics = queue.metrics, .tokens = item.rows() * item.length()};
    inline_batch.items.push_back(std::move(item));
    queue.computing_tokens += inline_batch.tokens;
    ++computing_;
  }
  Run(inline_batch, /*worker=*/nullptr);
  inline_batch = {};
  Sweep();
  return absl::OkStatus();
}

void Batcher::SessionEnded(const Model* model, const core::PagedStep* step) {
  absl::MutexLock lock(&mu_);
  if (const auto it = queues_.find(model); it != queues_.end()) it->second.pacing.Ended(step);
}

int64_t Batcher::queue_size() const {
  absl::MutexLock lock(&mu_);
  return queued_;
}

void Batcher::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    wakes_.fetch_add(1, std::memory_order_release);
  }
  for (std::thread& worker : workers_) {
    if (worker.joinable()) worker.join();
  }
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(
      +[](int64_t* computing) { return *computing == 0; }, &computing_));
}

Batcher::ModelQueue* Batcher::OldestQueue() {
  ModelQueue* oldest = nullptr;
  for (auto& [model, queue] : queues_) {
    if (queue.items.empty()) continue;
    if (oldest == nullptr || queue.items.front().enqueued < oldest->items.front().enqueued) {
      oldest = &queue;
    }
  }
  return oldest;
}

bool Batcher::Gathers(const ModelQueue& queue) const {
  const BatchingPolicy& policy = queue.model->batching;
  if (stopping_ || !policy.enabled || policy.session_gather <= absl::ZeroDuration() ||
      !queue.pacing.awaiting() || Full(queue)) {
    return false;
  }
  // Only steps wait, and only when nothing else is queued: a request, or another
  // model's work, is never held up for a session that has not stepped yet.
  if (queued_ != static_cast<int64_t>(queue.items.size())) return false;
  return std::all_of(queue.items.begin(), queue.items.end(),
                     [](const WorkItem& item) { return item.step != nullptr && !item.warmup; });
}

absl::Time Batcher::LoneSessionPoll() const {
  const ModelQueue* lone = nullptr;
  for (const auto& [model, queue] : queues_) {
    if (queue.pacing.sessions() == 0) continue;
    if (lone != nullptr || queue.pacing.sessions() > 1) return absl::InfinitePast();
    lone = &queue;
  }
  if (lone == nullptr) return absl::InfinitePast();
  return lone->pacing.PollDeadline(lone->model->batching.session_gather);
}

bool Batcher::Full(const ModelQueue& queue) const {
  const BatchingPolicy& policy = queue.model->batching;
  return queue.rows >= policy.max_batch_size || queue.tokens >= policy.max_batch_tokens;
}

Batcher::Batch Batcher::TakeBatch(ModelQueue& queue) {
  const BatchingPolicy& policy = queue.model->batching;
  Batch batch{.model = queue.model, .metrics = queue.metrics};
  const absl::Time now = absl::Now();
  std::deque<WorkItem> kept;
  int64_t rows = 0;
  int64_t length = 0;
  bool closed = false;
  for (WorkItem& item : queue.items) {
    if (closed) {
      kept.push_back(std::move(item));
    } else if (now >= item.deadline) {
      batch.expired.push_back(std::move(item));
    } else if (item.cancelled && item.cancelled()) {
      batch.cancelled.push_back(std::move(item));
    } else if (batch.items.empty()) {
      rows = item.rows();
      length = item.length();
      closed = !policy.enabled || item.attention != nullptr || item.lse != nullptr;
      batch.items.push_back(std::move(item));
    } else if (CanShare(batch.items.front(), item) && rows + item.rows() <= policy.max_batch_size &&
               (rows + item.rows()) * std::max(length, item.length()) <= policy.max_batch_tokens) {
      rows += item.rows();
      length = std::max(length, item.length());
      batch.items.push_back(std::move(item));
    } else {
      kept.push_back(std::move(item));
    }
    if (rows >= policy.max_batch_size) closed = true;
  }
  batch.tokens = rows * length;
  queue.computing_tokens += batch.tokens;
  if (!batch.items.empty()) ++computing_;
  queue.items = std::move(kept);
  queue.rows = 0;
  queue.tokens = 0;
  for (const WorkItem& item : queue.items) {
    queue.rows += item.rows();
    queue.tokens += item.rows() * item.length();
  }
  queued_ -=
      static_cast<int64_t>(batch.items.size() + batch.expired.size() + batch.cancelled.size());
  if (queue.metrics != nullptr) {
    queue.metrics->queue_depth().Set(static_cast<double>(queue.items.size()));
  }
  return batch;
}

Batcher::Batch Batcher::NextBatch() {
  absl::MutexLock lock(&mu_);
  while (true) {
    const absl::Condition due(
        +[](Batcher* b) ABSL_NO_THREAD_SAFETY_ANALYSIS {
          return b->stopping_ || b->queued_ > 0 || b->wake_for_sweep_;
        },
        this);
    if (const absl::Time until = polling_ || due.Eval() ? absl::InfinitePast() : LoneSessionPoll();
        absl::Now() < until) {
      // A lone session's next step is due within the round trip of its answer:
      // look for it without sleeping, so that no thread wake-up stands between its
      // arrival and its compute (batcher.h, "Gathering session steps").
      const int64_t seen = wakes_.load(std::memory_order_acquire);
      polling_ = true;
      mu_.Unlock();
      while (wakes_.load(std::memory_order_acquire) == seen && absl::Now() < until) {
        std::this_thread::yield();
      }
      mu_.Lock();
      polling_ = false;
      continue;
    }
    if (retiring_ > 0 && !stopping_) {
      // A retired model goes once its last holder lets go, which may be a front
      // after its answer: look again every second while one waits.
      if (!mu_.AwaitWithTimeout(due, absl::Seconds(1))) return Batch{.sweep = true};
    } else {
      mu_.Await(due);
    }
    if (std::exchange(wake_for_sweep_, false) && queued_ == 0 && !stopping_) {
      return Batch{.sweep = true};
    }
    ModelQueue* queue = OldestQueue();
    if (queue == nullptr) return {};  // stopping, and everything is done
    const BatchingPolicy& policy = queue->model->batching;
    if (Gathers(*queue)) {
      const absl::Time due =
          queue->pacing.GatherDeadline(queue->items.front().enqueued, policy.session_gather);
      if (absl::Now() < due) {
        // Wait for the awaited sessions, the delay, or a reason to stop gathering.
        auto ready = [this, queue]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
          return queue->items.empty() || !Gathers(*queue);
        };
        ++queue->waiters;
        mu_.AwaitWithDeadline(absl::Condition(&ready), due);
        --queue->waiters;
        continue;
      }
    }
    // Warm-up items are due at once: nothing can join them (requests for a warming
    // model are refused), so waiting the batching delay would only stretch start-up.
    if (!stopping_ && policy.enabled && !Full(*queue) && !queue->items.front().warmup) {
      const absl::Time due = queue->items.front().enqueued + policy.max_queue_delay;
      if (absl::Now() < due) {
        // Wait for a full batch, the delay, or another worker taking the queue.
        auto ready = [this, queue]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
          return stopping_ || queue->items.empty() || Full(*queue);
        };
        ++queue->waiters;  // the condition reads the queue: SweepLocked keeps it
        mu_.AwaitWithDeadline(absl::Condition(&ready), due);
        --queue->waiters;
        continue;
      }
    }
    return TakeBatch(*queue);
  }
}

void Batcher::WorkerLoop() {
  Worker worker;
  while (true) {
    {
      Batch batch = NextBatch();
      if (batch.model == nullptr && !batch.sweep) return;
      if (!batch.sweep) Run(batch, &worker);
    }
    Sweep();  // after the batch's items, and their model references, are gone
  }
}

void Batcher::BatchDone(const Batch& batch, absl::Duration elapsed, bool computed) {
  absl::MutexLock lock(&mu_);
  ModelQueue& queue = queues_.at(batch.model);
  queue.computing_tokens -= batch.tokens;
  --computing_;
  const WorkItem& front = batch.items.front();
  if (front.step != nullptr && !front.warmup) {
    // A computed call's steps are all answered by now (Run); a failed call's are
    // answered next, and its sessions end.
    queue.pacing.CallEnded(batch.items, computed, absl::Now());
  }
  // Warm-up passes are cold by design (packing, primitives): not the model's pace.
  if (!computed || batch.tokens == 0 || front.warmup) return;
  const double sample = absl::ToDoubleSeconds(elapsed) / static_cast<double>(batch.tokens);
  double& average = queue.seconds_per_token;
  average = average == 0 ? sample : 0.75 * average + 0.25 * sample;
}

void Batcher::Run(Batch& batch, Worker* worker) {
  const absl::Time start = absl::Now();
  AnswerDropped(batch, start);
  if (batch.items.empty()) return;

  int64_t rows = 0;
  int64_t queries = 0;  // padded Q of the call
  for (const WorkItem& item : batch.items) {
    rows += item.rows();
    queries = std::max(queries, item.inputs.num_queries);
  }
  // A warming model admits warm-up items only, so a batch is all warm-up or none:
  // warm-up passes stay out of the request metrics.
  ModelMetrics* metrics = batch.items.front().warmup ? nullptr : batch.metrics;
  auto answer = [&](WorkItem& item, const absl::Status& status, absl::Time end) {
    if (metrics != nullptr) {
      metrics->queue_duration().Observe(absl::ToDoubleSeconds(start - item.enqueued));
    }
    item.done(
        status,
        ComputeTiming{.queue = start - item.enqueued, .compute = end - start, .batch_rows = rows});
  };
  // A session step is answered with its own answer's time recorded for the
  // gathering (SessionPacing::Answered), so that a session is judged prompt by how
  // soon its next step follows that answer. One byte per item: each is written by
  // one thread.
  std::vector<uint8_t> answered(batch.items.size(), 0);
  auto answer_step = [&](size_t i, absl::Time end) {
    WorkItem& item = batch.items[i];
    if (!item.warmup) {
      absl::MutexLock lock(&mu_);
      queues_.at(batch.model).pacing.Answered(item.step, absl::Now());
    }
    answer(item, absl::OkStatus(), end);
    answered[i] = 1;
  };
  // With answer_steps_as_they_end, the steps the core reports done while it computes
  // the others are answered then, from the thread that finished them (batcher.h).
  auto step_done = [&](size_t i) {
    if (options_.answer_steps_as_they_end) answer_step(i, absl::Now());
  };
  const absl::Status status = Compute(batch, worker, step_done);
  const absl::Time end = absl::Now();
  if (status.ok() && batch.items.front().step != nullptr) {
    for (size_t i = 0; i < batch.items.size(); ++i) {
      if (!answered[i]) answer_step(i, end);
    }
  }
  BatchDone(batch, end - start, status.ok());
  if (metrics != nullptr) {
    metrics->Batch(static_cast<int64_t>(batch.items.size()), rows, rows * queries, end - start);
  }
  for (size_t i = 0; i < batch.items.size(); ++i) {
    if (!answered[i]) answer(batch.items[i], status, end);
  }
}

void Batcher::AnswerDropped(Batch& batch, absl::Time now) {
  for (WorkItem& item : batch.expired) {
    item.done(absl::DeadlineExceededError(absl::StrCat(
                  "deadline passed while queued for ",
                  absl::ToInt64Microseconds(now - item.enqueued), " us; not computed")),
              {});
  }
  for (WorkItem& item : batch.cancelled) {
    item.done(absl::CancelledError("call cancelled by the client while queued; not computed"), {});
  }
}

absl::Status Batcher::Compute(const Batch& batch, Worker* worker,
                              absl::FunctionRef<void(size_t)> step_done) {
  const core::MultiHeadAttention& attention = *batch.model->attention;
  auto threads_of = [&attention](const core::AttentionInputs& inputs) {
    return attention.Threads(inputs, kThreadRule);
  };
  if (batch.items.front().step != nullptr) {  // session steps (CanShare: all of them)
    if (batch.items.size() == 1) {
      return attention.ForwardPaged({batch.items.front().step, 1}, step_done);
    }
    worker->steps.clear();
    for (const WorkItem& item : batch.items) worker->steps.push_back(*item.step);
    return attention.ForwardPaged(worker->steps, step_done);
  }
  if (batch.items.size() == 1) {
    const WorkItem& item = batch.items.front();
    return attention.Forward(item.inputs, item.output, item.attention, threads_of(item.inputs),
                             item.lse);
  }
  worker->parts.clear();
  for (const WorkItem& item : batch.items) {
    worker->parts.push_back(BatchPart{.inputs = &item.inputs, .output = item.output});
  }
  const core::ModelConfig& config = batch.model->config;
  const core::AttentionInputs merged = worker->merger.Merge(worker->parts, config);
  // Merging saves per-call overhead; it takes no more cores than the largest request.
  int threads = 1;
  for (const WorkItem& item : batch.items) threads = std::max(threads, threads_of(item.inputs));
  MHA_RETURN_IF_ERROR(
      attention.Forward(merged, worker->merger.output(), /*attention=*/nullptr, threads));
  worker->merger.Scatter(worker->parts, config);
  return absl::OkStatus();
}

}  // namespace mha::server

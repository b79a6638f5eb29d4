#include "server/batcher.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"

namespace mha::server {
namespace {

using attention::v1::AttendResponse;

int64_t Rows(const WorkItem& item) { return item.request.inputs.batch; }

// The sequence length a request pads a batch to: max(Q, K).
int64_t Length(const WorkItem& item) {
  return std::max(item.request.inputs.num_queries, item.request.inputs.num_keys);
}

bool CanShare(const ValidatedRequest& a, const ValidatedRequest& b) {
  if (a.return_attention || b.return_attention) return false;
  const core::AttentionInputs& x = a.inputs;
  const core::AttentionInputs& y = b.inputs;
  return x.self_attention() == y.self_attention() && x.causal == y.causal &&
         std::equal(x.head_mask.begin(), x.head_mask.end(), y.head_mask.begin(),
                    y.head_mask.end());
}

// Sets the response's output shape (B, Q, p_o) and returns its data, sized.
float* PrepareOutput(const ValidatedRequest& request, AttendResponse* response) {
  const core::AttentionInputs& in = request.inputs;
  attention::v1::Tensor* output = response->mutable_output();
  output->clear_shape();
  output->add_shape(in.batch);
  output->add_shape(in.num_queries);
  output->add_shape(request.model->config.num_hiddens);
  output->mutable_data()->Resize(static_cast<int>(request.output_elements()), 0.0f);
  return output->mutable_data()->mutable_data();
}

// Copies B rows of `length` x `width` floats into a batch buffer whose rows hold
// `padded` x `width`, starting at batch row `row0`.
void CopyIn(const float* source, int64_t batch, int64_t length, int64_t width, float* dest,
            int64_t row0, int64_t padded) {
  for (int64_t b = 0; b < batch; ++b) {
    std::memcpy(dest + (row0 + b) * padded * width, source + b * length * width,
                sizeof(float) * length * width);
  }
}

}  // namespace

absl::Status RunForward(const ValidatedRequest& request, AttendResponse* response) {
  float* output = PrepareOutput(request, response);
  float* attention = nullptr;
  if (request.return_attention) {
    const core::AttentionInputs& in = request.inputs;
    attention::v1::Tensor* weights = response->mutable_attention();
    weights->clear_shape();
    for (int64_t d : {in.batch, request.model->config.num_heads, in.num_queries, in.num_keys}) {
      weights->add_shape(d);
    }
    weights->mutable_data()->Resize(static_cast<int>(request.attention_elements()), 0.0f);
    attention = weights->mutable_data()->mutable_data();
  }
  return request.model->attention->Forward(request.inputs, output, attention);
}

absl::StatusOr<std::unique_ptr<Batcher>> Batcher::Create(const Options& options,
                                                         const ModelRepository& models,
                                                         Metrics* metrics) {
  if (options.num_workers < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("compute_workers: expected >= 1, got ", options.num_workers));
  }
  std::unique_ptr<Batcher> batcher(new Batcher(options));
  {
    absl::MutexLock lock(&batcher->mu_);
    for (const Model* model : models.models()) {
      if (model->batching.max_queue_size < 1) {
        return absl::InvalidArgumentError(absl::StrCat(
            "model ", model->name, ": max_queue_size: expected >= 1, got ",
            model->batching.max_queue_size));
      }
      ModelQueue& queue = batcher->queues_[model];
      queue.model = model;
      queue.metrics = metrics != nullptr ? &metrics->ForModel(model->name) : nullptr;
    }
  }
  for (int i = 0; i < options.num_workers; ++i) {
    batcher->workers_.emplace_back([b = batcher.get()] { b->WorkerLoop(); });
  }
  return batcher;
}

Batcher::~Batcher() { Shutdown(); }

absl::Status Batcher::Admit(const Model* model) const {
  absl::MutexLock lock(&mu_);
  const auto it = queues_.find(model);
  return AdmitLocked(it == queues_.end() ? nullptr : &it->second);
}

absl::Status Batcher::AdmitLocked(const ModelQueue* found) const {
  if (stopping_) return absl::UnavailableError("server is shutting down");
  if (found == nullptr) {
    return absl::InternalError("request for a model the batcher does not serve");
  }
  const ModelQueue& queue = *found;
  const int64_t limit = queue.model->batching.max_queue_size;
  if (static_cast<int64_t>(queue.items.size()) >= limit) {
    return absl::ResourceExhaustedError(
        absl::StrCat("queue full for model ", queue.model->name, ": max_queue_size ", limit,
                     " requests waiting; retry later"));
  }
  const absl::Duration max_wait = queue.model->batching.max_queue_wait;
  if (max_wait > absl::ZeroDuration() && queue.seconds_per_token > 0) {
    const absl::Duration wait = absl::Seconds(
        static_cast<double>(queue.tokens + queue.computing_tokens) * queue.seconds_per_token /
        options_.num_workers);
    if (wait > max_wait) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "queue for model ", queue.model->name, " would take about ",
          absl::ToInt64Microseconds(wait), " us to reach this request: over max_queue_wait_us ",
          absl::ToInt64Microseconds(max_wait), "; retry later"));
    }
  }
  return absl::OkStatus();
}

absl::Status Batcher::Submit(WorkItem item) {
  absl::MutexLock lock(&mu_);
  const auto it = queues_.find(item.request.model);
  MHA_RETURN_IF_ERROR(AdmitLocked(it == queues_.end() ? nullptr : &it->second));
  ModelQueue& queue = it->second;
  item.enqueued = absl::Now();
  queue.rows += Rows(item);
  queue.tokens += Rows(item) * Length(item);
  queue.items.push_back(std::move(item));
  ++queued_;
  if (queue.metrics != nullptr) {
    queue.metrics->queue_depth().Set(static_cast<double>(queue.items.size()));
  }
  return absl::OkStatus();
}

int64_t Batcher::queue_size() const {
  absl::MutexLock lock(&mu_);
  return queued_;
}

void Batcher::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  for (std::thread& worker : workers_) {
    if (worker.joinable()) worker.join();
  }
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
      rows = Rows(item);
      length = Length(item);
      closed = !policy.enabled || item.request.return_attention;
      batch.items.push_back(std::move(item));
    } else if (CanShare(batch.items.front().request, item.request) &&
               rows + Rows(item) <= policy.max_batch_size &&
               (rows + Rows(item)) * std::max(length, Length(item)) <=
                   policy.max_batch_tokens) {
      rows += Rows(item);
      length = std::max(length, Length(item));
      batch.items.push_back(std::move(item));
    } else {
      kept.push_back(std::move(item));
    }
    if (rows >= policy.max_batch_size) closed = true;
  }
  batch.tokens = rows * length;
  queue.computing_tokens += batch.tokens;
  queue.items = std::move(kept);
  queue.rows = 0;
  queue.tokens = 0;
  for (const WorkItem& item : queue.items) {
    queue.rows += Rows(item);
    queue.tokens += Rows(item) * Length(item);
  }
  queued_ -= static_cast<int64_t>(batch.items.size() + batch.expired.size() +
                                  batch.cancelled.size());
  if (queue.metrics != nullptr) {
    queue.metrics->queue_depth().Set(static_cast<double>(queue.items.size()));
  }
  return batch;
}

Batcher::Batch Batcher::NextBatch() {
  absl::MutexLock lock(&mu_);
  while (true) {
    mu_.Await(absl::Condition(
        +[](Batcher* b) ABSL_NO_THREAD_SAFETY_ANALYSIS { return b->stopping_ || b->queued_ > 0; },
        this));
    ModelQueue* queue = OldestQueue();
    if (queue == nullptr) return {};  // stopping, and everything is done
    const BatchingPolicy& policy = queue->model->batching;
    if (!stopping_ && policy.enabled && !Full(*queue)) {
      const absl::Time due = queue->items.front().enqueued + policy.max_queue_delay;
      if (absl::Now() < due) {
        // Wait for a full batch, the delay, or another worker taking the queue.
        auto ready = [this, queue]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
          return stopping_ || queue->items.empty() || Full(*queue);
        };
        mu_.AwaitWithDeadline(absl::Condition(&ready), due);
        continue;
      }
    }
    return TakeBatch(*queue);
  }
}

void Batcher::WorkerLoop() {
  Staging staging;
  while (true) {
    Batch batch = NextBatch();
    if (batch.model == nullptr) return;
    Run(batch, staging);
  }
}

void Batcher::BatchDone(const Batch& batch, absl::Duration elapsed, bool computed) {
  absl::MutexLock lock(&mu_);
  ModelQueue& queue = queues_.at(batch.model);
  queue.computing_tokens -= batch.tokens;
  if (!computed || batch.tokens == 0) return;
  const double sample = absl::ToDoubleSeconds(elapsed) / static_cast<double>(batch.tokens);
  double& average = queue.seconds_per_token;
  average = average == 0 ? sample : 0.75 * average + 0.25 * sample;
}

void Batcher::Run(Batch& batch, Staging& staging) {
  const absl::Time start = absl::Now();
  for (WorkItem& item : batch.expired) {
    item.done(absl::DeadlineExceededError(
        absl::StrCat("deadline passed while queued for ",
                     absl::ToInt64Microseconds(start - item.enqueued), " us; not computed")));
  }
  for (WorkItem& item : batch.cancelled) {
    item.done(absl::CancelledError("call cancelled by the client while queued; not computed"));
  }
  if (batch.items.empty()) return;

  const core::ModelConfig& config = batch.model->config;
  int64_t rows = 0;
  int64_t queries = 0;  // padded Q of the call
  int64_t keys = 0;     // padded K
  for (const WorkItem& item : batch.items) {
    rows += item.request.inputs.batch;
    queries = std::max(queries, item.request.inputs.num_queries);
    keys = std::max(keys, item.request.inputs.num_keys);
  }

  absl::Status status;
  if (batch.items.size() == 1) {
    status = RunForward(batch.items.front().request, batch.items.front().response);
  } else {
    // Merge: zero-padded copies, every padded key masked through valid_lens.
    const core::AttentionInputs& first = batch.items.front().request.inputs;
    const bool self = first.self_attention();
    if (self) keys = queries;
    bool per_query = false;  // any request with one valid_len per query
    bool need_lens = false;
    for (const WorkItem& item : batch.items) {
      const core::AttentionInputs& in = item.request.inputs;
      const int64_t n = static_cast<int64_t>(in.valid_lens.size());
      if (n > 0) need_lens = true;
      if (n > 0 && n != in.batch) per_query = true;
      if (in.num_keys < keys) need_lens = true;
    }
    staging.queries.assign(rows * queries * config.query_size, 0.0f);
    if (!self) {
      staging.keys.assign(rows * keys * config.key_size, 0.0f);
      staging.values.assign(rows * keys * config.value_size, 0.0f);
    }
    staging.valid_lens.assign(need_lens ? (per_query ? rows * queries : rows) : 0, 0);
    int64_t row0 = 0;
    for (const WorkItem& item : batch.items) {
      const core::AttentionInputs& in = item.request.inputs;
      CopyIn(in.queries, in.batch, in.num_queries, config.query_size, staging.queries.data(),
             row0, queries);
      if (!self) {
        CopyIn(in.keys, in.batch, in.num_keys, config.key_size, staging.keys.data(), row0,
               keys);
        CopyIn(in.values, in.batch, in.num_keys, config.value_size, staging.values.data(),
               row0, keys);
      }
      if (need_lens) {
        const int64_t n = static_cast<int64_t>(in.valid_lens.size());
        for (int64_t b = 0; b < in.batch; ++b) {
          auto len = [&](int64_t q) -> int32_t {
            if (n == 0) return static_cast<int32_t>(in.num_keys);
            return n == in.batch ? in.valid_lens[b] : in.valid_lens[b * in.num_queries + q];
          };
          if (!per_query) {
            staging.valid_lens[row0 + b] = len(0);
            continue;
          }
          // Padded query rows keep valid_len 0: no work, and they are dropped.
          for (int64_t q = 0; q < in.num_queries; ++q) {
            staging.valid_lens[(row0 + b) * queries + q] = len(q);
          }
        }
      }
      row0 += in.batch;
    }
    staging.output.resize(rows * queries * config.num_hiddens);
    const core::AttentionInputs merged{
        .batch = rows,
        .num_queries = queries,
        .num_keys = keys,
        .queries = staging.queries.data(),
        .keys = self ? nullptr : staging.keys.data(),
        .values = self ? nullptr : staging.values.data(),
        .valid_lens = staging.valid_lens,
        .causal = first.causal,
        .head_mask = first.head_mask,
    };
    status = batch.model->attention->Forward(merged, staging.output.data());
    if (status.ok()) {
      row0 = 0;
      for (const WorkItem& item : batch.items) {
        const core::AttentionInputs& in = item.request.inputs;
        float* output = PrepareOutput(item.request, item.response);
        const int64_t width = in.num_queries * config.num_hiddens;
        for (int64_t b = 0; b < in.batch; ++b) {
          std::memcpy(output + b * width,
                      staging.output.data() + (row0 + b) * queries * config.num_hiddens,
                      sizeof(float) * width);
        }
        row0 += in.batch;
      }
    }
  }
  const absl::Time end = absl::Now();
  BatchDone(batch, end - start, status.ok());
  if (batch.metrics != nullptr) batch.metrics->Batch(rows, rows * queries, end - start);
  for (WorkItem& item : batch.items) {
    if (status.ok()) {
      attention::v1::Timing* timing = item.response->mutable_timing();
      timing->set_queue_us(absl::ToInt64Microseconds(start - item.enqueued));
      timing->set_compute_us(absl::ToInt64Microseconds(end - start));
      timing->set_batch_rows(rows);
    }
    if (batch.metrics != nullptr) {
      batch.metrics->queue_duration().Observe(absl::ToDoubleSeconds(start - item.enqueued));
    }
    item.done(status);
  }
}

}  // namespace mha::server

#include "server/compute_queue.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace mha::server {

absl::Status RunForward(const ValidatedRequest& request,
                        attention::v1::AttendResponse* response) {
  const core::AttentionInputs& in = request.inputs;
  const core::ModelConfig& c = request.model->config;
  attention::v1::Tensor* output = response->mutable_output();
  output->clear_shape();
  output->add_shape(in.batch);
  output->add_shape(in.num_queries);
  output->add_shape(c.num_hiddens);
  output->mutable_data()->Resize(static_cast<int>(request.output_elements()), 0.0f);
  float* attention = nullptr;
  if (request.return_attention) {
    attention::v1::Tensor* weights = response->mutable_attention();
    weights->clear_shape();
    for (int64_t d : {in.batch, c.num_heads, in.num_queries, in.num_keys}) weights->add_shape(d);
    weights->mutable_data()->Resize(static_cast<int>(request.attention_elements()), 0.0f);
    attention = weights->mutable_data()->mutable_data();
  }
  return request.model->attention->Forward(in, output->mutable_data()->mutable_data(),
                                           attention);
}

ComputeQueue::ComputeQueue(const Options& options) : options_(options) {}

absl::StatusOr<std::unique_ptr<ComputeQueue>> ComputeQueue::Create(const Options& options) {
  if (options.num_workers < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("compute workers: expected >= 1, got ", options.num_workers));
  }
  if (options.max_queue_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_queue_size: expected >= 1, got ", options.max_queue_size));
  }
  std::unique_ptr<ComputeQueue> queue(new ComputeQueue(options));
  for (int i = 0; i < options.num_workers; ++i) {
    queue->workers_.emplace_back([q = queue.get()] { q->WorkerLoop(); });
  }
  return queue;
}

ComputeQueue::~ComputeQueue() { Shutdown(); }

absl::Status ComputeQueue::Submit(WorkItem item) {
  absl::MutexLock lock(&mu_);
  if (stopping_) return absl::UnavailableError("server is shutting down");
  if (static_cast<int64_t>(queue_.size()) >= options_.max_queue_size) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "compute queue full: max_queue_size ", options_.max_queue_size, " requests waiting"));
  }
  item.enqueued = absl::Now();
  queue_.push_back(std::move(item));
  return absl::OkStatus();
}

int64_t ComputeQueue::queue_size() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(queue_.size());
}

void ComputeQueue::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  for (std::thread& worker : workers_) {
    if (worker.joinable()) worker.join();
  }
}

bool ComputeQueue::HasWorkOrStopping() const { return stopping_ || !queue_.empty(); }

void ComputeQueue::WorkerLoop() {
  while (true) {
    WorkItem item;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(this, &ComputeQueue::HasWorkOrStopping));
      if (queue_.empty()) return;  // stopping and drained
      item = std::move(queue_.front());
      queue_.pop_front();
    }
    const absl::Time start = absl::Now();
    const int64_t queue_us = absl::ToInt64Microseconds(start - item.enqueued);
    absl::Status status;
    if (start >= item.deadline) {
      status = absl::DeadlineExceededError(absl::StrCat(
          "deadline passed while queued for ", queue_us, " us; not computed"));
    } else if (item.cancelled && item.cancelled()) {
      status = absl::CancelledError("call cancelled by the client while queued; not computed");
    } else {
      status = RunForward(item.request, item.response);
      attention::v1::Timing* timing = item.response->mutable_timing();
      timing->set_queue_us(queue_us);
      timing->set_compute_us(absl::ToInt64Microseconds(absl::Now() - start));
      timing->set_batch_rows(item.request.inputs.batch);
    }
    item.done(std::move(status));
  }
}

}  // namespace mha::server

// A bounded FIFO of validated requests and a few worker threads that run them
// through the core, so compute never runs on gRPC's threads. The dynamic batcher
// (next issue) replaces it behind the same Submit contract.
//
// Each worker, per item: if the deadline has passed -> done(DEADLINE_EXCEEDED);
// else if the call was cancelled -> done(CANCELLED); else it runs the forward pass
// into `response` (output (B, Q, p_o), attention (B, h, Q, K) when asked, timing)
// and calls done(status). The request behind `request.inputs` and `response` must
// stay alive until `done` is called.
//
//   ComputeQueue::Options options{.num_workers = 1};
//   auto queue = ComputeQueue::Create(options).value();
//   absl::Status s = queue->Submit(WorkItem{.request = validated, .response = &response,
//                                           .done = [&](absl::Status s) { ... }});
//   // s not OK (queue full, shut down): `done` will never be called.
//
// Thread safety: Submit and Shutdown are thread-safe. `done` runs on a worker
// thread and must not block for long.
#ifndef MHA_SERVER_COMPUTE_QUEUE_H_
#define MHA_SERVER_COMPUTE_QUEUE_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "proto/attention.pb.h"
#include "server/validation.h"

namespace mha::server {

struct WorkItem {
  ValidatedRequest request;
  attention::v1::AttendResponse* response = nullptr;  // output, attention, timing
  absl::Time deadline = absl::InfiniteFuture();
  std::function<bool()> cancelled;         // optional; polled before compute
  std::function<void(absl::Status)> done;  // called exactly once if Submit is OK
  absl::Time enqueued;                     // set by Submit
};

class ComputeQueue {
 public:
  struct Options {
    int num_workers = 1;
    int64_t max_queue_size = 1024;  // queued (not yet running) items
  };

  static absl::StatusOr<std::unique_ptr<ComputeQueue>> Create(const Options& options);
  ~ComputeQueue();  // Shutdown()

  // OK: queued, `done` will be called. RESOURCE_EXHAUSTED naming max_queue_size when
  // full; UNAVAILABLE after Shutdown. Never blocks.
  absl::Status Submit(WorkItem item);

  // Stops accepting, runs every queued item (deadline and cancellation still
  // apply), then joins the workers. Idempotent.
  void Shutdown();

  int64_t queue_size() const;

 private:
  explicit ComputeQueue(const Options& options);
  void WorkerLoop();
  bool HasWorkOrStopping() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Options options_;
  mutable absl::Mutex mu_;
  std::deque<WorkItem> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> workers_;
};

// One item's forward pass on the calling thread (what a worker does after the
// deadline and cancellation checks).
absl::Status RunForward(const ValidatedRequest& request,
                        attention::v1::AttendResponse* response);

}  // namespace mha::server

#endif  // MHA_SERVER_COMPUTE_QUEUE_H_

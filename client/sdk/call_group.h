// Calls in flight that are cancelled together: a program that runs many gRPC calls
// at once (decode's sessions) tracks each call's context from its start to its end,
// and one failure cancels them all instead of leaving them to their deadlines.
//
//   CallGroup group;
//   connection->set_call_group(&group);  // its gRPC calls join the group
//   group.Track(&stream_context);        // or a call made directly on a stub
//   ...
//   group.Cancel();                      // from any thread: every call ends CANCELLED
//
// Thread-safe.
#ifndef MHA_CLIENT_SDK_CALL_GROUP_H_
#define MHA_CLIENT_SDK_CALL_GROUP_H_

#include <grpcpp/client_context.h>

#include <atomic>
#include <mutex>
#include <set>

namespace mha::client {

class CallGroup {
 public:
  // `context`'s call is in flight from now until Untrack. Cancelled at once when the
  // group has been cancelled already.
  void Track(grpc::ClientContext* context);
  void Untrack(grpc::ClientContext* context);

  // Cancels every call in flight and every call tracked later. Idempotent.
  void Cancel();
  bool cancelled() const { return cancelled_.load(std::memory_order_relaxed); }

 private:
  std::atomic<bool> cancelled_{false};
  std::mutex mu_;
  std::set<grpc::ClientContext*> in_flight_;  // guarded by mu_
};

// Tracks `context` in `group` (when not null) for the scope's life.
class TrackedCall {
 public:
  TrackedCall(CallGroup* group, grpc::ClientContext* context) : group_(group), context_(context) {
    if (group_ != nullptr) group_->Track(context_);
  }
  ~TrackedCall() {
    if (group_ != nullptr) group_->Untrack(context_);
  }
  TrackedCall(const TrackedCall&) = delete;
  TrackedCall& operator=(const TrackedCall&) = delete;

 private:
  CallGroup* const group_;
  grpc::ClientContext* const context_;
};

}  // namespace mha::client

#endif  // MHA_CLIENT_SDK_CALL_GROUP_H_

#include "client/sdk/call_group.h"

namespace mha::client {

void CallGroup::Track(grpc::ClientContext* context) {
  std::lock_guard<std::mutex> lock(mu_);
  if (cancelled()) context->TryCancel();
  in_flight_.insert(context);
}

void CallGroup::Untrack(grpc::ClientContext* context) {
  std::lock_guard<std::mutex> lock(mu_);
  in_flight_.erase(context);
}

void CallGroup::Cancel() {
  std::lock_guard<std::mutex> lock(mu_);
  if (cancelled_.exchange(true, std::memory_order_relaxed)) return;
  for (grpc::ClientContext* context : in_flight_) context->TryCancel();
}

}  // namespace mha::client

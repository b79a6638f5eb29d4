#include "server/app/memory_trimmer.h"

#include <malloc.h>

namespace mha::server {

MemoryTrimmer::MemoryTrimmer(absl::Duration interval) : interval_(interval) {
  if (interval_ > absl::ZeroDuration()) thread_ = std::thread(&MemoryTrimmer::Loop, this);
}

MemoryTrimmer::~MemoryTrimmer() { Stop(); }

void MemoryTrimmer::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

int64_t MemoryTrimmer::trims() const {
  absl::MutexLock lock(&mu_);
  return trims_;
}

void MemoryTrimmer::Loop() {
  absl::MutexLock lock(&mu_);
  while (!mu_.AwaitWithTimeout(absl::Condition(&stop_), interval_)) {
    mu_.Unlock();
    malloc_trim(0);
    mu_.Lock();
    ++trims_;
  }
}

}  // namespace mha::server

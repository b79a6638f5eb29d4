// Debian builds Abseil without NDEBUG, so by default every absl::Mutex acquisition
// records lock-order edges in a process-wide graph (deadlock detection). On the
// toy-request path that graph cost about 3% of the server's CPU (docs/performance.md).
// Release binaries (NDEBUG) turn it off in main(); debug builds, and the unit tests,
// which do not run through a binary's main, keep it.
#ifndef MHA_BASE_MUTEX_MODE_H_
#define MHA_BASE_MUTEX_MODE_H_

#include "absl/synchronization/mutex.h"

namespace mha {

inline void SkipMutexDeadlockDetectionInRelease() {
#ifdef NDEBUG
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
#endif
}

}  // namespace mha

#endif  // MHA_BASE_MUTEX_MODE_H_

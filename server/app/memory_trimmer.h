// Returns the memory glibc's malloc holds free to the system at a fixed interval
// (malloc_trim(0)), so that the server's RSS comes back to its working set after a
// burst of queued requests. Why, and what it costs: docs/reliability.md, "Memory at
// steady state".
//
//   MemoryTrimmer trimmer(absl::Seconds(2));   // a thread; stops in the destructor
#ifndef MHA_SERVER_APP_MEMORY_TRIMMER_H_
#define MHA_SERVER_APP_MEMORY_TRIMMER_H_

#include <cstdint>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace mha::server {

class MemoryTrimmer {
 public:
  // interval <= 0: no thread, never trims.
  explicit MemoryTrimmer(absl::Duration interval);
  ~MemoryTrimmer();  // Stop()
  MemoryTrimmer(const MemoryTrimmer&) = delete;
  MemoryTrimmer& operator=(const MemoryTrimmer&) = delete;

  // Ends the thread; idempotent.
  void Stop();
  // Trims done so far.
  int64_t trims() const;

 private:
  void Loop();

  const absl::Duration interval_;
  mutable absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  int64_t trims_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread thread_;
};

}  // namespace mha::server

#endif  // MHA_SERVER_APP_MEMORY_TRIMMER_H_

// ThreadSanitizer builds only: makes absl::Mutex and absl::CondVar visible to TSan.
//
// Debian's Abseil (and gRPC, whose gpr_mu and grpc_core::Mutex are absl::Mutex
// since GPR_ABSEIL_SYNC) is not built with -fsanitize=thread, so TSan sees neither
// the lock's atomics nor its futex waits and reports every access a mutex orders
// as a race (it did: WorkspacePool in core, the compute queue, the stream reactor).
// Linked into every executable of a tsan build, these definitions interpose the
// library's (the dynamic linker prefers the executable's symbols, also for calls
// from libgrpc and libabsl), call the real function found with dlsym(RTLD_NEXT),
// and tell TSan what it did: acquire after a lock, release before an unlock. The
// library's own accesses inside a call (the wait queue, and Condition functions it
// evaluates on behalf of waiters) are ignored, as Abseil's own TSan annotations do.
#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

extern "C" {
void __tsan_acquire(void* addr);
void __tsan_release(void* addr);
void __tsan_ignore_thread_begin();
void __tsan_ignore_thread_end();
}

namespace {

template <typename F>
F Real(const char* mangled) {
  void* symbol = dlsym(RTLD_NEXT, mangled);
  if (symbol == nullptr) {
    std::fprintf(stderr, "tsan_absl_sync: %s not found: %s\n", mangled, dlerror());
    std::abort();
  }
  return reinterpret_cast<F>(symbol);
}

// The real function's own memory accesses are not ours to check.
struct Ignored {
  Ignored() { __tsan_ignore_thread_begin(); }
  ~Ignored() { __tsan_ignore_thread_end(); }
};

#define MHA_REAL(type, mangled)                          \
  static const auto real = Real<type>(mangled)

using absl::Condition;
using absl::CondVar;
using absl::Duration;
using absl::Mutex;
using absl::Time;

}  // namespace

namespace absl {
ABSL_NAMESPACE_BEGIN

void Mutex::Lock() {
  MHA_REAL(void (*)(Mutex*), "_ZN4absl7debian35Mutex4LockEv");
  {
    Ignored ignored;
    real(this);
  }
  __tsan_acquire(this);
}

void Mutex::ReaderLock() {
  MHA_REAL(void (*)(Mutex*), "_ZN4absl7debian35Mutex10ReaderLockEv");
  {
    Ignored ignored;
    real(this);
  }
  __tsan_acquire(this);
}

bool Mutex::TryLock() {
  MHA_REAL(bool (*)(Mutex*), "_ZN4absl7debian35Mutex7TryLockEv");
  bool locked;
  {
    Ignored ignored;
    locked = real(this);
  }
  if (locked) __tsan_acquire(this);
  return locked;
}

bool Mutex::ReaderTryLock() {
  MHA_REAL(bool (*)(Mutex*), "_ZN4absl7debian35Mutex13ReaderTryLockEv");
  bool locked;
  {
    Ignored ignored;
    locked = real(this);
  }
  if (locked) __tsan_acquire(this);
  return locked;
}

void Mutex::Unlock() {
  MHA_REAL(void (*)(Mutex*), "_ZN4absl7debian35Mutex6UnlockEv");
  __tsan_release(this);
  Ignored ignored;
  real(this);
}

void Mutex::ReaderUnlock() {
  MHA_REAL(void (*)(Mutex*), "_ZN4absl7debian35Mutex12ReaderUnlockEv");
  __tsan_release(this);
  Ignored ignored;
  real(this);
}

void Mutex::LockWhen(const Condition& cond) {
  MHA_REAL(void (*)(Mutex*, const Condition&), "_ZN4absl7debian35Mutex8LockWhenERKNS0_9ConditionE");
  {
    Ignored ignored;
    real(this, cond);
  }
  __tsan_acquire(this);
}

bool Mutex::LockWhenWithTimeout(const Condition& cond, Duration timeout) {
  MHA_REAL(bool (*)(Mutex*, const Condition&, Duration),
           "_ZN4absl7debian35Mutex19LockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE");
  bool met;
  {
    Ignored ignored;
    met = real(this, cond, timeout);
  }
  __tsan_acquire(this);
  return met;
}

bool Mutex::LockWhenWithDeadline(const Condition& cond, Time deadline) {
  MHA_REAL(bool (*)(Mutex*, const Condition&, Time),
           "_ZN4absl7debian35Mutex20LockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE");
  bool met;
  {
    Ignored ignored;
    met = real(this, cond, deadline);
  }
  __tsan_acquire(this);
  return met;
}

void Mutex::Await(const Condition& cond) {
  MHA_REAL(void (*)(Mutex*, const Condition&), "_ZN4absl7debian35Mutex5AwaitERKNS0_9ConditionE");
  __tsan_release(this);
  {
    Ignored ignored;
    real(this, cond);
  }
  __tsan_acquire(this);
}

bool Mutex::AwaitWithTimeout(const Condition& cond, Duration timeout) {
  MHA_REAL(bool (*)(Mutex*, const Condition&, Duration),
           "_ZN4absl7debian35Mutex16AwaitWithTimeoutERKNS0_9ConditionENS0_8DurationE");
  __tsan_release(this);
  bool met;
  {
    Ignored ignored;
    met = real(this, cond, timeout);
  }
  __tsan_acquire(this);
  return met;
}

bool Mutex::AwaitWithDeadline(const Condition& cond, Time deadline) {
  MHA_REAL(bool (*)(Mutex*, const Condition&, Time),
           "_ZN4absl7debian35Mutex17AwaitWithDeadlineERKNS0_9ConditionENS0_4TimeE");
  __tsan_release(this);
  bool met;
  {
    Ignored ignored;
    met = real(this, cond, deadline);
  }
  __tsan_acquire(this);
  return met;
}

void CondVar::Wait(Mutex* mu) {
  MHA_REAL(void (*)(CondVar*, Mutex*), "_ZN4absl7debian37CondVar4WaitEPNS0_5MutexE");
  __tsan_release(mu);
  {
    Ignored ignored;
    real(this, mu);
  }
  __tsan_acquire(mu);
}

bool CondVar::WaitWithTimeout(Mutex* mu, Duration timeout) {
  MHA_REAL(bool (*)(CondVar*, Mutex*, Duration),
           "_ZN4absl7debian37CondVar15WaitWithTimeoutEPNS0_5MutexENS0_8DurationE");
  __tsan_release(mu);
  bool timed_out;
  {
    Ignored ignored;
    timed_out = real(this, mu, timeout);
  }
  __tsan_acquire(mu);
  return timed_out;
}

bool CondVar::WaitWithDeadline(Mutex* mu, Time deadline) {
  MHA_REAL(bool (*)(CondVar*, Mutex*, Time),
           "_ZN4absl7debian37CondVar16WaitWithDeadlineEPNS0_5MutexENS0_4TimeE");
  __tsan_release(mu);
  bool timed_out;
  {
    Ignored ignored;
    timed_out = real(this, mu, deadline);
  }
  __tsan_acquire(mu);
  return timed_out;
}

ABSL_NAMESPACE_END
}  // namespace absl

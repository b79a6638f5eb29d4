// Attention sessions apart from their transport: the K/V cache budget, each
// session's state (its model, its cache, its steps) and the idle reaper. A front
// (server/attention_v1/session.h for attention.v1's AttendSession) decodes each
// message into a core::PagedStep and implements SessionStream; the store computes
// the step through the batcher (continuous batching with other sessions' steps)
// and tells the stream when to read, write and end.
//
// A session runs one step at a time:
//   reading -> (Received) computing -> (computed: Write) writing -> (Written) reading
// and ends once, with a status and a SessionEnd reason, in any state. Only a
// reading session is ended from outside (idle timeout, shutdown); a computing or
// writing one ends at its next transition.
//
// Limits, each ending only the session that meets it:
//   cache_bytes   every session's blocks together; a step whose new blocks do not
//                 fit -> RESOURCE_EXHAUSTED naming --session_cache_bytes (cache_budget)
//   token limit   checked by the front's decoder, whose status carries the reason
//                 (WithSessionEnd: token_limit)
//   idle_timeout  no message for that long after the last response
//                 -> DEADLINE_EXCEEDED naming --session_idle_timeout (idle_timeout)
// A failed step ends the session with its status, its message prefixed with
// "step N: " (N steps were answered before it). Shutdown ends every session with
// UNAVAILABLE: a reading one at once; one computing or writing once its step's
// response is written and the client's next message (not computed) arrives, or
// kShutdownGrace after the response, so that the transport is not closed under a
// response the client has not read.
//
// Metrics (on the registry given):
//   mha_sessions_active                   gauge, open sessions
//   mha_sessions_total                    counter, sessions opened
//   mha_session_cached_tokens             gauge, keys held by every session
//   mha_session_cache_bytes               gauge, bytes of blocks held (the budget's use)
//   mha_session_cache_budget_bytes        gauge, cache_bytes
//   mha_session_ends_total{reason}        counter, sessions ended: client (half-close
//                                         or cancel), error, cache_budget, token_limit,
//                                         idle_timeout, shutdown
//   mha_session_step_duration_seconds{context}  histogram, a step from its message
//                                         received to its response computed, by the
//                                         keys cached after it: le64, le512,
//                                         le2048, le4096, gt4096
//
// Thread safety: thread-safe. The batcher and the registry outlive the store.
#ifndef MHA_SERVER_SERVING_SESSION_STORE_H_
#define MHA_SERVER_SERVING_SESSION_STORE_H_

#include <prometheus/registry.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <set>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "core/attention.h"
#include "core/kv_cache.h"
#include "server/serving/batcher.h"
#include "server/serving/model.h"
#include "server/serving/work_item.h"

namespace mha::server {

// Why a session ended (mha_session_ends_total's reason label).
enum class SessionEnd { kClient, kError, kCacheBudget, kTokenLimit, kIdleTimeout, kShutdown };
inline constexpr int kNumSessionEnds = 6;
absl::string_view SessionEndLabel(SessionEnd end);  // "client", ..., "shutdown"

// `status` carrying the reason the session it ends ends (a payload, not its text).
absl::Status WithSessionEnd(absl::Status status, SessionEnd end);
// The reason `status` carries; kError when it carries none.
SessionEnd SessionEndOf(const absl::Status& status);

struct SessionOptions {
  int64_t cache_bytes = int64_t{1} << 30;           // every session's blocks together
  absl::Duration idle_timeout = absl::Seconds(60);  // between a response and the next step
};

// Shutdown: how long a session whose computing step was answered waits for its
// client's next message or half-close before it ends.
inline constexpr absl::Duration kShutdownGrace = absl::Seconds(1);

// The transport's side of one session, implemented by its front. The store calls
// these with the session's lock held, one at a time.
class SessionStream {
 public:
  virtual ~SessionStream() = default;
  virtual void Read() = 0;  // read the next message
  // The step computed: write its response. `context` keys are cached after it.
  virtual void Write(const ComputeTiming& timing, int64_t context) = 0;
  virtual void End(const absl::Status& status) = 0;  // finish the stream; called once
};

class SessionStore {
 public:
  class Session;

  SessionStore(const SessionOptions& options, Batcher* batcher, prometheus::Registry& registry);
  ~SessionStore();  // Shutdown(), then waits for the reaper

  // A new session for `stream`, reading its first message; after Shutdown it is
  // ended at once with UNAVAILABLE. Close it once its stream is done.
  Session* Open(SessionStream* stream);
  // The session's stream is done (after its End): the store forgets and frees it.
  void Close(Session* session);

  // Ends every session (see above) and ends new ones at once. Returns without
  // waiting; the reaper ends sessions answered after it within kShutdownGrace.
  void Shutdown();

  int64_t active() const;
  const core::KvCachePool& pool() const { return pool_; }

 private:
  struct Metrics;
  bool Add(Session* session);  // false once shutting down
  void ReapIdle();

  const SessionOptions options_;
  Batcher* const batcher_;
  core::KvCachePool pool_;
  std::unique_ptr<Metrics> metrics_;

  mutable absl::Mutex mu_;
  std::set<Session*> sessions_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread reaper_;  // ends idle sessions
};

// One session. Its front calls, from its transport's threads:
//   Received     a message arrived: false when the session has ended (or ends now:
//                it was answered after Shutdown), so the message is not stepped
//   Step / Fail  the message decoded into a step / did not decode
//   Written      the step's response is written (or could not be)
//   ClientDone   the client half-closed, or the call is gone
// While it computes, only the step's own thread and then the worker touch it.
class SessionStore::Session {
 public:
  Session(SessionStore* store, SessionStream* stream) : store_(store), stream_(stream) {}

  bool Received();
  // Computes `step` (its views owned by the front until the response is written or
  // the session ends; its cache is the session's). `model`: the session's model,
  // given with its first step and held until the session ends (a reload does not
  // change it); ignored after. RESOURCE_EXHAUSTED naming --session_cache_bytes when
  // the step's keys do not fit the budget. A failure ends the session.
  void Step(std::shared_ptr<const Model> model, const core::PagedStep& step, absl::Time deadline,
            std::function<bool()> cancelled);
  // Ends the session with `status` (its message prefixed with the step) and the
  // reason it carries (SessionEndOf).
  void Fail(const absl::Status& status);
  void Written(bool ok);
  void ClientDone();

  // The session's model, nullptr before its first step. Read by the front between
  // Received and Step.
  const Model* model() const { return model_.get(); }
  int64_t cached() const { return cache_ != nullptr ? cache_->size() : 0; }

 private:
  friend class SessionStore;
  enum class State { kReading, kComputing, kWriting, kFinished };

  void OnComputed(absl::Status status, const ComputeTiming& timing);
  // The reaper, under the store's lock: ends a reading session idle past the
  // timeout, or past kShutdownGrace after Shutdown. Returns whether the session's
  // step is still computing or being written (its grace has not started).
  bool ExpireIfIdle(absl::Time now);
  void Stop();  // Shutdown, under the store's lock
  absl::Status ShutdownError() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status StepError(const absl::Status& status) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ends the stream with `status` and releases the cache (no step is computing).
  void EndLocked(const absl::Status& status, SessionEnd reason) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  SessionStore* const store_;
  SessionStream* const stream_;
  absl::Mutex mu_;
  State state_ ABSL_GUARDED_BY(mu_) = State::kReading;
  bool stop_requested_ ABSL_GUARDED_BY(mu_) = false;
  absl::Time idle_since_ ABSL_GUARDED_BY(mu_) = absl::Now();
  int64_t steps_ ABSL_GUARDED_BY(mu_) = 0;  // answered

  // The step in progress and the session's state (see the class comment).
  std::shared_ptr<const Model> model_;
  std::unique_ptr<core::KvSequence> cache_;
  core::PagedStep step_;  // its address names the session to the batcher
  absl::Time step_start_;
};

}  // namespace mha::server

#endif  // MHA_SERVER_SERVING_SESSION_STORE_H_

// Attention sessions (attention.v1 AttendSession): one bidirectional stream is one
// session, whose projected keys and values the server keeps (core/kv_cache.h) for
// exactly as long as the stream lives. Each message is one step: its new tokens are
// projected once, appended, and its queries attend over everything cached, so a
// decoding client sends one token per step instead of its whole prefix.
//
// A session runs one step at a time: read, compute (through the batcher, where
// steps of different sessions queued together run as one paged forward call:
// continuous batching), write, read the next. Its model, version, kind and causal
// flag come from its first message (server/attention_v1/session_codec.h); the model version it
// started with serves it to the end, also across a reload (the session holds it).
//
// Steps do not go through the submit path (server/serving/submit.h) that every
// request takes: a session finds its model once, at its first message, and is
// counted by the session metrics below, not per step in mha_requests_total. Each
// step is admitted by Batcher::Submit as every item is (queue bound, a warming
// model, shutdown: the session ends with that status).
//
// Limits, each ending only the stream that meets it:
//   --session_cache_bytes   every session's blocks together (SessionOptions
//                           ::cache_bytes); a step whose new blocks do not fit
//                           -> RESOURCE_EXHAUSTED naming the flag
//   token limit             the model's limits.max_session_tokens, else its
//                           max_sequence_length -> RESOURCE_EXHAUSTED naming it
//   --session_idle_timeout  no message for that long after the last response
//                           -> DEADLINE_EXCEEDED naming the flag
// The first failed step ends the stream with its status, its message prefixed
// with "step N: ". A client's half-close ends it with OK. Shutdown ends every
// session with UNAVAILABLE: one waiting for its next message at once; one
// computing once its step's response is written and the client's next message
// (not computed) arrives, or 1 s after the response (a half-close meanwhile ends
// it with OK), so that the connection is not closed under a response the client
// has not read.
//
// Metrics (on the server's registry):
//   mha_sessions_active                   gauge, open sessions
//   mha_sessions_total                    counter, sessions opened
//   mha_session_cached_tokens             gauge, keys held by every session
//   mha_session_cache_bytes               gauge, bytes of blocks held (the budget's use)
//   mha_session_cache_budget_bytes        gauge, --session_cache_bytes
//   mha_session_ends_total{reason}        counter, sessions ended: client (half-close
//                                         or cancel), error, cache_budget, token_limit,
//                                         idle_timeout, shutdown
//   mha_session_step_duration_seconds{context}  histogram, a step from its message
//                                         read to its response computed, by the
//                                         keys cached after it: le64, le512,
//                                         le2048, le4096, gt4096
//
// Thread safety: thread-safe. The repository, batcher and registry outlive it.
#ifndef MHA_SERVER_ATTENTION_V1_SESSION_H_
#define MHA_SERVER_ATTENTION_V1_SESSION_H_

#include <grpcpp/grpcpp.h>
#include <prometheus/registry.h>

#include <cstdint>
#include <memory>
#include <set>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "core/kv_cache.h"
#include "proto/attention.pb.h"
#include "server/serving/batcher.h"
#include "server/serving/model_source.h"

namespace mha::server {

struct SessionOptions {
  int64_t cache_bytes = int64_t{1} << 30;           // every session's blocks together
  absl::Duration idle_timeout = absl::Seconds(60);  // between a response and the next step
};

class SessionManager {
 public:
  SessionManager(const SessionOptions& options, const ModelSource* models, Batcher* batcher,
                 prometheus::Registry& registry);
  ~SessionManager();  // Shutdown(), then waits for the reaper

  // The reactor of a new AttendSession stream (owned by gRPC until OnDone).
  grpc::ServerBidiReactor<attention::v1::SessionRequest, attention::v1::SessionResponse>* Open(
      grpc::CallbackServerContext* context);

  // Ends every session (see above) and refuses new ones with UNAVAILABLE. Returns
  // without waiting; gRPC's own shutdown waits for the streams.
  void Shutdown();

  int64_t active() const;
  const core::KvCachePool& pool() const { return pool_; }

 private:
  class Session;
  struct Metrics;
  bool Add(Session* session);  // false once shutting down
  void Remove(Session* session);
  void ReapIdle();

  const SessionOptions options_;
  const ModelSource* const models_;
  Batcher* const batcher_;
  core::KvCachePool pool_;
  std::unique_ptr<Metrics> metrics_;

  mutable absl::Mutex mu_;
  std::set<Session*> sessions_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread reaper_;  // ends idle sessions
};

}  // namespace mha::server

#endif  // MHA_SERVER_ATTENTION_V1_SESSION_H_

// attention.v1 AttendSession: one bidirectional stream is one session, whose
// projected keys and values the server keeps (core/kv_cache.h) for exactly as
// long as the stream lives. Each message is one step: its new tokens are
// projected once, appended, and its queries attend over everything cached, so a
// decoding client sends one token per step instead of its whole prefix.
//
// This front only reads, writes and decodes: the session's state, its cache
// budget, its idle timeout, its end reasons and its metrics are the serving
// layer's session store (server/serving/session_store.h), which computes each
// step through the batcher. Its model, version, kind and causal flag come from
// its first message (server/attention_v1/session_codec.h); the model version it
// started with serves it to the end, also across a reload (the session holds it).
//
// Steps do not go through the submit path (server/serving/submit.h) that every
// request takes: a session finds its model once, at its first message, and is
// counted by the session metrics, not per step in mha_requests_total. Each step is
// admitted by Batcher::Submit as every item is (queue bound, a warming model,
// shutdown: the session ends with that status).
//
// A failed step ends the stream with its status, its message prefixed with
// "step N: "; a client's half-close ends it with OK; the store's limits and
// Shutdown end it as the store's header says.
//
// Thread safety: thread-safe. The model source, batcher and registry outlive it.
#ifndef MHA_SERVER_ATTENTION_V1_SESSION_H_
#define MHA_SERVER_ATTENTION_V1_SESSION_H_

#include <grpcpp/grpcpp.h>
#include <prometheus/registry.h>

#include "proto/attention.pb.h"
#include "server/serving/access_log.h"
#include "server/serving/batcher.h"
#include "server/serving/model_source.h"
#include "server/serving/session_store.h"

namespace mha::server {

class SessionManager {
 public:
  // `access_log` (optional) gets one record per session, at its end.
  SessionManager(const SessionOptions& options, const ModelSource* models, Batcher* batcher,
                 prometheus::Registry& registry, AccessLog access_log = nullptr)
      : models_(models), store_(options, batcher, registry), access_log_(std::move(access_log)) {}

  // The reactor of a new AttendSession stream (owned by gRPC until OnDone).
  grpc::ServerBidiReactor<attention::v1::SessionRequest, attention::v1::SessionResponse>* Open(
      grpc::CallbackServerContext* context);

  // Ends every session (SessionStore::Shutdown) and refuses new ones with
  // UNAVAILABLE. Returns without waiting; gRPC's own shutdown waits for the streams.
  void Shutdown() { store_.Shutdown(); }

 private:
  class Reactor;

  const ModelSource* const models_;
  SessionStore store_;
  const AccessLog access_log_;
};

}  // namespace mha::server

#endif  // MHA_SERVER_ATTENTION_V1_SESSION_H_

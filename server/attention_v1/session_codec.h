// The AttendSession codec: one SessionRequest checked against its session and
// model into the views of one paged step (core::PagedStep), and its response
// sized. No gRPC types; the session reactor (server/attention_v1/session.h) and the fuzz target
// call it. A failed step's status carries why the session ends (SessionEndOf).
//
// DecodeSessionStep checks, in this order (the first failure is returned):
//   max_request_bytes  serialized size over the model's limit -> RESOURCE_EXHAUSTED
//   model              set in a message after the first (model or model_version)
//                      -> INVALID_ARGUMENT
//   kind               (first message) not SELF or CROSS; SELF on a model whose
//                      d_k, d_v differ from d_q or that is attention-only; a model
//                      with additive scoring -> INVALID_ARGUMENT
//   causal             (first message) false in an attention-only model's session
//                      (projections NONE: CROSS with causal true) -> INVALID_ARGUMENT
//   return_lse         (first message) on a model with projections FULL
//                      -> INVALID_ARGUMENT
//   encodings          as AttendRequest's (server/attention_v1/codec.h) -> INVALID_ARGUMENT
//   queries            SELF: required, (1, T, d_q) with T >= 1. CROSS: absent (T = 0)
//                      or (1, T, d_q), T >= 0 -> INVALID_ARGUMENT
//   keys, values       SELF: absent. CROSS: both or neither, (1, T_k, d_k) and
//                      (1, T_k, d_v); causal needs T_k == T -> INVALID_ARGUMENT
//   token limit        cached + new keys over the model's session limit
//                      (limits.max_session_tokens, else max_sequence_length)
//                      -> RESOURCE_EXHAUSTED naming the limit, carrying
//                      SessionEnd::kTokenLimit (server/serving/session_store.h)
//   values             every entry finite -> INVALID_ARGUMENT naming the position
#ifndef MHA_SERVER_ATTENTION_V1_SESSION_CODEC_H_
#define MHA_SERVER_ATTENTION_V1_SESSION_CODEC_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "core/attention.h"
#include "core/kv_cache.h"
#include "proto/attention.pb.h"
#include "server/serving/model.h"

namespace mha::server {

// What a session's first message fixes for all its steps.
struct SessionSettings {
  attention::v1::SessionKind kind = attention::v1::SELF;
  bool causal = false;
  bool return_lse = false;  // every response carries lse (1, h, T)
};

// One decoded step; the views point into the SessionRequest, which must outlive
// them.
struct SessionStepInput {
  int64_t num_queries = 0;         // T
  const float* queries = nullptr;  // (T, d_q)
  int64_t num_keys = 0;            // T_k (CROSS); T for SELF
  const float* keys = nullptr;     // (T_k, d_k); nullptr in a SELF session
  const float* values = nullptr;   // (T_k, d_v)
  bool raw = false;                // answer in Tensor.raw (the queries came raw)
  int64_t request_bytes = 0;       // the message serialized (its size was checked)
};

// `first`: the stream's first message, whose settings `settings` already holds
// (SettingsOf). `cached`: keys the session holds before this step.
absl::StatusOr<SessionStepInput> DecodeSessionStep(const attention::v1::SessionRequest& request,
                                                   bool first, const SessionSettings& settings,
                                                   const Model& model, int64_t cached);

// The settings a first message asks for.
SessionSettings SettingsOf(const attention::v1::SessionRequest& first);

// The core step of a decoded step, appending to `cache` and writing `output`.
// (A CROSS step without new keys still points its keys at something: nullptr keys
// mean self-attention to the core.)
core::PagedStep ToPagedStep(const SessionStepInput& step, const SessionSettings& settings,
                            core::KvSequence* cache, float* output, float* lse = nullptr);

// Sizes response.output (1, T, p_o) zeroed, raw or data as the step came, and
// returns its values.
float* PrepareSessionResponse(const SessionStepInput& step, const Model& model,
                              attention::v1::SessionResponse* response);

// Sizes response.lse (1, h, T) zeroed, raw or data as the step came, and returns its
// values (a session with return_lse).
float* PrepareSessionLse(const SessionStepInput& step, const Model& model,
                         attention::v1::SessionResponse* response);

}  // namespace mha::server

#endif  // MHA_SERVER_ATTENTION_V1_SESSION_CODEC_H_

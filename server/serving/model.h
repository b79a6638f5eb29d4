// A served model: its core layer, its request limits and its batching policy.
// Immutable once loaded (server/models/model_repository.h loads them). No protocol types.
#ifndef MHA_SERVER_SERVING_MODEL_H_
#define MHA_SERVER_SERVING_MODEL_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "core/attention.h"
#include "core/config.h"

namespace mha::server {

inline constexpr char kDefaultModelName[] = "default";
inline constexpr uint64_t kDefaultModelSeed = 0;

// Per-model request limits. A request over one is RESOURCE_EXHAUSTED naming it.
struct ModelLimits {
  int64_t max_batch_size = 64;                        // B
  int64_t max_sequence_length = 4096;                 // Q and K
  int64_t max_request_bytes = int64_t{64} << 20;      // serialized AttendRequest
  int64_t max_attention_elements = int64_t{1} << 24;  // B*h*Q*K, return_attention
  // Keys one AttendSession may cache (server/serving/session_store.h); 0 = max_sequence_length.
  int64_t max_session_tokens = 0;

  int64_t session_tokens() const {
    return max_session_tokens > 0 ? max_session_tokens : max_sequence_length;
  }
};

// Per-model dynamic batching (server/serving/batcher.h). Defaults are the server flags;
// config.pbtxt `batching { ... }` overrides them per model.
struct BatchingPolicy {
  bool enabled = true;
  // 0, as in Triton: merge only what queued while the previous call computed.
  absl::Duration max_queue_delay = absl::ZeroDuration();
  int64_t max_batch_size = 64;      // rows per forward call (<= limits.max_batch_size)
  int64_t max_batch_tokens = 8192;  // rows x max(Q, K) per forward call
  int64_t max_queue_size = 1024;    // queued requests before RESOURCE_EXHAUSTED
  // Expected queue wait before RESOURCE_EXHAUSTED (server/serving/batcher.h); 0 = no bound.
  // Unlike max_queue_size, this bound follows compute as it slows.
  absl::Duration max_queue_wait = absl::ZeroDuration();
  // How long queued session steps wait for the prompt sessions of the model's
  // previous session call that have not yet sent their next step
  // (server/serving/batcher.h), so that sessions decoding in lockstep keep sharing one
  // call, and how long an idle worker polls for the server's only session's next
  // step; 0 = no waiting.
  absl::Duration session_gather = absl::Microseconds(1000);
};

// One warm-up forward pass (config.pbtxt `warmup`): B rows of Q queries and K keys;
// K 0 = self-attention. valid_lens: one per row, or empty (every key valid); only the
// default passes set it (server/models/model_repository.h DefaultWarmup).
struct WarmupShape {
  int64_t batch = 1;
  int64_t num_queries = 1;
  int64_t num_keys = 0;
  std::vector<int32_t> valid_lens;

  bool operator==(const WarmupShape&) const = default;
};

struct Model {
  std::string name;
  int64_t version = 1;  // its version folder's number; 1 without version folders
  core::ModelConfig config;
  ModelLimits limits;
  BatchingPolicy batching;
  std::vector<WarmupShape> warmup;  // run before the model serves (server/app/server.h)
  bool default_warmup = false;      // `warmup` is DefaultWarmup's (config.pbtxt lists none)
  std::string weights_source;       // "seeded (seed 0)" or the weights path
  std::string fingerprint;          // of its files when loaded (server/models/model_repository.h)
  std::unique_ptr<core::MultiHeadAttention> attention;
};

}  // namespace mha::server

#endif  // MHA_SERVER_SERVING_MODEL_H_

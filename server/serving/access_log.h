// The access log's record (--log_requests): one per unary request or stream request
// answered (RequestPath, server/serving/submit.h) and one per session at its end
// (server/attention_v1/session.h), never one per session step. The app writes it
// (server/app/server.cc, as base/log.h's access line); this layer only fills it.
#ifndef MHA_SERVER_SERVING_ACCESS_LOG_H_
#define MHA_SERVER_SERVING_ACCESS_LOG_H_

#include <cstdint>
#include <functional>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "server/serving/metrics.h"

namespace mha::server {

struct AccessRecord {
  Protocol protocol = Protocol::kAttentionV1;  // the front ("attention_v1", ...)
  bool session = false;                        // an AttendSession's end
  absl::string_view model;  // the served model's name, or as requested when not accepted
  int64_t version = 0;      // the served model's version; 0 when not accepted
  int64_t batch = 0;        // B (0 when the request was refused before decoding)
  int64_t queries = 0;      // Q (sessions: every step's Q together)
  int64_t keys = 0;         // K (sessions: the cached context at the end)
  int64_t steps = 0;        // sessions: steps answered
  absl::StatusCode code = absl::StatusCode::kOk;
  absl::Duration queue;    // waiting for compute (sessions: summed over steps)
  absl::Duration compute;  // forward calls
  absl::Duration total;    // from receipt to answer (sessions: the stream's life)
  absl::string_view peer;  // the transport's, e.g. "ipv4:127.0.0.1:50522"
};

// Called on the thread that answers; must not block for long. Thread-safe.
using AccessLog = std::function<void(const AccessRecord&)>;

}  // namespace mha::server

#endif  // MHA_SERVER_SERVING_ACCESS_LOG_H_

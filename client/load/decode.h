// `decode`: an autoregressive-decoding load. `sessions` sessions run at once, each a
// causal self-attention session: one step prefills `prefill` tokens, then
// `decode_tokens` steps send one new token each. Over AttendSession (the default)
// the server keeps the session's projected keys and values, so a step sends only its
// new token; the calling thread drives every session's stream over one completion
// queue. With `stateless` the same tokens go through the SDK's unary Attend
// (Connection, client/sdk/connection.h), a thread per session: the cheapest
// stateless equivalent, a decode step sends the new token as its query and every
// token so far, the new one included, as keys and values (cross-attention, not
// causal), so its request and its compute grow with the context.
//
//   DecodeOptions options{.sessions = 4, .prefill = 128, .decode_tokens = 256};
//   DecodeReport report = RunDecode(options, channel, model).value();
//   PrintDecodeTable(report, std::cout);  // report.h
//
// Attention-only models (ModelInfo.projections "none", issue 35): sessions are CROSS
// and causal, each step sending its tokens' random pre-projected q, k and v (k and v
// (1, P + N, d_k) drawn from SplitMix64((seed + s) ^ (1 << 56)), v from ... ^ (2 << 56));
// stateless steps send the keys and values so far. The report adds the cache bytes
// the decode steps read and that over the decode phase's time (GB/s).
//
// Inputs: session s draws its tokens (1, prefill + decode_tokens, d_q), row-major,
// from SplitMix64(seed + s) (FillSigned, client/sdk/request.h): the prefill takes the first
// `prefill` rows, decode step n row prefill + n. Both modes send the same tokens,
// so their outputs agree (DecodeReport::output_sum).
//
// The decode phase starts when every session has prefilled (a session waits
// `timeout` for the others at most); its tokens/s are the decode steps of all
// sessions over the phase's wall time. The first failed step fails the run with its
// status (code and message kept, naming session and step) and cancels every call
// still in flight; a response whose shape or context_tokens is not the step's
// fails it as INTERNAL.
#ifndef MHA_CLIENT_LOAD_DECODE_H_
#define MHA_CLIENT_LOAD_DECODE_H_

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/load/stats.h"
#include "proto/attention.pb.h"

namespace mha::client {

struct DecodeOptions {
  std::string model;            // "" = the server's default model
  std::string model_version;    // "" = the newest served
  int64_t sessions = 1;         // S; with `stateless`, each on a thread
  int64_t prefill = 128;        // P: tokens of the first step
  int64_t decode_tokens = 128;  // N: steps of one token after it
  bool stateless = false;       // unary Attend instead of AttendSession
  uint64_t seed = 0;            // session s: SplitMix64(seed + s)
  // Unary: each Attend's deadline. Session: the stream is one call carrying
  // N + 1 steps, so its deadline is timeout * (N + 1) from its start. Also the
  // longest the prefill barrier waits for the next session's prefill.
  absl::Duration timeout = absl::Seconds(10);
};

// Usage errors (client/sdk/status.h) naming the flag: sessions 1 .. kMaxDecodeSessions,
// prefill >= 1, decode_tokens >= 1, timeout > 0.
inline constexpr int64_t kMaxDecodeSessions = 4096;
absl::Status CheckDecodeOptions(const DecodeOptions& options);

// An attention-only model (projections "none", the disaggregated-decoding worker).
bool IsWorker(const attention::v1::ModelInfo& model);

// Decode steps grouped by context (keys cached after the step).
struct ContextBucket {
  int64_t max_context = 0;  // the bucket holds contexts <= this; 0 = above the last bound
  std::string label;        // "<=64", ">4096"
  StepStats stats;          // latency and the server's timing of its steps
};

struct DecodeReport {
  DecodeOptions options;
  attention::v1::ModelInfo model;
  std::string target;  // as given
  StepStats prefill;   // one sample per session
  // Non-empty buckets of the upper bounds 64, 128, ..., 4096 and above, ascending.
  std::vector<ContextBucket> buckets;
  StepStats decode;           // every decode step; duration_s = the decode phase's wall time
  int64_t decode_tokens = 0;  // S * N
  double decode_tokens_per_s = 0;
  // Sum of every decode step's output values, summed per session and then in
  // session order: the same in both modes up to float rounding, a check that the
  // server's cache gives what recomputing does.
  double output_sum = 0;
  double output_abs_sum = 0;  // of |value|: the scale of output_sum's rounding
  int64_t calls = 0;          // AttendSession streams, or Attend calls, made
  // An attention-only model (projections "none"): the K/V cache its decode steps
  // read, context x (d_k + d_v) x 4 bytes (2 for a bf16 cache) per step: in all,
  // per step on average, and over the decode phase's wall time (GB = 1e9 bytes).
  // 0 for other models.
  double cache_bytes_read = 0;
  double cache_bytes_per_step = 0;
  double cache_gb_per_s = 0;
};

// Runs the load on `channel` against `model` (GetModel's answer for
// options.model). INVALID_ARGUMENT when the model cannot self-attend; the first
// failed step's status otherwise.
absl::StatusOr<DecodeReport> RunDecode(const DecodeOptions& options,
                                       const std::shared_ptr<grpc::Channel>& channel,
                                       const attention::v1::ModelInfo& model);

}  // namespace mha::client

#endif  // MHA_CLIENT_LOAD_DECODE_H_

// The verbs of attention_client. Each takes option structs (filled from flags in
// main.cc), writes its result to `out` and returns the first error, whose one-line
// form (OneLine in client/sdk/status.h) carries the gRPC code name. infer and bench speak
// ChannelOptions::protocol (connection.h); main.cc lets the others run with
// --protocol=attention only.
//
//   infer    one request; prints the output's shape, a summary and timing
//   bench    load test (bench.h), table on `out`, progress on `progress`
//   heatmap  attention weights of one batch row as a PNG (client/heatmap/heatmap.h)
//   heads    head importance: drop one head at a time with head_mask
//   health   grpc.health.v1 Check of the server and of every model
//   decode   autoregressive decoding: AttendSession sessions, or the same tokens
//            through unary Attend (client/load/decode.h)
#ifndef MHA_CLIENT_VERBS_H_
#define MHA_CLIENT_VERBS_H_

#include <ostream>
#include <string>

#include "absl/status/status.h"
#include "client/heatmap/heatmap.h"
#include "client/load/bench.h"
#include "client/load/decode.h"
#include "client/sdk/channel.h"
#include "client/sdk/request.h"

namespace mha::client {

// infer: when the request's input is one .safetensors that holds an "output" tensor
// (the exporter's io.safetensors: PyTorch's answer; infer --output's: an earlier
// answer), it prints that tensor's max abs difference from the server's output
// (INVALID_ARGUMENT naming the file when their shapes differ).
struct InferOptions {
  // .npy: the output; .safetensors: the inputs sent and the output (and the
  // attention weights when asked), loadable again with --input.
  std::string output;
};
absl::Status Infer(const ChannelOptions& channel, const RequestOptions& request,
                   const InferOptions& options, std::ostream& out);

struct BenchCommandOptions {
  BenchOptions bench;
  std::string json, csv;     // report files, when set
  bool interactive = false;  // progress rewrites one terminal line
};
absl::Status Bench(const ChannelOptions& channel, const RequestOptions& request,
                   const BenchCommandOptions& options, std::ostream& out, std::ostream& progress);

// "linear", "log" or "row"; a usage error naming --scale otherwise.
absl::StatusOr<HeatmapScale> ParseHeatmapScale(const std::string& text);

struct HeatmapOptions {
  std::string output = "attention.png";
  std::string json;  // the layout (image size, where each head's map is), when set
  int64_t batch_index = 0;
  HeatmapStyle style;
};
absl::Status Heatmap(const ChannelOptions& channel, const RequestOptions& request,
                     const HeatmapOptions& options, std::ostream& out);

struct HeadsOptions {
  int64_t prune = 0;  // also drop the `prune` least important heads together
  std::string json;
};
absl::Status Heads(const ChannelOptions& channel, const RequestOptions& request,
                   const HeadsOptions& options, std::ostream& out);

struct HealthOptions {
  std::string service;  // "" = the server and every model it lists
};
// UNAVAILABLE naming the services that are not SERVING.
absl::Status Health(const ChannelOptions& channel, const HealthOptions& options, std::ostream& out);

struct DecodeCommandOptions {
  DecodeOptions decode;  // its timeout is the channel's
  std::string json;      // report file, when set
  // Also runs the other mode (decode.stateless flipped) on the same tokens and prints
  // whether the output sums agree within kDecodeCheckTolerance x the sum of |output|,
  // and the sessions' decode tokens/s over the stateless run's. The JSON report is
  // the first run's, with a "check" object.
  bool check = false;
};
inline constexpr double kDecodeCheckTolerance = 1e-5;
// Fails with the first failed step's status (the run stops there); no table then.
// With `check`, FAILED_PRECONDITION when the sums disagree.
absl::Status Decode(const ChannelOptions& channel, const DecodeCommandOptions& options,
                    std::ostream& out);

}  // namespace mha::client

#endif  // MHA_CLIENT_VERBS_H_

// attention_client: a client for attention_server that is also a load tester.
// Every flag lives here and fills the option structs of client/verbs.h.
#include <malloc.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "base/command_line.h"
#include "base/mutex_mode.h"
#include "client/sdk/http.h"
#include "client/sdk/status.h"
#include "client/verbs.h"

namespace {
using mha::client::UsageError;

const mha::client::ChannelOptions kChannel;
const mha::client::RequestOptions kRequest;
const mha::client::BenchOptions kBench;
const mha::client::HeatmapOptions kHeatmap;
const mha::client::DecodeOptions kDecode;
}  // namespace

// Connection (every verb).
ABSL_FLAG(std::string, protocol, "attention",
          "infer, bench: attention (attention.v1 over gRPC), kserve (the Open Inference "
          "Protocol over gRPC on the same --target: ModelInfer, ModelStreamInfer) or http "
          "(KServe v2 REST with binary tensors on the server's --http_port; HTTPS with --tls, "
          "--tls_ca, --tls_cert/--tls_key; --target is the HTTP HOST[:PORT], port 8000 when "
          "omitted, 127.0.0.1:8000 when --target is not given; one keep-alive connection per "
          "concurrency slot). An empty --model takes the server's only model (or \"default\") "
          "for every protocol. Other verbs: attention only.");
ABSL_FLAG(std::string, target, kChannel.target,
          "Server address, HOST:PORT (any gRPC target; with --protocol=http the HTTP server's).");
ABSL_FLAG(std::string, targets, "",
          "Comma-separated HOST:PORT list; replaces --target and spreads calls over the "
          "servers with gRPC's round_robin policy.");
ABSL_FLAG(bool, tls, kChannel.tls, "Use TLS (system roots unless --tls_ca).");
ABSL_FLAG(std::string, tls_ca, kChannel.tls_ca,
          "PEM CA bundle to verify the server; implies --tls.");
ABSL_FLAG(std::string, tls_cert, kChannel.tls_cert,
          "PEM client certificate chain for mutual TLS (with --tls_key); implies --tls.");
ABSL_FLAG(std::string, tls_key, kChannel.tls_key, "PEM client private key for mutual TLS.");
ABSL_FLAG(std::string, tls_server_name, kChannel.tls_server_name,
          "Name to verify in the server certificate instead of the target's host.");
ABSL_FLAG(absl::Duration, timeout, kChannel.timeout,
          "Deadline of every call (a duration with a unit: 500ms, 10s, 2m); decode: of every "
          "step (a session's stream gets --timeout x (1 + --decode_tokens)).");
ABSL_FLAG(int64_t, max_message_size, kChannel.max_message_bytes,
          "Largest message sent or received, in bytes (gRPC's client default is 4 MiB).");

// The request (infer, bench, heatmap, heads; decode: model, model_version, seed).
ABSL_FLAG(std::string, model, kRequest.model, "Model name; empty = the server's default model.");
ABSL_FLAG(std::string, model_version, kRequest.model_version,
          "Model version (a number the model serves); empty = the newest served.");
ABSL_FLAG(int64_t, batch, kRequest.batch, "B: batch rows of generated inputs.");
ABSL_FLAG(int64_t, num_queries, kRequest.num_queries, "Q: queries per batch row.");
ABSL_FLAG(int64_t, num_keys, kRequest.num_keys,
          "K: keys (and values) per batch row; 0 = self-attention on the queries.");
ABSL_FLAG(std::string, valid_lens, "",
          "Comma-separated key lengths, B entries (per row) or B*Q (per query); 'none' for "
          "no mask. Empty: the toy request's 3,2 for its sizes (--batch=2 --num_queries=4 "
          "--num_keys=6, no --input), else none (or an --input .safetensors' own valid_lens).");
ABSL_FLAG(bool, causal, kRequest.causal, "Causal mask: query i sees keys j <= i.");
ABSL_FLAG(uint64_t, seed, kRequest.seed,
          "Seed of the generated inputs and of Poisson intervals. Inputs: SplitMix64 from the "
          "seed (base/splitmix64.h), each value (z >> 11) * 2^-53 * 2 - 1 as a float; queries "
          "(B, Q, d_q), then keys and values (B, K, d_k / d_v), row-major, from one stream. "
          "decode: session s's tokens (1, P + N, d_q) from seed + s.");
ABSL_FLAG(std::string, input, "",
          "Inputs from files instead of generated ones: one .safetensors (tensors queries, "
          "keys, values, valid_lens) or .npy files: queries (self-attention) or "
          "queries,keys,values. infer: a .safetensors that also holds an output tensor (as "
          "the exporter's io.safetensors and infer --output do) is compared with the "
          "server's output (max abs difference).");

// infer, heatmap.
ABSL_FLAG(std::string, output, "",
          "infer: write the output to FILE.npy, or inputs and output to FILE.safetensors; "
          "heatmap: the PNG (empty = attention.png).");
ABSL_FLAG(bool, return_attention, false, "infer: also ask for the attention weights.");

// bench.
ABSL_FLAG(std::string, shared_memory, "none",
          "infer, bench: system sends tensors through POSIX shared-memory regions "
          "registered with the server (Triton's system shared memory; --protocol=kserve, "
          "a server on this host started with --shared_memory=system; bench: one region "
          "per concurrency slot, unary calls), or none.");
ABSL_FLAG(std::string, concurrency, "1",
          "bench: requests in flight, N or a sweep START:END[:STEP|:xFACTOR], e.g. 1:64:x2.");
ABSL_FLAG(std::string, request_rate, "",
          "bench: fixed request rate(s) per second instead of concurrency, N or a sweep.");
ABSL_FLAG(std::string, request_distribution, "constant",
          "bench: intervals at a fixed rate: constant or poisson.");
ABSL_FLAG(std::string, mode, "unary",
          "bench: unary (Attend, ModelInfer) or stream (AttendStream, ModelStreamInfer; one "
          "stream per concurrency slot; not with --protocol=http).");
ABSL_FLAG(int32_t, streams, kBench.rate_streams,
          "bench: streams carrying a --request_rate load in --mode=stream (--protocol=http: "
          "connections carrying it).");
ABSL_FLAG(std::string, rpc, "attend",
          "bench: attend, or health (measures grpc.health.v1 Check, then Attend at the "
          "same load, and prints their ratio; kserve: ServerReady; http: GET "
          "/v2/health/ready).");
ABSL_FLAG(int32_t, channels, kBench.channels,
          "bench: gRPC channels (HTTP/2 connections per server) the load is spread over.");
ABSL_FLAG(absl::Duration, warmup, kBench.warmup,
          "bench: warm-up per step: sent, not measured, not counted in --max_requests.");
ABSL_FLAG(absl::Duration, window, kBench.window, "bench: length of a measurement window.");
ABSL_FLAG(int32_t, stable_windows, kBench.stable_windows,
          "bench: a step is stable when this many last windows agree.");
ABSL_FLAG(double, stability, kBench.stability,
          "bench: tolerance of that agreement (throughput and mean latency, +- fraction).");
ABSL_FLAG(int32_t, max_windows, kBench.max_windows,
          "bench: measurement windows per step, at most.");
ABSL_FLAG(absl::Duration, duration, kBench.duration,
          "bench: time per step, at most (warm-up included; longer than --warmup).");
ABSL_FLAG(int64_t, max_requests, kBench.max_requests,
          "bench: measured requests per step (after the warm-up), at most; 0 = no limit.");
ABSL_FLAG(std::string, allow_errors, "",
          "bench: comma-separated canonical codes the run expects, e.g. RESOURCE_EXHAUSTED "
          "(refusals under overload). A request failing with any other code makes bench exit "
          "1; those failures back off (1 ms doubling to 100 ms between attempts).");
ABSL_FLAG(int64_t, max_errors, kBench.max_errors,
          "bench: failed requests per step, codes not in --allow_errors, that end the step "
          "and the run early; 0 = no limit.");
ABSL_FLAG(std::string, json, "",
          "bench, heads, heatmap, decode: write a JSON report (heatmap: the image layout) to "
          "FILE.");
ABSL_FLAG(std::string, csv, "", "bench: write a CSV report (one row per step) to FILE.");
ABSL_FLAG(bool, progress, true, "bench: print progress per window on stderr.");

// heatmap.
ABSL_FLAG(int64_t, batch_index, kHeatmap.batch_index, "heatmap: the batch row to draw.");
ABSL_FLAG(int32_t, cell_size, kHeatmap.style.cell_size,
          "heatmap: pixels per weight; 0 = fit each map in about 240 pixels.");
ABSL_FLAG(int32_t, columns, kHeatmap.style.columns,
          "heatmap: maps per grid row; 0 = ceil(sqrt(heads)).");
ABSL_FLAG(std::string, scale, "linear",
          "heatmap: colour scale: linear (0 .. the largest weight, shared by every map), log "
          "(log10 of the weight, from the smallest positive weight, at most 6 decades down, to "
          "the largest) or row (each query row of each map from 0 to its own largest weight).");

// heads.
ABSL_FLAG(int64_t, prune, 0,
          "heads: also report the change from dropping this many least important heads.");

// health.
ABSL_FLAG(std::string, service, "",
          "health: the service name to check; empty = the server and every model.");

// decode.
ABSL_FLAG(int64_t, sessions, kDecode.sessions,
          "decode: S, sessions at once, each a causal self-attention session (one thread "
          "drives every stream; --stateless runs a thread each).");
ABSL_FLAG(int64_t, prefill, kDecode.prefill,
          "decode: P, tokens of each session's first step (1, P, d_q).");
ABSL_FLAG(int64_t, decode_tokens, kDecode.decode_tokens,
          "decode: N, steps of one new token after the prefill.");
ABSL_FLAG(bool, stateless, kDecode.stateless,
          "decode: unary Attend instead of AttendSession: the prefill as causal "
          "self-attention, then per step the new token as the query and every token so far "
          "(itself included) as keys and values.");
ABSL_FLAG(bool, check, false,
          "decode: run the other mode too (sessions and --stateless) on the same tokens, and "
          "print whether the two output sums agree within 1e-5 x the sum of |output| and the "
          "sessions' speed-up in decode tokens/s.");

namespace {

constexpr char kUsage[] =
    "A client for attention_server (attention.v1.AttentionService) and a load tester.\n"
    "Usage: attention_client VERB [--target=HOST:PORT] [--protocol=attention|kserve|http] "
    "[flags]\n"
    "Verbs:\n"
    "  infer    one request (generated from --seed, or --input files); prints the output's\n"
    "           shape, a summary, the first values of its rows and timing;\n"
    "           --output=FILE.npy|.safetensors\n"
    "  bench    load test: --concurrency=1:64:x2 or --request_rate=..., --mode=unary|stream,\n"
    "           warm-up then windows until stable; table, --json, --csv\n"
    "  heatmap  attention weights of one batch row as a PNG, one map per head;\n"
    "           --scale=linear|log|row\n"
    "  heads    head importance: drop each head (head_mask), rank by output change\n"
    "  health   grpc.health.v1 Check of the server and every model\n"
    "  decode   autoregressive decoding: --sessions=S causal self-attention sessions\n"
    "           (AttendSession), each a prefill of --prefill=P tokens then\n"
    "           --decode_tokens=N steps of one; --stateless sends the same tokens through\n"
    "           Attend, all keys and values every step. Latency by context length,\n"
    "           decode tokens/s; --json; --check runs both and compares their outputs.\n"
    "           An attention-only model (projections NONE) gets random pre-projected\n"
    "           q, k, v in CROSS causal sessions, and the cache bytes a step reads and\n"
    "           GB/s are printed\n"
    "infer and bench speak --protocol (attention, kserve or http); the others attention.\n"
    "Errors print one line, 'error: CODE: message', and exit 1 (decode: its first failed\n"
    "step, naming session and step); bench also exits 1 when a step measured nothing or a\n"
    "request failed with a code not in --allow_errors. Usage errors (a flag's value, flags\n"
    "that disagree, a flag the verb does not read, an argument too many) print\n"
    "'error: --flag: message' and exit 2. --version prints the version and build type.";

absl::StatusOr<std::vector<int32_t>> ParseValidLens(const std::string& text) {
  std::vector<int32_t> lens;
  if (text == "none") return lens;
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    int32_t len = 0;
    if (!absl::SimpleAtoi(part, &len)) {
      return UsageError(absl::StrCat(
          "--valid_lens: expected comma-separated integers or 'none', got \"", text, "\""));
    }
    lens.push_back(len);
  }
  return lens;
}

absl::StatusOr<std::set<grpc::StatusCode>> ParseAllowErrors(const std::string& text) {
  std::set<grpc::StatusCode> codes;
  for (absl::string_view name : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    const std::optional<absl::StatusCode> code = mha::client::CodeFromName(name);
    if (!code || *code == absl::StatusCode::kOk) {
      return UsageError(absl::StrCat("--allow_errors: unknown code \"", name,
                                     "\"; expected canonical names such as RESOURCE_EXHAUSTED, "
                                     "DEADLINE_EXCEEDED, UNAVAILABLE"));
    }
    codes.insert(static_cast<grpc::StatusCode>(*code));
  }
  return codes;
}

absl::StatusOr<mha::client::BenchOptions> BenchFromFlags() {
  using mha::client::Mode;
  using mha::client::Rpc;
  mha::client::BenchOptions bench;
  const std::string rpc = absl::GetFlag(FLAGS_rpc), mode = absl::GetFlag(FLAGS_mode),
                    distribution = absl::GetFlag(FLAGS_request_distribution);
  if (rpc != "attend" && rpc != "health") {
    return UsageError(absl::StrCat("--rpc: expected attend or health, got ", rpc));
  }
  if (mode != "unary" && mode != "stream") {
    return UsageError(absl::StrCat("--mode: expected unary or stream, got ", mode));
  }
  if (distribution != "constant" && distribution != "poisson") {
    return UsageError(
        absl::StrCat("--request_distribution: expected constant or poisson, got ", distribution));
  }
  bench.rpc = rpc == "health" ? Rpc::kHealth : Rpc::kAttend;
  bench.mode = mode == "stream" ? Mode::kStream : Mode::kUnary;
  bench.poisson = distribution == "poisson";
  if (const std::string rates = absl::GetFlag(FLAGS_request_rate); !rates.empty()) {
    MHA_ASSIGN_OR_RETURN(bench.request_rates, mha::client::ParseSweep(rates, "request_rate"));
  } else {
    MHA_ASSIGN_OR_RETURN(std::vector<double> levels,
                         mha::client::ParseSweep(absl::GetFlag(FLAGS_concurrency), "concurrency"));
    bench.concurrency.clear();
    for (double level : levels) {
      if (level != static_cast<int>(level) || level > 100000) {
        return UsageError(
            absl::StrCat("--concurrency: expected whole numbers up to 100000, got ", level));
      }
      bench.concurrency.push_back(static_cast<int>(level));
    }
  }
  bench.rate_streams = absl::GetFlag(FLAGS_streams);
  bench.channels = absl::GetFlag(FLAGS_channels);
  bench.warmup = absl::GetFlag(FLAGS_warmup);
  bench.window = absl::GetFlag(FLAGS_window);
  bench.stable_windows = absl::GetFlag(FLAGS_stable_windows);
  bench.stability = absl::GetFlag(FLAGS_stability);
  bench.max_windows = absl::GetFlag(FLAGS_max_windows);
  bench.duration = absl::GetFlag(FLAGS_duration);
  bench.max_requests = absl::GetFlag(FLAGS_max_requests);
  bench.max_errors = absl::GetFlag(FLAGS_max_errors);
  MHA_ASSIGN_OR_RETURN(bench.allowed_errors, ParseAllowErrors(absl::GetFlag(FLAGS_allow_errors)));
  bench.seed = absl::GetFlag(FLAGS_seed);
  bench.shared_memory = absl::GetFlag(FLAGS_shared_memory) == "system";
  return bench;
}

// `target_given`: --target is on the command line.
mha::client::ChannelOptions ChannelFromFlags(mha::client::Protocol protocol, bool target_given) {
  mha::client::ChannelOptions channel;
  channel.protocol = protocol;
  channel.target = absl::GetFlag(FLAGS_target);
  // --target as given, even when it equals the gRPC default; unset, http's default.
  if (protocol == mha::client::Protocol::kHttp && !target_given) {
    channel.target = absl::StrCat("127.0.0.1:", mha::client::kDefaultHttpPort);
  }
  for (absl::string_view t : absl::StrSplit(absl::GetFlag(FLAGS_targets), ',', absl::SkipEmpty())) {
    channel.targets.emplace_back(t);
  }
  channel.tls = absl::GetFlag(FLAGS_tls);
  channel.shared_memory = absl::GetFlag(FLAGS_shared_memory) == "system";
  channel.tls_ca = absl::GetFlag(FLAGS_tls_ca);
  channel.tls_cert = absl::GetFlag(FLAGS_tls_cert);
  channel.tls_key = absl::GetFlag(FLAGS_tls_key);
  channel.tls_server_name = absl::GetFlag(FLAGS_tls_server_name);
  channel.timeout = absl::GetFlag(FLAGS_timeout);
  channel.max_message_bytes = absl::GetFlag(FLAGS_max_message_size);
  return channel;
}

absl::StatusOr<mha::client::RequestOptions> RequestFromFlags() {
  mha::client::RequestOptions request;
  request.model = absl::GetFlag(FLAGS_model);
  request.model_version = absl::GetFlag(FLAGS_model_version);
  request.batch = absl::GetFlag(FLAGS_batch);
  request.num_queries = absl::GetFlag(FLAGS_num_queries);
  request.num_keys = absl::GetFlag(FLAGS_num_keys);
  request.causal = absl::GetFlag(FLAGS_causal);
  request.seed = absl::GetFlag(FLAGS_seed);
  request.return_attention = absl::GetFlag(FLAGS_return_attention);
  for (absl::string_view f : absl::StrSplit(absl::GetFlag(FLAGS_input), ',', absl::SkipEmpty())) {
    request.input_files.emplace_back(f);
  }
  // No --valid_lens: the toy request's lengths for the toy request only (as
  // mha-serve-client does), else none.
  const bool toy = request.input_files.empty() && request.batch == kRequest.batch &&
                   request.num_queries == kRequest.num_queries &&
                   request.num_keys == kRequest.num_keys;
  const std::string valid_lens = absl::GetFlag(FLAGS_valid_lens);
  if (!valid_lens.empty()) {
    MHA_ASSIGN_OR_RETURN(request.valid_lens, ParseValidLens(valid_lens));
  } else {
    request.valid_lens = toy ? kRequest.valid_lens : std::vector<int32_t>{};
  }
  MHA_RETURN_IF_ERROR(mha::client::CheckRequestOptions(request));
  return request;
}

// Flags that contradict --protocol: usage errors, like an unknown verb.
absl::StatusOr<mha::client::Protocol> ProtocolFromFlags(const std::string& verb) {
  using mha::client::Protocol;
  MHA_ASSIGN_OR_RETURN(const Protocol protocol,
                       mha::client::ParseProtocol(absl::GetFlag(FLAGS_protocol)));
  if (const std::string shm = absl::GetFlag(FLAGS_shared_memory); shm != "none") {
    if (shm != "system") {
      return UsageError(
          absl::StrCat("--shared_memory: expected system or none, got \"", shm, "\""));
    }
    if (protocol != Protocol::kKServe) {
      return UsageError(
          "--shared_memory=system: registers regions over gRPC; use --protocol=kserve");
    }
  }
  if (protocol == Protocol::kAttention) return protocol;
  const std::string flag = absl::StrCat("--protocol=", mha::client::ProtocolName(protocol));
  if (verb != "infer" && verb != "bench") {
    return UsageError(
        absl::StrCat(flag, ": ", verb, " speaks attention.v1 only; use --protocol=attention"));
  }
  if (protocol != Protocol::kHttp) return protocol;
  if (!absl::GetFlag(FLAGS_targets).empty()) {
    return UsageError(
        absl::StrCat(flag, ": --targets spreads gRPC calls; give one HTTP server in --target"));
  }
  if (!absl::GetFlag(FLAGS_tls_server_name).empty()) {
    return UsageError(absl::StrCat(
        flag, ": --tls_server_name applies to gRPC only; HTTPS checks the --target host"));
  }
  if (verb == "bench" && absl::GetFlag(FLAGS_mode) == "stream") {
    return UsageError(absl::StrCat(
        flag, ": --mode=stream needs a gRPC stream; use --protocol=kserve (ModelStreamInfer)"));
  }
  if (verb == "bench" && absl::GetFlag(FLAGS_channels) != kBench.channels) {
    return UsageError(absl::StrCat(
        flag, ": --channels counts gRPC connections; HTTP opens one per concurrency slot"));
  }
  return protocol;
}

// The flags each verb reads besides the connection's (kConnectionFlags); any other
// on its command line is a usage error rather than silently ignored.
const std::set<std::string> kConnectionFlags = {
    "protocol", "target",  "targets",         "tls",     "tls_ca",
    "tls_cert", "tls_key", "tls_server_name", "timeout", "max_message_size"};
const std::set<std::string> kRequestFlags = {"model",       "model_version", "batch",
                                             "num_queries", "num_keys",      "valid_lens",
                                             "causal",      "seed",          "input"};
std::set<std::string> VerbFlags(const std::string& verb) {
  std::set<std::string> flags;
  if (verb == "infer" || verb == "bench" || verb == "heatmap" || verb == "heads") {
    flags = kRequestFlags;
  }
  if (verb == "infer") flags.insert({"output", "return_attention", "shared_memory"});
  if (verb == "bench") {
    flags.insert({"concurrency", "request_rate", "request_distribution", "mode", "streams", "rpc",
                  "channels", "warmup", "window", "stable_windows", "stability", "max_windows",
                  "duration", "max_requests", "allow_errors", "max_errors", "json", "csv",
                  "progress", "shared_memory"});
  }
  if (verb == "heatmap") {
    flags.insert({"output", "json", "batch_index", "cell_size", "columns", "scale"});
  }
  if (verb == "heads") flags.insert({"prune", "json"});
  if (verb == "health") flags.insert("service");
  if (verb == "decode") {
    flags.insert({"model", "model_version", "seed", "sessions", "prefill", "decode_tokens",
                  "stateless", "check", "json"});
  }
  return flags;
}

// A usage error naming the first flag on the command line that `verb` does not read,
// and the verbs that do.
absl::Status CheckFlagsApplyToVerb(const std::string& verb, const std::vector<std::string>& given,
                                   const std::vector<std::string>& verbs) {
  const std::set<std::string> flags = VerbFlags(verb);
  for (const std::string& name : given) {
    if (kConnectionFlags.count(name) > 0 || flags.count(name) > 0) continue;
    std::vector<std::string> readers;
    for (const std::string& other : verbs) {
      if (VerbFlags(other).count(name) > 0) readers.push_back(other);
    }
    return UsageError(absl::StrCat("--", name, ": ", verb, " does not read it (",
                                   readers.empty() ? "no verb" : absl::StrJoin(readers, ", "),
                                   " only)"));
  }
  return absl::OkStatus();
}

// Every flag is checked (usage errors) before the verb connects.
absl::Status RunVerb(const std::string& verb, const mha::client::ChannelOptions& channel) {
  namespace client = mha::client;
  MHA_RETURN_IF_ERROR(client::CheckPositive("timeout", channel.timeout));
  if (verb == "health") {
    return client::Health(channel, {.service = absl::GetFlag(FLAGS_service)}, std::cout);
  }
  if (verb == "decode") {
    client::DecodeCommandOptions options;
    options.decode.model = absl::GetFlag(FLAGS_model);
    options.decode.model_version = absl::GetFlag(FLAGS_model_version);
    options.decode.sessions = absl::GetFlag(FLAGS_sessions);
    options.decode.prefill = absl::GetFlag(FLAGS_prefill);
    options.decode.decode_tokens = absl::GetFlag(FLAGS_decode_tokens);
    options.decode.stateless = absl::GetFlag(FLAGS_stateless);
    options.decode.seed = absl::GetFlag(FLAGS_seed);
    MHA_RETURN_IF_ERROR(client::CheckDecodeOptions(options.decode));
    options.json = absl::GetFlag(FLAGS_json);
    options.check = absl::GetFlag(FLAGS_check);
    return client::Decode(channel, options, std::cout);
  }
  MHA_ASSIGN_OR_RETURN(const client::RequestOptions request, RequestFromFlags());

  if (verb == "infer") {
    return client::Infer(channel, request, {.output = absl::GetFlag(FLAGS_output)}, std::cout);
  }
  if (verb == "bench") {
    client::BenchCommandOptions options;
    MHA_ASSIGN_OR_RETURN(options.bench, BenchFromFlags());
    MHA_RETURN_IF_ERROR(client::CheckBenchOptions(options.bench, channel.protocol));
    options.json = absl::GetFlag(FLAGS_json);
    options.csv = absl::GetFlag(FLAGS_csv);
    options.interactive = isatty(STDERR_FILENO) != 0;
    std::ostream null_stream(nullptr);
    return client::Bench(channel, request, options, std::cout,
                         absl::GetFlag(FLAGS_progress) ? std::cerr : null_stream);
  }
  if (verb == "heatmap") {
    client::HeatmapOptions options;
    if (!absl::GetFlag(FLAGS_output).empty()) options.output = absl::GetFlag(FLAGS_output);
    options.json = absl::GetFlag(FLAGS_json);
    options.batch_index = absl::GetFlag(FLAGS_batch_index);
    options.style.cell_size = absl::GetFlag(FLAGS_cell_size);
    options.style.columns = absl::GetFlag(FLAGS_columns);
    MHA_ASSIGN_OR_RETURN(options.style.scale,
                         client::ParseHeatmapScale(absl::GetFlag(FLAGS_scale)));
    return client::Heatmap(channel, request, options, std::cout);
  }
  if (verb == "heads") {
    return client::Heads(channel, request,
                         {.prune = absl::GetFlag(FLAGS_prune), .json = absl::GetFlag(FLAGS_json)},
                         std::cout);
  }
  return absl::InternalError(absl::StrCat("no verb ", verb));
}

absl::Status Run(const std::string& verb, const std::vector<std::string>& given) {
  MHA_ASSIGN_OR_RETURN(const mha::client::Protocol protocol, ProtocolFromFlags(verb));
  const mha::client::ChannelOptions channel =
      ChannelFromFlags(protocol, std::find(given.begin(), given.end(), "target") != given.end());
  return mha::client::WithChannelHint(RunVerb(verb, channel), channel);
}

// bench serializes a fresh buffer for every request. By default glibc serves blocks
// over 128 KiB with mmap and trims the heap top past twice that, so every large
// request would pay for new pages (page faults). With these thresholds freed buffers
// stay in the heap for the next request, and memory returns to the OS past 64 MiB
// free at the top. Only the client does this: a long-running server should give
// memory back after a burst. GLIBC_TUNABLES, when set, decides instead.
void KeepRequestBuffersInTheHeap() {
  if (std::getenv("GLIBC_TUNABLES") != nullptr) return;
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 64 << 20);
}

}  // namespace

int main(int argc, char** argv) {
  KeepRequestBuffersInTheHeap();
  // cpp-httplib writes HTTPS through OpenSSL's plain write(): a server that drops the
  // connection (a refused client certificate) would kill the client with SIGPIPE
  // instead of letting it report the error.
  std::signal(SIGPIPE, SIG_IGN);
  mha::SkipMutexDeadlockDetectionInRelease();
  // --help (base/command_line.h) prints this and every flag; --version the version.
  absl::SetProgramUsageMessage(kUsage);
  const std::vector<std::string> args = mha::ParseCommandLineOrExit(argc, argv);

  const std::vector<std::string> verbs = {"infer", "bench", "heatmap", "heads", "health", "decode"};
  if (args.empty() || std::find(verbs.begin(), verbs.end(), args[0]) == verbs.end()) {
    std::fprintf(stderr,
                 "error: expected one verb (infer, bench, heatmap, heads, health, decode)%s\n%s\n",
                 args.empty() ? "" : absl::StrCat(", got '", args[0], "'").c_str(), kUsage);
    return 2;
  }
  if (args.size() > 1) {
    mha::ExitWithUsageError(absl::StrCat("unexpected argument '", args[1], "' after the verb ",
                                         args[0], " (flags are --name=value)"));
  }
  const std::vector<std::string> given = mha::FlagsOnCommandLine(argc, argv);
  absl::Status status = CheckFlagsApplyToVerb(args[0], given, verbs);
  if (status.ok()) status = Run(args[0], given);
  if (!status.ok()) {
    std::fflush(stdout);
    std::fprintf(stderr, "%s\n", mha::client::ErrorLine(status).c_str());
  }
  return mha::client::ExitCode(status);
}

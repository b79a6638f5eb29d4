// Benchmarks of mha::core::MultiHeadAttention::Forward on the shapes of the core
// issue. Each reports GFLOPS: the four projections and the two attention products
// counted at full length (MultiHeadAttention::Flops), per second of wall time.
//
//   build/release/tests/bench/mha_core_bench --benchmark_filter='Forward/(bert|long|small|padded)'
//   /usr/bin/time -v build/release/tests/bench/mha_core_bench --benchmark_filter=memory_16k
//   build/release/tests/bench/mha_core_bench --benchmark_filter=Rows/   (service ceiling)
//   build/release/tests/bench/mha_core_bench --benchmark_filter=Additive/ (additive scoring)
//   build/release/tests/bench/mha_core_bench --benchmark_filter=Decode/   (session steps)
//   build/release/tests/bench/mha_core_bench --benchmark_filter=Prefill/  (GQA + RoPE)
//   build/release/tests/bench/mha_core_bench --benchmark_filter=GemmPeak/ (oneDNN's 2048^3)
//   build/release/tests/bench/mha_core_bench --isa=avx2 ...  (a lower build of our kernels)
//
// Threads: OMP_NUM_THREADS, else every core. Compare with PyTorch on the same shapes:
// tests/bench/compare_torch.py --ours FILE (FILE from --benchmark_out=FILE
// --benchmark_out_format=json).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <initializer_list>
#include <iterator>
#include <memory>
#include <random>
#include <string>
#include <unordered_map>
#include <vector>

#include "benchmark/benchmark.h"
#include "core/attention.h"
#include "core/kernels.h"
#include "core/kv_cache.h"
#include "oneapi/dnnl/dnnl.hpp"

namespace mha::core {
namespace {

// The median of v (its upper middle for an even count).
double Median(std::vector<double> v) {
  std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
  return v[v.size() / 2];
}

struct Shape {
  const char* name;
  int64_t batch, length, hiddens, heads;
  bool padded;                  // valid_lens = length / 2 for every batch row
  int64_t iterations = 0;       // 0: let the library decide
  int64_t additive_hidden = 0;  // p_a: additive scoring; 0: dot product
};

constexpr Shape kShapes[] = {
    {"bert_base", 8, 128, 768, 12, false},
    {"long", 1, 2048, 512, 8, false},
    {"small", 1, 16, 256, 8, false},
    {"padded", 1, 2048, 512, 8, true},
    // Self-attention at L 16384: the full score tensor would be 8.6 GB; run under
    // /usr/bin/time -v to see the peak RSS of the blocked kernel.
    {"memory_16k", 1, 16384, 512, 8, false, 1},
};

// Additive scoring (p_a 64), against d2l's broadcast AdditiveAttention in
// compare_torch.py --additive.
constexpr Shape kAdditiveShapes[] = {
    {"additive_128", 4, 128, 256, 8, false, 0, 64},
    {"additive_1024", 1, 1024, 256, 8, false, 0, 64},
};

void BM_Forward(benchmark::State& state, Shape shape, Precision precision) {
  const ModelConfig config{
      .num_hiddens = shape.hiddens,
      .num_heads = shape.heads,
      .query_size = shape.hiddens,
      .key_size = shape.hiddens,
      .value_size = shape.hiddens,
      .bias = true,
      .precision = precision,
      .scoring = shape.additive_hidden > 0 ? Scoring::kAdditive : Scoring::kDotProduct,
      .additive_hidden = shape.additive_hidden};
  auto mha = MultiHeadAttention::Create(config, SeededWeights(config, 1));
  if (!mha.ok()) {
    state.SkipWithError(std::string(mha.status().message()).c_str());
    return;
  }
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> x(shape.batch * shape.length * shape.hiddens);
  for (float& v : x) v = dist(rng);
  std::vector<float> out(x.size());
  std::vector<int32_t> lens;
  if (shape.padded) lens.assign(shape.batch, static_cast<int32_t>(shape.length / 2));
  const AttentionInputs in{.batch = shape.batch,
                           .num_queries = shape.length,
                           .num_keys = shape.length,
                           .queries = x.data(),
                           .valid_lens = lens};
  for (auto _ : state) {
    const absl::Status s = (*mha)->Forward(in, out.data());
    if (!s.ok()) {
      state.SkipWithError(std::string(s.message()).c_str());
      break;
    }
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  const double flops = MultiHeadAttention::Flops(config, shape.batch, shape.length, shape.length);
  state.counters["GFLOPS"] =
      benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["tokens/s"] = benchmark::Counter(static_cast<double>(shape.batch * shape.length),
                                                  benchmark::Counter::kIsIterationInvariantRate);
}

// The core alone on what the batcher hands it for the service benchmark: `rows`
// requests of B 1, Q = K = 32 (self-attention) in one call. requests/s here is
// the ceiling the service's batched throughput is compared with
// (docs/performance.md).
void BM_Rows(benchmark::State& state, const char* model, int64_t hiddens, int64_t heads,
             bool bias) {
  const int64_t rows = state.range(0);
  constexpr int64_t kLength = 32;
  const ModelConfig config{.num_hiddens = hiddens,
                           .num_heads = heads,
                           .query_size = hiddens,
                           .key_size = hiddens,
                           .value_size = hiddens,
                           .bias = bias};
  auto mha = MultiHeadAttention::Create(config, SeededWeights(config, 1)).value();
  std::vector<float> x(rows * kLength * hiddens, 0.5f), out(x.size());
  const AttentionInputs in{
      .batch = rows, .num_queries = kLength, .num_keys = kLength, .queries = x.data()};
  for (auto _ : state) {
    if (!mha->Forward(in, out.data()).ok()) {
      state.SkipWithError("Forward failed");
      break;
    }
    benchmark::DoNotOptimize(out.data());
  }
  state.SetLabel(model);
  state.counters["requests/s"] =
      benchmark::Counter(static_cast<double>(rows), benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK_CAPTURE(BM_Rows, toy, "toy", 100, 5, false)
    ->Name("Rows/toy_q32")
    ->RangeMultiplier(2)
    ->Range(1, 64)
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(BM_Rows, bert_base, "bert_base", 768, 12, true)
    ->Name("Rows/bert_base_q32")
    ->RangeMultiplier(2)
    ->Range(1, 64)
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);

// The seeds' toy request (B 2, Q 4, K 6, valid_lens {3, 2}), `n` of them merged into
// one call as the batcher does (B 2n): the tiny attention blocks of the serving
// path's small-request figures (docs/performance.md, "The serving path").
void BM_ToyRequests(benchmark::State& state) {
  const int64_t n = state.range(0);
  const ModelConfig config{.num_hiddens = 100, .num_heads = 5};
  auto mha = MultiHeadAttention::Create(config, SeededWeights(config, 0)).value();
  const int64_t rows = 2 * n;
  std::vector<float> q(rows * 4 * 100, 0.5f), kv(rows * 6 * 100, 0.25f), out(q.size());
  std::vector<int32_t> lens;
  for (int64_t i = 0; i < n; ++i) lens.insert(lens.end(), {3, 2});
  const AttentionInputs in{.batch = rows,
                           .num_queries = 4,
                           .num_keys = 6,
                           .queries = q.data(),
                           .keys = kv.data(),
                           .values = kv.data(),
                           .valid_lens = lens};
  for (auto _ : state) {
    if (!mha->Forward(in, out.data()).ok()) {
      state.SkipWithError("Forward failed");
      break;
    }
    benchmark::DoNotOptimize(out.data());
  }
  state.counters["requests/s"] =
      benchmark::Counter(static_cast<double>(n), benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_ToyRequests)
    ->Name("Rows/toy_request")
    ->Arg(1)
    ->Arg(8)
    ->Arg(32)
    ->Arg(13)  // merges of other sizes: row counts off the projections' chunk sizes
    ->Arg(27)
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);

// The decode benches' pools hold each session's tokens and the rest of its last
// chunk (core/kv_cache.h).
constexpr int64_t kChunkSlackTokens = KvCachePool::kChunkBlocks * KvCachePool::kBlockTokens;

// The decoder model's sizes (deploy/models/decoder): 768, 12 heads, biases.
ModelConfig DecoderConfig(Precision precision) {
  return {.num_hiddens = 768,
          .num_heads = 12,
          .query_size = 768,
          .key_size = 768,
          .value_size = 768,
          .bias = true,
          .precision = precision};
}

// Uniform values in [-1, 1) from one fixed seed, into each vector in turn.
void FillUniform(std::initializer_list<std::vector<float>*> vectors) {
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  for (std::vector<float>* v : vectors) {
    for (float& x : *v) x = dist(rng);
  }
}

// One decode step per session (ForwardPaged): `sessions` self-attention sessions
// of the decoder model's size (768, 12 heads, bias), each prefilled to `context`
// tokens, then each iteration adds one token to every session in one call, as the
// batcher merges decode steps. 64 steps per repetition, so the context grows by
// at most 64. tokens/s counts the sessions' new tokens. At context 160 (calls at
// 160-224) the steps are those of tests/bench/decode_bench.py's tokens/s runs
// (prefill 128, 128 steps: contexts 128-256), so 16 / 1 sessions' tokens/s there is
// what the core alone, without RPC, gives that bench's 16 / 1 ratio.
//   build/release/tests/bench/mha_core_bench --benchmark_filter=Decode/
// Decode/step_int8: the same model made int8 (its cache stays f32).
void BM_DecodeStep(benchmark::State& state, Precision precision) {
  const int64_t sessions = state.range(0), context = state.range(1);
  const ModelConfig config = DecoderConfig(precision);
  auto mha = MultiHeadAttention::Create(config, SeededWeights(config, 5)).value();
  const int64_t steps = 64;
  KvCachePool pool(sessions * (context + steps + kChunkSlackTokens) * 2 * 768 * 4);
  std::vector<float> prefill((context + steps) * 768), token(sessions * 768);
  FillUniform({&prefill, &token});
  std::vector<float> prefill_out(prefill.size()), out(token.size());
  std::vector<std::unique_ptr<KvSequence>> caches;
  // Sessions of `tokens` prefilled tokens each, into `caches`.
  auto open = [&](int64_t tokens) {
    caches.clear();
    for (int64_t s = 0; s < sessions; ++s) {
      caches.push_back(std::make_unique<KvSequence>(&pool, 12, 64));
      if (!caches.back()->Reserve(tokens).ok()) return false;
      const PagedStep step{.num_queries = tokens,
                           .queries = prefill.data(),
                           .causal = true,
                           .cache = caches.back().get(),
                           .output = prefill_out.data()};
      if (!mha->ForwardPaged({&step, 1}).ok()) return false;
    }
    return true;
  };
  // The pool as a server's is once earlier sessions have ended: their blocks, written
  // and released, kept for reuse up to its retain_bytes (16 MiB), so that the steps
  // time the step and not the first touch of fresh pages (docs/performance.md).
  if (!open(context + steps)) return state.SkipWithError("warm-up sessions");
  if (!open(context)) return state.SkipWithError("prefill");
  std::vector<PagedStep> batch(sessions);
  for (auto _ : state) {
    for (int64_t s = 0; s < sessions; ++s) {
      if (!caches[s]->Reserve(1).ok()) return state.SkipWithError("pool");
      batch[s] = {.num_queries = 1,
                  .queries = token.data() + s * 768,
                  .causal = true,
                  .cache = caches[s].get(),
                  .output = out.data() + s * 768};
    }
    if (!mha->ForwardPaged(batch).ok()) return state.SkipWithError("ForwardPaged");
    benchmark::DoNotOptimize(out.data());
  }
  state.counters["tokens/s"] = benchmark::Counter(static_cast<double>(sessions),
                                                  benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK_CAPTURE(BM_DecodeStep, f32, Precision::kF32)
    ->Name("Decode/step")
    ->ArgNames({"sessions", "context"})
    ->ArgsProduct({{1, 12}, {64, 512, 2048}})
    ->Args({1, 160})
    ->Args({16, 160})
    ->Iterations(64)
    ->Repetitions(5)
    ->ReportAggregatesOnly()
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(BM_DecodeStep, int8, Precision::kInt8)
    ->Name("Decode/step_int8")
    ->ArgNames({"sessions", "context"})
    ->ArgsProduct({{1, 12}, {64, 2048}})
    ->Iterations(64)
    ->Repetitions(5)
    ->ReportAggregatesOnly()
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);

// Decode/held and Decode/held_int8: one session's decode step at exactly `context`
// cached tokens, call after call: each step is undone (KvSequence::Truncate) and
// run again, so every timed step attends over the same context and reads the same
// blocks, as a session's next steps would. Steps at a context that drifts (Decode/step
// covers 64 of them) mix contexts; these are what issue 37's "a decode step at
// context 64" compares, int8 against f32.
// One model's session held at `context` cached tokens (BM_DecodeHeld).
class HeldSession {
 public:
  HeldSession(Precision precision, int64_t context)
      : config_(DecoderConfig(precision)),
        mha_(MultiHeadAttention::Create(config_, SeededWeights(config_, 5)).value()),
        pool_((context + kChunkSlackTokens) * 2 * 768 * 4),
        cache_(&pool_, 12, 64),
        context_(context),
        prefill_(context * 768),
        token_(768),
        prefill_out_(prefill_.size()),
        out_(768) {
    FillUniform({&prefill_, &token_});
  }
  bool Prefill() {
    if (!cache_.Reserve(context_ + 1).ok()) return false;
    const PagedStep first{.num_queries = context_,
                          .queries = prefill_.data(),
                          .causal = true,
                          .cache = &cache_,
                          .output = prefill_out_.data()};
    return mha_->ForwardPaged({&first, 1}).ok();
  }
  // One step at the context, then undone.
  bool Step() {
    const PagedStep step{.num_queries = 1,
                         .queries = token_.data(),
                         .causal = true,
                         .cache = &cache_,
                         .output = out_.data()};
    if (!mha_->ForwardPaged({&step, 1}).ok()) return false;
    cache_.Truncate(context_);
    benchmark::DoNotOptimize(out_.data());
    return true;
  }

 private:
  const ModelConfig config_;
  const std::unique_ptr<MultiHeadAttention> mha_;
  KvCachePool pool_;
  KvSequence cache_;
  const int64_t context_;
  std::vector<float> prefill_, token_, prefill_out_, out_;
};

// Decode/held and Decode/held_int8: one session's decode step at exactly `context`
// cached tokens, call after call: each step is undone (KvSequence::Truncate) and
// run again, so every timed step attends over the same context and reads the same
// blocks, as a session's next steps would. Steps at a context that drifts (Decode/step
// covers 64 of them) mix contexts; these are what issue 37's "a decode step at
// context 64" compares, int8 against f32.
void BM_DecodeHeld(benchmark::State& state, Precision precision) {
  HeldSession session(precision, state.range(0));
  if (!session.Prefill()) return state.SkipWithError("prefill");
  for (auto _ : state) {
    if (!session.Step()) return state.SkipWithError("ForwardPaged");
  }
}
// Decode/held_ratio: the same two sessions (f32 and int8) in one process, in turns of
// 200 steps each, so that both see the same spells of a noisy machine; each
// iteration is one turn of each. Counters: the median step of each (us) and the
// median of the turns' int8 / f32 ratios.
void BM_DecodeHeldRatio(benchmark::State& state) {
  constexpr int kTurn = 200;
  HeldSession f32(Precision::kF32, state.range(0)), int8(Precision::kInt8, state.range(0));
  if (!f32.Prefill() || !int8.Prefill()) return state.SkipWithError("prefill");
  auto turn = [&](HeldSession& session) {
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < kTurn; ++i) {
      if (!session.Step()) return -1.0;
    }
    return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start)
               .count() /
           kTurn;
  };
  std::vector<double> f32_us, int8_us, ratios;
  for (auto _ : state) {
    const double a = turn(f32), b = turn(int8);
    if (a < 0 || b < 0) return state.SkipWithError("ForwardPaged");
    f32_us.push_back(a);
    int8_us.push_back(b);
    ratios.push_back(b / a);
  }
  state.counters["f32_us"] = Median(f32_us);
  state.counters["int8_us"] = Median(int8_us);
  state.counters["int8_per_f32"] = Median(ratios);
}
BENCHMARK_CAPTURE(BM_DecodeHeld, f32, Precision::kF32)
    ->Name("Decode/held")
    ->ArgName("context")
    ->Arg(64)
    ->Repetitions(5)
    ->ReportAggregatesOnly()
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(BM_DecodeHeld, int8, Precision::kInt8)
    ->Name("Decode/held_int8")
    ->ArgName("context")
    ->Arg(64)
    ->Repetitions(5)
    ->ReportAggregatesOnly()
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_DecodeHeldRatio)
    ->Name("Decode/held_ratio")
    ->ArgName("context")
    ->Arg(64)
    ->Iterations(50)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

// The attention-only worker's decode step in the core alone (issue 35; the serving
// figure is tests/bench/attention_only_bench.py): 16 sessions of
// deploy/models_llm/llama_attention_only's heads (h 32, G 8 or 32, d_h 128, no
// projections), their caches filled to 4,032 tokens (appended without attending),
// then one call of one causal token per session per iteration, 64 iterations (context
// 4,033-4,096). cache GB/s: the bytes of the cache the steps read (2 G d_h f32 or
// bf16 per token) over wall time; p50 step ms and p50 cache GB/s: the median step's
// time, and a step's mean bytes over it.
//   build/release/tests/bench/mha_core_bench --benchmark_filter=Decode/attention_only
void BM_AttentionOnlyDecode(benchmark::State& state) {
  const int64_t kv_heads = state.range(0);
  const bool bf16 = state.range(1) != 0;
  constexpr int64_t kSessions = 16, kContext = 4032, kSteps = 64, kHeads = 32, kDh = 128;
  ModelConfig config;
  config.num_heads = kHeads;
  config.num_kv_heads = kv_heads;
  config.num_hiddens = config.query_size = kHeads * kDh;
  config.key_size = config.value_size = kv_heads * kDh;
  config.projections = Projections::kNone;
  if (bf16) config.kv_cache_precision = Precision::kBf16;
  auto mha = MultiHeadAttention::Create(config, Weights{}).value();
  const int64_t E = kHeads * kDh, Ekv = kv_heads * kDh, elem = bf16 ? 2 : 4;
  KvCachePool pool(kSessions * (kContext + kSteps + kChunkSlackTokens) * 2 * Ekv * elem);
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> kv(kContext * Ekv), q(kSessions * E), k(kSessions * Ekv), v(kSessions * Ekv);
  for (float& x : kv) x = dist(rng);
  for (float& x : q) x = dist(rng);
  for (float& x : k) x = dist(rng);
  for (float& x : v) x = dist(rng);
  std::vector<float> out(kSessions * E), lse(kSessions * kHeads);
  std::vector<std::unique_ptr<KvSequence>> caches;
  for (int64_t s = 0; s < kSessions; ++s) {
    caches.push_back(std::make_unique<KvSequence>(&pool, kv_heads, kDh, bf16));
    if (!caches.back()->Reserve(kContext).ok()) return state.SkipWithError("pool");
    const PagedStep fill{
        .num_keys = kContext, .keys = kv.data(), .values = kv.data(), .cache = caches.back().get()};
    if (!mha->ForwardPaged({&fill, 1}).ok()) return state.SkipWithError("fill");
  }
  std::vector<PagedStep> batch(kSessions);
  double bytes = 0;
  std::vector<double> step_ms;  // each step's ForwardPaged, for the p50
  for (auto _ : state) {
    for (int64_t s = 0; s < kSessions; ++s) {
      if (!caches[s]->Reserve(1).ok()) return state.SkipWithError("pool");
      bytes += static_cast<double>((caches[s]->size() + 1) * 2 * Ekv * elem);
      batch[s] = {.num_queries = 1,
                  .queries = q.data() + s * E,
                  .num_keys = 1,
                  .keys = k.data() + s * Ekv,
                  .values = v.data() + s * Ekv,
                  .causal = true,
                  .cache = caches[s].get(),
                  .output = out.data() + s * E,
                  .lse = lse.data() + s * kHeads};
    }
    const auto start = std::chrono::steady_clock::now();
    if (!mha->ForwardPaged(batch).ok()) return state.SkipWithError("ForwardPaged");
    step_ms.push_back(
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
            .count());
    benchmark::DoNotOptimize(out.data());
  }
  state.counters["cache GB/s"] = benchmark::Counter(bytes * 1e-9, benchmark::Counter::kIsRate);
  // The mean above counts the steps that first touch a session's new chunk (2 MiB for
  // 8 blocks of G 8 f32); the p50 leaves them out, as the served bench's step p50 does.
  const double p50 = Median(step_ms);
  state.counters["p50 step ms"] = p50;
  state.counters["p50 cache GB/s"] = bytes / static_cast<double>(step_ms.size()) / p50 * 1e-6;
  state.counters["tokens/s"] = benchmark::Counter(static_cast<double>(kSessions),
                                                  benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_AttentionOnlyDecode)
    ->Name("Decode/attention_only")
    ->ArgNames({"G", "bf16"})
    ->ArgsProduct({{8, 32}, {0, 1}})
    ->Iterations(64)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

// Causal prefill of 2,048 tokens (self-attention, B 1) on a grouped-query rotary
// layer (p_o 2048, h 16, G 4, rope theta 10000 over the whole head, no bias) and on
// the same-size multi-head layer without rope: issue 34's bound is the first within
// 1.0x the time of the second. GFLOPS counts each model's own FLOPs (the grouped
// model projects fewer).
//   build/release/tests/bench/mha_core_bench --benchmark_filter=Prefill/
void BM_CausalPrefill(benchmark::State& state, bool gqa_rope) {
  constexpr int64_t kLength = 2048, kHiddens = 2048;
  ModelConfig config{.num_hiddens = kHiddens,
                     .num_heads = 16,
                     .query_size = kHiddens,
                     .key_size = kHiddens,
                     .value_size = kHiddens};
  if (gqa_rope) {
    config.num_kv_heads = 4;
    config.rope = RotaryConfig{};
  }
  auto mha = MultiHeadAttention::Create(config, SeededWeights(config, 1)).value();
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> x(kLength * kHiddens), out(x.size());
  for (float& v : x) v = dist(rng);
  const AttentionInputs in{
      .batch = 1, .num_queries = kLength, .num_keys = kLength, .queries = x.data(), .causal = true};
  for (auto _ : state) {
    if (!mha->Forward(in, out.data()).ok()) return state.SkipWithError("Forward failed");
    benchmark::DoNotOptimize(out.data());
  }
  state.counters["GFLOPS"] =
      benchmark::Counter(MultiHeadAttention::Flops(config, 1, kLength, kLength) * 1e-9,
                         benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK_CAPTURE(BM_CausalPrefill, gqa_rope, true)
    ->Name("Prefill/gqa_rope_h16_g4_2048")
    ->MinTime(1.0)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_CausalPrefill, mha, false)
    ->Name("Prefill/mha_h16_2048")
    ->MinTime(1.0)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

// This machine's GEMM peak through oneDNN: one n^3 matmul (f32, or bf16 in with f32
// out), weights reordered once to the layout the primitive picks, as the core's
// projections do. GFLOPS = 2 n^3 per second of wall time; the ceiling the core's
// GEMM-bound shapes are read against (tests/bench/compare_onnxruntime.py).
void BM_GemmPeak(benchmark::State& state, dnnl::memory::data_type dt) {
  using dnnl::memory;
  const int64_t n = state.range(0);
  dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  dnnl::stream stream(engine);
  const memory::desc src({n, n}, dt, memory::format_tag::ab);
  const memory::desc any({n, n}, dt, memory::format_tag::any);
  const memory::desc dst({n, n}, memory::data_type::f32, memory::format_tag::ab);
  const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(src, any, dst), engine);
  const dnnl::matmul prim(pd);
  memory a(src, engine), w_plain(src, engine), w(pd.weights_desc(), engine), c(dst, engine);
  const size_t bytes = src.get_size();
  std::vector<char> fill(bytes, 0);
  for (size_t i = 0; i < bytes; i += 2) fill[i + 1] = 0x3c;  // small positive values
  std::memcpy(a.get_data_handle(), fill.data(), bytes);
  std::memcpy(w_plain.get_data_handle(), fill.data(), bytes);
  dnnl::reorder(w_plain, w).execute(stream, w_plain, w);
  const std::unordered_map<int, memory> args{
      {DNNL_ARG_SRC, a}, {DNNL_ARG_WEIGHTS, w}, {DNNL_ARG_DST, c}};
  for (auto _ : state) {
    prim.execute(stream, args);
    stream.wait();
  }
  state.counters["GFLOPS"] = benchmark::Counter(2.0 * static_cast<double>(n * n * n) * 1e-9,
                                                benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK_CAPTURE(BM_GemmPeak, f32, dnnl::memory::data_type::f32)
    ->Name("GemmPeak/f32")
    ->Arg(2048)
    ->MinTime(1.0)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_GemmPeak, bf16, dnnl::memory::data_type::bf16)
    ->Name("GemmPeak/bf16")
    ->Arg(2048)
    ->MinTime(1.0)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
// s8 x s8 (VNNI), the int8 models' projections; "GFLOPS" counts multiply-adds as 2.
BENCHMARK_CAPTURE(BM_GemmPeak, int8, dnnl::memory::data_type::s8)
    ->Name("GemmPeak/int8")
    ->Arg(2048)
    ->MinTime(1.0)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

void Register(const char* group, const Shape& shape, bool int8) {
  for (Precision p : {Precision::kF32, Precision::kBf16, Precision::kInt8}) {
    if (p == Precision::kInt8 && !int8) continue;
    auto* b = benchmark::RegisterBenchmark(
        (std::string(group) + "/" + shape.name + "/" + std::string(PrecisionName(p))).c_str(),
        BM_Forward, shape, p);
    b->Unit(benchmark::kMillisecond)->UseRealTime();
    if (shape.iterations > 0) {
      b->Iterations(shape.iterations);
    } else {
      b->MinTime(1.0);
    }
  }
}

[[maybe_unused]] const bool kRegistered = [] {
  for (const Shape& shape : kShapes) Register("Forward", shape, /*int8=*/true);
  for (const Shape& shape : kAdditiveShapes) Register("Additive", shape, /*int8=*/false);
  return true;
}();

}  // namespace
}  // namespace mha::core

// --isa=avx512|avx2|baseline (kernels::IsaName): the kernels built for several instruction sets run
// that build (core/kernels.h, Isa), for A/B runs of one build against another on one CPU.
int main(int argc, char** argv) {
  namespace kernels = mha::core::kernels;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--isa=", 6) != 0) continue;
    const std::string name = argv[i] + 6;
    const kernels::Isa isas[] = {kernels::Isa::kAvx512, kernels::Isa::kAvx2,
                                 kernels::Isa::kBaseline};
    const auto isa = std::find_if(std::begin(isas), std::end(isas),
                                  [&](kernels::Isa x) { return name == kernels::IsaName(x); });
    if (isa == std::end(isas)) {
      std::fprintf(stderr, "--isa=%s: not avx512, avx2 or baseline\n", name.c_str());
      return 1;
    }
    kernels::CapIsa(*isa);
    std::fprintf(stderr, "kernels: the %s build (this CPU's best: %s)\n",
                 kernels::IsaName(kernels::ActiveIsa()), kernels::IsaName(kernels::CpuIsa()));
    std::copy(argv + i + 1, argv + argc, argv + i);
    --argc;
    break;
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}

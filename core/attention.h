// mha::core::MultiHeadAttention: the textbook multi-head attention layer (d2l,
// "Multi-Head Attention") on oneDNN.
//
//   q_i = queries W_q^T (+ b_q), k_i, v_i likewise, each head i its slice of p columns
//   scores_i = q_i k_i^T / sqrt(p), or for ModelConfig::scoring kAdditive
//     score_ij = w_v_i . tanh(A_q_i q_i + A_k_i k_ij) (core/config.h);
//   masked keys excluded; a_i = softmax over keys
//   head_i = a_i v_i (* head_mask[i]); output = concat(head_1..head_h) W_o^T (+ b_o)
//
// Shapes (row-major float32):
//   queries (B, Q, d_q); keys (B, K, d_k); values (B, K, d_v); output (B, Q, p_o);
//   attention weights, when asked for, (B, h, Q, K).
//
// Grouped-query heads (ModelConfig::num_kv_heads G < h): k and v have G heads, and
// query head i attends with key/value head i / (h / G) (Hugging Face's repeat_kv,
// without the copies). Rotary models (ModelConfig::rope) rotate every q and k head
// after projection (core/config.h): key j of a call is at position j, query i at
// K - Q + i (the queries are the last Q of the K tokens; Q > K is INVALID_ARGUMENT).
//
// Masks, all optional and combinable:
//   valid_lens: B entries (one key length per batch row) or B*Q (one per query);
//     keys j >= valid_len are masked. 0 <= valid_len <= K, else INVALID_ARGUMENT.
//   causal: query i sees keys j <= i (top-left aligned, like PyTorch is_causal); in a
//     rotary model the keys at positions <= its own, j <= K - Q + i (bottom-right
//     aligned; the same when Q == K).
//   head_mask: h factors multiplying each head's output before W_o.
// A query whose every key is masked gets a zero context vector (not NaN, not the
// uniform average); its attention-weight row is all zeros. Masked weights are
// exactly 0.
//
// Attention-only layers (ModelConfig::projections kNone, the disaggregated-decoding
// worker): queries (B, Q, h*d_h), keys and values (B, K, G*d_h) come already
// projected (and rotated); output (B, Q, h*d_h) is the heads' contexts concatenated,
// each times its head_mask factor, without W_o.
// Log-sum-exp, when asked for (Forward's `lse`, PagedStep::lse): per (batch row,
// head, query) the natural log of sum_j exp(score_j) over the keys the query sees,
// every mask applied and head_mask ignored; -inf for a query that sees no key. Two
// calls over disjoint key sets merge exactly: m = max(l1, l2), w_i = exp(l_i - m),
// context = (w1 c1 + w2 c2) / (w1 + w2), lse = m + log(w1 + w2). It comes from the
// online softmax's running max and sum (max + log(sum)): no extra pass.
//
// Worked example, the seeds' toy call:
//   ModelConfig c;                       // p_o 100, h 5, d_q = d_k = d_v = 100
//   auto mha = MultiHeadAttention::Create(c, SeededWeights(c, 0)).value();
//   std::vector<float> x(2 * 4 * 100), y(2 * 6 * 100), out(2 * 4 * 100);
//   int32_t lens[] = {3, 2};
//   AttentionInputs in{.batch = 2, .num_queries = 4, .num_keys = 6,
//                      .queries = x.data(), .keys = y.data(), .values = y.data(),
//                      .valid_lens = lens};
//   absl::Status s = mha->Forward(in, out.data());   // out is (2, 4, 100)
//
// Thread safety: Create'd objects are immutable apart from internal caches that are
// guarded; Forward may be called from several threads at once. Each call runs its
// parallel regions on at most `Options::num_threads` OpenMP threads (0: the OpenMP
// default), fewer for small calls, so callers that run calls concurrently should
// divide the cores between them.
#ifndef MHA_CORE_ATTENTION_H_
#define MHA_CORE_ATTENTION_H_

#include <cstdint>
#include <memory>
#include <span>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/config.h"
#include "core/kv_cache.h"
#include "core/valid_lens.h"
#include "core/weights.h"

namespace mha::core {

// Non-owning views of one forward call's inputs.
struct AttentionInputs {
  int64_t batch = 0;                    // B
  int64_t num_queries = 0;              // Q
  int64_t num_keys = 0;                 // K; must equal Q for self-attention
  const float* queries = nullptr;       // (B, Q, d_q)
  const float* keys = nullptr;          // (B, K, d_k); nullptr: self-attention on queries
  const float* values = nullptr;        // (B, K, d_v); nullptr iff keys is nullptr
  std::span<const int32_t> valid_lens;  // empty, B or B*Q entries
  bool causal = false;
  std::span<const float> head_mask;  // empty or h entries

  bool self_attention() const { return keys == nullptr; }
  // valid_lens read through its layout (core/valid_lens.h).
  ValidLens lens() const { return ValidLens(valid_lens, batch, num_queries, num_keys); }
};

// One step of one attention session (ForwardPaged): new tokens of one sequence
// whose earlier keys and values are already projected in `cache`.
struct PagedStep {
  int64_t num_queries = 0;         // T; 0 (cross only): the step only appends
  const float* queries = nullptr;  // (T, d_q)
  // New keys and values, appended to the cache before the queries attend: T_k rows
  // of (T_k, d_k) and (T_k, d_v); keys == nullptr: self-attention, the queries are
  // also the keys and values (T_k = T).
  int64_t num_keys = 0;
  const float* keys = nullptr;
  const float* values = nullptr;
  // Query i (position n + i, n = cache->size() before the step) sees key positions
  // <= n + i; needs T_k == T. Else every query sees every cached key. A rotary
  // model's steps are self-attention, token t of the sequence at position t.
  bool causal = false;
  KvSequence* cache = nullptr;  // G heads (kv_heads()); room for T_k more tokens
  float* output = nullptr;      // (T, p_o)
  float* lse = nullptr;         // nullptr, or (h, T): each head's log-sum-exp per query

  int64_t new_keys() const { return keys == nullptr ? num_queries : num_keys; }
};

class MultiHeadAttention {
 public:
  struct Options {
    // OpenMP threads per Forward at most; 0 = the caller's omp_get_max_threads().
    // A call uses one thread per 16 MFLOP of work, up to this (core/attention.cc).
    int num_threads = 0;
    // Query and key block sizes of the fused attention kernel: query_block 1..256,
    // key_block 1..65536. The defaults keep a block's f32 scores tile (128 x 512 x
    // 4 bytes = 256 KiB) within L2.
    int64_t query_block = 128;
    int64_t key_block = 512;
  };

  static absl::StatusOr<std::unique_ptr<MultiHeadAttention>> Create(const ModelConfig& config,
                                                                    const Weights& weights);
  static absl::StatusOr<std::unique_ptr<MultiHeadAttention>> Create(const ModelConfig& config,
                                                                    const Weights& weights,
                                                                    const Options& options);
  ~MultiHeadAttention();

  // Checks `inputs` against the model (one line per rule; INVALID_ARGUMENT names
  // the field). Forward calls it; servers may call it earlier to fail fast.
  absl::Status CheckInputs(const AttentionInputs& inputs) const;

  // output: (B, Q, p_o), caller-owned. attention: nullptr, or (B, h, Q, K)
  // caller-owned, filled with the softmax weights. lse: nullptr, or (B, h, Q)
  // caller-owned, filled with the scores' log-sum-exp (above). Errors: INVALID_ARGUMENT for bad
  // inputs, INTERNAL if oneDNN fails (never throws).
  // `max_threads` > 0 caps the call's OpenMP threads below Options::num_threads
  // (the batcher runs a merged call on no more threads than its largest request
  // would use alone).
  absl::Status Forward(const AttentionInputs& inputs, float* output, float* attention = nullptr,
                       int max_threads = 0, float* lse = nullptr) const;

  // Attention over cached keys and values (attention sessions): every step's new
  // keys and values are projected (one GEMM over all steps' tokens) into its cache,
  // then each step's queries attend, head by head, over its own cache's blocks (no
  // padding to the longest), and one GEMM applies W_o to every step's rows. A
  // self-attention step fed in chunks gives the rows of one causal Forward on the
  // whole sequence. Dot-product scoring only; the cache holds f32, or bf16 for a
  // bf16 model or ModelConfig::kv_cache_precision kBf16 (KvSequence's bf16 flag must
  // match ModelConfig::cache_bf16()).
  // INVALID_ARGUMENT names the step and field; the caches are unchanged on error.
  absl::Status ForwardPaged(std::span<const PagedStep> steps, int max_threads = 0) const;
  // The same, calling step_done(i) once for each step i when it is done: its output
  // and lse written and its cache holding its new tokens. The call reads a done step
  // no more, so its caller may answer it and reserve its cache for the next step
  // while the others compute. An attention-only model's decode steps (a few queries
  // each: one task per step and key/value head) are done as their last task ends, on
  // that task's thread, concurrently with the call's other threads; every other
  // call's steps are done at its end, in order, on the calling thread. On error,
  // steps already done stay done and the others' caches are unchanged.
  absl::Status ForwardPaged(std::span<const PagedStep> steps,
                            absl::FunctionRef<void(size_t)> step_done, int max_threads = 0) const;

  // How a call's threads are counted. kAlone, what Forward does with max_threads 0:
  // one per 16 MFLOP of work, and one per 4 MFLOP for a small self-attention call
  // that runs as one region (under 32 MFLOP; docs/core.md), which cuts its latency
  // when the other cores are idle. kBeside: one per 16 MFLOP for every call, for a
  // call beside other work on the same cores (the server's calls, whose fronts need
  // the cores for the other requests' RPCs: docs/performance.md).
  enum class ThreadRule { kAlone, kBeside };

  // Builds the oneDNN primitives that Forward calls of up to `max_rows` query (or
  // key) rows in all and `max_keys` keys per batch row use, whatever their shape
  // (docs/service.md, "Warm-up"): the projections' row chunks (multiples of 16 up to
  // 128, of 128 up to 1024; remainders below 16 rows are built when met) on one
  // thread and on Options::num_threads, and the attention blocks' padded sizes.
  // Returns how many it built (0 the second time). Thread-safe; the server runs it
  // before a model's warm-up passes. Optional: Forward builds what it needs.
  // `rule` is the thread rule the calls will keep to (Threads): kBeside skips the
  // primitives only a lone small call's one region uses.
  int Prepare(int64_t max_rows, int64_t max_keys, ThreadRule rule = ThreadRule::kAlone) const;

  // The OpenMP threads a call on `inputs` uses under `rule`: at least one, at most
  // Options::num_threads (or the caller's omp_get_max_threads()).
  int Threads(const AttentionInputs& inputs, ThreadRule rule = ThreadRule::kAlone) const;

  // Forward keeps its buffers (a workspace per concurrent call) between calls.
  // From now on this layer takes them from `other`'s pool, and `other` from the
  // same: two layers that never run at once need one set, and a new version of a
  // model warms up in its predecessor's grown buffers instead of a second set. Any
  // sizes may share (buffers grow as a call needs). Call before the first Forward.
  void ShareWorkspacesWith(const MultiHeadAttention& other);

  // What the GEMMs multiply in on this CPU: config().precision, except kF32 for a
  // bf16 or int8 model where oneDNN makes no bf16 matmul (below AVX-512; docs/core.md,
  // "Precision on CPUs without AVX-512").
  Precision GemmPrecision() const;

  const ModelConfig& config() const { return config_; }
  const Options& options() const { return options_; }

  // Floating-point operations of one call at full length, as benchmarks count
  // them: the four projections (none in an attention-only model) and the two
  // attention products (2 per multiply-add).
  // Additive scoring counts A_q q and A_k k (2 per multiply-add) and 4 per (head,
  // query, key, feature) for its add, tanh and multiply-add instead of q k^T.
  static double Flops(const ModelConfig& config, int64_t batch, int64_t num_queries,
                      int64_t num_keys);

 private:
  class Impl;
  MultiHeadAttention(const ModelConfig& config, const Options& options, std::unique_ptr<Impl> impl);

  ModelConfig config_;
  Options options_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace mha::core

#endif  // MHA_CORE_ATTENTION_H_

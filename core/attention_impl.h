// MultiHeadAttention::Impl: the layer's weights as oneDNN operators and its two passes.
//
//   attention.cc          public entry points: input checks, slicing, the status mapping
//   attention_impl.cc     the weights (Linear operators, stacked and packed) and activations
//   dense_pass.cc         Forward: projections, head-major repack, fused attention tasks, W_o
//   additive_scoring.cc   additive scoring inside the dense pass
//   paged_pass.cc         ForwardPaged: sessions' steps over their K/V caches
//   online_softmax.h      the running max / sum and final normalisation both passes share
//   rotary.h              rotary position embedding, applied where q and k are repacked
//   workspace.h           buffers kept between calls, the thread policy, the task loop
//
// Internal to core/: only core/*.cc include it.
#ifndef MHA_CORE_ATTENTION_IMPL_H_
#define MHA_CORE_ATTENTION_IMPL_H_

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <numbers>
#include <optional>
#include <span>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "core/attention.h"
#include "core/kernels.h"
#include "core/matmul.h"
#include "core/online_softmax.h"
#include "core/rotary.h"
#include "core/workspace.h"
#include "oneapi/dnnl/dnnl.hpp"

namespace mha::core {

class MultiHeadAttention::Impl {
 public:
  using Dt = internal::Dt;
  using Linear = internal::Linear;
  using Matmul = internal::Matmul;
  using RowStats = internal::RowStats;
  using TaskScratch = internal::TaskScratch;
  using Workspace = internal::Workspace;

  Impl(const ModelConfig& c, const Weights& w, const Options& o);

  // Both passes expect checked inputs (MultiHeadAttention's entry points) and may
  // throw (the entry points map exceptions to a status); `max_threads` > 0 caps the
  // call's OpenMP threads.
  absl::Status Forward(const AttentionInputs& in, float* output, float* attention, int max_threads,
                       float* lse) const;
  absl::Status ForwardPaged(std::span<const PagedStep> steps, int max_threads,
                            absl::FunctionRef<void(size_t)> step_done) const;
  // MultiHeadAttention::Prepare (dense_pass.cc).
  int Prepare(int64_t max_rows, int64_t max_keys, ThreadRule rule) const;
  // The threads a dense call on `in` gets (internal::ThreadsForFlops).
  int ThreadsFor(const AttentionInputs& in, int max_threads = 0,
                 ThreadRule rule = ThreadRule::kAlone) const;
  // MultiHeadAttention::GemmPrecision: f32 where act_ fell back to it.
  Precision GemmPrecision() const { return act_ == Dt::f32 ? Precision::kF32 : c_.precision; }
  void ShareWorkspaces(const Impl& other) { workspaces_ = other.workspaces_; }

 private:
  // ---- dense pass (dense_pass.cc) ----
  // How many keys each query sees: valid_lens and causal folded into one number;
  // `positions` (a rotary model): causal compares positions, bottom-right aligned.
  struct KeyLimits {
    std::vector<int32_t> per_query;  // (B, Q)
    int64_t kv_rows = 0;             // the largest: key rows projected per batch row
  };
  // Q, K, V after projection, row-major in act_; K and V have kv_rows rows per
  // batch row.
  struct Projections {
    internal::StridedOperand<const char> q, k, v;
  };
  // Q, K, V after projection, repacked head-major, dense, in act_; rotated to their
  // positions in a rotary model. The queries of the heads_per_task_ (s) query heads
  // one task attends with are interleaved row by row, so that its rows are one dense
  // matrix: (B, h / s, Q, s, p); s = 1 (multi-head) is (B, h, Q, p).
  // A head's full key blocks (ld keys from each multiple of key_block, within its
  // kv_stride) copied once, by a oneDNN reorder, into the layout the block GEMMs'
  // kernels read (what they choose for format_tag::any): K for the scores and, in a
  // bf16 model, V for the context. Without this copy each task copies the block it
  // reads again, inside the GEMM. Null where there are none (PreBlockKv).
  struct BlockedKv {
    const char* k = nullptr;  // (B, G, blocks) blocks of k_bytes
    const char* v = nullptr;  // (B, G, blocks) blocks of v_bytes, or null
    int64_t blocks = 0;       // full blocks per head
    int64_t ld = 0;           // keys in a full block: key_block rounded up to kKeyPad
    size_t k_bytes = 0, v_bytes = 0;
    dnnl::memory::desc k_md, v_md;
  };
  struct HeadMajor {
    const char* q;      // (B, h / s, Q, s, p)
    const char* k;      // (B, G, kv_stride, p)
    const char* v;      // (B, G, kv_stride, p)
    int64_t kv_rows;    // key rows projected per batch row (the largest key limit)
    int64_t kv_stride;  // rows per head: kv_rows rounded up to kKeyPad, the pad rows 0
    BlockedKv blocked;
  };
  // Additive scoring's projections of every head's queries and keys, f32; both null
  // for dot-product scoring.
  struct ScoringProjections {
    const float* qa = nullptr;  // (B, h, Q, p_a): A_q q
    const float* kt = nullptr;  // (B, h, p_a, kv_rows): (A_k k)^T, key j in column j
  };
  // What every attention task of one call reads and writes.
  struct TaskInputs {
    const AttentionInputs& in;
    const HeadMajor& heads;
    const ScoringProjections& scoring;
    const std::vector<int32_t>& limits;  // KeyLimits::per_query
    float* ctx;                          // (B*Q, p_o) f32: the concatenated heads
    float* attention;                    // (B, h, Q, K), or nullptr
    float* lse;                          // (B, h, Q), or nullptr
    int64_t q_blocks;                    // query blocks per (batch row, head)
    int64_t tasks;                       // (batch row, task's heads, query block)s
  };
  // One attention task: a block of queries of `heads` query heads (heads_per_task_,
  // which share one key/value head) of one batch row. Its rows are (query, head)
  // pairs, row r = query r / heads of head r % heads.
  struct Task {
    int64_t mq;             // rows: queries in the block times heads, <= query_block
    int64_t heads;          // query heads in the task (1 unless grouped)
    const int32_t* limits;  // (mq / heads): the keys each query sees
    int64_t max_limit;      // the largest of them
    const char* q;          // (mq, p)
    const char* k;          // (kv_stride, p)
    const char* v;          // (kv_stride, p)
    int64_t kv_stride;      // rows of k and v: the head's keys, then rows of zeros
    float* ctx;             // the first head's columns of the first query, row stride p_o
    float* attention;       // (heads, Q, K) at the first head's first query, or nullptr
    float* lse;             // (heads, Q) at the first head's first query, or nullptr
    int64_t num_queries;    // Q
    int64_t num_keys;       // K
    const float* factors;   // head_mask of the task's heads, or nullptr (all 1)

    // Row r's query and head; multi-head tasks (heads 1) skip the divisions.
    int64_t query(int64_t r) const { return heads == 1 ? r : r / heads; }
    int64_t head(int64_t r) const { return heads == 1 ? 0 : r % heads; }
    int64_t limit(int64_t r) const { return limits[query(r)]; }
    float factor(int64_t r) const { return factors == nullptr ? 1.0f : factors[head(r)]; }
    float* ctx_row(int64_t r, int64_t E, int64_t p) const {
      return ctx + query(r) * E + head(r) * p;
    }
    float* attention_row(int64_t r) const {
      return attention + (head(r) * num_queries + query(r)) * num_keys;
    }
    float& lse_at(int64_t r) const { return lse[(r % heads) * num_queries + r / heads]; }
    // Additive scoring only (else null): the block's A_q q (mq, p_a), the head's
    // (A_k k)^T (p_a, kv_rows) and its w_v (p_a).
    const float* qa;
    const float* kt;
    int64_t kv_rows;
    const float* score_v;
    // The key/value head's full key blocks, pre-blocked (BlockedKv), or null.
    const BlockedKv* blocked = nullptr;
    int64_t head_index = 0;  // b G + g: which head's blocks in `blocked`
  };

  // Forward's phases, in order.
  static KeyLimits ComputeKeyLimits(const AttentionInputs& in, bool positions);
  // Q, K, V projections; key/value rows that no query can see are not projected
  // (unless they are few: WholeKeyRows, dense_pass.cc).
  // An attention-only model's "projections" are its inputs (in act_).
  Projections Project(const AttentionInputs& in, int64_t kv_rows, Workspace& ws) const;
  Projections ProjectSelf(const AttentionInputs& in, int64_t kv_rows, const void* xq,
                          Workspace& ws) const;
  Projections ProjectCross(const AttentionInputs& in, int64_t kv_rows, const void* xq,
                           Workspace& ws) const;
  // The head-major buffers of a call (ws.heads), then either its projections
  // repacked into them, or, where ProjectsIntoHeads, projected straight in.
  HeadMajor LayOutHeads(const AttentionInputs& in, int64_t kv_rows, Workspace& ws) const;
  void RepackHeadMajor(const AttentionInputs& in, const Projections& proj, const HeadMajor& heads,
                       int threads) const;
  // RepackHeadMajor's rows [first, last) of B * max(Q, kv_rows), of the key/value
  // heads [g0, g1) and their query heads, on this thread; `table` is a rotary model's
  // table for in.num_keys positions, else null.
  void RepackRows(const AttentionInputs& in, const Projections& proj, const HeadMajor& heads,
                  const internal::RotaryTable* table, int64_t first, int64_t last, int64_t g0,
                  int64_t g1) const;
  bool ProjectsIntoHeads(const AttentionInputs& in, int64_t kv_rows) const;
  void ProjectIntoHeads(const AttentionInputs& in, const HeadMajor& heads, Workspace& ws) const;
  // An f32 or bf16 model's self-attention without rotary positions, of at least
  // kMinHeadColumnQueries queries per batch row: each head's Q, K and V columns are
  // projected straight into their head-major places (Linear::RunColumnBlock), as
  // tasks of (batch row, kHeadColumnRows rows, head) on the team, with no row-major
  // projections to copy from (docs/performance.md, "Heads projected in place").
  static constexpr int64_t kHeadColumnRows = 256;
  static constexpr int64_t kMinHeadColumnQueries = 128;
  bool ProjectsHeadColumns(const AttentionInputs& in) const;
  bool HeadColumnsModel() const;
  absl::Status ProjectHeadColumns(const AttentionInputs& in, const HeadMajor& heads, int threads,
                                  Workspace& ws) const;
  // heads.blocked (in ws.blocked) for a dot-product call with at least
  // kMinBlockReaders tasks to each key/value head (query blocks times its query
  // heads' tasks), which read its full key blocks (under causal masks, the later
  // blocks by fewer of them); else none.
  static constexpr int64_t kMinBlockReaders = 4;
  absl::Status PreBlockKv(const AttentionInputs& in, HeadMajor& heads, int threads,
                          Workspace& ws) const;
  // The attention tasks of a call, writing into ws.ctx (grown here).
  TaskInputs AttentionTasks(const AttentionInputs& in, const HeadMajor& heads,
                            const ScoringProjections& scoring, const KeyLimits& limits,
                            float* attention, float* lse, Workspace& ws) const;
  // Fills ws.ctx (and `attention`) with every head's context.
  absl::Status RunAttentionTasks(const AttentionInputs& in, const HeadMajor& heads,
                                 const ScoringProjections& scoring, const KeyLimits& limits,
                                 float* attention, float* lse, int threads, Workspace& ws) const;
  // output = ws.ctx W_o^T (+ b_o); an attention-only model's output is ws.ctx.
  void ProjectOutput(const AttentionInputs& in, float* output, Workspace& ws) const;

  // A small self-attention call on more than one thread, as one region
  // (internal::RunPhases): each thread owns a share of the key/value heads (and
  // their query heads), projects their Q, K, V columns with one-thread primitives,
  // lays them out and attends them; a barrier; then W_o's output columns shared
  // out the same way. Only where RunsAsOneRegion: a model with fused Q/K/V weights,
  // f32 or bf16, dot-product scoring; every key row projected; a call under
  // internal::kOneRegionMaxFlops.
  bool RunsAsOneRegion(const AttentionInputs& in, int64_t kv_rows) const;
  absl::Status ForwardOneRegion(const AttentionInputs& in, const KeyLimits& limits, float* output,
                                float* attention, float* lse, int threads, Workspace& ws) const;

  // Prepare's two halves: the projections' primitives, for calls on 1 and on `most`
  // threads; the attention blocks' (and PreBlockKv's reorders).
  int PrepareProjections(int64_t max_rows, ThreadRule rule, int most) const;
  int PrepareAttentionBlocks(int64_t max_keys, int most) const;
  // A call's query blocks: its queries over a task's (query_block over the task's
  // query heads, heads_per_task_).
  int64_t QueryBlocks(int64_t num_queries) const {
    const int64_t per_task = o_.query_block / heads_per_task_;
    return (num_queries + per_task - 1) / per_task;
  }
  // Dot-product scores are q.k / sqrt(d_h) in log2 units, log2 e folded into their
  // scale (the dense pass's GEMM, the paged pass's kernels), for the base-2
  // exponentials (kernels::ExpSubSum, ExpSubSumRows).
  float ScoreScale() const {
    return std::numbers::log2e_v<float> / std::sqrt(static_cast<float>(c_.head_size()));
  }
  // Keys in one of PreBlockKv's full blocks: key_block rounded up to kKeyPad.
  int64_t FullBlockKeys() const;

  // Task t of RunAttentionTasks, counted over (batch row, head, query block).
  Task TaskAt(const TaskInputs& inputs, int64_t t) const;
  // One task, block by block of nk keys from key j0: scores, online softmax,
  // context; then the normalised, head-masked context into the task's columns.
  void AttendTask(const Task& task, dnnl::stream& stream, TaskScratch& scratch) const;
  // A block of keys j0 .. j0 + nk. oneDNN runs it padded to `rows` (the task's mq
  // rounded up to kQueryPad) by `ld` keys (nk rounded up to kKeyPad, within the
  // head's kv_stride), so that its primitives come from a few sizes built at warm-up:
  // the pad keys are rows of zeros, their scores set to 0 before the context, and
  // the pad rows' results are never read. Plain loops (`loops`) run it unpadded.
  static constexpr int64_t kQueryPad = 16, kKeyPad = 32;
  struct Block {
    int64_t j0, nk, ld, rows;
    bool loops;
  };
  Block BlockAt(const Task& task, int64_t j0, int64_t nk) const;
  // Whether a block of `rows` x `keys` runs in plain loops (f32, small) rather than oneDNN.
  bool InLoops(int64_t rows, int64_t keys) const;
  // The block's keys (or values) pre-blocked by PreBlockKv, or null.
  const char* PreBlocked(const Task& task, const Block& blk, bool values) const;
  void ScoreBlock(const Task& task, const Block& blk, dnnl::stream& stream,
                  TaskScratch& scratch) const;
  void SoftmaxBlock(const Task& task, const Block& blk, RowStats& stats,
                    TaskScratch& scratch) const;
  void ContextBlock(const Task& task, const Block& blk, dnnl::stream& stream,
                    TaskScratch& scratch) const;
  // (mq, nk) f32 = q (mq, p) k^T / sqrt(p); all operands dense, or (`blocked`) k^T in
  // the layout the primitive chose (Matmul::weights).
  Matmul ScorePrimitive(int64_t mq, int64_t nk, bool blocked = false) const;
  // o (mq, p) f32 (+)= P (mq, nk) v (nk, p); v likewise.
  Matmul ContextPrimitive(int64_t mq, int64_t nk, bool accumulate, bool blocked = false) const;
  // The reorders from a block of a head's plain keys (as k^T) and values to
  // BlockedKv's layouts; made once (a model's blocks are all of one size).
  struct KvReorders {
    dnnl::reorder k, v;  // v only in a bf16 model
    dnnl::memory::desc k_src, k_dst, v_src, v_dst;
  };
  const KvReorders& BlockReorders() const;

  // ---- additive scoring (additive_scoring.cc) ----
  // A_q q and A_k k of every (batch row, head), once each.
  absl::Status ProjectScoring(const AttentionInputs& in, const HeadMajor& heads, int threads,
                              Workspace& ws, ScoringProjections& out) const;
  // A task's scores of keys j0 .. j0 + nk into scratch.s (only the keys a row sees).
  void AdditiveScoreBlock(const Task& task, const Block& blk, TaskScratch& scratch) const;
  // (m, n) f32 = a (m, p) b^T for b (n, p), both dense in act_: A_q q is (Q, p_a) =
  // q A_q^T, (A_k k)^T is (p_a, kv_rows) = A_k k^T.
  Matmul ScoringPrimitive(int64_t m, int64_t n) const;

  // ---- paged pass (paged_pass.cc) ----
  static constexpr int64_t kPagedQueryRows = 64;  // rows (queries x heads) per task
  // One ForwardPaged task: a block of query rows of `heads` query heads (sharing
  // one key/value head) of one step.
  struct PagedTask {
    const PagedStep* step;
    int64_t head;    // the first query head
    int64_t heads;   // query heads (heads_per_paged_task_)
    int64_t i0, mq;  // the step's query rows i0 .. i0 + mq
    int64_t cached;  // keys in the step's cache before it
    const float* q;  // the step's row 0 of the Q projection, row stride ldq
    int64_t ldq;
    float* ctx;                         // the step's row 0 of the concatenated heads, (T, p_o)
    const internal::RotaryTable* rope;  // the call's table, or nullptr
    // The step's new keys and values (row 0, row stride ldkv), which the task stores
    // into its key/value head's blocks before it attends (TasksStorePaged), or
    // nullptr when StorePaged has stored them.
    const float* new_k = nullptr;
    const float* new_v = nullptr;
    int64_t ldkv = 0;
    // Read ahead of the kernels (the steps' caches are read from memory).
    bool prefetch = true;
  };
  // The steps' new rows through the projections: row r of Q at q + r * ld; of the
  // new keys and values at k + r * ldkv, v + r * ldkv.
  struct PagedProjections {
    float* q = nullptr;
    float* k = nullptr;
    float* v = nullptr;
    int64_t rows = 0, padded_rows = 0, ld = 0;  // query rows, as projected (PagedRows)
    int64_t ldkv = 0;
  };
  // ForwardPaged's phases, in order. PagedWork: the FLOPs the steps count as for
  // their threads. AttendPaged: every (step, head, block of query rows) into ctx
  // ((padded_rows, p_o)).
  double PagedWork(std::span<const PagedStep> steps) const;
  // Gathers the steps' rows and lays out their projections; `run`: projects them.
  PagedProjections ProjectPaged(std::span<const PagedStep> steps, Workspace& ws,
                                bool run = true) const;
  PagedProjections GatherPaged(std::span<const PagedStep> steps, int64_t tq, int64_t tk,
                               Workspace& ws) const;
  // Steps' new keys and values (rows at k and v, row stride ld) into their caches,
  // the keys rotated to their positions when `rope` is given.
  void StorePaged(std::span<const PagedStep> steps, const float* k, const float* v, int64_t ld,
                  const internal::RotaryTable* rope) const;
  // Whether each key/value head of every step has one task (a few query rows of all
  // its query heads), which then stores that head's new rows itself: the rows a core
  // writes are those it reads, and no thread waits for a serial StorePaged.
  bool TasksStorePaged(std::span<const PagedStep> steps) const;
  // With tasks_store, tasks go to threads as contiguous ranges of equal cost
  // (RunTasks), so that a session's heads stay with one core from step to step.
  // finish, when given, is called for each step as its last task ends, on that
  // task's thread (ForwardPaged's step_done).
  absl::Status AttendPaged(std::span<const PagedStep> steps, const PagedProjections& proj,
                           const internal::RotaryTable* rope, int threads, bool tasks_store,
                           Workspace& ws, float* ctx,
                           const absl::FunctionRef<void(size_t)>* finish = nullptr) const;
  // Every (step, head group, block of query rows) as a task, and each task's cost
  // (rows x keys seen) for RunTasks' ranges.
  std::vector<PagedTask> PagedTasks(std::span<const PagedStep> steps, const PagedProjections& proj,
                                    const internal::RotaryTable* rope, bool tasks_store, float* ctx,
                                    std::vector<double>& costs) const;
  void RunPagedTask(const PagedTask& task, TaskScratch& scratch) const;
  // A decode step of a few self-attention rows (Linear's row path) on a team of
  // `threads`, in one region (internal::RunPhases): the Q, K and V panels shared out,
  // then the tasks in RunTasks' ranges, each storing its head's rows, then W_o's panels.
  bool DecodeInOneRegion(std::span<const PagedStep> steps, int threads) const;
  absl::Status DecodeRegion(std::span<const PagedStep> steps, const PagedProjections& proj,
                            const internal::RotaryTable* rope, int threads, Workspace& ws,
                            float* ctx, float* out) const;
  // One task over a cache of element type T (float, or uint16_t for bf16).
  template <typename T>
  void AttendPagedTask(const PagedTask& task, TaskScratch& scratch) const;
  void ProjectPagedOutput(const PagedProjections& proj, const float* ctx, float* out,
                          Workspace& ws) const;

  // ---- weights and activations (attention_impl.cc) ----
  // A weight tensor in act_, converted once.
  std::vector<char> ToActivation(const std::vector<float>& w) const;
  // x (n floats) in act_: x itself for f32, else a bf16 copy in `tmp`.
  const void* AsActivation(const float* x, int64_t n, std::vector<char>& tmp) const;
  // x as the projections read it (in_): x itself, or AsActivation's copy.
  const void* AsProjectionInput(const float* x, int64_t n, std::vector<char>& tmp) const {
    return in_ == Dt::f32 ? x : AsActivation(x, n, tmp);
  }

  const ModelConfig c_;
  const Options o_;
  // Shared with other instances by ShareWorkspacesWith.
  std::shared_ptr<internal::WorkspacePool> workspaces_ =
      std::make_shared<internal::WorkspacePool>();
  const Dt act_;
  // The projections' weights: act_, or s8 in an int8 model (whose act_ is bf16).
  const Dt weights_;
  // What the projections read: bf16 in a bf16 model, else f32 (an int8 model's
  // Linears quantize f32 rows themselves; a bf16 copy first would only cost time).
  const Dt in_;
  std::unique_ptr<Linear> q_, k_, v_, kv_, qkv_, o_lin_;
  // Additive scoring: A_q, A_k (h, p_a, p) in act_; w_v (h, p_a) f32.
  std::vector<char> score_q_, score_k_;
  std::vector<float> score_v_;
  mutable internal::MatmulCache attn_cache_;  // the block GEMMs' primitives
  mutable absl::Mutex reorders_mu_;
  mutable std::optional<KvReorders> kv_reorders_ ABSL_GUARDED_BY(reorders_mu_);
  // Grouped-query heads: h / G query heads share each key/value head. A dense task
  // attends with heads_per_task_ of them (a divisor of h / G, at most query_block
  // rows), a paged task with heads_per_paged_task_; both 1 for multi-head models.
  int64_t heads_per_task_ = 1, heads_per_paged_task_ = 1;
  std::optional<internal::Rotary> rope_;  // a rotary model's
};

}  // namespace mha::core

#endif  // MHA_CORE_ATTENTION_IMPL_H_

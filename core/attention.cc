#include "core/attention.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/functional/function_ref.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "base/status_macros.h"
#include "core/kernels.h"
#include "core/matmul.h"
#include "oneapi/dnnl/dnnl.hpp"

namespace mha::core {
namespace {

using dnnl::memory;
using internal::Bindings;
using internal::CpuEngine;
using internal::Dt;
using internal::Linear;
using internal::Matmul;
using internal::MatmulCache;
using internal::PlanThreads;
using internal::SizeOf;
using internal::StridedOperand;

// A Forward call runs as slices of batch rows of at most this many rows x max(Q, K) x
// p_o activation elements (4 MiB of f32 per activation plane; MultiHeadAttention::Forward).
constexpr int64_t kSliceElements = int64_t{1} << 20;

// Below this size the head-major repack runs on the calling thread (RepackHeadMajor).
constexpr int64_t kParallelBytes = 256 << 10;
// A Forward call gets one OpenMP thread per this many FLOPs, up to Options::num_threads
// (PyTorch's grain-size idea): below it, another thread's fork/join and its share of
// a GEMM partition cost more than the work it takes over.
constexpr double kFlopsPerThread = 16e6;

// An f32 attention block of at most this many multiply-adds per product (mq x nk x
// p) runs in plain loops (kernels::SmallScores/SmallContext): below it a oneDNN
// primitive's look-up, binding and dispatch cost more than the arithmetic.
constexpr int64_t kSmallBlockMacs = 8192;

// ForwardPaged: one thread per this many bytes of weights and cached keys and
// values read (bert_base's weights are 9 MiB), when that is more than its FLOPs get.
constexpr double kPagedBytesPerThread = 4 << 20;

// Options::query_block at most: a task keeps its rows' softmax state on the stack.
constexpr int64_t kMaxQueryBlock = 256;

// Records the first failure of a parallel region; exceptions may not cross an
// OpenMP region, so each task catches and reports here.
class FirstError {
 public:
  void Set(std::string message) {
    absl::MutexLock lock(&mu_);
    if (message_.empty()) message_ = std::move(message);
    failed_.store(true, std::memory_order_relaxed);
  }
  bool failed() const { return failed_.load(std::memory_order_relaxed); }
  absl::Status status() const {
    absl::MutexLock lock(&mu_);
    return message_.empty() ? absl::OkStatus() : absl::InternalError(message_);
  }

 private:
  mutable absl::Mutex mu_;
  std::string message_ ABSL_GUARDED_BY(mu_);
  std::atomic<bool> failed_{false};
};

std::vector<float> Stack(std::initializer_list<const std::vector<float>*> parts) {
  std::vector<float> out;
  for (const auto* p : parts) out.insert(out.end(), p->begin(), p->end());
  return out;
}

std::string DnnlMessage(const dnnl::error& e) {
  return absl::StrCat("oneDNN: ", e.what(), " (status ", static_cast<int>(e.status), ")");
}

// Dimensions, tensors present, and self-attention allowed by the model.
absl::Status CheckSizes(const AttentionInputs& in, const ModelConfig& c) {
  // Bounds keep every element count and offset comfortably inside int64.
  constexpr int64_t kMaxRows = int64_t{1} << 31;
  if (in.batch < 1) {
    return absl::InvalidArgumentError(absl::StrCat("batch: expected >= 1, got ", in.batch));
  }
  if (in.num_queries < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("queries: expected >= 1 query, got ", in.num_queries));
  }
  if (in.num_keys < 1) {
    return absl::InvalidArgumentError(absl::StrCat("keys: expected >= 1 key, got ", in.num_keys));
  }
  if (in.batch * in.num_queries > kMaxRows || in.batch * in.num_keys > kMaxRows) {
    return absl::InvalidArgumentError("batch * length: exceeds 2^31 rows");
  }
  if (in.queries == nullptr) return absl::InvalidArgumentError("queries: missing");
  if ((in.keys == nullptr) != (in.values == nullptr)) {
    return absl::InvalidArgumentError(
        "keys, values: give both or neither (neither = self-attention)");
  }
  if (in.self_attention() && !c.SupportsSelfAttention()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "keys: required, the model's key_size ", c.key_size, " / value_size ", c.value_size,
        " differ from query_size ", c.query_size, " so it cannot self-attend"));
  }
  if (in.self_attention() && in.num_keys != in.num_queries) {
    return absl::InvalidArgumentError(absl::StrCat(
        "keys: self-attention has K == Q, got K = ", in.num_keys, ", Q = ", in.num_queries));
  }
  return absl::OkStatus();
}

// valid_lens: a count the layout knows, each entry within 0..K.
absl::Status CheckValidLens(const AttentionInputs& in) {
  const size_t vl = in.valid_lens.size();
  // Any count but 0, B and B*Q reads as one per row, and then B entries are needed.
  if (vl != static_cast<size_t>(in.batch * in.lens().per_row())) {
    return absl::InvalidArgumentError(absl::StrCat("valid_lens: expected 0, B = ", in.batch,
                                                   " or B*Q = ", in.batch * in.num_queries,
                                                   " entries, got ", vl));
  }
  for (size_t i = 0; i < vl; ++i) {
    if (in.valid_lens[i] < 0 || in.valid_lens[i] > in.num_keys) {
      return absl::InvalidArgumentError(
          absl::StrCat("valid_lens[", i, "]: expected 0 <= valid_len <= K = ", in.num_keys,
                       ", got ", in.valid_lens[i]));
    }
  }
  return absl::OkStatus();
}

// head_mask: none, or one finite factor per head.
absl::Status CheckHeadMask(std::span<const float> head_mask, int64_t num_heads) {
  if (head_mask.empty()) return absl::OkStatus();
  if (static_cast<int64_t>(head_mask.size()) != num_heads) {
    return absl::InvalidArgumentError(absl::StrCat("head_mask: expected ", num_heads,
                                                   " entries (one per head) or none, got ",
                                                   head_mask.size()));
  }
  for (size_t i = 0; i < head_mask.size(); ++i) {
    if (!std::isfinite(head_mask[i])) {
      return absl::InvalidArgumentError(
          absl::StrCat("head_mask[", i, "]: expected a finite value, got ", head_mask[i]));
    }
  }
  return absl::OkStatus();
}

}  // namespace

class MultiHeadAttention::Impl {
 public:
  Impl(const ModelConfig& c, const Weights& w, const Options& o)
      : c_(c), o_(o), act_(c.precision == Precision::kBf16 ? Dt::bf16 : Dt::f32) {
    const int64_t e = c.num_hiddens;
    auto bias = [&](const std::vector<float>& b) { return b.empty() ? nullptr : b.data(); };
    q_ = std::make_unique<Linear>(w.w_q.data(), bias(w.b_q), e, c.query_size, act_);
    k_ = std::make_unique<Linear>(w.w_k.data(), bias(w.b_k), e, c.key_size, act_);
    v_ = std::make_unique<Linear>(w.w_v.data(), bias(w.b_v), e, c.value_size, act_);
    // A decode step's W_o and stacked Q/K/V projections of a few rows run by hand
    // (ForwardPaged); f32 models keep a panel copy of those weights for it (Linear).
    o_lin_ = std::make_unique<Linear>(w.w_o.data(), bias(w.b_o), e, e, act_, /*row_path=*/true);
    if (c.key_size == c.value_size) {
      const auto kv_w = Stack({&w.w_k, &w.w_v});
      const auto kv_b = Stack({&w.b_k, &w.b_v});
      kv_ = std::make_unique<Linear>(kv_w.data(), c.bias ? kv_b.data() : nullptr, 2 * e, c.key_size,
                                     act_);
    }
    if (c.SupportsSelfAttention()) {
      const auto qkv_w = Stack({&w.w_q, &w.w_k, &w.w_v});
      const auto qkv_b = Stack({&w.b_q, &w.b_k, &w.b_v});
      qkv_ = std::make_unique<Linear>(qkv_w.data(), c.bias ? qkv_b.data() : nullptr, 3 * e,
                                      c.query_size, act_, /*row_path=*/true);
    }
    if (c.scoring == Scoring::kAdditive) {
      score_q_ = ToActivation(w.score_w_q);
      score_k_ = ToActivation(w.score_w_k);
      score_v_ = w.score_w_v;
    }
  }

  absl::Status Forward(const AttentionInputs& in, float* output, float* attention,
                       int max_threads) const;
  // The thread count follows the call's size (kFlopsPerThread), capped by
  // `max_threads` when > 0.
  int ThreadsFor(const AttentionInputs& in, int caller_threads, int max_threads = 0) const;
  int ThreadsForFlops(double flops, int caller_threads, int max_threads) const;
  absl::Status ForwardPaged(std::span<const PagedStep> steps, int max_threads) const;
  void ShareWorkspaces(const Impl& other) { workspaces_ = other.workspaces_; }

 private:
  // How many keys each query sees: valid_lens and causal folded into one number.
  struct KeyLimits {
    std::vector<int32_t> per_query;  // (B, Q)
    int64_t kv_rows = 0;             // the largest: key rows projected per batch row
  };
  // Q, K, V after projection, row-major in act_; K and V have kv_rows rows per
  // batch row.
  struct Projections {
    StridedOperand<const char> q, k, v;
  };
  // Q, K, V after projection, repacked head-major: (B, h, L, p), dense, in act_.
  struct HeadMajor {
    const char* q;    // (B, h, Q, p)
    const char* k;    // (B, h, kv_rows, p)
    const char* v;    // (B, h, kv_rows, p)
    int64_t kv_rows;  // key rows projected per batch row (the largest key limit)
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
    int64_t q_blocks;                    // query blocks per (batch row, head)
  };
  // One attention task: a block of queries of one head of one batch row.
  struct Task {
    int64_t mq;             // queries in the block, <= query_block
    const int32_t* limits;  // (mq): the keys each query sees
    int64_t max_limit;      // the largest of them
    const char* q;          // (mq, p)
    const char* k;          // (kv_rows, p)
    const char* v;          // (kv_rows, p)
    float* ctx;             // (mq, p) at row stride p_o: this head's columns
    float* attention;       // (mq, K) at row stride K, or nullptr
    int64_t num_keys;       // K
    float factor;           // head_mask[h], else 1
    // Additive scoring only (else null): the block's A_q q (mq, p_a), the head's
    // (A_k k)^T (p_a, kv_rows) and its w_v (p_a).
    const float* qa;
    const float* kt;
    int64_t kv_rows;
    const float* score_v;
  };
  // Online-softmax state of a task's query rows.
  struct RowStats {
    float max[kMaxQueryBlock];  // running maximum score
    float sum[kMaxQueryBlock];  // running sum of exp(score - max)
  };
  struct TaskScratch {
    std::vector<float> s;     // scores / f32 probabilities (query_block, key_block)
    std::vector<float> o;     // context accumulator (query_block, p)
    std::vector<uint16_t> p;  // bf16 probabilities
    Bindings bindings;        // oneDNN arguments and scratchpad
    std::optional<dnnl::stream> stream;
  };

  // Buffers of one Forward call, kept between calls: first-touching fresh pages is
  // expensive (and on some VMs very expensive), so a call reuses the memory of an
  // earlier one. A pool holds one workspace per concurrent call.
  struct Workspace {
    std::vector<char> xq, xk, xv;      // bf16 copies of the inputs
    std::vector<char> proj, kv;        // projections, row-major
    std::vector<char> heads;           // Q, K, V head-major
    std::vector<char> ctx;             // concatenated heads, f32 (B*Q, p_o)
    std::vector<float> qa, kt;         // additive scoring's projections
    std::vector<TaskScratch> scratch;  // one per OpenMP thread
    // ForwardPaged: the steps' gathered inputs, their projections, the gathered
    // output, f32.
    std::vector<float> paged_in, paged_proj, paged_out;
    Bindings bindings;  // oneDNN arguments of the projections
    std::optional<dnnl::stream> stream;
  };
  class WorkspacePool {
   public:
    std::unique_ptr<Workspace> Acquire() {
      absl::MutexLock lock(&mu_);
      if (free_.empty()) return std::make_unique<Workspace>();
      auto ws = std::move(free_.back());
      free_.pop_back();
      return ws;
    }
    void Release(std::unique_ptr<Workspace> ws) {
      absl::MutexLock lock(&mu_);
      free_.push_back(std::move(ws));
    }

   private:
    absl::Mutex mu_;
    std::vector<std::unique_ptr<Workspace>> free_ ABSL_GUARDED_BY(mu_);
  };
  class WorkspaceLease {
   public:
    explicit WorkspaceLease(WorkspacePool& pool) : pool_(pool), ws_(pool.Acquire()) {}
    ~WorkspaceLease() { pool_.Release(std::move(ws_)); }
    Workspace& operator*() { return *ws_; }

   private:
    WorkspacePool& pool_;
    std::unique_ptr<Workspace> ws_;
  };

  // One ForwardPaged task: a block of query rows of one head of one step.
  struct PagedTask {
    const PagedStep* step;
    int64_t head;
    int64_t i0, mq;  // the step's query rows i0 .. i0 + mq
    int64_t cached;  // keys in the step's cache before it
    const float* q;  // the step's row 0 of the Q projection, row stride ldq
    int64_t ldq;
    float* ctx;  // the step's row 0 of the concatenated heads, (T, p_o)
  };
  void AttendPagedTask(const PagedTask& task, TaskScratch& scratch) const;
  // ForwardPaged's phases, in order. PagedWork: the FLOPs the steps count as for
  // their threads. ProjectPaged: the steps' new rows through the projections.
  // AttendPaged: every (step, head, block of query rows) into ctx ((padded_rows, p_o)).
  struct PagedProjections {
    // Row r of Q at q + r * ld; of the new keys and values likewise.
    float* q = nullptr;
    float* k = nullptr;
    float* v = nullptr;
    int64_t rows = 0, padded_rows = 0, ld = 0;  // query rows, as projected (PagedRows)
  };
  double PagedWork(std::span<const PagedStep> steps) const;
  PagedProjections ProjectPaged(std::span<const PagedStep> steps, Workspace& ws) const;
  absl::Status AttendPaged(std::span<const PagedStep> steps, const PagedProjections& proj,
                           int threads, Workspace& ws, float* ctx) const;
  // Steps' new keys and values (rows at k and v, row stride ld) into their caches.
  void StorePaged(std::span<const PagedStep> steps, const float* k, const float* v,
                  int64_t ld) const;

  // Forward's phases, in order.
  static KeyLimits ComputeKeyLimits(const AttentionInputs& in);
  // Q, K, V projections; key/value rows that no query can see are never projected.
  Projections Project(const AttentionInputs& in, int64_t kv_rows, Workspace& ws) const;
  Projections ProjectSelf(const AttentionInputs& in, int64_t kv_rows, const void* xq,
                          Workspace& ws) const;
  Projections ProjectCross(const AttentionInputs& in, int64_t kv_rows, const void* xq,
                           Workspace& ws) const;
  HeadMajor RepackHeadMajor(const AttentionInputs& in, const Projections& proj, int64_t kv_rows,
                            int threads, Workspace& ws) const;
  // Additive scoring: A_q q and A_k k of every (batch row, head), once each.
  absl::Status ProjectScoring(const AttentionInputs& in, const HeadMajor& heads, int threads,
                              Workspace& ws, ScoringProjections& out) const;
  // Fills ws.ctx (and `attention`) with every head's context.
  absl::Status RunAttentionTasks(const AttentionInputs& in, const HeadMajor& heads,
                                 const ScoringProjections& scoring, const KeyLimits& limits,
                                 float* attention, int threads, Workspace& ws) const;
  // Runs task(t, stream, scratch) for t < tasks, shared out over a team of up to
  // `threads`, each thread with its own stream and scratch; the first failure.
  absl::Status RunTasks(int64_t tasks, int threads, Workspace& ws,
                        absl::FunctionRef<void(int64_t, dnnl::stream&, TaskScratch&)> task) const;
  // output = ws.ctx W_o^T (+ b_o).
  void ProjectOutput(const AttentionInputs& in, float* output, Workspace& ws) const;

  // Task t of RunAttentionTasks, counted over (batch row, head, query block).
  Task TaskAt(const TaskInputs& inputs, int64_t t) const;
  // One task, block by block of nk keys from key j0: scores, online softmax,
  // context; then the normalised, head-masked context into the task's columns.
  void AttendTask(const Task& task, dnnl::stream& stream, TaskScratch& scratch) const;
  void ScoreBlock(const Task& task, int64_t j0, int64_t nk, dnnl::stream& stream,
                  TaskScratch& scratch) const;
  void AdditiveScoreBlock(const Task& task, int64_t j0, int64_t nk, TaskScratch& scratch) const;
  void SoftmaxBlock(const Task& task, int64_t j0, int64_t nk, RowStats& stats,
                    TaskScratch& scratch) const;
  void ContextBlock(const Task& task, int64_t j0, int64_t nk, dnnl::stream& stream,
                    TaskScratch& scratch) const;
  void WriteContext(const Task& task, const RowStats& stats, const float* o) const;

  // (mq, nk) f32 = q (mq, p) k^T / sqrt(p); all operands dense.
  Matmul ScorePrimitive(int64_t mq, int64_t nk) const;
  // o (mq, p) f32 (+)= P (mq, nk) v (nk, p).
  Matmul ContextPrimitive(int64_t mq, int64_t nk, bool accumulate) const;
  // Additive scoring's projections, (m, n) f32 = a (m, p) b^T for b (n, p), both
  // dense in act_: A_q q is (Q, p_a) = q A_q^T, (A_k k)^T is (p_a, kv_rows) = A_k k^T.
  Matmul ScoringPrimitive(int64_t m, int64_t n) const;

  // A weight tensor in act_, converted once.
  std::vector<char> ToActivation(const std::vector<float>& w) const {
    std::vector<char> out(w.size() * SizeOf(act_));
    if (act_ == Dt::f32) {
      std::memcpy(out.data(), w.data(), out.size());
    } else {
      kernels::ToBf16(w.data(), reinterpret_cast<uint16_t*>(out.data()),
                      static_cast<int64_t>(w.size()));
    }
    return out;
  }
  // x (n floats) in act_: x itself for f32, else a bf16 copy in `tmp`.
  const void* AsActivation(const float* x, int64_t n, std::vector<char>& tmp) const;
  // Grows (never shrinks) a buffer to at least n elements; contents are not
  // preserved.
  template <typename T>
  static void Grow(std::vector<T>& buf, size_t n) {
    if (buf.size() < n) {
      buf = std::vector<T>();
      buf.resize(n);
    }
  }

  const ModelConfig c_;
  const Options o_;
  // Shared with other instances by ShareWorkspacesWith.
  std::shared_ptr<WorkspacePool> workspaces_ = std::make_shared<WorkspacePool>();
  const Dt act_;
  std::unique_ptr<Linear> q_, k_, v_, kv_, qkv_, o_lin_;
  // Additive scoring: A_q, A_k (h, p_a, p) in act_; w_v (h, p_a) f32.
  std::vector<char> score_q_, score_k_;
  std::vector<float> score_v_;
  mutable MatmulCache attn_cache_;  // the block GEMMs' primitives
};

Matmul MultiHeadAttention::Impl::ScorePrimitive(int64_t mq, int64_t nk) const {
  const int64_t p = c_.head_size();
  const MatmulCache::Key key{0, mq, nk, 0, PlanThreads()};
  if (auto prim = attn_cache_.Find(key)) return *prim;
  dnnl::primitive_attr attr;
  attr.set_output_scales(0, {1.0f / std::sqrt(static_cast<float>(p))});
  return attn_cache_.Add(
      key,
      dnnl::matmul::desc(memory::desc({mq, p}, act_, {p, 1}), memory::desc({p, nk}, act_, {1, p}),
                         memory::desc({mq, nk}, Dt::f32, {nk, 1})),
      attr);
}

Matmul MultiHeadAttention::Impl::ContextPrimitive(int64_t mq, int64_t nk, bool accumulate) const {
  const int64_t p = c_.head_size();
  const MatmulCache::Key key{1, mq, nk, accumulate, PlanThreads()};
  if (auto prim = attn_cache_.Find(key)) return *prim;
  dnnl::primitive_attr attr;
  if (accumulate) {
    dnnl::post_ops ops;
    ops.append_sum(1.0f);
    attr.set_post_ops(ops);
  }
  return attn_cache_.Add(
      key,
      dnnl::matmul::desc(memory::desc({mq, nk}, act_, {nk, 1}), memory::desc({nk, p}, act_, {p, 1}),
                         memory::desc({mq, p}, Dt::f32, {p, 1})),
      attr);
}

Matmul MultiHeadAttention::Impl::ScoringPrimitive(int64_t m, int64_t n) const {
  const int64_t p = c_.head_size();
  const MatmulCache::Key key{2, m, n, 0, PlanThreads()};
  if (auto prim = attn_cache_.Find(key)) return *prim;
  return attn_cache_.Add(
      key,
      dnnl::matmul::desc(memory::desc({m, p}, act_, {p, 1}), memory::desc({p, n}, act_, {1, p}),
                         memory::desc({m, n}, Dt::f32, {n, 1})),
      dnnl::primitive_attr());
}

MultiHeadAttention::Impl::Task MultiHeadAttention::Impl::TaskAt(const TaskInputs& inputs,
                                                                int64_t t) const {
  const AttentionInputs& in = inputs.in;
  const HeadMajor& hm = inputs.heads;
  const int64_t Q = in.num_queries, K = in.num_keys, H = c_.num_heads, E = c_.num_hiddens;
  const int64_t p = c_.head_size(), q_blocks = inputs.q_blocks;
  const size_t asz = SizeOf(act_);
  const int64_t b = t / (H * q_blocks), h = (t / q_blocks) % H, qb = t % q_blocks;
  const int64_t i0 = qb * o_.query_block;
  const int64_t mq = std::min(o_.query_block, Q - i0);
  const int32_t* lim = &inputs.limits[b * Q + i0];
  const ScoringProjections& sp = inputs.scoring;
  const int64_t pa = c_.additive_hidden;
  const bool additive = sp.qa != nullptr;
  return {
      .mq = mq,
      .limits = lim,
      .max_limit = *std::max_element(lim, lim + mq),
      .q = hm.q + ((b * H + h) * Q + i0) * p * asz,
      .k = hm.k + (b * H + h) * hm.kv_rows * p * asz,
      .v = hm.v + (b * H + h) * hm.kv_rows * p * asz,
      .ctx = inputs.ctx + (b * Q + i0) * E + h * p,
      .attention =
          inputs.attention == nullptr ? nullptr : inputs.attention + ((b * H + h) * Q + i0) * K,
      .num_keys = K,
      .factor = in.head_mask.empty() ? 1.0f : in.head_mask[h],
      .qa = additive ? sp.qa + ((b * H + h) * Q + i0) * pa : nullptr,
      .kt = additive ? sp.kt + (b * H + h) * pa * hm.kv_rows : nullptr,
      .kv_rows = hm.kv_rows,
      .score_v = additive ? score_v_.data() + h * pa : nullptr,
  };
}

void MultiHeadAttention::Impl::AttendTask(const Task& task, dnnl::stream& stream,
                                          TaskScratch& scratch) const {
  const int64_t E = c_.num_hiddens, p = c_.head_size(), mq = task.mq;
  if (task.attention != nullptr) std::fill_n(task.attention, mq * task.num_keys, 0.0f);
  if (task.max_limit == 0 || (task.factor == 0.0f && task.attention == nullptr)) {
    for (int64_t i = 0; i < mq; ++i) std::fill_n(task.ctx + i * E, p, 0.0f);
    return;
  }

  // Every operand is dense, which is what lets oneDNN pick its brgemm kernels. With
  // attention weights asked for, a row's keys are all in one block.
  const int64_t bk =
      task.attention != nullptr ? task.max_limit : std::min(o_.key_block, task.max_limit);
  scratch.s.resize(std::max<size_t>(scratch.s.size(), mq * bk));
  scratch.o.resize(std::max<size_t>(scratch.o.size(), mq * p));
  if (act_ == Dt::bf16) scratch.p.resize(std::max<size_t>(scratch.p.size(), mq * bk));
  RowStats stats;
  std::fill_n(stats.max, mq, -std::numeric_limits<float>::infinity());
  std::fill_n(stats.sum, mq, 0.0f);

  for (int64_t j0 = 0; j0 < task.max_limit; j0 += bk) {
    const int64_t nk = std::min(bk, task.max_limit - j0);
    ScoreBlock(task, j0, nk, stream, scratch);
    SoftmaxBlock(task, j0, nk, stats, scratch);
    ContextBlock(task, j0, nk, stream, scratch);
  }
  WriteContext(task, stats, scratch.o.data());
}

// scratch.s (mq, nk) = the block's scores.
void MultiHeadAttention::Impl::ScoreBlock(const Task& task, int64_t j0, int64_t nk,
                                          dnnl::stream& stream, TaskScratch& scratch) const {
  if (task.qa != nullptr) return AdditiveScoreBlock(task, j0, nk, scratch);
  const int64_t p = c_.head_size();
  if (act_ == Dt::f32 && task.mq * nk * p <= kSmallBlockMacs) {
    return kernels::SmallScores(reinterpret_cast<const float*>(task.q),
                                reinterpret_cast<const float*>(task.k) + j0 * p, p, task.mq, nk,
                                1.0f / std::sqrt(static_cast<float>(p)), scratch.s.data());
  }
  Bindings& args = scratch.bindings;
  args.Bind(DNNL_ARG_SRC, task.mq, p, p, false, act_, task.q);
  args.Bind(DNNL_ARG_WEIGHTS, p, nk, p, /*transposed=*/true, act_, task.k + j0 * p * SizeOf(act_));
  args.Bind(DNNL_ARG_DST, task.mq, nk, nk, false, Dt::f32, scratch.s.data());
  args.Execute(ScorePrimitive(task.mq, nk), stream);
}

// Only the keys a row sees are scored: padded and masked keys cost nothing.
void MultiHeadAttention::Impl::AdditiveScoreBlock(const Task& task, int64_t j0, int64_t nk,
                                                  TaskScratch& scratch) const {
  const int64_t pa = c_.additive_hidden;
  for (int64_t i = 0; i < task.mq; ++i) {
    const int64_t n = std::clamp<int64_t>(task.limits[i] - j0, 0, nk);
    kernels::AdditiveScores(task.qa + i * pa, task.kt + j0, task.kv_rows, task.score_v, pa,
                            scratch.s.data() + i * nk, n);
  }
}

// Scores become unnormalised probabilities (in scratch.s, and scratch.p for bf16),
// masked keys 0; the running max and sum move on, and the context accumulated so
// far is rescaled to the new max.
void MultiHeadAttention::Impl::SoftmaxBlock(const Task& task, int64_t j0, int64_t nk,
                                            RowStats& stats, TaskScratch& scratch) const {
  const int64_t p = c_.head_size(), K = task.num_keys;
  const bool bf16 = act_ == Dt::bf16;
  const bool first = j0 == 0;
  const int32_t* lim = task.limits;
  float* a = task.attention;
  float* s = scratch.s.data();
  float* o = scratch.o.data();
  float* m = stats.max;
  float* l = stats.sum;
  uint16_t* probs16 = bf16 ? scratch.p.data() : nullptr;
  for (int64_t i = 0; i < task.mq; ++i) {
    float* srow = s + i * nk;
    uint16_t* prow = bf16 ? probs16 + i * nk : nullptr;
    const int64_t n = std::clamp<int64_t>(lim[i] - j0, 0, nk);
    if (n > 0) {
      const float m_new = std::max(m[i], kernels::RowMax(srow, n));
      if (a != nullptr) {
        // The whole row is in this one block: normalise now, hand out the weights.
        const float sum = kernels::ExpSubSum(srow, m_new, srow, n);
        kernels::Scale(srow, 1.0f / sum, n);
        std::copy_n(srow, n, a + i * K);
        if (bf16) kernels::ToBf16(srow, prow, n);
        l[i] = 1.0f;
      } else {
        const float sum = bf16 ? kernels::ExpSubSumBf16(srow, m_new, prow, n)
                               : kernels::ExpSubSum(srow, m_new, srow, n);
        const float alpha = std::exp(m[i] - m_new);  // 0 while m[i] is -inf
        if (!first && alpha != 1.0f) kernels::Scale(o + i * p, alpha, p);
        l[i] = l[i] * alpha + sum;
      }
      m[i] = m_new;
    }
    std::fill(srow + n, srow + nk, 0.0f);
    if (bf16) std::fill(prow + n, prow + nk, uint16_t{0});
  }
}

// scratch.o (mq, p) (+)= the block's probabilities times its values.
void MultiHeadAttention::Impl::ContextBlock(const Task& task, int64_t j0, int64_t nk,
                                            dnnl::stream& stream, TaskScratch& scratch) const {
  const int64_t p = c_.head_size();
  if (act_ == Dt::f32 && task.mq * nk * p <= kSmallBlockMacs) {
    return kernels::SmallContext(scratch.s.data(), reinterpret_cast<const float*>(task.v) + j0 * p,
                                 p, task.mq, nk, /*accumulate=*/j0 > 0, scratch.o.data());
  }
  const void* probs =
      act_ == Dt::bf16 ? static_cast<const void*>(scratch.p.data()) : scratch.s.data();
  Bindings& args = scratch.bindings;
  args.Bind(DNNL_ARG_SRC, task.mq, nk, nk, false, act_, probs);
  args.Bind(DNNL_ARG_WEIGHTS, nk, p, p, false, act_, task.v + j0 * p * SizeOf(act_));
  args.Bind(DNNL_ARG_DST, task.mq, p, p, false, Dt::f32, scratch.o.data());
  args.Execute(ContextPrimitive(task.mq, nk, /*accumulate=*/j0 > 0), stream);
}

// Final softmax normalisation and head_mask, written into this head's columns.
void MultiHeadAttention::Impl::WriteContext(const Task& task, const RowStats& stats,
                                            const float* o) const {
  const int64_t E = c_.num_hiddens, p = c_.head_size();
  for (int64_t i = 0; i < task.mq; ++i) {
    const float scale = stats.sum[i] > 0.0f ? task.factor / stats.sum[i] : 0.0f;
    const float* orow = o + i * p;
    float* crow = task.ctx + i * E;
    for (int64_t d = 0; d < p; ++d) crow[d] = orow[d] * scale;
  }
}

int MultiHeadAttention::Impl::ThreadsFor(const AttentionInputs& in, int caller_threads,
                                         int cap) const {
  return ThreadsForFlops(MultiHeadAttention::Flops(c_, in.batch, in.num_queries, in.num_keys),
                         caller_threads, cap);
}

int MultiHeadAttention::Impl::ThreadsForFlops(double flops, int caller_threads, int cap) const {
  // oneDNN splits a primitive's work for the threads it asks OpenMP for and assumes
  // it gets them all, so a call never asks for more than OMP_THREAD_LIMIT: the part
  // of the output planned for threads OpenMP refuses would silently be skipped.
  int max_threads =
      std::min(o_.num_threads > 0 ? o_.num_threads : caller_threads, omp_get_thread_limit());
  if (cap > 0) max_threads = std::min(max_threads, cap);
  // Small calls run on fewer threads (kFlopsPerThread): a fork/join and a partition of
  // a tiny GEMM cost more than they save, and the cores are left to other callers.
  return static_cast<int>(
      std::clamp<double>(std::floor(flops / kFlopsPerThread), 1.0, max_threads));
}

MultiHeadAttention::Impl::KeyLimits MultiHeadAttention::Impl::ComputeKeyLimits(
    const AttentionInputs& in) {
  const int64_t B = in.batch, Q = in.num_queries;
  const ValidLens lens = in.lens();
  KeyLimits limits{.per_query = std::vector<int32_t>(static_cast<size_t>(B * Q))};
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t i = 0; i < Q; ++i) {
      int64_t lim = lens.at(b, i);
      if (in.causal) lim = std::min(lim, i + 1);
      limits.per_query[b * Q + i] = static_cast<int32_t>(lim);
      limits.kv_rows = std::max(limits.kv_rows, lim);
    }
  }
  return limits;
}

const void* MultiHeadAttention::Impl::AsActivation(const float* x, int64_t n,
                                                   std::vector<char>& tmp) const {
  // bf16: activations are converted once, then every GEMM runs in bf16.
  if (act_ == Dt::f32) return x;
  Grow(tmp, n * 2);
  kernels::ToBf16(x, reinterpret_cast<uint16_t*>(tmp.data()), n);
  return tmp.data();
}

MultiHeadAttention::Impl::Projections MultiHeadAttention::Impl::Project(const AttentionInputs& in,
                                                                        int64_t kv_rows,
                                                                        Workspace& ws) const {
  const void* xq = AsActivation(in.queries, in.batch * in.num_queries * c_.query_size, ws.xq);
  return in.self_attention() ? ProjectSelf(in, kv_rows, xq, ws) : ProjectCross(in, kv_rows, xq, ws);
}

// One (B*Q, 3 p_o) buffer, each row Q | K | V of one token.
MultiHeadAttention::Impl::Projections MultiHeadAttention::Impl::ProjectSelf(
    const AttentionInputs& in, int64_t kv_rows, const void* xq, Workspace& ws) const {
  const int64_t B = in.batch, Q = in.num_queries, E = c_.num_hiddens;
  const size_t asz = SizeOf(act_);
  const int64_t ld = 3 * E, d = c_.query_size;
  Grow(ws.proj, B * Q * ld * asz);
  char* base = ws.proj.data();
  if (kv_rows == in.num_keys) {
    qkv_->Run(*ws.stream, ws.bindings, 1, B * Q, {xq, d}, {base, ld}, act_);
  } else {
    q_->Run(*ws.stream, ws.bindings, 1, B * Q, {xq, d}, {base, ld}, act_);
    if (kv_rows > 0) {
      kv_->Run(*ws.stream, ws.bindings, B, kv_rows, {xq, d, Q * d}, {base + E * asz, ld, Q * ld},
               act_);
    }
  }
  return {.q = {base, ld, Q * ld},
          .k = {base + E * asz, ld, Q * ld},
          .v = {base + 2 * E * asz, ld, Q * ld}};
}

// Q in a (B*Q, p_o) buffer; K and V side by side in each row of a (B*K, 2 p_o) one
// when keys and values are the same tensor, else as two (B*K, p_o) planes.
MultiHeadAttention::Impl::Projections MultiHeadAttention::Impl::ProjectCross(
    const AttentionInputs& in, int64_t kv_rows, const void* xq, Workspace& ws) const {
  const int64_t B = in.batch, Q = in.num_queries, K = in.num_keys, E = c_.num_hiddens;
  const size_t asz = SizeOf(act_);
  const bool fuse_kv = in.keys == in.values && kv_ != nullptr;
  const int64_t ld = fuse_kv ? 2 * E : E;
  Grow(ws.proj, B * Q * E * asz);
  q_->Run(*ws.stream, ws.bindings, 1, B * Q, {xq, c_.query_size}, {ws.proj.data(), E}, act_);
  Grow(ws.kv, B * K * 2 * E * asz);
  char* kbase = ws.kv.data();
  char* vbase = fuse_kv ? kbase + E * asz : kbase + B * K * E * asz;
  // Contiguous rows run as one 2-D GEMM; a per-batch prefix as a 3-D one.
  const int64_t batch = kv_rows == K ? 1 : B;
  const int64_t rows = kv_rows == K ? B * K : kv_rows;
  const int64_t dk = c_.key_size, dv = c_.value_size;
  if (kv_rows > 0) {
    const void* xk = AsActivation(in.keys, B * K * dk, ws.xk);
    if (fuse_kv) {
      kv_->Run(*ws.stream, ws.bindings, batch, rows, {xk, dk, K * dk}, {kbase, ld, K * ld}, act_);
    } else {
      const void* xv = AsActivation(in.values, B * K * dv, ws.xv);
      k_->Run(*ws.stream, ws.bindings, batch, rows, {xk, dk, K * dk}, {kbase, ld, K * ld}, act_);
      v_->Run(*ws.stream, ws.bindings, batch, rows, {xv, dv, K * dv}, {vbase, ld, K * ld}, act_);
    }
  }
  return {.q = {ws.proj.data(), E, Q * E}, .k = {kbase, ld, K * ld}, .v = {vbase, ld, K * ld}};
}

// Head-major, so that every block GEMM has dense operands.
MultiHeadAttention::Impl::HeadMajor MultiHeadAttention::Impl::RepackHeadMajor(
    const AttentionInputs& in, const Projections& proj, int64_t kv_rows, int threads,
    Workspace& ws) const {
  const int64_t B = in.batch, Q = in.num_queries, E = c_.num_hiddens, H = c_.num_heads;
  const size_t asz = SizeOf(act_);
  Grow(ws.heads, (B * Q + 2 * B * kv_rows) * E * asz);
  char* qh = ws.heads.data();
  char* kh = qh + B * Q * E * asz;
  char* vh = kh + B * kv_rows * E * asz;
  const int64_t pb = c_.head_size() * asz;
  const int64_t rows_per_batch = std::max(Q, kv_rows);
  // Tiny problems run our loops on the calling thread: a fork/join costs more than
  // the work.
  const bool parallel_repack = B * (Q + 2 * kv_rows) * E * asz >= kParallelBytes;
  auto row = [asz](const StridedOperand<const char>& x, int64_t b, int64_t i) {
    return x.data + (b * x.batch_stride + i * x.row_stride) * asz;
  };
  auto repack = [&](int64_t r) {
    const int64_t b = r / rows_per_batch, i = r % rows_per_batch;
    if (i < Q) {
      const char* src = row(proj.q, b, i);
      for (int64_t h = 0; h < H; ++h) {
        std::memcpy(qh + ((b * H + h) * Q + i) * pb, src + h * pb, pb);
      }
    }
    if (i < kv_rows) {
      const char* ksrc = row(proj.k, b, i);
      const char* vsrc = row(proj.v, b, i);
      for (int64_t h = 0; h < H; ++h) {
        std::memcpy(kh + ((b * H + h) * kv_rows + i) * pb, ksrc + h * pb, pb);
        std::memcpy(vh + ((b * H + h) * kv_rows + i) * pb, vsrc + h * pb, pb);
      }
    }
  };
  // Serial work runs outside any OpenMP construct: a one-thread team between the
  // full teams of oneDNN's regions makes libgomp re-dock its pool, which is slow to
  // wake again on a busy machine.
  if (parallel_repack) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < B * rows_per_batch; ++r) repack(r);
  } else {
    for (int64_t r = 0; r < B * rows_per_batch; ++r) repack(r);
  }
  return {qh, kh, vh, kv_rows};
}

absl::Status MultiHeadAttention::Impl::RunTasks(
    int64_t tasks, int threads, Workspace& ws,
    absl::FunctionRef<void(int64_t, dnnl::stream&, TaskScratch&)> task) const {
  // One thread runs every task itself. A team shares them out: run serially beside
  // multi-threaded primitives, each tiny block GEMM would fork a team of its own.
  const int team = static_cast<int>(std::min<int64_t>(threads, tasks));
  if (ws.scratch.size() < static_cast<size_t>(team)) ws.scratch.resize(team);
  FirstError error;
  auto run_task = [&](TaskScratch& scratch, int64_t t) {
    if (error.failed()) return;
    if (!scratch.stream) scratch.stream.emplace(CpuEngine());
    try {
      task(t, *scratch.stream, scratch);
    } catch (const dnnl::error& e) {
      error.Set(DnnlMessage(e));
    } catch (const std::exception& e) {
      error.Set(e.what());
    }
  };
  if (team > 1) {
#pragma omp parallel num_threads(team)
    {
      TaskScratch& scratch = ws.scratch[omp_get_thread_num()];
#pragma omp for schedule(dynamic, 1)
      for (int64_t t = 0; t < tasks; ++t) run_task(scratch, t);
    }
  } else {
    // Block GEMMs run inline here, as they do inside a team (one task on many threads).
    omp_set_num_threads(1);
    for (int64_t t = 0; t < tasks; ++t) run_task(ws.scratch[0], t);
    omp_set_num_threads(threads);
  }
  return error.status();
}

// One task per (batch row, head): its queries' and keys' scoring projections.
absl::Status MultiHeadAttention::Impl::ProjectScoring(const AttentionInputs& in,
                                                      const HeadMajor& heads, int threads,
                                                      Workspace& ws,
                                                      ScoringProjections& out) const {
  const int64_t Q = in.num_queries, H = c_.num_heads, kv = heads.kv_rows;
  const int64_t p = c_.head_size(), pa = c_.additive_hidden;
  const size_t asz = SizeOf(act_);
  if (ws.qa.size() < static_cast<size_t>(in.batch * H * Q * pa))
    ws.qa.resize(in.batch * H * Q * pa);
  if (ws.kt.size() < static_cast<size_t>(in.batch * H * pa * kv))
    ws.kt.resize(in.batch * H * pa * kv);
  out = {.qa = ws.qa.data(), .kt = ws.kt.data()};
  return RunTasks(in.batch * H, threads, ws,
                  [&](int64_t t, dnnl::stream& stream, TaskScratch& scratch) {
                    const int64_t h = t % H;
                    const char* a_q = score_q_.data() + h * pa * p * asz;
                    const char* a_k = score_k_.data() + h * pa * p * asz;
                    Bindings& args = scratch.bindings;
                    args.Bind(DNNL_ARG_SRC, Q, p, p, false, act_, heads.q + t * Q * p * asz);
                    args.Bind(DNNL_ARG_WEIGHTS, p, pa, p, /*transposed=*/true, act_, a_q);
                    args.Bind(DNNL_ARG_DST, Q, pa, pa, false, Dt::f32, ws.qa.data() + t * Q * pa);
                    args.Execute(ScoringPrimitive(Q, pa), stream);
                    if (kv == 0) return;
                    args.Bind(DNNL_ARG_SRC, pa, p, p, false, act_, a_k);
                    args.Bind(DNNL_ARG_WEIGHTS, p, kv, p, /*transposed=*/true, act_,
                              heads.k + t * kv * p * asz);
                    args.Bind(DNNL_ARG_DST, pa, kv, kv, false, Dt::f32, ws.kt.data() + t * pa * kv);
                    args.Execute(ScoringPrimitive(pa, kv), stream);
                  });
}

// One task per (batch row, head, query block), key blocks inside.
absl::Status MultiHeadAttention::Impl::RunAttentionTasks(const AttentionInputs& in,
                                                         const HeadMajor& heads,
                                                         const ScoringProjections& scoring,
                                                         const KeyLimits& limits, float* attention,
                                                         int threads, Workspace& ws) const {
  Grow(ws.ctx, in.batch * in.num_queries * c_.num_hiddens * sizeof(float));
  const int64_t q_blocks = (in.num_queries + o_.query_block - 1) / o_.query_block;
  const TaskInputs inputs{.in = in,
                          .heads = heads,
                          .scoring = scoring,
                          .limits = limits.per_query,
                          .ctx = reinterpret_cast<float*>(ws.ctx.data()),
                          .attention = attention,
                          .q_blocks = q_blocks};
  return RunTasks(in.batch * c_.num_heads * q_blocks, threads, ws,
                  [&](int64_t t, dnnl::stream& stream, TaskScratch& scratch) {
                    AttendTask(TaskAt(inputs, t), stream, scratch);
                  });
}

void MultiHeadAttention::Impl::ProjectOutput(const AttentionInputs& in, float* output,
                                             Workspace& ws) const {
  const int64_t rows = in.batch * in.num_queries, E = c_.num_hiddens;
  const float* ctx = reinterpret_cast<const float*>(ws.ctx.data());
  const void* ctx_act = AsActivation(ctx, rows * E, ws.xq);  // the queries' copy is spent
  o_lin_->Run(*ws.stream, ws.bindings, 1, rows, {ctx_act, E}, {output, E}, Dt::f32);
}

absl::Status MultiHeadAttention::Impl::Forward(const AttentionInputs& in, float* output,
                                               float* attention, int max_threads) const {
  const int caller_threads = omp_get_max_threads();
  const int threads = ThreadsFor(in, caller_threads, max_threads);
  // This thread's ICV bounds oneDNN's regions too; the caller gets its own back.
  omp_set_num_threads(threads);
  const absl::Cleanup restore_threads = [caller_threads] { omp_set_num_threads(caller_threads); };
  const KeyLimits limits = ComputeKeyLimits(in);

  WorkspaceLease lease(*workspaces_);
  Workspace& ws = *lease;
  try {
    if (!ws.stream) ws.stream.emplace(CpuEngine());
    const Projections proj = Project(in, limits.kv_rows, ws);
    const HeadMajor heads = RepackHeadMajor(in, proj, limits.kv_rows, threads, ws);
    ScoringProjections scoring;
    if (c_.scoring == Scoring::kAdditive) {
      MHA_RETURN_IF_ERROR(ProjectScoring(in, heads, threads, ws, scoring));
    }
    MHA_RETURN_IF_ERROR(RunAttentionTasks(in, heads, scoring, limits, attention, threads, ws));
    ProjectOutput(in, output, ws);
    ws.stream->wait();
  } catch (const dnnl::error& e) {
    return absl::InternalError(DnnlMessage(e));
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError("out of memory in MultiHeadAttention::Forward");
  } catch (const std::exception& e) {
    return absl::InternalError(e.what());
  }
  return absl::OkStatus();
}

namespace {

// The rows ForwardPaged's GEMMs run on for n rows: the next power of two up to 64,
// then the next multiple of 64. Small GEMMs are bound by reading the weights, so
// the padding costs little; the primitives are at most 7 + n / 64 per weight.
int64_t PagedRows(int64_t n) {
  if (n > 64) return (n + 63) / 64 * 64;
  int64_t rows = 1;
  while (rows < n) rows *= 2;
  return rows;
}

}  // namespace

// Paged attention: a query-row block of one head of one step, over its cache's
// blocks with an online softmax. Plain loops (kernels::TransposedScores,
// SmallContext):
// a decode step is one query row against kBlockTokens keys per block, far below
// what a oneDNN primitive's dispatch is worth.
void MultiHeadAttention::Impl::AttendPagedTask(const PagedTask& task, TaskScratch& scratch) const {
  constexpr int64_t kBt = KvCachePool::kBlockTokens;
  const int64_t E = c_.num_hiddens, p = c_.head_size(), mq = task.mq, h = task.head;
  const PagedStep& step = *task.step;
  const int64_t total = task.cached + step.new_keys();
  // Row i sees keys [0, limit(i)); causal limits grow with the row.
  auto limit = [&](int64_t i) {
    return step.causal ? std::min(total, task.cached + task.i0 + i + 1) : total;
  };
  const int64_t max_limit = limit(mq - 1);
  float* ctx = task.ctx + task.i0 * E + h * p;
  if (max_limit == 0) {
    for (int64_t i = 0; i < mq; ++i) std::fill_n(ctx + i * E, p, 0.0f);
    return;
  }
  scratch.s.resize(std::max<size_t>(scratch.s.size(), mq * kBt));
  scratch.o.resize(std::max<size_t>(scratch.o.size(), 2 * mq * p));
  float* s = scratch.s.data();
  float* o = scratch.o.data();
  float* q = o + mq * p;  // this head's query rows, dense
  for (int64_t i = 0; i < mq; ++i) {
    std::memcpy(q + i * p, task.q + (task.i0 + i) * task.ldq + h * p, p * sizeof(float));
  }
  std::fill_n(o, mq * p, 0.0f);
  RowStats stats;
  std::fill_n(stats.max, mq, -std::numeric_limits<float>::infinity());
  std::fill_n(stats.sum, mq, 0.0f);
  const float scale = 1.0f / std::sqrt(static_cast<float>(p));
  const KvSequence& cache = *step.cache;
  const bool bf16 = cache.bf16();
  // The next block's keys and values for this head are fetched while this one is
  // worked on: each block is a mapping of its own, so the hardware prefetchers, which
  // stop at page boundaries, never run ahead into it. The kernels spread those
  // prefetches over their loops (the keys' over the scores, the values' over the
  // context), so that the reads overlap the arithmetic instead of stalling before it.
  const int64_t head_bytes = kBt * p * (bf16 ? 2 : 4);
  for (int64_t j0 = 0; j0 < max_limit; j0 += kBt) {
    const int64_t b = j0 / kBt, nk = std::min(kBt, max_limit - j0);
    const void* next_keys = nullptr;
    const void* next_values = nullptr;
    if (j0 + kBt < max_limit) {
      next_keys = bf16 ? static_cast<const void*>(cache.keys<uint16_t>(b + 1, h))
                       : static_cast<const void*>(cache.keys<float>(b + 1, h));
      next_values = bf16 ? static_cast<const void*>(cache.values<uint16_t>(b + 1, h))
                         : static_cast<const void*>(cache.values<float>(b + 1, h));
    }
    if (bf16) {
      kernels::TransposedScoresBf16(q, cache.keys<uint16_t>(b, h), kBt, p, mq, nk, scale, s,
                                    next_keys, head_bytes);
    } else {
      kernels::TransposedScores(q, cache.keys<float>(b, h), kBt, p, mq, nk, scale, s, next_keys,
                                head_bytes);
    }
    for (int64_t i = 0; i < mq; ++i) {
      float* si = s + i * nk;
      const int64_t seen = std::clamp<int64_t>(limit(i) - j0, 0, nk);
      std::fill(si + seen, si + nk, -std::numeric_limits<float>::infinity());
      const float m = std::max(stats.max[i], kernels::RowMax(si, seen));
      if (m == -std::numeric_limits<float>::infinity()) {  // nothing seen yet
        std::fill_n(si, nk, 0.0f);
        continue;
      }
      const float factor = std::exp(stats.max[i] - m);  // 0 on the first keys
      kernels::Scale(o + i * p, factor, p);
      stats.sum[i] = stats.sum[i] * factor + kernels::ExpSubSum(si, m, si, nk);
      stats.max[i] = m;
    }
    if (bf16) {
      kernels::SmallContextBf16(s, cache.values<uint16_t>(b, h), p, mq, nk, o, next_values,
                                head_bytes);
    } else {
      kernels::SmallContext(s, cache.values<float>(b, h), p, mq, nk, /*accumulate=*/true, o,
                            next_values, head_bytes);
    }
  }
  for (int64_t i = 0; i < mq; ++i) {
    const float inv = stats.sum[i] > 0 ? 1.0f / stats.sum[i] : 0.0f;
    for (int64_t c = 0; c < p; ++c) ctx[i * E + c] = o[i * p + c] * inv;
  }
}

void MultiHeadAttention::Impl::StorePaged(std::span<const PagedStep> steps, const float* k,
                                          const float* v, int64_t ld) const {
  constexpr int64_t kBt = KvCachePool::kBlockTokens;
  const int64_t H = c_.num_heads, p = c_.head_size();
  int64_t row = 0;
  for (const PagedStep& step : steps) {
    KvSequence& cache = *step.cache;
    for (int64_t r = 0; r < step.new_keys(); ++r, ++row) {
      const int64_t t = cache.size() + r, b = t / kBt, col = t % kBt;
      for (int64_t h = 0; h < H; ++h) {
        const float* key = k + row * ld + h * p;
        const float* value = v + row * ld + h * p;
        if (cache.bf16()) {
          uint16_t* kt = cache.keys<uint16_t>(b, h) + col;
          for (int64_t c = 0; c < p; ++c) kernels::ToBf16(key + c, kt + c * kBt, 1);
          kernels::ToBf16(value, cache.values<uint16_t>(b, h) + col * p, p);
        } else {
          float* kt = cache.keys<float>(b, h) + col;
          for (int64_t c = 0; c < p; ++c) kt[c * kBt] = key[c];
          std::memcpy(cache.values<float>(b, h) + col * p, value, p * sizeof(float));
        }
      }
    }
  }
}

double MultiHeadAttention::Impl::PagedWork(std::span<const PagedStep> steps) const {
  const int64_t E = c_.num_hiddens;
  int64_t tq = 0, tk = 0;
  double flops = 0;
  // A decode step does ~1 FLOP per byte it reads, of the weights and of the cached
  // keys and values: memory bound, so it gets threads for its bytes
  // (kPagedBytesPerThread) where its FLOPs alone would keep it on one.
  double bytes =
      static_cast<double>((c_.query_size + c_.key_size + c_.value_size + E) * E * SizeOf(act_));
  for (const PagedStep& step : steps) {
    tq += step.num_queries;
    tk += step.new_keys();
    const double seen = static_cast<double>(step.cache->size() + step.new_keys());
    flops += 4.0 * static_cast<double>(step.num_queries) * seen * static_cast<double>(E);
    if (step.num_queries > 0) {
      bytes +=
          static_cast<double>(step.cache->size()) * 2.0 * static_cast<double>(E) * sizeof(float);
    }
  }
  flops += 2.0 * static_cast<double>(E) *
           static_cast<double>(tq * c_.query_size + tk * (c_.key_size + c_.value_size) + tq * E);
  return std::max(flops, bytes / kPagedBytesPerThread * kFlopsPerThread);
}

MultiHeadAttention::Impl::PagedProjections MultiHeadAttention::Impl::ProjectPaged(
    std::span<const PagedStep> steps, Workspace& ws) const {
  const int64_t E = c_.num_hiddens;
  const int64_t dq = c_.query_size, dk = c_.key_size, dv = c_.value_size;
  int64_t tq = 0, tk = 0;
  bool all_self = true;
  for (const PagedStep& step : steps) {
    tq += step.num_queries;
    tk += step.new_keys();
    all_self = all_self && step.keys == nullptr;
  }
  // Gather every step's new rows, then project them, one GEMM per weight: Q as
  // (tq, ld) rows, K and V as (tk, ld) rows, f32. All self-attention steps (the
  // decode case) run Q, K and V as one stacked GEMM. The GEMMs run on row counts
  // padded to a few sizes (PagedRows, zero rows): a continuously batched call's row
  // count changes from call to call, and a primitive per count would cost its
  // creation on the request path and memory for each. A call of a few query rows (one
  // to three sessions' decode steps) takes the hand-written row path of f32 models
  // instead (Linear::RunRows), and so does its W_o (ForwardPaged).
  const int64_t pq = PagedRows(tq), pk = PagedRows(tk);
  Grow(ws.paged_in, pq * dq + pk * (dk + dv));
  float* xq = ws.paged_in.data();
  float* xk = xq + pq * dq;
  float* xv = xk + pk * dk;
  int64_t qi = 0, ki = 0;
  for (const PagedStep& step : steps) {
    std::copy_n(step.queries, step.num_queries * dq, xq + qi * dq);
    qi += step.num_queries;
    if (all_self) continue;
    const float* keys = step.keys == nullptr ? step.queries : step.keys;
    const float* values = step.keys == nullptr ? step.queries : step.values;
    std::copy_n(keys, step.new_keys() * dk, xk + ki * dk);
    std::copy_n(values, step.new_keys() * dv, xv + ki * dv);
    ki += step.new_keys();
  }
  std::fill(xq + tq * dq, xq + pq * dq, 0.0f);
  if (!all_self) {
    std::fill(xk + tk * dk, xk + pk * dk, 0.0f);
    std::fill(xv + tk * dv, xv + pk * dv, 0.0f);
  }
  PagedProjections proj{.rows = tq, .padded_rows = pq, .ld = all_self ? 3 * E : E};
  Grow(ws.paged_proj, all_self ? pq * proj.ld : (pq + 2 * pk) * E);
  proj.q = ws.paged_proj.data();
  proj.k = all_self ? proj.q + E : proj.q + pq * E;
  proj.v = all_self ? proj.q + 2 * E : proj.k + pk * E;
  if (all_self && qkv_->has_row_path(tq)) {
    qkv_->RunRows(xq, dq, tq, proj.q, proj.ld);
    return proj;
  }
  if (all_self) {
    qkv_->Run(*ws.stream, ws.bindings, 1, pq, {AsActivation(xq, pq * dq, ws.xq), dq},
              {proj.q, proj.ld}, Dt::f32);
  } else {
    if (tq > 0) {
      q_->Run(*ws.stream, ws.bindings, 1, pq, {AsActivation(xq, pq * dq, ws.xq), dq}, {proj.q, E},
              Dt::f32);
    }
    if (tk > 0) {
      k_->Run(*ws.stream, ws.bindings, 1, pk, {AsActivation(xk, pk * dk, ws.xk), dk}, {proj.k, E},
              Dt::f32);
      v_->Run(*ws.stream, ws.bindings, 1, pk, {AsActivation(xv, pk * dv, ws.xv), dv}, {proj.v, E},
              Dt::f32);
    }
  }
  ws.stream->wait();
  return proj;
}

absl::Status MultiHeadAttention::Impl::AttendPaged(std::span<const PagedStep> steps,
                                                   const PagedProjections& proj, int threads,
                                                   Workspace& ws, float* ctx) const {
  constexpr int64_t kQueryRows = 64;  // query rows per task
  const int64_t E = c_.num_hiddens;
  std::fill(ctx + proj.rows * E, ctx + proj.padded_rows * E, 0.0f);
  std::vector<PagedTask> tasks;
  int64_t qi = 0;
  for (const PagedStep& step : steps) {
    for (int64_t h = 0; h < c_.num_heads; ++h) {
      for (int64_t i0 = 0; i0 < step.num_queries; i0 += kQueryRows) {
        tasks.push_back({.step = &step,
                         .head = h,
                         .i0 = i0,
                         .mq = std::min(kQueryRows, step.num_queries - i0),
                         .cached = step.cache->size(),
                         .q = proj.q + qi * proj.ld,
                         .ldq = proj.ld,
                         .ctx = ctx + qi * E});
      }
    }
    qi += step.num_queries;
  }
  return RunTasks(
      static_cast<int64_t>(tasks.size()), threads, ws,
      [&](int64_t t, dnnl::stream&, TaskScratch& scratch) { AttendPagedTask(tasks[t], scratch); });
}

absl::Status MultiHeadAttention::Impl::ForwardPaged(std::span<const PagedStep> steps,
                                                    int max_threads) const {
  const int64_t E = c_.num_hiddens;
  const int caller_threads = omp_get_max_threads();
  const int threads = ThreadsForFlops(PagedWork(steps), caller_threads, max_threads);
  omp_set_num_threads(threads);
  const absl::Cleanup restore_threads = [caller_threads] { omp_set_num_threads(caller_threads); };

  WorkspaceLease lease(*workspaces_);
  Workspace& ws = *lease;
  try {
    if (!ws.stream) ws.stream.emplace(CpuEngine());
    const PagedProjections proj = ProjectPaged(steps, ws);
    StorePaged(steps, proj.k, proj.v, proj.ld);
    const int64_t pq = proj.padded_rows;
    Grow(ws.paged_out, 2 * pq * E);
    float* ctx = ws.paged_out.data();
    float* out = ctx + pq * E;
    MHA_RETURN_IF_ERROR(AttendPaged(steps, proj, threads, ws, ctx));
    if (o_lin_->has_row_path(proj.rows)) {
      o_lin_->RunRows(ctx, E, proj.rows, out, E);
    } else if (proj.rows > 0) {
      o_lin_->Run(*ws.stream, ws.bindings, 1, pq, {AsActivation(ctx, pq * E, ws.xq), E}, {out, E},
                  Dt::f32);
      ws.stream->wait();
    }
    int64_t qi = 0;
    for (const PagedStep& step : steps) {
      std::copy_n(out + qi * E, step.num_queries * E, step.output);
      qi += step.num_queries;
      step.cache->Append(step.new_keys());
    }
  } catch (const dnnl::error& e) {
    return absl::InternalError(DnnlMessage(e));
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError("out of memory in MultiHeadAttention::ForwardPaged");
  } catch (const std::exception& e) {
    return absl::InternalError(e.what());
  }
  return absl::OkStatus();
}

MultiHeadAttention::MultiHeadAttention(const ModelConfig& config, const Options& options,
                                       std::unique_ptr<Impl> impl)
    : config_(config), options_(options), impl_(std::move(impl)) {}

MultiHeadAttention::~MultiHeadAttention() = default;

void MultiHeadAttention::ShareWorkspacesWith(const MultiHeadAttention& other) {
  impl_->ShareWorkspaces(*other.impl_);
}

absl::StatusOr<std::unique_ptr<MultiHeadAttention>> MultiHeadAttention::Create(
    const ModelConfig& config, const Weights& weights) {
  return Create(config, weights, Options{});
}

absl::StatusOr<std::unique_ptr<MultiHeadAttention>> MultiHeadAttention::Create(
    const ModelConfig& config, const Weights& weights, const Options& options) {
  MHA_RETURN_IF_ERROR(config.Validate());
  MHA_RETURN_IF_ERROR(weights.Validate(config));
  if (options.query_block < 1 || options.query_block > kMaxQueryBlock) {
    return absl::InvalidArgumentError(absl::StrCat("query_block: expected 1..", kMaxQueryBlock));
  }
  if (options.key_block < 1 || options.key_block > 65536) {
    return absl::InvalidArgumentError("key_block: expected 1..65536");
  }
  if (options.num_threads < 0) return absl::InvalidArgumentError("num_threads: expected >= 0");
  try {
    auto impl = std::make_unique<Impl>(config, weights, options);
    return std::unique_ptr<MultiHeadAttention>(
        new MultiHeadAttention(config, options, std::move(impl)));
  } catch (const dnnl::error& e) {
    return absl::InternalError(DnnlMessage(e));
  }
}

absl::Status MultiHeadAttention::CheckInputs(const AttentionInputs& in) const {
  MHA_RETURN_IF_ERROR(CheckSizes(in, config_));
  MHA_RETURN_IF_ERROR(CheckValidLens(in));
  return CheckHeadMask(in.head_mask, config_.num_heads);
}

int MultiHeadAttention::Threads(const AttentionInputs& inputs) const {
  return impl_->ThreadsFor(inputs, omp_get_max_threads());
}

absl::Status MultiHeadAttention::Forward(const AttentionInputs& inputs, float* output,
                                         float* attention, int max_threads) const {
  MHA_RETURN_IF_ERROR(CheckInputs(inputs));
  if (output == nullptr) return absl::InvalidArgumentError("output: missing");
  // Batch rows are independent. A call whose activations would outgrow the caches
  // runs as even slices of rows, each within kSliceElements.
  const int64_t B = inputs.batch, Q = inputs.num_queries, K = inputs.num_keys;
  const int64_t h = config_.num_heads, E = config_.num_hiddens;
  const int64_t max_rows = std::max<int64_t>(1, kSliceElements / (std::max(Q, K) * E));
  const int64_t slices = (B + max_rows - 1) / max_rows;
  if (slices == 1) return impl_->Forward(inputs, output, attention, max_threads);
  const int64_t rows = (B + slices - 1) / slices;
  const ValidLens lens = inputs.lens();
  for (int64_t b0 = 0; b0 < B; b0 += rows) {
    AttentionInputs slice = inputs;
    slice.batch = std::min(rows, B - b0);
    slice.queries = inputs.queries + b0 * Q * config_.query_size;
    if (!inputs.self_attention()) {
      slice.keys = inputs.keys + b0 * K * config_.key_size;
      slice.values = inputs.values + b0 * K * config_.value_size;
    }
    slice.valid_lens = lens.rows(b0, slice.batch);
    MHA_RETURN_IF_ERROR(impl_->Forward(slice, output + b0 * Q * E,
                                       attention == nullptr ? nullptr : attention + b0 * h * Q * K,
                                       max_threads));
  }
  return absl::OkStatus();
}

absl::Status MultiHeadAttention::ForwardPaged(std::span<const PagedStep> steps,
                                              int max_threads) const {
  const ModelConfig& c = config_;
  if (c.scoring != Scoring::kDotProduct) {
    return absl::InvalidArgumentError(
        "scoring: attention sessions need dot-product scoring; this model is additive");
  }
  for (size_t i = 0; i < steps.size(); ++i) {
    const PagedStep& s = steps[i];
    auto error = [i](const char* field, const std::string& what) {
      return absl::InvalidArgumentError(absl::StrCat("step ", i, ": ", field, ": ", what));
    };
    if (s.cache == nullptr) return error("cache", "missing");
    if (s.cache->bf16() != (c.precision == Precision::kBf16)) {
      return error("cache", absl::StrCat("holds ", s.cache->bf16() ? "bf16" : "f32",
                                         ", the model's cache is ", PrecisionName(c.precision)));
    }
    if (s.cache->num_heads() != c.num_heads || s.cache->head_size() != c.head_size()) {
      return error("cache", absl::StrCat("made for ", s.cache->num_heads(), " heads of ",
                                         s.cache->head_size(), ", the model has ", c.num_heads,
                                         " of ", c.head_size()));
    }
    if (s.num_queries < 0)
      return error("queries", absl::StrCat("expected >= 0 rows, got ", s.num_queries));
    if (s.num_queries > 0 && (s.queries == nullptr || s.output == nullptr)) {
      return error("queries, output", "missing");
    }
    if ((s.keys == nullptr) != (s.values == nullptr)) {
      return error("keys, values", "give both or neither (neither = self-attention)");
    }
    if (s.keys == nullptr) {
      if (!c.SupportsSelfAttention()) {
        return error("keys",
                     absl::StrCat("required: the model's key_size ", c.key_size, " / value_size ",
                                  c.value_size, " differ from query_size ", c.query_size));
      }
    } else if (s.num_keys < 0) {
      return error("keys", absl::StrCat("expected >= 0 rows, got ", s.num_keys));
    }
    if (s.causal && s.new_keys() != s.num_queries) {
      return error("keys",
                   absl::StrCat("a causal step appends as many keys as it has queries, got ",
                                s.new_keys(), " keys for ", s.num_queries, " queries"));
    }
    if (s.cache->size() + s.new_keys() > s.cache->capacity()) {
      return error("cache", absl::StrCat("room for ", s.cache->capacity() - s.cache->size(),
                                         " more tokens, the step appends ", s.new_keys(),
                                         " (Reserve first)"));
    }
    for (size_t j = 0; j < i; ++j) {
      if (steps[j].cache == s.cache) return error("cache", absl::StrCat("also step ", j, "'s"));
    }
  }
  if (steps.empty()) return absl::OkStatus();
  return impl_->ForwardPaged(steps, max_threads);
}

double MultiHeadAttention::Flops(const ModelConfig& c, int64_t batch, int64_t num_queries,
                                 int64_t num_keys) {
  const double b = batch, q = num_queries, k = num_keys, e = c.num_hiddens;
  const double projections =
      2 * b * e * (q * c.query_size + k * c.key_size + k * c.value_size + q * e);
  const double context = 2 * b * q * k * e;  // all heads
  if (c.scoring == Scoring::kDotProduct) return projections + 2 * b * q * k * e + context;
  // Additive: A_q q and A_k k per head, then per (query, key, feature) an add, a
  // tanh and a multiply-add, counted as 4.
  const double pa = c.additive_hidden, h = c.num_heads;
  return projections + 2 * b * (q + k) * e * pa + 4 * b * h * q * k * pa + context;
}

}  // namespace mha::core

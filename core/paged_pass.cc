#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "core/attention_impl.h"

// The paged pass (ForwardPaged): sessions' steps. Every step's new rows are projected
// together, their keys and values stored into the steps' caches, and each step's
// queries attend over its own cache's blocks, head by head; W_o applies to every
// step's rows at once.

namespace mha::core {
namespace {

using internal::Dt;
using internal::Grow;
using internal::SizeOf;

// The paged kernels read ahead (kernels::kReadAhead) above this many bytes of cache
// read by a call; below it the cache is in the CPU's caches.
constexpr double kPrefetchAboveBytes = 32 << 20;

// ForwardPaged: one thread per this many bytes of weights and cached keys and
// values read (bert_base's weights are 9 MiB), when that is more than its FLOPs get.
constexpr double kPagedBytesPerThread = 4 << 20;

// The rows ForwardPaged's GEMMs run on for n rows: the next power of two up to 64,
// then the next multiple of 64. Small GEMMs are bound by reading the weights, so
// the padding costs little; the primitives are at most 7 + n / 64 per weight.
int64_t PagedRows(int64_t n) {
  if (n > 64) return (n + 63) / 64 * 64;
  int64_t rows = 1;
  while (rows < n) rows *= 2;
  return rows;
}

// The paged kernels by the cache's element type: f32, or bf16 held as uint16_t. A
// task's rows (its query heads sharing one key/value head, times its queries) go
// through each block together, in register-blocked groups (kernels::GroupScores,
// GroupContext): the block streams in once per group of up to 8 rows (AVX2: 2, or 4
// over a bf16 cache), not per row.
inline void BlockScores(const float* q, const float* kt, int64_t ld, int64_t p, int64_t mq,
                        int64_t nk, float scale, float* s, int64_t read_ahead) {
  kernels::GroupScores(q, kt, ld, p, mq, nk, scale, s, read_ahead);
}
inline void BlockScores(const float* q, const uint16_t* kt, int64_t ld, int64_t p, int64_t mq,
                        int64_t nk, float scale, float* s, int64_t read_ahead) {
  kernels::GroupScoresBf16(q, kt, ld, p, mq, nk, scale, s, read_ahead);
}
inline void BlockContext(const float* probs, const float* v, int64_t p, int64_t mq, int64_t nk,
                         float* o, int64_t read_ahead) {
  kernels::GroupContext(probs, v, KvCachePool::kBlockTokens, p, mq, nk, o, read_ahead);
}
inline void BlockContext(const float* probs, const uint16_t* v, int64_t p, int64_t mq, int64_t nk,
                         float* o, int64_t read_ahead) {
  kernels::GroupContextBf16(probs, v, KvCachePool::kBlockTokens, p, mq, nk, o, read_ahead);
}
inline void ToCache(const float* x, float* y, int64_t n) { std::copy_n(x, n, y); }
inline void ToCache(const float* x, uint16_t* y, int64_t n) { kernels::ToBf16(x, y, n); }

// n new keys and values of heads [h0, h1) (rows at k and v, row stride ld; heads of
// p) into the cache after its last token: keys transposed within their block, values
// in its column panels (kernels::ValueIndex). With `rope`, each key is rotated to its
// token's position first (rotated: p floats of scratch).
template <typename T>
void StoreRows(KvSequence& cache, int64_t n, const float* k, const float* v, int64_t ld, int64_t h0,
               int64_t h1, int64_t p, const internal::Rotary* rotary,
               const internal::RotaryTable* rope, float* rotated) {
  constexpr int64_t kBt = KvCachePool::kBlockTokens;
  for (int64_t r = 0; r < n; ++r) {
    const int64_t t = cache.size() + r, b = t / kBt, col = t % kBt;
    for (int64_t h = h0; h < h1; ++h) {
      const float* key = k + r * ld + h * p;
      if (rope != nullptr) {
        rotary->Apply(key, rotated, p, *rope, t);
        key = rotated;
      }
      T* kt = cache.keys<T>(b, h) + col;
      for (int64_t c = 0; c < p; ++c) ToCache(key + c, kt + c * kBt, 1);
      const float* value = v + r * ld + h * p;
      T* panels = cache.values<T>(b, h);
      for (int64_t c0 = 0; c0 < p; c0 += kernels::kValuePanel<T>) {
        ToCache(value + c0, panels + kernels::ValueIndex<T>(col, c0, p, kBt),
                std::min(kernels::kValuePanel<T>, p - c0));
      }
    }
  }
}

// The online softmax of a task's mq rows (queries q, rows of p) over the blocks of
// key/value head g holding keys [0, max_limit): row r sees keys [0, limit(r)). Each
// block's scores go to s (mq x kBlockTokens) in log2 units (`scale` is
// Impl::ScoreScale; stats in base2), their running max and sum to stats, and the
// context to o (mq x p, unnormalised).
//
// With `prefetch` (caches read from memory), the kernels read kernels::kReadAhead bytes
// ahead of themselves in the head's run of blocks.
template <typename T, typename Limit>
void AttendBlocks(const KvSequence& cache, int64_t g, const float* q, int64_t p, int64_t mq,
                  int64_t max_limit, const Limit& limit, bool prefetch, float scale, float* s,
                  float* o, internal::RowStats& stats) {
  constexpr int64_t kBt = KvCachePool::kBlockTokens;
  const int64_t read_ahead = prefetch ? kernels::kReadAhead : 0;
  for (int64_t j0 = 0; j0 < max_limit; j0 += kBt) {
    const int64_t b = j0 / kBt, nk = std::min(kBt, max_limit - j0);
    BlockScores(q, cache.keys<T>(b, g), kBt, p, mq, nk, scale, s, read_ahead);
    // Rows that see none of the block come first (limits grow with the row): their
    // probabilities are 0; the rest see at least one key, the others masked to -inf.
    int64_t first = 0;
    for (int64_t i = 0; i < mq; ++i) {
      float* si = s + i * nk;
      const int64_t seen = std::clamp<int64_t>(limit(i) - j0, 0, nk);
      if (seen == 0) {
        std::fill_n(si, nk, 0.0f);
        first = i + 1;
      } else {
        std::fill(si + seen, si + nk, -std::numeric_limits<float>::infinity());
      }
    }
    if (first < mq) stats.UpdateRows(first, mq, s + first * nk, nk, o + first * p, p);
    BlockContext(s, cache.values<T>(b, g), p, mq, nk, o, read_ahead);
  }
}

}  // namespace

// Paged attention: a query-row block of one head of one step, over its cache's
// blocks with an online softmax. Plain loops (kernels::GroupScores,
// GroupContext): a decode step is a few query rows (h / G) against kBlockTokens
// keys per block, far below what a oneDNN primitive's dispatch is worth.
template <typename T>
void MultiHeadAttention::Impl::AttendPagedTask(const PagedTask& task, TaskScratch& scratch) const {
  constexpr int64_t kBt = KvCachePool::kBlockTokens;
  const int64_t E = c_.num_hiddens, p = c_.head_size();
  // Rows are (query, head) pairs: row r is query r / hs of head task.head + r % hs, all
  // against the one key/value head g they share, read once for all of them.
  const int64_t hs = task.heads, mq = task.mq * hs;
  const int64_t g = task.head / (c_.num_heads / c_.kv_heads());
  const PagedStep& step = *task.step;
  const int64_t total = task.cached + step.new_keys();
  // Row r sees keys [0, limit(r)); causal limits grow with the query.
  auto limit = [&](int64_t r) {
    return step.causal ? std::min(total, task.cached + task.i0 + r / hs + 1) : total;
  };
  const int64_t max_limit = limit(mq - 1);
  float* ctx = task.ctx + task.i0 * E + task.head * p;
  auto ctx_row = [&](int64_t r) { return ctx + (r / hs) * E + (r % hs) * p; };
  // The lse of row r, (h, T) per step.
  auto lse_at = [&](int64_t r) -> float& {
    return step.lse[(task.head + r % hs) * step.num_queries + task.i0 + r / hs];
  };
  if (max_limit == 0) {
    for (int64_t r = 0; r < mq; ++r) std::fill_n(ctx_row(r), p, 0.0f);
    if (step.lse != nullptr) {
      for (int64_t r = 0; r < mq; ++r) lse_at(r) = -std::numeric_limits<float>::infinity();
    }
    return;
  }
  scratch.s.resize(std::max<size_t>(scratch.s.size(), mq * kBt));
  scratch.o.resize(std::max<size_t>(scratch.o.size(), 2 * mq * p + p));
  float* s = scratch.s.data();
  float* o = scratch.o.data();
  float* q = o + mq * p;  // the task's query rows, dense, rotated in a rotary model
  if (task.new_k != nullptr) {
    StoreRows<T>(*step.cache, step.new_keys(), task.new_k, task.new_v, task.ldkv, g, g + 1, p,
                 rope_ ? &*rope_ : nullptr, task.rope, q + mq * p);
  }
  for (int64_t r = 0; r < mq; ++r) {
    const int64_t i = task.i0 + r / hs;
    const float* src = task.q + i * task.ldq + (task.head + r % hs) * p;
    if (task.rope != nullptr) {
      rope_->Apply(src, q + r * p, p, *task.rope, task.cached + i);
    } else {
      std::memcpy(q + r * p, src, p * sizeof(float));
    }
  }
  std::fill_n(o, mq * p, 0.0f);
  RowStats stats;
  stats.Reset(mq, /*base2=*/true);
  AttendBlocks<T>(*step.cache, g, q, p, mq, max_limit, limit, task.prefetch, ScoreScale(), s, o,
                  stats);
  if (step.lse != nullptr) {
    for (int64_t r = 0; r < mq; ++r) lse_at(r) = stats.Lse(r);
  }
  if (hs == 1) return stats.Normalise(mq, o, p, /*factor=*/1.0f, ctx, E);
  for (int64_t r = 0; r < mq; ++r) stats.NormaliseRow(r, o + r * p, p, 1.0f, ctx_row(r));
}

void MultiHeadAttention::Impl::StorePaged(std::span<const PagedStep> steps, const float* k,
                                          const float* v, int64_t ld,
                                          const internal::RotaryTable* rope) const {
  const int64_t G = c_.kv_heads(), p = c_.head_size();
  const internal::Rotary* rotary = rope_ ? &*rope_ : nullptr;
  std::vector<float> rotated(rope != nullptr ? p : 0);
  int64_t row = 0;
  for (const PagedStep& step : steps) {
    const int64_t n = step.new_keys();
    if (step.cache->bf16()) {
      StoreRows<uint16_t>(*step.cache, n, k + row * ld, v + row * ld, ld, 0, G, p, rotary, rope,
                          rotated.data());
    } else {
      StoreRows<float>(*step.cache, n, k + row * ld, v + row * ld, ld, 0, G, p, rotary, rope,
                       rotated.data());
    }
    row += n;
  }
}

double MultiHeadAttention::Impl::PagedWork(std::span<const PagedStep> steps) const {
  const int64_t E = c_.num_hiddens, Ekv = c_.kv_hiddens();
  int64_t tq = 0, tk = 0;
  double flops = 0;
  // A decode step does ~1 FLOP per byte it reads, of the weights and of the cached
  // keys and values: memory bound, so it gets threads for its bytes
  // (kPagedBytesPerThread) where its FLOPs alone would keep it on one. An int8
  // weight counts as 4 bytes: its row path does 4 multiply-adds per 4 bytes read and
  // rescales every sum, and one thread took 51 us where two take 31 (decoder, context
  // 64; docs/core.md, "int8 models").
  const size_t weight_bytes = weights_ == Dt::s8 ? sizeof(float) : SizeOf(weights_);
  double bytes =
      c_.attention_only()
          ? 0.0
          : static_cast<double>(((c_.query_size + E) * E + (c_.key_size + c_.value_size) * Ekv) *
                                weight_bytes);
  for (const PagedStep& step : steps) {
    tq += step.num_queries;
    tk += step.new_keys();
    const double seen = static_cast<double>(step.cache->size() + step.new_keys());
    flops += 4.0 * static_cast<double>(step.num_queries) * seen * static_cast<double>(E);
    if (step.num_queries > 0) {
      bytes +=
          static_cast<double>(step.cache->size()) * 2.0 * static_cast<double>(Ekv) * sizeof(float);
    }
  }
  if (!c_.attention_only()) {
    flops +=
        2.0 * static_cast<double>(E) * static_cast<double>(tq * c_.query_size + tq * E) +
        2.0 * static_cast<double>(Ekv) * static_cast<double>(tk * (c_.key_size + c_.value_size));
  }
  return std::max(flops, bytes / kPagedBytesPerThread * internal::kFlopsPerThread);
}

MultiHeadAttention::Impl::PagedProjections MultiHeadAttention::Impl::ProjectPaged(
    std::span<const PagedStep> steps, Workspace& ws, bool run) const {
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
  if (c_.attention_only()) return GatherPaged(steps, tq, tk, ws);
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
  const int64_t Ekv = c_.kv_hiddens();
  PagedProjections proj{.rows = tq,
                        .padded_rows = pq,
                        .ld = all_self ? E + 2 * Ekv : E,
                        .ldkv = all_self ? E + 2 * Ekv : Ekv};
  Grow(ws.paged_proj, all_self ? pq * proj.ld : pq * E + 2 * pk * Ekv);
  proj.q = ws.paged_proj.data();
  proj.k = all_self ? proj.q + E : proj.q + pq * E;
  proj.v = all_self ? proj.q + E + Ekv : proj.k + pk * Ekv;
  if (!run) return proj;
  if (all_self && qkv_->has_row_path(tq)) {
    qkv_->RunRows(xq, dq, tq, proj.q, proj.ld);
    return proj;
  }
  if (all_self) {
    qkv_->Run(*ws.stream, ws.bindings, 1, pq, {AsProjectionInput(xq, pq * dq, ws.xq), dq},
              {proj.q, proj.ld}, Dt::f32);
  } else {
    if (tq > 0) {
      q_->Run(*ws.stream, ws.bindings, 1, pq, {AsProjectionInput(xq, pq * dq, ws.xq), dq},
              {proj.q, E}, Dt::f32);
    }
    if (tk > 0) {
      k_->Run(*ws.stream, ws.bindings, 1, pk, {AsProjectionInput(xk, pk * dk, ws.xk), dk},
              {proj.k, Ekv}, Dt::f32);
      v_->Run(*ws.stream, ws.bindings, 1, pk, {AsProjectionInput(xv, pk * dv, ws.xv), dv},
              {proj.v, Ekv}, Dt::f32);
    }
  }
  ws.stream->wait();
  return proj;
}

// An attention-only model's steps bring their q, k and v projected: gathered as they
// are, q (rows, p_o) then k and v (tk, G * d_h) each; nothing padded (no GEMM runs).
MultiHeadAttention::Impl::PagedProjections MultiHeadAttention::Impl::GatherPaged(
    std::span<const PagedStep> steps, int64_t tq, int64_t tk, Workspace& ws) const {
  const int64_t E = c_.num_hiddens, Ekv = c_.kv_hiddens();
  Grow(ws.paged_proj, tq * E + 2 * tk * Ekv);
  PagedProjections proj{.rows = tq, .padded_rows = tq, .ld = E, .ldkv = Ekv};
  proj.q = ws.paged_proj.data();
  proj.k = proj.q + tq * E;
  proj.v = proj.k + tk * Ekv;
  int64_t qi = 0, ki = 0;
  for (const PagedStep& step : steps) {
    std::copy_n(step.queries, step.num_queries * E, proj.q + qi * E);
    std::copy_n(step.keys, step.num_keys * Ekv, proj.k + ki * Ekv);
    std::copy_n(step.values, step.num_keys * Ekv, proj.v + ki * Ekv);
    qi += step.num_queries;
    ki += step.num_keys;
  }
  return proj;
}

bool MultiHeadAttention::Impl::TasksStorePaged(std::span<const PagedStep> steps) const {
  const int64_t per_task = kPagedQueryRows / heads_per_paged_task_;
  if (heads_per_paged_task_ != c_.num_heads / c_.kv_heads()) return false;
  return std::all_of(steps.begin(), steps.end(), [&](const PagedStep& step) {
    return step.num_queries > 0 && step.num_queries <= per_task;
  });
}

std::vector<MultiHeadAttention::Impl::PagedTask> MultiHeadAttention::Impl::PagedTasks(
    std::span<const PagedStep> steps, const PagedProjections& proj,
    const internal::RotaryTable* rope, bool tasks_store, float* ctx,
    std::vector<double>& costs) const {
  const int64_t E = c_.num_hiddens, hs = heads_per_paged_task_;
  const int64_t per_task = kPagedQueryRows / hs;  // queries per task
  // The kernels prefetch each next block when the steps' caches are larger than this
  // machine's L3 could hold (read from memory); on smaller ones the prefetches only
  // take load slots (docs/performance.md, "Decode steps: one region").
  double cache_bytes = 0;
  for (const PagedStep& step : steps) {
    cache_bytes += static_cast<double>(step.cache->size() * 2 * c_.kv_hiddens()) *
                   (step.cache->bf16() ? 2.0 : 4.0);
  }
  const bool prefetch = cache_bytes > kPrefetchAboveBytes;
  std::vector<PagedTask> tasks;
  costs.clear();
  int64_t qi = 0, ki = 0;
  for (const PagedStep& step : steps) {
    const int64_t seen = step.cache->size() + step.new_keys();
    for (int64_t h = 0; h < c_.num_heads; h += hs) {
      for (int64_t i0 = 0; i0 < step.num_queries; i0 += per_task) {
        tasks.push_back({.step = &step,
                         .head = h,
                         .heads = hs,
                         .i0 = i0,
                         .mq = std::min(per_task, step.num_queries - i0),
                         .cached = step.cache->size(),
                         .q = proj.q + qi * proj.ld,
                         .ldq = proj.ld,
                         .ctx = ctx + qi * E,
                         .rope = rope,
                         .new_k = tasks_store ? proj.k + ki * proj.ldkv : nullptr,
                         .new_v = tasks_store ? proj.v + ki * proj.ldkv : nullptr,
                         .ldkv = proj.ldkv,
                         .prefetch = prefetch});
        costs.push_back(static_cast<double>(tasks.back().mq * hs * seen));
      }
    }
    qi += step.num_queries;
    ki += step.new_keys();
  }
  return tasks;
}

void MultiHeadAttention::Impl::RunPagedTask(const PagedTask& task, TaskScratch& scratch) const {
  if (task.step->cache->bf16()) {
    AttendPagedTask<uint16_t>(task, scratch);
  } else {
    AttendPagedTask<float>(task, scratch);
  }
}

absl::Status MultiHeadAttention::Impl::AttendPaged(
    std::span<const PagedStep> steps, const PagedProjections& proj,
    const internal::RotaryTable* rope, int threads, bool tasks_store, Workspace& ws, float* ctx,
    const absl::FunctionRef<void(size_t)>* finish) const {
  const int64_t E = c_.num_hiddens;
  std::fill(ctx + proj.rows * E, ctx + proj.padded_rows * E, 0.0f);
  std::vector<double> costs;  // rows x keys seen, for decode steps' ranges (tasks_store)
  const std::vector<PagedTask> tasks = PagedTasks(steps, proj, rope, tasks_store, ctx, costs);
  // With `finish`: each step's tasks not yet ended. The task that ends a step's last
  // sees every other task's rows of it (acquire-release on the count). A finished
  // step is not read again: its caller may free it at once.
  std::unique_ptr<std::atomic<int64_t>[]> left;
  if (finish != nullptr) {
    left = std::make_unique<std::atomic<int64_t>[]>(steps.size());
    for (const PagedTask& task : tasks) left[task.step - steps.data()].fetch_add(1);
    for (size_t i = 0; i < steps.size(); ++i) {
      if (left[i].load(std::memory_order_relaxed) == 0) {
        return absl::InternalError(absl::StrCat("step ", i, " has no task to finish it"));
      }
    }
  }
  return internal::RunTasks(
      static_cast<int64_t>(tasks.size()), threads, ws,
      [&](int64_t t, dnnl::stream&, TaskScratch& scratch) {
        RunPagedTask(tasks[t], scratch);
        if (finish == nullptr) return;
        const size_t i = static_cast<size_t>(tasks[t].step - steps.data());
        if (left[i].fetch_sub(1, std::memory_order_acq_rel) == 1) (*finish)(i);
      },
      tasks_store ? std::span<const double>(costs) : std::span<const double>());
}

bool MultiHeadAttention::Impl::DecodeInOneRegion(std::span<const PagedStep> steps,
                                                 int threads) const {
  if (threads < 2 || c_.attention_only() || !TasksStorePaged(steps)) return false;
  int64_t tq = 0;
  for (const PagedStep& step : steps) {
    if (step.keys != nullptr) return false;
    tq += step.num_queries;
  }
  return qkv_ != nullptr && qkv_->has_row_path(tq) && o_lin_->has_row_path(tq);
}

absl::Status MultiHeadAttention::Impl::DecodeRegion(std::span<const PagedStep> steps,
                                                    const PagedProjections& proj,
                                                    const internal::RotaryTable* rope, int threads,
                                                    Workspace& ws, float* ctx, float* out) const {
  const int64_t E = c_.num_hiddens;
  std::vector<double> costs;
  const std::vector<PagedTask> tasks = PagedTasks(steps, proj, rope, true, ctx, costs);
  const float* xq = ws.paged_in.data();  // the steps' rows, gathered by ProjectPaged
  return internal::RunPhases(threads, ws,
                             {[&](int me, int n, TaskScratch&) {
                                qkv_->RunRowsPart(xq, c_.query_size, proj.rows, proj.q, proj.ld, me,
                                                  n);
                              },
                              [&](int me, int n, TaskScratch& scratch) {
                                const auto [first, last] = internal::CostRange(costs, me, n);
                                for (int64_t t = first; t < last; ++t) {
                                  RunPagedTask(tasks[t], scratch);
                                }
                              },
                              [&](int me, int n, TaskScratch&) {
                                o_lin_->RunRowsPart(ctx, E, proj.rows, out, E, me, n);
                              }});
}

// out ((padded_rows, p_o)) = ctx W_o^T (+ b_o).
void MultiHeadAttention::Impl::ProjectPagedOutput(const PagedProjections& proj, const float* ctx,
                                                  float* out, Workspace& ws) const {
  const int64_t E = c_.num_hiddens, pq = proj.padded_rows;
  if (o_lin_->has_row_path(proj.rows)) {
    o_lin_->RunRows(ctx, E, proj.rows, out, E);
  } else if (proj.rows > 0) {
    o_lin_->Run(*ws.stream, ws.bindings, 1, pq, {AsProjectionInput(ctx, pq * E, ws.xq), E},
                {out, E}, Dt::f32);
    ws.stream->wait();
  }
}

absl::Status MultiHeadAttention::Impl::ForwardPaged(
    std::span<const PagedStep> steps, int max_threads,
    absl::FunctionRef<void(size_t)> step_done) const {
  const int64_t E = c_.num_hiddens;
  const int threads = internal::ThreadsForFlops(PagedWork(steps), o_.num_threads, max_threads);
  const internal::ThreadScope thread_scope(threads);

  internal::WorkspaceLease lease(*workspaces_);
  Workspace& ws = *lease;
  if (!ws.stream) ws.stream.emplace(internal::CpuEngine());
  // A decode step of a few rows runs its projections, attention and W_o on one team
  // (DecodeRegion), with a barrier between them where it would otherwise fork and
  // join three times.
  const bool one_region = DecodeInOneRegion(steps, threads);
  const PagedProjections proj = ProjectPaged(steps, ws, /*run=*/!one_region);
  // A rotary model's tokens sit at their positions in the sequence: the table covers
  // every step's last.
  std::shared_ptr<const internal::RotaryTable> rope;
  if (rope_) {
    int64_t positions = 0;
    for (const PagedStep& step : steps) {
      positions = std::max(positions, step.cache->size() + step.new_keys());
    }
    rope = rope_->Table(positions);
  }
  // Each key/value head's new rows are stored by the one task that attends over its
  // blocks, when there is one task per head (decode steps), else all here first.
  const bool tasks_store = TasksStorePaged(steps);
  const int64_t pq = proj.padded_rows;
  Grow(ws.paged_out, 2 * pq * E);
  float* ctx = ws.paged_out.data();
  float* out = ctx + pq * E;
  // An attention-only model's output is the concatenated heads themselves.
  const float* result = c_.attention_only() ? ctx : out;
  std::vector<int64_t> first_row(steps.size());  // each step's first row in result
  for (size_t i = 1; i < steps.size(); ++i) {
    first_row[i] = first_row[i - 1] + steps[i - 1].num_queries;
  }
  auto finish = [&](size_t i) {
    const PagedStep& step = steps[i];
    std::copy_n(result + first_row[i] * E, step.num_queries * E, step.output);
    step.cache->Append(step.new_keys());
    step_done(i);
  };
  // Attention-only steps whose tasks store their own rows need nothing after their
  // tasks: each is finished by its last (docs/performance.md, "Steps answered as they
  // end").
  if (c_.attention_only() && tasks_store) {
    const absl::FunctionRef<void(size_t)> early = finish;
    return AttendPaged(steps, proj, rope.get(), threads, tasks_store, ws, ctx, &early);
  }
  if (one_region) {
    MHA_RETURN_IF_ERROR(DecodeRegion(steps, proj, rope.get(), threads, ws, ctx, out));
  } else {
    if (!tasks_store) StorePaged(steps, proj.k, proj.v, proj.ldkv, rope.get());
    MHA_RETURN_IF_ERROR(AttendPaged(steps, proj, rope.get(), threads, tasks_store, ws, ctx));
    if (!c_.attention_only()) ProjectPagedOutput(proj, ctx, out, ws);
  }
  for (size_t i = 0; i < steps.size(); ++i) finish(i);
  return absl::OkStatus();
}

}  // namespace mha::core

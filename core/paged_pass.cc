#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

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

// The paged kernels by the cache's element type: f32, or bf16 held as uint16_t.
inline void BlockScores(const float* q, const float* kt, int64_t ld, int64_t p, int64_t mq,
                        int64_t nk, float scale, float* s, const void* prefetch, int64_t bytes) {
  kernels::TransposedScores(q, kt, ld, p, mq, nk, scale, s, prefetch, bytes);
}
inline void BlockScores(const float* q, const uint16_t* kt, int64_t ld, int64_t p, int64_t mq,
                        int64_t nk, float scale, float* s, const void* prefetch, int64_t bytes) {
  kernels::TransposedScoresBf16(q, kt, ld, p, mq, nk, scale, s, prefetch, bytes);
}
inline void BlockContext(const float* probs, const float* v, int64_t p, int64_t mq, int64_t nk,
                         float* o, const void* prefetch, int64_t bytes) {
  kernels::SmallContext(probs, v, p, mq, nk, /*accumulate=*/true, o, prefetch, bytes);
}
inline void BlockContext(const float* probs, const uint16_t* v, int64_t p, int64_t mq, int64_t nk,
                         float* o, const void* prefetch, int64_t bytes) {
  kernels::SmallContextBf16(probs, v, p, mq, nk, o, prefetch, bytes);
}
inline void ToCache(const float* x, float* y, int64_t n) { std::copy_n(x, n, y); }
inline void ToCache(const float* x, uint16_t* y, int64_t n) { kernels::ToBf16(x, y, n); }

// n new keys and values (rows at k and v, row stride ld; h heads of p) into the cache
// after its last token: keys transposed within their block, values as rows.
template <typename T>
void StoreRows(KvSequence& cache, int64_t n, const float* k, const float* v, int64_t ld,
               int64_t num_heads, int64_t p) {
  constexpr int64_t kBt = KvCachePool::kBlockTokens;
  for (int64_t r = 0; r < n; ++r) {
    const int64_t t = cache.size() + r, b = t / kBt, col = t % kBt;
    for (int64_t h = 0; h < num_heads; ++h) {
      const float* key = k + r * ld + h * p;
      T* kt = cache.keys<T>(b, h) + col;
      for (int64_t c = 0; c < p; ++c) ToCache(key + c, kt + c * kBt, 1);
      ToCache(v + r * ld + h * p, cache.values<T>(b, h) + col * p, p);
    }
  }
}

}  // namespace

// Paged attention: a query-row block of one head of one step, over its cache's
// blocks with an online softmax. Plain loops (kernels::TransposedScores,
// SmallContext): a decode step is one query row against kBlockTokens keys per
// block, far below what a oneDNN primitive's dispatch is worth.
template <typename T>
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
  stats.Reset(mq);
  const float scale = 1.0f / std::sqrt(static_cast<float>(p));
  const KvSequence& cache = *step.cache;
  // The next block's keys and values for this head are fetched while this one is
  // worked on: each block is a mapping of its own, so the hardware prefetchers, which
  // stop at page boundaries, never run ahead into it. The kernels spread those
  // prefetches over their loops (the keys' over the scores, the values' over the
  // context), so that the reads overlap the arithmetic instead of stalling before it.
  const int64_t head_bytes = kBt * p * sizeof(T);
  for (int64_t j0 = 0; j0 < max_limit; j0 += kBt) {
    const int64_t b = j0 / kBt, nk = std::min(kBt, max_limit - j0);
    const bool more = j0 + kBt < max_limit;
    const T* next_keys = more ? cache.keys<T>(b + 1, h) : nullptr;
    const T* next_values = more ? cache.values<T>(b + 1, h) : nullptr;
    BlockScores(q, cache.keys<T>(b, h), kBt, p, mq, nk, scale, s, next_keys, head_bytes);
    for (int64_t i = 0; i < mq; ++i) {
      float* si = s + i * nk;
      const int64_t seen = std::clamp<int64_t>(limit(i) - j0, 0, nk);
      if (seen == 0) {
        std::fill_n(si, nk, 0.0f);
        continue;
      }
      std::fill(si + seen, si + nk, -std::numeric_limits<float>::infinity());
      stats.Update(i, si, seen, o + i * p, p,
                   [&](float m) { return kernels::ExpSubSum(si, m, si, nk); });
    }
    BlockContext(s, cache.values<T>(b, h), p, mq, nk, o, next_values, head_bytes);
  }
  stats.Normalise(mq, o, p, /*factor=*/1.0f, ctx, E);
}

void MultiHeadAttention::Impl::StorePaged(std::span<const PagedStep> steps, const float* k,
                                          const float* v, int64_t ld) const {
  const int64_t H = c_.num_heads, p = c_.head_size();
  int64_t row = 0;
  for (const PagedStep& step : steps) {
    const int64_t n = step.new_keys();
    if (step.cache->bf16()) {
      StoreRows<uint16_t>(*step.cache, n, k + row * ld, v + row * ld, ld, H, p);
    } else {
      StoreRows<float>(*step.cache, n, k + row * ld, v + row * ld, ld, H, p);
    }
    row += n;
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
  return std::max(flops, bytes / kPagedBytesPerThread * internal::kFlopsPerThread);
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
  return internal::RunTasks(static_cast<int64_t>(tasks.size()), threads, ws,
                            [&](int64_t t, dnnl::stream&, TaskScratch& scratch) {
                              if (tasks[t].step->cache->bf16()) {
                                AttendPagedTask<uint16_t>(tasks[t], scratch);
                              } else {
                                AttendPagedTask<float>(tasks[t], scratch);
                              }
                            });
}

// out ((padded_rows, p_o)) = ctx W_o^T (+ b_o).
void MultiHeadAttention::Impl::ProjectPagedOutput(const PagedProjections& proj, const float* ctx,
                                                  float* out, Workspace& ws) const {
  const int64_t E = c_.num_hiddens, pq = proj.padded_rows;
  if (o_lin_->has_row_path(proj.rows)) {
    o_lin_->RunRows(ctx, E, proj.rows, out, E);
  } else if (proj.rows > 0) {
    o_lin_->Run(*ws.stream, ws.bindings, 1, pq, {AsActivation(ctx, pq * E, ws.xq), E}, {out, E},
                Dt::f32);
    ws.stream->wait();
  }
}

absl::Status MultiHeadAttention::Impl::ForwardPaged(std::span<const PagedStep> steps,
                                                    int max_threads) const {
  const int64_t E = c_.num_hiddens;
  const int threads = internal::ThreadsForFlops(PagedWork(steps), o_.num_threads, max_threads);
  const internal::ThreadScope thread_scope(threads);

  internal::WorkspaceLease lease(*workspaces_);
  Workspace& ws = *lease;
  if (!ws.stream) ws.stream.emplace(internal::CpuEngine());
  const PagedProjections proj = ProjectPaged(steps, ws);
  StorePaged(steps, proj.k, proj.v, proj.ld);
  const int64_t pq = proj.padded_rows;
  Grow(ws.paged_out, 2 * pq * E);
  float* ctx = ws.paged_out.data();
  float* out = ctx + pq * E;
  MHA_RETURN_IF_ERROR(AttendPaged(steps, proj, threads, ws, ctx));
  ProjectPagedOutput(proj, ctx, out, ws);
  int64_t qi = 0;
  for (const PagedStep& step : steps) {
    std::copy_n(out + qi * E, step.num_queries * E, step.output);
    qi += step.num_queries;
    step.cache->Append(step.new_keys());
  }
  return absl::OkStatus();
}

}  // namespace mha::core

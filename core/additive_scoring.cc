#include <algorithm>

#include "core/attention_impl.h"

// Additive scoring inside the dense pass (core/config.h): score_ij = w_v .
// tanh(A_q q_i + A_k k_j) per head. A_q q and A_k k are projected once per (batch
// row, head) by oneDNN; the tanh sums run in kernels::AdditiveScores.

namespace mha::core {

using dnnl::memory;
using internal::Bindings;
using internal::Dt;
using internal::Matmul;
using internal::MatmulCache;
using internal::PlanThreads;
using internal::SizeOf;

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

// Only the keys a row sees are scored: padded and masked keys cost nothing.
void MultiHeadAttention::Impl::AdditiveScoreBlock(const Task& task, const Block& blk,
                                                  TaskScratch& scratch) const {
  const int64_t pa = c_.additive_hidden;
  for (int64_t i = 0; i < task.mq; ++i) {
    const int64_t n = std::clamp<int64_t>(task.limit(i) - blk.j0, 0, blk.nk);
    kernels::AdditiveScores(task.qa + i * pa, task.kt + blk.j0, task.kv_rows, task.score_v, pa,
                            scratch.s.data() + i * blk.ld, n);
  }
}

// One task per (batch row, head): its queries' and keys' scoring projections.
absl::Status MultiHeadAttention::Impl::ProjectScoring(const AttentionInputs& in,
                                                      const HeadMajor& heads, int threads,
                                                      Workspace& ws,
                                                      ScoringProjections& out) const {
  const int64_t Q = in.num_queries, H = c_.num_heads, kv = heads.kv_rows;
  const int64_t kv_stride = heads.kv_stride;
  const int64_t p = c_.head_size(), pa = c_.additive_hidden;
  const size_t asz = SizeOf(act_);
  if (ws.qa.size() < static_cast<size_t>(in.batch * H * Q * pa))
    ws.qa.resize(in.batch * H * Q * pa);
  if (ws.kt.size() < static_cast<size_t>(in.batch * H * pa * kv))
    ws.kt.resize(in.batch * H * pa * kv);
  out = {.qa = ws.qa.data(), .kt = ws.kt.data()};
  return internal::RunTasks(
      in.batch * H, threads, ws, [&](int64_t t, dnnl::stream& stream, TaskScratch& scratch) {
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
                  heads.k + t * kv_stride * p * asz);
        args.Bind(DNNL_ARG_DST, pa, kv, kv, false, Dt::f32, ws.kt.data() + t * pa * kv);
        args.Execute(ScoringPrimitive(pa, kv), stream);
      });
}

}  // namespace mha::core

#include <omp.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "base/status_macros.h"
#include "core/attention_impl.h"

// The dense pass (Forward): the queries, keys and values of a whole batch are
// projected, repacked head-major, and attended by one fused task per (batch row,
// head, block of queries) that runs its key blocks through scores, an online softmax
// and the context without writing the scores out; W_o applies to the concatenated
// heads.

namespace mha::core {
namespace {

using dnnl::memory;
using internal::Bindings;
using internal::Dt;
using internal::Grow;
using internal::Matmul;
using internal::MatmulCache;
using internal::PlanThreads;
using internal::SizeOf;
using internal::StridedOperand;

// Below this size the head-major repack runs on the calling thread (RepackHeadMajor).
constexpr int64_t kParallelBytes = 256 << 10;

// An f32 attention block of at most this many multiply-adds per product (mq x nk x
// p) runs in plain loops (kernels::SmallScores/SmallContext): below it a oneDNN
// primitive's look-up, binding and dispatch cost more than the arithmetic.
constexpr int64_t kSmallBlockMacs = 8192;

int64_t RoundUp(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

// Thread `me` of n's share of a one-region call's `cols` output columns: whole
// blocks of Linear::kColumnBlock, so that it reads them in place.
std::pair<int64_t, int64_t> OneRegionColumns(int64_t cols, int me, int n) {
  auto first = [&](int i) {
    return i >= n ? cols : std::min(cols, RoundUp(cols * i / n, internal::Linear::kColumnBlock));
  };
  return {first(me), first(me + 1)};
}

// Thread `me` of n's share of a one-region call's heads: the key/value heads
// [G me / n, G (me + 1) / n), and the fused projection's Q, K and V columns of those
// heads and of their query heads.
struct OneRegionHeads {
  int64_t g0, g1;
  std::array<std::pair<int64_t, int64_t>, 3> qkv_columns;
};
OneRegionHeads OneRegionHeadsOf(const ModelConfig& c, int me, int n) {
  const int64_t G = c.kv_heads(), g0 = G * me / n, g1 = G * (me + 1) / n;
  const int64_t E = c.num_hiddens, Ekv = c.kv_hiddens(), p = c.head_size();
  const int64_t group = c.num_heads / G;
  return {.g0 = g0,
          .g1 = g1,
          .qkv_columns = {{{g0 * group * p, g1 * group * p},
                           {E + g0 * p, E + g1 * p},
                           {E + Ekv + g0 * p, E + Ekv + g1 * p}}}};
}

// Key rows no query sees are skipped by projecting a prefix of kv_rows per batch row,
// a GEMM each (Linear::Run). When those prefixes are a few rows each (merged small
// requests with valid_lens), the calls would cost more than their rows: the prefixes
// are copied together first and projected as one GEMM (GatherPrefix).
bool GathersPrefixes(int64_t batch, int64_t kv_rows) { return batch > 1 && kv_rows < 16; }

// The first `rows` rows of each of `batch` dense matrices of `width` elements a row,
// `batch_stride` apart, packed one after the other into `buf`.
const void* GatherPrefix(const void* x, int64_t batch, int64_t rows, int64_t width,
                         int64_t batch_stride, size_t elem, std::vector<char>& buf) {
  const size_t bytes = rows * width * elem;
  Grow(buf, batch * bytes);
  for (int64_t b = 0; b < batch; ++b) {
    std::memcpy(buf.data() + b * bytes, static_cast<const char*>(x) + b * batch_stride * elem,
                bytes);
  }
  return buf.data();
}

}  // namespace

Matmul MultiHeadAttention::Impl::ScorePrimitive(int64_t mq, int64_t nk, bool blocked) const {
  const int64_t p = c_.head_size();
  const MatmulCache::Key key{blocked ? 2 : 0, mq, nk, 0, PlanThreads()};
  if (auto prim = attn_cache_.Find(key)) return *prim;
  dnnl::primitive_attr attr;
  attr.set_output_scales(0, {ScoreScale()});
  const memory::desc kt = blocked ? memory::desc({p, nk}, act_, memory::format_tag::any)
                                  : memory::desc({p, nk}, act_, {1, p});
  return attn_cache_.Add(key,
                         dnnl::matmul::desc(memory::desc({mq, p}, act_, {p, 1}), kt,
                                            memory::desc({mq, nk}, Dt::f32, {nk, 1})),
                         attr);
}

Matmul MultiHeadAttention::Impl::ContextPrimitive(int64_t mq, int64_t nk, bool accumulate,
                                                  bool blocked) const {
  const int64_t p = c_.head_size();
  const MatmulCache::Key key{blocked ? 3 : 1, mq, nk, accumulate, PlanThreads()};
  if (auto prim = attn_cache_.Find(key)) return *prim;
  dnnl::primitive_attr attr;
  if (accumulate) {
    dnnl::post_ops ops;
    ops.append_sum(1.0f);
    attr.set_post_ops(ops);
  }
  const memory::desc v = blocked ? memory::desc({nk, p}, act_, memory::format_tag::any)
                                 : memory::desc({nk, p}, act_, {p, 1});
  return attn_cache_.Add(key,
                         dnnl::matmul::desc(memory::desc({mq, nk}, act_, {nk, 1}), v,
                                            memory::desc({mq, p}, Dt::f32, {p, 1})),
                         attr);
}

int64_t MultiHeadAttention::Impl::FullBlockKeys() const { return RoundUp(o_.key_block, kKeyPad); }

const MultiHeadAttention::Impl::KvReorders& MultiHeadAttention::Impl::BlockReorders() const {
  absl::MutexLock lock(&reorders_mu_);
  if (!kv_reorders_) {
    const int64_t p = c_.head_size(), ld = FullBlockKeys();
    const int64_t rows = RoundUp(o_.query_block, kQueryPad);
    const internal::ThreadScope one(1);  // the layouts of the tasks' one-thread primitives
    KvReorders r;
    r.k_src = memory::desc({p, ld}, act_, {1, p});
    r.k_dst = ScorePrimitive(rows, ld, /*blocked=*/true).weights;
    r.k = dnnl::reorder(dnnl::reorder::primitive_desc(internal::CpuEngine(), r.k_src,
                                                      internal::CpuEngine(), r.k_dst));
    if (act_ == Dt::bf16) {
      r.v_src = memory::desc({ld, p}, act_, {p, 1});
      r.v_dst = ContextPrimitive(rows, ld, /*accumulate=*/false, /*blocked=*/true).weights;
      r.v = dnnl::reorder(dnnl::reorder::primitive_desc(internal::CpuEngine(), r.v_src,
                                                        internal::CpuEngine(), r.v_dst));
    }
    kv_reorders_ = std::move(r);
  }
  return *kv_reorders_;
}

MultiHeadAttention::Impl::Task MultiHeadAttention::Impl::TaskAt(const TaskInputs& inputs,
                                                                int64_t t) const {
  const AttentionInputs& in = inputs.in;
  const HeadMajor& hm = inputs.heads;
  const int64_t Q = in.num_queries, K = in.num_keys, H = c_.num_heads, E = c_.num_hiddens;
  const int64_t p = c_.head_size(), q_blocks = inputs.q_blocks;
  // s query heads per task; multi-head models: s = 1, a task per (b, head, block).
  const int64_t s = heads_per_task_, tasks_per_row = H / s, group = H / c_.kv_heads();
  const int64_t per_block = o_.query_block / s;  // queries per task
  const size_t asz = SizeOf(act_);
  const int64_t b = t / (tasks_per_row * q_blocks), hs = (t / q_blocks) % tasks_per_row;
  const int64_t qb = t % q_blocks, h = hs * s, g = h / group;
  const int64_t i0 = qb * per_block;
  const int64_t nq = std::min(per_block, Q - i0);
  const int32_t* lim = &inputs.limits[b * Q + i0];
  const ScoringProjections& sp = inputs.scoring;
  const int64_t pa = c_.additive_hidden;
  const bool additive = sp.qa != nullptr;
  return {
      .mq = nq * s,
      .heads = s,
      .limits = lim,
      .max_limit = *std::max_element(lim, lim + nq),
      .q = hm.q + ((b * tasks_per_row + hs) * Q + i0) * s * p * asz,
      .k = hm.k + (b * c_.kv_heads() + g) * hm.kv_stride * p * asz,
      .v = hm.v + (b * c_.kv_heads() + g) * hm.kv_stride * p * asz,
      .kv_stride = hm.kv_stride,
      .ctx = inputs.ctx + (b * Q + i0) * E + h * p,
      .attention =
          inputs.attention == nullptr ? nullptr : inputs.attention + ((b * H + h) * Q + i0) * K,
      .lse = inputs.lse == nullptr ? nullptr : inputs.lse + (b * H + h) * Q + i0,
      .num_queries = Q,
      .num_keys = K,
      .factors = in.head_mask.empty() ? nullptr : in.head_mask.data() + h,
      .qa = additive ? sp.qa + ((b * H + h) * Q + i0) * pa : nullptr,
      .kt = additive ? sp.kt + (b * H + h) * pa * hm.kv_rows : nullptr,
      .kv_rows = hm.kv_rows,
      .score_v = additive ? score_v_.data() + h * pa : nullptr,
      .blocked = hm.blocked.k != nullptr ? &hm.blocked : nullptr,
      .head_index = b * c_.kv_heads() + g,
  };
}

void MultiHeadAttention::Impl::AttendTask(const Task& task, dnnl::stream& stream,
                                          TaskScratch& scratch) const {
  const int64_t E = c_.num_hiddens, p = c_.head_size(), mq = task.mq;
  if (task.attention != nullptr) {
    for (int64_t r = 0; r < mq; ++r) std::fill_n(task.attention_row(r), task.num_keys, 0.0f);
  }
  // Every head's factor 0: a zero context, unless the weights or the lse (which head_mask
  // leaves alone) are asked for.
  bool dropped = task.factors != nullptr && task.attention == nullptr && task.lse == nullptr;
  for (int64_t r = 0; r < task.heads && dropped; ++r) dropped = task.factor(r) == 0.0f;
  if (task.max_limit == 0 || dropped) {
    for (int64_t r = 0; r < mq; ++r) std::fill_n(task.ctx_row(r, E, p), p, 0.0f);
    if (task.lse != nullptr) {
      for (int64_t r = 0; r < mq; ++r) task.lse_at(r) = -std::numeric_limits<float>::infinity();
    }
    return;
  }

  // Every operand is dense, which is what lets oneDNN pick its brgemm kernels. With
  // attention weights asked for, a row's keys are all in one block.
  const int64_t bk =
      task.attention != nullptr ? task.max_limit : std::min(o_.key_block, task.max_limit);
  const size_t tile = RoundUp(mq, kQueryPad) * RoundUp(bk, kKeyPad);
  scratch.s.resize(std::max(scratch.s.size(), tile));
  scratch.o.resize(std::max<size_t>(scratch.o.size(), RoundUp(mq, kQueryPad) * p));
  if (act_ == Dt::bf16) scratch.p.resize(std::max(scratch.p.size(), tile));
  RowStats stats;
  stats.Reset(mq, /*base2=*/task.qa == nullptr);  // dot-product scores: ScoreScale

  for (int64_t j0 = 0; j0 < task.max_limit; j0 += bk) {
    const Block blk = BlockAt(task, j0, std::min(bk, task.max_limit - j0));
    ScoreBlock(task, blk, stream, scratch);
    SoftmaxBlock(task, blk, stats, scratch);
    ContextBlock(task, blk, stream, scratch);
  }
  // The final normalisation and head_mask, into each head's columns.
  for (int64_t r = 0; r < mq; ++r) {
    stats.NormaliseRow(r, scratch.o.data() + r * p, p, task.factor(r), task.ctx_row(r, E, p));
  }
  if (task.lse != nullptr) {
    for (int64_t r = 0; r < mq; ++r) task.lse_at(r) = stats.Lse(r);
  }
}

bool MultiHeadAttention::Impl::InLoops(int64_t rows, int64_t keys) const {
  return act_ == Dt::f32 && rows * keys * c_.head_size() <= kSmallBlockMacs;
}

MultiHeadAttention::Impl::Block MultiHeadAttention::Impl::BlockAt(const Task& task, int64_t j0,
                                                                  int64_t nk) const {
  if (InLoops(task.mq, nk)) {
    return {.j0 = j0, .nk = nk, .ld = nk, .rows = task.mq, .loops = true};
  }
  return {.j0 = j0,
          .nk = nk,
          .ld = std::min(RoundUp(nk, kKeyPad), task.kv_stride - j0),
          .rows = RoundUp(task.mq, kQueryPad),
          .loops = false};
}

// scratch.s (rows, ld) = the block's scores.
void MultiHeadAttention::Impl::ScoreBlock(const Task& task, const Block& blk, dnnl::stream& stream,
                                          TaskScratch& scratch) const {
  if (task.qa != nullptr) return AdditiveScoreBlock(task, blk, scratch);
  const int64_t p = c_.head_size();
  if (blk.loops) {
    return kernels::SmallScores(reinterpret_cast<const float*>(task.q),
                                reinterpret_cast<const float*>(task.k) + blk.j0 * p, p, task.mq,
                                blk.nk, ScoreScale(), scratch.s.data());
  }
  Bindings& args = scratch.bindings;
  args.Bind(DNNL_ARG_SRC, blk.rows, p, p, false, act_, task.q);
  args.Bind(DNNL_ARG_DST, blk.rows, blk.ld, blk.ld, false, Dt::f32, scratch.s.data());
  if (const char* kb = PreBlocked(task, blk, /*values=*/false)) {
    const Matmul prim = ScorePrimitive(blk.rows, blk.ld, /*blocked=*/true);
    if (prim.weights == task.blocked->k_md) {
      args.Bind(DNNL_ARG_WEIGHTS, prim.weights, kb);
      return args.Execute(prim, stream);
    }
  }
  args.Bind(DNNL_ARG_WEIGHTS, p, blk.ld, p, /*transposed=*/true, act_,
            task.k + blk.j0 * p * SizeOf(act_));
  args.Execute(ScorePrimitive(blk.rows, blk.ld), stream);
}

const char* MultiHeadAttention::Impl::PreBlocked(const Task& task, const Block& blk,
                                                 bool values) const {
  const BlockedKv* kv = task.blocked;
  if (kv == nullptr || blk.loops || blk.ld != kv->ld || blk.j0 % o_.key_block != 0) return nullptr;
  const int64_t m = blk.j0 / o_.key_block;
  if (m >= kv->blocks) return nullptr;
  const int64_t i = task.head_index * kv->blocks + m;
  if (values) return kv->v == nullptr ? nullptr : kv->v + i * kv->v_bytes;
  return kv->k + i * kv->k_bytes;
}

// Scores become unnormalised probabilities (in scratch.s, and scratch.p for bf16),
// masked keys 0; the running max and sum move on, and the context accumulated so
// far is rescaled to the new max.
void MultiHeadAttention::Impl::SoftmaxBlock(const Task& task, const Block& blk, RowStats& stats,
                                            TaskScratch& scratch) const {
  const int64_t j0 = blk.j0, ld = blk.ld;  // the pad keys' scores are set to 0 as masked ones
  const int64_t p = c_.head_size();
  const bool bf16 = act_ == Dt::bf16;
  const bool base2 = stats.base2;
  float* s = scratch.s.data();
  float* o = scratch.o.data();
  uint16_t* probs16 = bf16 ? scratch.p.data() : nullptr;
  for (int64_t i = 0; i < task.mq; ++i) {
    float* srow = s + i * ld;
    uint16_t* prow = bf16 ? probs16 + i * ld : nullptr;
    const int64_t n = std::clamp<int64_t>(task.limit(i) - j0, 0, blk.nk);
    if (n > 0 && task.attention != nullptr) {
      // The whole row is in this one block: normalise now, hand out the weights.
      const float m = kernels::RowMax(srow, n);
      const float sum = kernels::ExpSubSum(srow, m, srow, n, base2);
      kernels::Scale(srow, 1.0f / sum, n);
      std::copy_n(srow, n, task.attention_row(i));
      if (bf16) kernels::ToBf16(srow, prow, n);
      // The context comes out normalised: sum 1, and the lse folded into the max.
      stats.sum[i] = 1.0f;
      stats.max[i] = m + (base2 ? std::log2(sum) : std::log(sum));
    } else if (n > 0) {
      stats.Update(i, srow, n, o + i * p, p, [&](float m) {
        return bf16 ? kernels::ExpSubSumBf16(srow, m, prow, n, base2)
                    : kernels::ExpSubSum(srow, m, srow, n, base2);
      });
    }
    std::fill(srow + n, srow + ld, 0.0f);
    if (bf16) std::fill(prow + n, prow + ld, uint16_t{0});
  }
}

// scratch.o (rows, p) (+)= the block's probabilities times its values.
void MultiHeadAttention::Impl::ContextBlock(const Task& task, const Block& blk,
                                            dnnl::stream& stream, TaskScratch& scratch) const {
  const int64_t p = c_.head_size();
  if (blk.loops) {
    return kernels::SmallContext(scratch.s.data(),
                                 reinterpret_cast<const float*>(task.v) + blk.j0 * p, p, task.mq,
                                 blk.nk, /*accumulate=*/blk.j0 > 0, scratch.o.data());
  }
  const void* probs =
      act_ == Dt::bf16 ? static_cast<const void*>(scratch.p.data()) : scratch.s.data();
  Bindings& args = scratch.bindings;
  args.Bind(DNNL_ARG_SRC, blk.rows, blk.ld, blk.ld, false, act_, probs);
  args.Bind(DNNL_ARG_DST, blk.rows, p, p, false, Dt::f32, scratch.o.data());
  if (const char* vb = PreBlocked(task, blk, /*values=*/true)) {
    const Matmul prim = ContextPrimitive(blk.rows, blk.ld, blk.j0 > 0, /*blocked=*/true);
    if (prim.weights == task.blocked->v_md) {
      args.Bind(DNNL_ARG_WEIGHTS, prim.weights, vb);
      return args.Execute(prim, stream);
    }
  }
  args.Bind(DNNL_ARG_WEIGHTS, blk.ld, p, p, false, act_, task.v + blk.j0 * p * SizeOf(act_));
  args.Execute(ContextPrimitive(blk.rows, blk.ld, /*accumulate=*/blk.j0 > 0), stream);
}

MultiHeadAttention::Impl::KeyLimits MultiHeadAttention::Impl::ComputeKeyLimits(
    const AttentionInputs& in, bool positions) {
  const int64_t B = in.batch, Q = in.num_queries;
  const ValidLens lens = in.lens();
  // Causal: query i sees keys j <= i (top-left), or in a model with positions keys at
  // positions <= its own, K - Q + i (bottom-right).
  const int64_t shift = positions ? in.num_keys - Q : 0;
  KeyLimits limits{.per_query = std::vector<int32_t>(static_cast<size_t>(B * Q))};
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t i = 0; i < Q; ++i) {
      int64_t lim = lens.at(b, i);
      if (in.causal) lim = std::min(lim, shift + i + 1);
      limits.per_query[b * Q + i] = static_cast<int32_t>(lim);
      limits.kv_rows = std::max(limits.kv_rows, lim);
    }
  }
  return limits;
}

MultiHeadAttention::Impl::Projections MultiHeadAttention::Impl::Project(const AttentionInputs& in,
                                                                        int64_t kv_rows,
                                                                        Workspace& ws) const {
  const int64_t nq = in.batch * in.num_queries * c_.query_size;
  if (c_.attention_only()) {
    const void* xq = AsActivation(in.queries, nq, ws.xq);
    const int64_t Q = in.num_queries, K = in.num_keys, E = c_.num_hiddens, Ekv = c_.kv_hiddens();
    const char* xk = nullptr;
    const char* xv = nullptr;
    if (kv_rows > 0) {
      xk = static_cast<const char*>(AsActivation(in.keys, in.batch * K * Ekv, ws.xk));
      xv = static_cast<const char*>(AsActivation(in.values, in.batch * K * Ekv, ws.xv));
    }
    return {.q = {static_cast<const char*>(xq), E, Q * E},
            .k = {xk, Ekv, K * Ekv},
            .v = {xv, Ekv, K * Ekv}};
  }
  const void* xq = AsProjectionInput(in.queries, nq, ws.xq);
  return in.self_attention() ? ProjectSelf(in, kv_rows, xq, ws) : ProjectCross(in, kv_rows, xq, ws);
}

// One (B*Q, p_o + 2 p_kv) buffer, each row Q | K | V of one token.
MultiHeadAttention::Impl::Projections MultiHeadAttention::Impl::ProjectSelf(
    const AttentionInputs& in, int64_t kv_rows, const void* xq, Workspace& ws) const {
  const int64_t B = in.batch, Q = in.num_queries, E = c_.num_hiddens, Ekv = c_.kv_hiddens();
  const size_t asz = SizeOf(act_);
  const int64_t ld = E + 2 * Ekv, d = c_.query_size;
  Grow(ws.proj, B * Q * ld * asz);
  char* base = ws.proj.data();
  int64_t kv_batch_stride = Q * ld;
  if (kv_rows == in.num_keys) {
    qkv_->Run(*ws.stream, ws.bindings, 1, B * Q, {xq, d}, {base, ld}, act_);
  } else {
    q_->Run(*ws.stream, ws.bindings, 1, B * Q, {xq, d}, {base, ld}, act_);
    if (kv_rows > 0 && GathersPrefixes(B, kv_rows)) {
      // Batch row b's keys and values in rows b * kv_rows.. (kv_rows <= Q: beside the queries)
      const void* xp = GatherPrefix(xq, B, kv_rows, d, Q * d, SizeOf(in_), ws.prefix_k);
      kv_->Run(*ws.stream, ws.bindings, 1, B * kv_rows, {xp, d}, {base + E * asz, ld}, act_);
      kv_batch_stride = kv_rows * ld;
    } else if (kv_rows > 0) {
      kv_->Run(*ws.stream, ws.bindings, B, kv_rows, {xq, d, Q * d}, {base + E * asz, ld, Q * ld},
               act_);
    }
  }
  return {.q = {base, ld, Q * ld},
          .k = {base + E * asz, ld, kv_batch_stride},
          .v = {base + (E + Ekv) * asz, ld, kv_batch_stride}};
}

// Q in a (B*Q, p_o) buffer; K and V side by side in each row of a (B*K, 2 p_kv) one
// when keys and values are the same tensor, else as two (B*K, p_kv) planes.
MultiHeadAttention::Impl::Projections MultiHeadAttention::Impl::ProjectCross(
    const AttentionInputs& in, int64_t kv_rows, const void* xq, Workspace& ws) const {
  const int64_t B = in.batch, Q = in.num_queries, K = in.num_keys, E = c_.num_hiddens;
  const int64_t Ekv = c_.kv_hiddens();
  const size_t asz = SizeOf(act_);
  const bool fuse_kv = in.keys == in.values && kv_ != nullptr;
  const int64_t ld = fuse_kv ? 2 * Ekv : Ekv;
  Grow(ws.proj, B * Q * E * asz);
  q_->Run(*ws.stream, ws.bindings, 1, B * Q, {xq, c_.query_size}, {ws.proj.data(), E}, act_);
  Grow(ws.kv, B * K * 2 * Ekv * asz);
  char* kbase = ws.kv.data();
  char* vbase = fuse_kv ? kbase + Ekv * asz : kbase + B * K * Ekv * asz;
  // Contiguous rows run as one 2-D GEMM, and so do gathered prefixes; other per-batch
  // prefixes as one per batch row.
  const bool gather = kv_rows < K && GathersPrefixes(B, kv_rows);
  const bool contiguous = kv_rows == K || gather;
  const int64_t batch = contiguous ? 1 : B, rows = contiguous ? B * kv_rows : kv_rows;
  const int64_t span = gather ? kv_rows : K;  // rows from one batch row's keys to the next
  const int64_t dk = c_.key_size, dv = c_.value_size;
  if (kv_rows > 0) {
    const size_t isz = SizeOf(in_);
    const void* xk = AsProjectionInput(in.keys, B * K * dk, ws.xk);
    if (gather) xk = GatherPrefix(xk, B, kv_rows, dk, K * dk, isz, ws.prefix_k);
    if (fuse_kv) {
      kv_->Run(*ws.stream, ws.bindings, batch, rows, {xk, dk, span * dk}, {kbase, ld, K * ld},
               act_);
    } else {
      const void* xv = AsProjectionInput(in.values, B * K * dv, ws.xv);
      if (gather) xv = GatherPrefix(xv, B, kv_rows, dv, K * dv, isz, ws.prefix_v);
      k_->Run(*ws.stream, ws.bindings, batch, rows, {xk, dk, span * dk}, {kbase, ld, K * ld}, act_);
      v_->Run(*ws.stream, ws.bindings, batch, rows, {xv, dv, span * dv}, {vbase, ld, K * ld}, act_);
    }
  }
  return {
      .q = {ws.proj.data(), E, Q * E}, .k = {kbase, ld, span * ld}, .v = {vbase, ld, span * ld}};
}

// Head-major, so that every block GEMM has dense operands: the buffers, with the pad
// key rows zeroed.
MultiHeadAttention::Impl::HeadMajor MultiHeadAttention::Impl::LayOutHeads(const AttentionInputs& in,
                                                                          int64_t kv_rows,
                                                                          Workspace& ws) const {
  const int64_t B = in.batch, Q = in.num_queries, E = c_.num_hiddens;
  const int64_t G = c_.kv_heads(), Ekv = c_.kv_hiddens(), p = c_.head_size();
  const int64_t s = heads_per_task_;  // query heads interleaved per task (HeadMajor)
  const size_t asz = SizeOf(act_);
  // Padded blocks read up to kQueryPad - 1 rows past a task's queries (slack after
  // the last) and kKeyPad - 1 past a head's keys (zero rows, up to kv_stride). When
  // every block is small enough for plain loops (BlockAt), nothing is padded.
  const bool loops_only = InLoops(std::min(o_.query_block, Q * s), kv_rows);
  const int64_t kv_stride = loops_only ? kv_rows : RoundUp(kv_rows, kKeyPad);
  const int64_t q_elems = B * Q * E + kQueryPad * p;
  Grow(ws.heads, (q_elems + 2 * B * kv_stride * Ekv) * asz);
  char* qh = ws.heads.data();
  char* kh = qh + q_elems * asz;
  char* vh = kh + B * kv_stride * Ekv * asz;
  const int64_t pb = p * asz;
  for (int64_t bg = 0; bg < B * G && kv_stride > kv_rows; ++bg) {
    std::memset(kh + (bg * kv_stride + kv_rows) * pb, 0, (kv_stride - kv_rows) * pb);
    std::memset(vh + (bg * kv_stride + kv_rows) * pb, 0, (kv_stride - kv_rows) * pb);
  }
  return {qh, kh, vh, kv_rows, kv_stride};
}

// An int8 model's self-attention without rotary positions: the Q/K/V sums are
// rescaled straight into their heads' places (Linear::RunSegments), with no
// row-major projections to copy from.
bool MultiHeadAttention::Impl::ProjectsIntoHeads(const AttentionInputs& in, int64_t kv_rows) const {
  return weights_ == Dt::s8 && qkv_ != nullptr && in.self_attention() && kv_rows == in.num_keys &&
         !rope_.has_value();
}

void MultiHeadAttention::Impl::ProjectIntoHeads(const AttentionInputs& in, const HeadMajor& heads,
                                                Workspace& ws) const {
  const int64_t Q = in.num_queries, H = c_.num_heads;
  const int64_t G = c_.kv_heads(), p = c_.head_size(), s = heads_per_task_;
  internal::ColumnSegments segments{.width = p, .rows_per_batch = Q};
  auto* q = const_cast<char*>(heads.q);
  auto* k = const_cast<char*>(heads.k);
  auto* v = const_cast<char*>(heads.v);
  const int64_t asz = static_cast<int64_t>(SizeOf(act_));
  // Query head h = hs * s + u: row i * s + u of task group hs (HeadMajor).
  for (int64_t h = 0; h < H; ++h) {
    segments.segments.push_back({.data = q + ((h / s) * Q * s + h % s) * p * asz,
                                 .row_stride = s * p,
                                 .batch_stride = H * Q * p});
  }
  for (char* base : {k, v}) {
    for (int64_t g = 0; g < G; ++g) {
      segments.segments.push_back({.data = base + g * heads.kv_stride * p * asz,
                                   .row_stride = p,
                                   .batch_stride = G * heads.kv_stride * p});
    }
  }
  qkv_->RunSegments(*ws.stream, ws.bindings, in.batch * Q, in.queries, c_.query_size, segments,
                    act_);
}

bool MultiHeadAttention::Impl::HeadColumnsModel() const {
  return qkv_ != nullptr && weights_ != Dt::s8 && !rope_.has_value();
}

bool MultiHeadAttention::Impl::ProjectsHeadColumns(const AttentionInputs& in) const {
  return HeadColumnsModel() && in.self_attention() && in.num_queries >= kMinHeadColumnQueries;
}

absl::Status MultiHeadAttention::Impl::ProjectHeadColumns(const AttentionInputs& in,
                                                          const HeadMajor& heads, int threads,
                                                          Workspace& ws) const {
  const int64_t B = in.batch, Q = in.num_queries, H = c_.num_heads, d = c_.query_size;
  const int64_t G = c_.kv_heads(), E = c_.num_hiddens, Ekv = c_.kv_hiddens(), p = c_.head_size();
  const int64_t s = heads_per_task_;  // query heads interleaved per task (HeadMajor)
  const int64_t asz = static_cast<int64_t>(SizeOf(act_));
  const auto* xq = static_cast<const char*>(AsProjectionInput(in.queries, B * Q * d, ws.xq));
  const int64_t chunks = (Q + kHeadColumnRows - 1) / kHeadColumnRows, segments = H + 2 * G;
  // Task order: a chunk's heads one after another, so that its rows of x stay in cache.
  return internal::RunTasks(
      B * chunks * segments, threads, ws, [&](int64_t t, dnnl::stream& stream, TaskScratch& scr) {
        const int64_t seg = t % segments, c = t / segments % chunks, b = t / segments / chunks;
        const int64_t i0 = c * kHeadColumnRows;
        // Key/value rows past heads.kv_rows, which no query sees, are not projected.
        const int64_t rows = std::min(kHeadColumnRows, (seg < H ? Q : heads.kv_rows) - i0);
        if (rows <= 0) return;
        char* dst = nullptr;
        int64_t ld = p, n0 = 0;
        if (seg < H) {  // query head h = hs s + u: row i s + u of task group hs
          dst = const_cast<char*>(heads.q) +
                (((b * (H / s) + seg / s) * Q + i0) * s + seg % s) * p * asz;
          ld = s * p;
          n0 = seg * p;
        } else {
          const bool key = seg < H + G;
          const int64_t g = key ? seg - H : seg - H - G;
          dst = const_cast<char*>(key ? heads.k : heads.v) +
                ((b * G + g) * heads.kv_stride + i0) * p * asz;
          n0 = (key ? E : E + Ekv) + g * p;
        }
        qkv_->RunColumnBlock(stream, scr.bindings, rows, {xq + (b * Q + i0) * d * SizeOf(in_), d},
                             {dst, ld}, act_, n0, p);
      });
}

absl::Status MultiHeadAttention::Impl::PreBlockKv(const AttentionInputs& in, HeadMajor& heads,
                                                  int threads, Workspace& ws) const {
  const int64_t G = c_.kv_heads(), p = c_.head_size(), kb = o_.key_block;
  const int64_t ld = FullBlockKeys();
  int64_t blocks = 0;  // full blocks: [m kb, m kb + ld) within the head's kv_stride rows
  while (blocks * kb < heads.kv_rows && blocks * kb + ld <= heads.kv_stride) ++blocks;
  const int64_t readers = QueryBlocks(in.num_queries) * (c_.num_heads / G / heads_per_task_);
  if (c_.scoring != Scoring::kDotProduct || blocks == 0 || readers < kMinBlockReaders) {
    return absl::OkStatus();
  }
  const KvReorders& r = BlockReorders();
  // Only layouts without padding: binding a padded one (set_data_handle) writes zeros
  // into its padding, which tasks on other threads would be reading.
  if (r.k_dst.get_size() != r.k_src.get_size()) return absl::OkStatus();
  BlockedKv& kv = heads.blocked;
  const int64_t n = in.batch * G * blocks;
  kv.blocks = blocks;
  kv.ld = ld;
  kv.k_md = r.k_dst;
  kv.k_bytes = r.k_dst.get_size();
  const bool values = act_ == Dt::bf16 && r.v_dst.get_size() == r.v_src.get_size();
  if (values) {
    kv.v_md = r.v_dst;
    kv.v_bytes = r.v_dst.get_size();
  }
  Grow(ws.blocked, n * (kv.k_bytes + kv.v_bytes));
  char* const kdst = ws.blocked.data();
  char* const vdst = kdst + n * kv.k_bytes;
  kv.k = kdst;
  kv.v = values ? vdst : nullptr;
  const size_t row_bytes = p * SizeOf(act_);
  return internal::RunTasks(
      values ? 2 * n : n, threads, ws, [&](int64_t t, dnnl::stream& stream, TaskScratch&) {
        const bool v = t >= n;
        const int64_t i = v ? t - n : t;  // block i % blocks of head (b G + g) = i / blocks
        const char* src = (v ? heads.v : heads.k) +
                          ((i / blocks) * heads.kv_stride + (i % blocks) * kb) * row_bytes;
        memory from(v ? r.v_src : r.k_src, internal::CpuEngine(), const_cast<char*>(src));
        memory to(v ? r.v_dst : r.k_dst, internal::CpuEngine(),
                  v ? vdst + i * kv.v_bytes : kdst + i * kv.k_bytes);
        (v ? r.v : r.k).execute(stream, from, to);
      });
}

// Fills `heads` from the row-major projections; a rotary model's queries and keys are
// rotated to their positions on the way (key j at j, query i at K - Q + i).
void MultiHeadAttention::Impl::RepackHeadMajor(const AttentionInputs& in, const Projections& proj,
                                               const HeadMajor& heads, int threads) const {
  const int64_t B = in.batch, rows = B * std::max(in.num_queries, heads.kv_rows);
  const std::shared_ptr<const internal::RotaryTable> table =
      rope_ ? rope_->Table(in.num_keys) : nullptr;
  // Tiny problems run our loops on the calling thread: a fork/join costs more than
  // the work.
  const bool parallel_repack =
      B * (in.num_queries * c_.num_hiddens + 2 * heads.kv_rows * c_.kv_hiddens()) *
          static_cast<int64_t>(SizeOf(act_)) >=
      kParallelBytes;
  // Serial work runs outside any OpenMP construct: a one-thread team between the
  // full teams of oneDNN's regions makes libgomp re-dock its pool, which is slow to
  // wake again on a busy machine.
  if (parallel_repack) {
#pragma omp parallel num_threads(threads)
    {
      const int64_t me = omp_get_thread_num(), n = omp_get_num_threads();
      RepackRows(in, proj, heads, table.get(), rows * me / n, rows * (me + 1) / n, 0,
                 c_.kv_heads());
    }
  } else {
    RepackRows(in, proj, heads, table.get(), 0, rows, 0, c_.kv_heads());
  }
}

void MultiHeadAttention::Impl::RepackRows(const AttentionInputs& in, const Projections& proj,
                                          const HeadMajor& heads,
                                          const internal::RotaryTable* table, int64_t first,
                                          int64_t last, int64_t g0, int64_t g1) const {
  const int64_t Q = in.num_queries, H = c_.num_heads;
  const int64_t G = c_.kv_heads(), p = c_.head_size();
  const int64_t s = heads_per_task_;  // query heads interleaved per task (HeadMajor)
  const size_t asz = SizeOf(act_);
  const int64_t kv_rows = heads.kv_rows, kv_stride = heads.kv_stride;
  char* qh = const_cast<char*>(heads.q);
  char* kh = const_cast<char*>(heads.k);
  char* vh = const_cast<char*>(heads.v);
  const int64_t pb = p * asz;
  const int64_t rows_per_batch = std::max(Q, kv_rows);
  const int64_t q_position = in.num_keys - Q;  // of query 0
  auto row = [asz](const StridedOperand<const char>& x, int64_t b, int64_t i) {
    return x.data + (b * x.batch_stride + i * x.row_stride) * asz;
  };
  // One head's p features from src to dst, rotated to `position` (a rotary model's).
  auto copy = [&](const char* src, char* dst, int64_t position) {
    if (act_ == Dt::f32) {
      rope_->Apply(reinterpret_cast<const float*>(src), reinterpret_cast<float*>(dst), p, *table,
                   position);
    } else {
      rope_->Apply(reinterpret_cast<const uint16_t*>(src), reinterpret_cast<uint16_t*>(dst), p,
                   *table, position);
    }
  };
  for (int64_t r = first; r < last; ++r) {
    const int64_t b = r / rows_per_batch, i = r % rows_per_batch;
    if (i < Q) {
      // Query head h = hs * s + u goes to row i * s + u of task group hs.
      const char* src = row(proj.q, b, i);
      for (int64_t hs = g0 * (H / G) / s, h = hs * s; hs < g1 * (H / G) / s; ++hs) {
        char* dst = qh + ((b * (H / s) + hs) * Q + i) * s * pb;
        for (int64_t u = 0; u < s; ++u, ++h) {
          if (table == nullptr) {
            std::memcpy(dst + u * pb, src + h * pb, pb);
          } else {
            copy(src + h * pb, dst + u * pb, q_position + i);
          }
        }
      }
    }
    if (i < kv_rows) {
      const char* ksrc = row(proj.k, b, i);
      const char* vsrc = row(proj.v, b, i);
      for (int64_t g = g0; g < g1; ++g) {
        char* kdst = kh + ((b * G + g) * kv_stride + i) * pb;
        if (table == nullptr) {
          std::memcpy(kdst, ksrc + g * pb, pb);
        } else {
          copy(ksrc + g * pb, kdst, i);
        }
        std::memcpy(vh + ((b * G + g) * kv_stride + i) * pb, vsrc + g * pb, pb);
      }
    }
  }
}

MultiHeadAttention::Impl::TaskInputs MultiHeadAttention::Impl::AttentionTasks(
    const AttentionInputs& in, const HeadMajor& heads, const ScoringProjections& scoring,
    const KeyLimits& limits, float* attention, float* lse, Workspace& ws) const {
  Grow(ws.ctx, in.batch * in.num_queries * c_.num_hiddens * sizeof(float));
  const int64_t q_blocks = QueryBlocks(in.num_queries);
  return {.in = in,
          .heads = heads,
          .scoring = scoring,
          .limits = limits.per_query,
          .ctx = reinterpret_cast<float*>(ws.ctx.data()),
          .attention = attention,
          .lse = lse,
          .q_blocks = q_blocks,
          .tasks = in.batch * (c_.num_heads / heads_per_task_) * q_blocks};
}

// One task per (batch row, head, query block), key blocks inside.
absl::Status MultiHeadAttention::Impl::RunAttentionTasks(
    const AttentionInputs& in, const HeadMajor& heads, const ScoringProjections& scoring,
    const KeyLimits& limits, float* attention, float* lse, int threads, Workspace& ws) const {
  const TaskInputs inputs = AttentionTasks(in, heads, scoring, limits, attention, lse, ws);
  return internal::RunTasks(inputs.tasks, threads, ws,
                            [&](int64_t t, dnnl::stream& stream, TaskScratch& scratch) {
                              AttendTask(TaskAt(inputs, t), stream, scratch);
                            });
}

void MultiHeadAttention::Impl::ProjectOutput(const AttentionInputs& in, float* output,
                                             Workspace& ws) const {
  const int64_t rows = in.batch * in.num_queries, E = c_.num_hiddens;
  const float* ctx = reinterpret_cast<const float*>(ws.ctx.data());
  if (c_.attention_only()) {
    std::copy_n(ctx, rows * E, output);
    return;
  }
  const void* ctx_in = AsProjectionInput(ctx, rows * E, ws.xq);  // the queries' copy is spent
  o_lin_->Run(*ws.stream, ws.bindings, 1, rows, {ctx_in, E}, {output, E}, Dt::f32);
}

absl::Status MultiHeadAttention::Impl::Forward(const AttentionInputs& in, float* output,
                                               float* attention, int max_threads,
                                               float* lse) const {
  const int threads = ThreadsFor(in, max_threads);
  const internal::ThreadScope thread_scope(threads);
  const KeyLimits limits = ComputeKeyLimits(in, rope_.has_value());

  internal::WorkspaceLease lease(*workspaces_);
  Workspace& ws = *lease;
  if (threads > 1 && RunsAsOneRegion(in, limits.kv_rows)) {
    return ForwardOneRegion(in, limits, output, attention, lse, threads, ws);
  }
  if (!ws.stream) ws.stream.emplace(internal::CpuEngine());
  HeadMajor heads = LayOutHeads(in, limits.kv_rows, ws);
  if (ProjectsIntoHeads(in, limits.kv_rows)) {
    ProjectIntoHeads(in, heads, ws);
  } else if (ProjectsHeadColumns(in)) {
    MHA_RETURN_IF_ERROR(ProjectHeadColumns(in, heads, threads, ws));
  } else {
    RepackHeadMajor(in, Project(in, limits.kv_rows, ws), heads, threads);
  }
  ScoringProjections scoring;
  if (c_.scoring == Scoring::kAdditive) {
    MHA_RETURN_IF_ERROR(ProjectScoring(in, heads, threads, ws, scoring));
  }
  MHA_RETURN_IF_ERROR(PreBlockKv(in, heads, threads, ws));
  MHA_RETURN_IF_ERROR(RunAttentionTasks(in, heads, scoring, limits, attention, lse, threads, ws));
  ProjectOutput(in, output, ws);
  ws.stream->wait();
  return absl::OkStatus();
}

bool MultiHeadAttention::Impl::RunsAsOneRegion(const AttentionInputs& in, int64_t kv_rows) const {
  return qkv_ != nullptr && weights_ != Dt::s8 && c_.scoring == Scoring::kDotProduct &&
         in.self_attention() && kv_rows == in.num_keys &&
         MultiHeadAttention::Flops(c_, in.batch, in.num_queries, in.num_keys) <
             internal::kOneRegionMaxFlops;
}

absl::Status MultiHeadAttention::Impl::ForwardOneRegion(const AttentionInputs& in,
                                                        const KeyLimits& limits, float* output,
                                                        float* attention, float* lse, int threads,
                                                        Workspace& ws) const {
  const int64_t B = in.batch, Q = in.num_queries, rows = B * Q, d = c_.query_size;
  const int64_t E = c_.num_hiddens, Ekv = c_.kv_hiddens(), ld = E + 2 * Ekv;
  const size_t asz = SizeOf(act_), isz = SizeOf(in_);
  // Everything a thread writes is sized here, before the region.
  const void* xq = AsProjectionInput(in.queries, rows * d, ws.xq);
  Grow(ws.proj, rows * ld * asz);
  if (in_ != Dt::f32) Grow(ws.xv, rows * E * isz);  // W_o's input in in_
  const HeadMajor heads = LayOutHeads(in, limits.kv_rows, ws);
  const std::shared_ptr<const internal::RotaryTable> table =
      rope_ ? rope_->Table(in.num_keys) : nullptr;
  char* proj = ws.proj.data();
  const Projections projections{.q = {proj, ld, Q * ld},
                                .k = {proj + E * asz, ld, Q * ld},
                                .v = {proj + (E + Ekv) * asz, ld, Q * ld}};
  const ScoringProjections no_scoring;  // dot-product scoring
  const TaskInputs inputs = AttentionTasks(in, heads, no_scoring, limits, attention, lse, ws);
  float* const ctx = inputs.ctx;
  const int64_t q_blocks = inputs.q_blocks, group = c_.num_heads / c_.kv_heads();
  const int64_t s = heads_per_task_, tasks_per_row = c_.num_heads / s;
  // Each thread owns the key/value heads [g0, g1) and their query heads: it projects
  // their columns of Q, K and V for every row, lays them out and attends them, all
  // in its own core's cache, with no barrier on the way.
  auto heads_of_thread = [&](int me, int n, TaskScratch& scratch) {
    const auto [g0, g1, qkv_columns] = OneRegionHeadsOf(c_, me, n);
    if (g1 == g0) return;
    dnnl::stream& st = scratch.Stream();
    for (const auto& [c0, c1] : qkv_columns) {
      qkv_->RunColumns(st, scratch.bindings, rows, {xq, d}, {proj, ld}, act_, c0, c1);
    }
    RepackRows(in, projections, heads, table.get(), 0, rows, g0, g1);
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t hs = g0 * group / s; hs < g1 * group / s; ++hs) {
        for (int64_t qb = 0; qb < q_blocks; ++qb) {
          AttendTask(TaskAt(inputs, (b * tasks_per_row + hs) * q_blocks + qb), st, scratch);
        }
      }
    }
  };
  auto convert = [&](int me, int n, TaskScratch&) {  // W_o's input rows, for a bf16 model
    const int64_t r0 = rows * me / n, r1 = rows * (me + 1) / n;
    kernels::ToBf16(ctx + r0 * E, reinterpret_cast<uint16_t*>(ws.xv.data()) + r0 * E,
                    (r1 - r0) * E);
  };
  auto output_columns = [&](int me, int n, TaskScratch& scratch) {
    const auto [c0, c1] = OneRegionColumns(E, me, n);
    const void* src = in_ == Dt::f32 ? static_cast<const void*>(ctx) : ws.xv.data();
    if (c1 > c0) {
      o_lin_->RunColumns(scratch.Stream(), scratch.bindings, rows, {src, E}, {output, E}, Dt::f32,
                         c0, c1);
    }
  };
  if (in_ == Dt::f32) return internal::RunPhases(threads, ws, {heads_of_thread, output_columns});
  return internal::RunPhases(threads, ws, {heads_of_thread, convert, output_columns});
}

int MultiHeadAttention::Impl::Prepare(int64_t max_rows, int64_t max_keys, ThreadRule rule) const {
  // The most threads a call gets (within OMP_THREAD_LIMIT, as ThreadsFor counts them).
  const int most =
      internal::ThreadsForFlops(std::numeric_limits<double>::infinity(), o_.num_threads, 0);
  const int built = c_.attention_only() ? 0 : PrepareProjections(max_rows, rule, most);
  return built + PrepareAttentionBlocks(max_keys, most);
}

int MultiHeadAttention::Impl::PrepareProjections(int64_t max_rows, ThreadRule rule,
                                                 int most) const {
  int built = 0;
  const int64_t E = c_.num_hiddens, Ekv = c_.kv_hiddens(), ld_self = E + 2 * Ekv;
  const int64_t dq = c_.query_size, dk = c_.key_size, dv = c_.value_size;
  // A call's thread count is part of its primitives' keys (internal::PlanThreads):
  // calls run on one thread per kFlopsPerThread of work, up to `most`, and a merged
  // call on no more than its largest request would use alone, so a chunk of any
  // size may run on one thread as on all.
  for (const int threads : most > 1 ? std::vector<int>{1, most} : std::vector<int>{1}) {
    const internal::ThreadScope scope(threads);
    auto prepare = [&](const std::unique_ptr<internal::Linear>& w, int64_t src_ld, int64_t dst_ld,
                       Dt dst_dt) {
      if (w != nullptr) built += w->Prepare(max_rows, src_ld, dst_ld, dst_dt);
    };
    if (c_.SupportsSelfAttention()) {  // ProjectSelf
      prepare(qkv_, dq, ld_self, act_);
      prepare(q_, dq, ld_self, act_);
      prepare(kv_, dq, ld_self, act_);
    }
    prepare(q_, dq, E, act_);  // ProjectCross
    prepare(kv_, dk, 2 * Ekv, act_);
    prepare(k_, dk, Ekv, act_);
    prepare(v_, dv, Ekv, act_);
    prepare(o_lin_, E, E, Dt::f32);  // ProjectOutput
    if (threads == 1 && HeadColumnsModel() && c_.SupportsSelfAttention()) {
      // ProjectHeadColumns' tasks: a primitive per row chunk, for every head or each.
      const int64_t p = c_.head_size();
      built += qkv_->PrepareColumnBlocks(std::min(max_rows, kHeadColumnRows), dq, p, act_);
    }
    if (rule == ThreadRule::kAlone && threads == 1 && most > 1 && qkv_ != nullptr &&
        weights_ != Dt::s8 && c_.scoring == Scoring::kDotProduct) {
      // ForwardOneRegion's column shares, on teams of 2 to `most`.
      // A one-region call has fewer rows than kOneRegionMaxFlops over a row's FLOPs.
      const auto region_rows = static_cast<int64_t>(internal::kOneRegionMaxFlops /
                                                    MultiHeadAttention::Flops(c_, 1, 1, 1));
      const int64_t rows = std::min(max_rows, region_rows);
      auto prepare_share = [&](int me, int team) {
        for (const auto& [c0, c1] : OneRegionHeadsOf(c_, me, team).qkv_columns) {
          if (c1 > c0) built += qkv_->Prepare(rows, dq, ld_self, act_, c0, c1);
        }
        const auto [o0, o1] = OneRegionColumns(E, me, team);
        if (o1 > o0) built += o_lin_->Prepare(rows, E, E, Dt::f32, o0, o1);
      };
      for (int team = 2; team <= most; ++team) {
        for (int me = 0; me < team; ++me) prepare_share(me, team);
      }
    }
  }
  return built;
}

// The attention blocks, on the threads that run tasks (a task's primitives are
// planned for one thread, internal::PlanThreads inside a parallel region).
int MultiHeadAttention::Impl::PrepareAttentionBlocks(int64_t max_keys, int most) const {
  const int64_t row_top = RoundUp(o_.query_block, kQueryPad);
  const int64_t key_top = RoundUp(std::min(o_.key_block, max_keys), kKeyPad);
  const bool accumulate = max_keys > o_.key_block;
  // kind: 0 score, 1 context, 2 context +=; 3-5 the same reading PreBlockKv's blocks.
  std::vector<std::array<int64_t, 3>> blocks;
  const int64_t full = FullBlockKeys();  // PreBlockKv's blocks
  const bool dot = c_.scoring == Scoring::kDotProduct;
  const bool pre_blocks = dot && max_keys >= full;
  for (int64_t rows = kQueryPad; rows <= row_top; rows += kQueryPad) {
    for (int64_t ld = kKeyPad; ld <= key_top; ld += kKeyPad) {
      if (InLoops(rows, ld)) continue;  // every block of this size or less
      if (dot) blocks.push_back({0, rows, ld});
      blocks.push_back({1, rows, ld});
      if (accumulate) blocks.push_back({2, rows, ld});
    }
    if (pre_blocks && !InLoops(rows, full)) {
      blocks.push_back({3, rows, full});
      if (act_ == Dt::bf16) blocks.push_back({4, rows, full});
      if (act_ == Dt::bf16 && accumulate) blocks.push_back({5, rows, full});
    }
  }
  const int64_t before = internal::MatmulsMade();
  auto make = [&](const std::array<int64_t, 3>& b) {
    const bool blocked = b[0] >= 3;
    const int64_t kind = b[0] % 3;
    if (kind == 0) {
      ScorePrimitive(b[1], b[2], blocked);
    } else {
      ContextPrimitive(b[1], b[2], kind == 2, blocked);
    }
  };
  if (most > 1) {
    const internal::ThreadScope scope(most);
#pragma omp parallel for num_threads(most) schedule(dynamic)
    for (size_t i = 0; i < blocks.size(); ++i) make(blocks[i]);
  } else {
    const internal::ThreadScope scope(1);
    for (const auto& b : blocks) make(b);
  }
  if (pre_blocks) BlockReorders();
  return static_cast<int>(internal::MatmulsMade() - before);
}

}  // namespace mha::core

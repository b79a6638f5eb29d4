#include "core/attention.h"

#include <omp.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "core/kernels.h"
#include "core/status_macros.h"
#include "oneapi/dnnl/dnnl.hpp"

namespace mha::core {
namespace {

using dnnl::memory;
using Dt = memory::data_type;

dnnl::engine& CpuEngine() {
  static dnnl::engine* engine = new dnnl::engine(dnnl::engine::kind::cpu, 0);
  return *engine;
}

size_t SizeOf(Dt dt) { return dt == Dt::bf16 ? 2 : 4; }

// Primitive caches are bounded: when one grows past this, it starts over. Shapes
// repeat in serving (the batcher pads to few sizes), so this almost never fires.
constexpr size_t kMaxCachedPrimitives = 1024;

// A weight matrix W (n, k) applied as dst = src W^T (+ b) with a oneDNN matmul.
// Primitives are built once per (rows, strides, dtype) and cached; the weights are
// reordered once into each blocked layout a primitive asks for. Thread-safe.
class Linear {
 public:
  Linear(const float* w, const float* b, int64_t n, int64_t k, Dt dt) : n_(n), k_(k), dt_(dt) {
    const size_t count = static_cast<size_t>(n * k);
    plain_.resize(count * SizeOf(dt));
    if (dt == Dt::bf16) {
      kernels::ToBf16(w, reinterpret_cast<uint16_t*>(plain_.data()), static_cast<int64_t>(count));
    } else {
      std::memcpy(plain_.data(), w, count * sizeof(float));
    }
    if (b != nullptr) bias_.assign(b, b + n);
  }

  // dst[bi, r, :] = src[bi, r, :] W^T + b for bi < batch, r < rows. src has dtype
  // dt_ with row stride src_ld and batch stride src_bs; dst has dtype dst_dt.
  void Run(dnnl::stream& stream, int64_t batch, int64_t rows, const void* src, int64_t src_ld,
           int64_t src_bs, void* dst, Dt dst_dt, int64_t dst_ld, int64_t dst_bs) const {
    const std::array<int64_t, 7> key{batch, rows, src_ld, src_bs, dst_ld, dst_bs,
                                     static_cast<int64_t>(dst_dt)};
    const std::shared_ptr<const Entry> entry = Lookup(key);
    const Entry& e = *entry;
    const dnnl::engine& eng = CpuEngine();
    memory src_m(e.src_md, eng, const_cast<void*>(src));
    memory dst_m(e.dst_md, eng, dst);
    std::unordered_map<int, memory> args{
        {DNNL_ARG_SRC, src_m}, {DNNL_ARG_WEIGHTS, e.weights}, {DNNL_ARG_DST, dst_m}};
    if (!bias_.empty()) {
      args.emplace(DNNL_ARG_BIAS, memory(e.bias_md, eng, const_cast<float*>(bias_.data())));
    }
    e.prim.execute(stream, args);
  }

 private:
  struct Entry {
    dnnl::matmul prim;
    memory::desc src_md, dst_md, bias_md;
    memory weights;
  };

  // Entries are shared so that a cache reset never frees one a caller still runs.
  std::shared_ptr<const Entry> Lookup(const std::array<int64_t, 7>& key) const {
    absl::MutexLock lock(&mu_);
    auto it = cache_.find(key);
    if (it != cache_.end()) return it->second;
    if (cache_.size() >= kMaxCachedPrimitives) cache_.clear();
    const auto [batch, rows, src_ld, src_bs, dst_ld, dst_bs, dst_dt] = key;
    auto e = std::make_shared<Entry>();
    const bool batched = batch > 1;
    const memory::dims w_dims = batched ? memory::dims{1, k_, n_} : memory::dims{k_, n_};
    const memory::dims w_strides = batched ? memory::dims{n_ * k_, 1, k_} : memory::dims{1, k_};
    if (batched) {
      e->src_md = memory::desc({batch, rows, k_}, dt_, {src_bs, src_ld, 1});
      e->dst_md = memory::desc({batch, rows, n_}, static_cast<Dt>(dst_dt), {dst_bs, dst_ld, 1});
      if (!bias_.empty()) e->bias_md = memory::desc({1, 1, n_}, Dt::f32, {n_, n_, 1});
    } else {
      e->src_md = memory::desc({rows, k_}, dt_, {src_ld, 1});
      e->dst_md = memory::desc({rows, n_}, static_cast<Dt>(dst_dt), {dst_ld, 1});
      if (!bias_.empty()) e->bias_md = memory::desc({1, n_}, Dt::f32, {n_, 1});
    }
    const memory::desc w_any(w_dims, dt_, memory::format_tag::any);
    const dnnl::engine& eng = CpuEngine();
    dnnl::matmul::primitive_desc pd(
        dnnl::matmul::desc(e->src_md, w_any, e->bias_md, e->dst_md), eng);
    e->prim = dnnl::matmul(pd);
    e->weights = PackedWeights(pd.weights_desc(), memory::desc(w_dims, dt_, w_strides));
    cache_.emplace(key, e);
    return e;
  }

  // The weights reordered into `want`, made once per distinct layout.
  memory PackedWeights(const memory::desc& want, const memory::desc& plain) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (const auto& [md, mem] : packed_) {
      if (md == want) return mem;
    }
    const dnnl::engine& eng = CpuEngine();
    memory src(plain, eng, const_cast<char*>(plain_.data()));
    memory dst(want, eng);
    dnnl::stream stream(eng);
    dnnl::reorder(src, dst).execute(stream, src, dst);
    stream.wait();
    packed_.emplace_back(want, dst);
    return dst;
  }

  const int64_t n_, k_;
  const Dt dt_;
  std::vector<char> plain_;  // W (n, k) row-major in dt_
  std::vector<float> bias_;
  mutable absl::Mutex mu_;
  mutable absl::flat_hash_map<std::array<int64_t, 7>, std::shared_ptr<const Entry>> cache_
      ABSL_GUARDED_BY(mu_);
  mutable std::vector<std::pair<memory::desc, memory>> packed_ ABSL_GUARDED_BY(mu_);
};

std::vector<float> Stack(std::initializer_list<const std::vector<float>*> parts) {
  std::vector<float> out;
  for (const auto* p : parts) out.insert(out.end(), p->begin(), p->end());
  return out;
}

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

std::string DnnlMessage(const dnnl::error& e) {
  return absl::StrCat("oneDNN: ", e.what(), " (status ", static_cast<int>(e.status), ")");
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
    o_lin_ = std::make_unique<Linear>(w.w_o.data(), bias(w.b_o), e, e, act_);
    if (c.key_size == c.value_size) {
      const auto kv_w = Stack({&w.w_k, &w.w_v});
      const auto kv_b = Stack({&w.b_k, &w.b_v});
      kv_ = std::make_unique<Linear>(kv_w.data(), c.bias ? kv_b.data() : nullptr, 2 * e,
                                     c.key_size, act_);
    }
    if (c.SupportsSelfAttention()) {
      const auto qkv_w = Stack({&w.w_q, &w.w_k, &w.w_v});
      const auto qkv_b = Stack({&w.b_q, &w.b_k, &w.b_v});
      qkv_ = std::make_unique<Linear>(qkv_w.data(), c.bias ? qkv_b.data() : nullptr, 3 * e,
                                      c.query_size, act_);
    }
  }

  absl::Status Forward(const AttentionInputs& in, float* output, float* attention) const;

 private:
  struct Projected {
    const char* q;
    const char* k;
    const char* v;
    int64_t ldq, ldk, ldv;  // row strides in elements
  };

  // dst (mq, nk) f32 = src (mq, p) wei^T; src, wei row strides given (elements).
  dnnl::matmul ScorePrimitive(int64_t mq, int64_t nk, int64_t ldq, int64_t ldk,
                                     int64_t ld_s) const;
  // dst (mq, p) f32 (+)= P (mq, nk) V (nk, p).
  dnnl::matmul ContextPrimitive(int64_t mq, int64_t nk, int64_t ld_p, int64_t ldv,
                                       bool accumulate) const;
  dnnl::matmul CachedMatmul(const std::array<int64_t, 8>& key,
                                   const dnnl::matmul::desc& desc,
                                   const dnnl::primitive_attr& attr) const;

  void AttendTask(int64_t b, int64_t h, int64_t qb, const AttentionInputs& in,
                  const Projected& pr, const std::vector<int32_t>& limits, float* ctx,
                  float* attention, dnnl::stream& stream, std::vector<float>& s_buf,
                  std::vector<uint16_t>& p_buf) const;

  const ModelConfig c_;
  const Options o_;
  const Dt act_;
  std::unique_ptr<Linear> q_, k_, v_, kv_, qkv_, o_lin_;
  mutable absl::Mutex mu_;
  mutable absl::flat_hash_map<std::array<int64_t, 8>, dnnl::matmul> attn_cache_
      ABSL_GUARDED_BY(mu_);
};

dnnl::matmul MultiHeadAttention::Impl::CachedMatmul(
    const std::array<int64_t, 8>& key, const dnnl::matmul::desc& desc,
    const dnnl::primitive_attr& attr) const {
  absl::MutexLock lock(&mu_);
  auto it = attn_cache_.find(key);
  if (it != attn_cache_.end()) return it->second;
  if (attn_cache_.size() >= kMaxCachedPrimitives) attn_cache_.clear();
  dnnl::matmul prim(dnnl::matmul::primitive_desc(desc, attr, CpuEngine()));
  attn_cache_.emplace(key, prim);
  return prim;  // a handle: copies share the primitive
}

dnnl::matmul MultiHeadAttention::Impl::ScorePrimitive(int64_t mq, int64_t nk, int64_t ldq,
                                                             int64_t ldk, int64_t ld_s) const {
  const int64_t p = c_.head_size();
  const std::array<int64_t, 8> key{0, mq, nk, ldq, ldk, ld_s, 0, 0};
  dnnl::primitive_attr attr;
  attr.set_output_scales(0, {1.0f / std::sqrt(static_cast<float>(p))});
  return CachedMatmul(key,
                      dnnl::matmul::desc(memory::desc({mq, p}, act_, {ldq, 1}),
                                         memory::desc({p, nk}, act_, {1, ldk}),
                                         memory::desc({mq, nk}, Dt::f32, {ld_s, 1})),
                      attr);
}

dnnl::matmul MultiHeadAttention::Impl::ContextPrimitive(int64_t mq, int64_t nk,
                                                               int64_t ld_p, int64_t ldv,
                                                               bool accumulate) const {
  const int64_t p = c_.head_size();
  const std::array<int64_t, 8> key{1, mq, nk, ld_p, ldv, accumulate, 0, 0};
  dnnl::primitive_attr attr;
  if (accumulate) {
    dnnl::post_ops ops;
    ops.append_sum(1.0f);
    attr.set_post_ops(ops);
  }
  return CachedMatmul(key,
                      dnnl::matmul::desc(memory::desc({mq, nk}, act_, {ld_p, 1}),
                                         memory::desc({nk, p}, act_, {ldv, 1}),
                                         memory::desc({mq, p}, Dt::f32, {c_.num_hiddens, 1})),
                      attr);
}

void MultiHeadAttention::Impl::AttendTask(int64_t b, int64_t h, int64_t qb,
                                          const AttentionInputs& in, const Projected& pr,
                                          const std::vector<int32_t>& limits, float* ctx,
                                          float* attention, dnnl::stream& stream,
                                          std::vector<float>& s_buf,
                                          std::vector<uint16_t>& p_buf) const {
  const int64_t Q = in.num_queries, K = in.num_keys, H = c_.num_heads, E = c_.num_hiddens;
  const int64_t p = c_.head_size();
  const size_t asz = SizeOf(act_);
  const int64_t i0 = qb * o_.query_block;
  const int64_t mq = std::min(o_.query_block, Q - i0);
  const int32_t* lim = &limits[b * Q + i0];
  const char* q = pr.q + ((b * Q + i0) * pr.ldq + h * p) * asz;
  const char* k = pr.k + (b * K * pr.ldk + h * p) * asz;
  const char* v = pr.v + (b * K * pr.ldv + h * p) * asz;
  float* c = ctx + (b * Q + i0) * E + h * p;
  float* a = attention == nullptr ? nullptr : attention + ((b * H + h) * Q + i0) * K;
  const dnnl::engine& eng = CpuEngine();
  const float factor = in.head_mask.empty() ? 1.0f : in.head_mask[h];
  const int64_t max_lim = *std::max_element(lim, lim + mq);

  auto zero_rows = [&] {
    for (int64_t i = 0; i < mq; ++i) std::fill_n(c + i * E, p, 0.0f);
    if (a != nullptr) std::fill_n(a, mq * K, 0.0f);
  };
  if (max_lim == 0 || (factor == 0.0f && a == nullptr)) return zero_rows();

  auto run = [&](const dnnl::matmul& prim, const memory::desc& src_md, const void* src,
                 const memory::desc& wei_md, const void* wei, const memory::desc& dst_md,
                 void* dst) {
    prim.execute(stream, {{DNNL_ARG_SRC, memory(src_md, eng, const_cast<void*>(src))},
                          {DNNL_ARG_WEIGHTS, memory(wei_md, eng, const_cast<void*>(wei))},
                          {DNNL_ARG_DST, memory(dst_md, eng, dst)}});
  };
  // One key block [j0, j0 + nk): scores into s (row stride ld_s), probabilities
  // into P (f32 in place, or bf16 in p_buf), then ctx (+)= P V.
  auto block = [&](int64_t j0, int64_t nk, float* s, int64_t ld_s, bool first, float* m,
                   float* l, bool exact) {
    run(ScorePrimitive(mq, nk, pr.ldq, pr.ldk, ld_s), memory::desc({mq, p}, act_, {pr.ldq, 1}),
        q, memory::desc({p, nk}, act_, {1, pr.ldk}), k + j0 * pr.ldk * asz,
        memory::desc({mq, nk}, Dt::f32, {ld_s, 1}), s);
    const bool bf16 = act_ == Dt::bf16;
    const int64_t ld_p = bf16 ? nk : ld_s;
    if (bf16 && p_buf.size() < static_cast<size_t>(mq * nk)) p_buf.resize(mq * nk);
    for (int64_t i = 0; i < mq; ++i) {
      float* srow = s + i * ld_s;
      uint16_t* prow = bf16 ? p_buf.data() + i * ld_p : nullptr;
      const int64_t n = std::clamp<int64_t>(lim[i] - j0, 0, nk);
      if (n == 0) {
        std::fill_n(srow, nk, 0.0f);
        if (bf16) std::fill_n(prow, nk, uint16_t{0});
        continue;
      }
      const float m_new = std::max(m[i], kernels::RowMax(srow, n));
      float sum;
      if (exact) {  // the whole row is in this block: normalise now (weights requested)
        sum = kernels::ExpSubSum(srow, m_new, srow, n);
        kernels::Scale(srow, 1.0f / sum, n);
        if (bf16) kernels::ToBf16(srow, prow, n);
        l[i] = 1.0f;
      } else {
        sum = bf16 ? kernels::ExpSubSumBf16(srow, m_new, prow, n)
                   : kernels::ExpSubSum(srow, m_new, srow, n);
        const float alpha = std::exp(m[i] - m_new);  // 0 when m[i] is -inf
        if (!first && alpha != 1.0f) kernels::Scale(c + i * E, alpha, p);
        l[i] = l[i] * alpha + sum;
      }
      m[i] = m_new;
      std::fill(srow + n, srow + nk, 0.0f);
      if (bf16) std::fill(prow + n, prow + nk, uint16_t{0});
    }
    const void* probs = bf16 ? static_cast<const void*>(p_buf.data()) : s;
    run(ContextPrimitive(mq, nk, ld_p, pr.ldv, !first),
        memory::desc({mq, nk}, act_, {ld_p, 1}), probs,
        memory::desc({nk, p}, act_, {pr.ldv, 1}), v + j0 * pr.ldv * asz,
        memory::desc({mq, p}, Dt::f32, {E, 1}), c);
  };

  float m[256], l[256];  // query_block <= 256 (checked in Create)
  std::fill_n(m, mq, -std::numeric_limits<float>::infinity());
  std::fill_n(l, mq, 0.0f);
  if (a != nullptr) {
    // Weights requested: one block over every key that any row may see, written
    // straight into the caller's (B, h, Q, K) tensor; the tail stays exactly 0.
    for (int64_t i = 0; i < mq; ++i) std::fill(a + i * K + max_lim, a + (i + 1) * K, 0.0f);
    block(0, max_lim, a, K, /*first=*/true, m, l, /*exact=*/true);
  } else {
    const int64_t bk = o_.key_block;
    if (s_buf.size() < static_cast<size_t>(mq * bk)) s_buf.resize(mq * bk);
    for (int64_t j0 = 0; j0 < max_lim; j0 += bk) {
      block(j0, std::min(bk, max_lim - j0), s_buf.data(), std::min(bk, max_lim - j0),
            /*first=*/j0 == 0, m, l, /*exact=*/false);
    }
  }
  for (int64_t i = 0; i < mq; ++i) {
    const float scale = l[i] > 0.0f ? factor / l[i] : 0.0f;
    if (scale != 1.0f) kernels::Scale(c + i * E, scale, p);
  }
}

absl::Status MultiHeadAttention::Impl::Forward(const AttentionInputs& in, float* output,
                                               float* attention) const {
  const int64_t B = in.batch, Q = in.num_queries, K = in.num_keys;
  const int64_t E = c_.num_hiddens, H = c_.num_heads;
  const size_t asz = SizeOf(act_);
  const int threads = o_.num_threads > 0 ? o_.num_threads : omp_get_max_threads();
  omp_set_num_threads(threads);  // this thread's ICV: bounds oneDNN's regions too

  // Per-query key limit: valid_lens and causal folded into one number.
  std::vector<int32_t> limits(static_cast<size_t>(B * Q));
  int64_t kv_rows = 0;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t i = 0; i < Q; ++i) {
      int64_t lim = K;
      if (in.valid_lens.size() == static_cast<size_t>(B * Q)) {
        lim = in.valid_lens[b * Q + i];
      } else if (!in.valid_lens.empty()) {
        lim = in.valid_lens[b];
      }
      if (in.causal) lim = std::min(lim, i + 1);
      limits[b * Q + i] = static_cast<int32_t>(lim);
      kv_rows = std::max(kv_rows, lim);
    }
  }

  try {
    dnnl::stream stream(CpuEngine());
    // bf16: activations are converted once, then every GEMM runs in bf16.
    std::vector<uint16_t> xq16, xk16, xv16;
    auto as_act = [&](const float* x, int64_t n, std::vector<uint16_t>& tmp) -> const void* {
      if (act_ == Dt::f32) return x;
      tmp.resize(n);
      kernels::ToBf16(x, tmp.data(), n);
      return tmp.data();
    };
    const void* xq = as_act(in.queries, B * Q * c_.query_size, xq16);

    // Projections. Key/value rows that no query can see are never projected.
    std::vector<char> qkv_buf, kv_buf;
    Projected pr{};
    if (in.self_attention()) {
      const int64_t ld = 3 * E, d = c_.query_size;
      qkv_buf.resize(B * Q * ld * asz);
      char* base = qkv_buf.data();
      if (kv_rows == K) {
        qkv_->Run(stream, 1, B * Q, xq, d, 0, base, act_, ld, 0);
      } else {
        q_->Run(stream, 1, B * Q, xq, d, 0, base, act_, ld, 0);
        if (kv_rows > 0) {
          kv_->Run(stream, B, kv_rows, xq, d, Q * d, base + E * asz, act_, ld, Q * ld);
        }
      }
      pr = {base, base + E * asz, base + 2 * E * asz, ld, ld, ld};
    } else {
      qkv_buf.resize(B * Q * E * asz);
      q_->Run(stream, 1, B * Q, xq, c_.query_size, 0, qkv_buf.data(), act_, E, 0);
      const bool fuse_kv = in.keys == in.values && kv_ != nullptr;
      const int64_t ld = fuse_kv ? 2 * E : E;
      kv_buf.resize(B * K * 2 * E * asz);
      char* kbase = kv_buf.data();
      char* vbase = fuse_kv ? kbase + E * asz : kbase + B * K * E * asz;
      // Contiguous rows run as one 2-D GEMM; a per-batch prefix as a 3-D one.
      const int64_t batch = kv_rows == K ? 1 : B;
      const int64_t rows = kv_rows == K ? B * K : kv_rows;
      if (kv_rows > 0) {
        const void* xk = as_act(in.keys, B * K * c_.key_size, xk16);
        if (fuse_kv) {
          kv_->Run(stream, batch, rows, xk, c_.key_size, K * c_.key_size, kbase, act_, ld,
                   K * ld);
        } else {
          const void* xv = as_act(in.values, B * K * c_.value_size, xv16);
          k_->Run(stream, batch, rows, xk, c_.key_size, K * c_.key_size, kbase, act_, ld,
                  K * ld);
          v_->Run(stream, batch, rows, xv, c_.value_size, K * c_.value_size, vbase, act_, ld,
                  K * ld);
        }
      }
      pr = {qkv_buf.data(), kbase, vbase, E, ld, ld};
    }

    // Attention: one task per (batch row, head, query block), key blocks inside.
    std::vector<float> ctx(static_cast<size_t>(B * Q * E));
    const int64_t q_blocks = (Q + o_.query_block - 1) / o_.query_block;
    const int64_t tasks = B * H * q_blocks;
    FirstError error;
#pragma omp parallel num_threads(static_cast<int>(std::min<int64_t>(threads, tasks)))
    {
      dnnl::stream task_stream(CpuEngine());
      std::vector<float> s_buf;
      std::vector<uint16_t> p_buf;
#pragma omp for schedule(dynamic, 1)
      for (int64_t t = 0; t < tasks; ++t) {
        if (error.failed()) continue;
        const int64_t b = t / (H * q_blocks), h = (t / q_blocks) % H, qb = t % q_blocks;
        try {
          AttendTask(b, h, qb, in, pr, limits, ctx.data(), attention, task_stream, s_buf,
                     p_buf);
        } catch (const dnnl::error& e) {
          error.Set(DnnlMessage(e));
        } catch (const std::exception& e) {
          error.Set(e.what());
        }
      }
    }
    MHA_RETURN_IF_ERROR(error.status());

    std::vector<uint16_t> ctx16;
    const void* ctx_act = as_act(ctx.data(), B * Q * E, ctx16);
    o_lin_->Run(stream, 1, B * Q, ctx_act, E, 0, output, Dt::f32, E, 0);
    stream.wait();
  } catch (const dnnl::error& e) {
    return absl::InternalError(DnnlMessage(e));
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError("out of memory in MultiHeadAttention::Forward");
  }
  return absl::OkStatus();
}

MultiHeadAttention::MultiHeadAttention(const ModelConfig& config, const Options& options,
                                       std::unique_ptr<Impl> impl)
    : config_(config), options_(options), impl_(std::move(impl)) {}

MultiHeadAttention::~MultiHeadAttention() = default;

absl::StatusOr<std::unique_ptr<MultiHeadAttention>> MultiHeadAttention::Create(
    const ModelConfig& config, const Weights& weights) {
  return Create(config, weights, Options{});
}

absl::StatusOr<std::unique_ptr<MultiHeadAttention>> MultiHeadAttention::Create(
    const ModelConfig& config, const Weights& weights, const Options& options) {
  MHA_RETURN_IF_ERROR(config.Validate());
  MHA_RETURN_IF_ERROR(weights.Validate(config));
  if (options.query_block < 1 || options.query_block > 256) {
    return absl::InvalidArgumentError("query_block: expected 1..256");
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
  const ModelConfig& c = config_;
  // Bounds keep every element count and offset comfortably inside int64.
  constexpr int64_t kMaxRows = int64_t{1} << 31;
  if (in.batch < 1) return absl::InvalidArgumentError(absl::StrCat("batch: expected >= 1, got ", in.batch));
  if (in.num_queries < 1) return absl::InvalidArgumentError(absl::StrCat("queries: expected >= 1 query, got ", in.num_queries));
  if (in.num_keys < 1) return absl::InvalidArgumentError(absl::StrCat("keys: expected >= 1 key, got ", in.num_keys));
  if (in.batch * in.num_queries > kMaxRows || in.batch * in.num_keys > kMaxRows) {
    return absl::InvalidArgumentError("batch * length: exceeds 2^31 rows");
  }
  if (in.queries == nullptr) return absl::InvalidArgumentError("queries: missing");
  if ((in.keys == nullptr) != (in.values == nullptr)) {
    return absl::InvalidArgumentError("keys, values: give both or neither (neither = self-attention)");
  }
  if (in.self_attention()) {
    if (!c.SupportsSelfAttention()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "keys: required, the model's key_size ", c.key_size, " / value_size ", c.value_size,
          " differ from query_size ", c.query_size, " so it cannot self-attend"));
    }
    if (in.num_keys != in.num_queries) {
      return absl::InvalidArgumentError(absl::StrCat(
          "keys: self-attention has K == Q, got K = ", in.num_keys, ", Q = ", in.num_queries));
    }
  }
  const size_t vl = in.valid_lens.size();
  if (vl != 0 && vl != static_cast<size_t>(in.batch) &&
      vl != static_cast<size_t>(in.batch * in.num_queries)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "valid_lens: expected 0, B = ", in.batch, " or B*Q = ", in.batch * in.num_queries,
        " entries, got ", vl));
  }
  for (size_t i = 0; i < vl; ++i) {
    if (in.valid_lens[i] < 0 || in.valid_lens[i] > in.num_keys) {
      return absl::InvalidArgumentError(absl::StrCat("valid_lens[", i, "]: expected 0 <= valid_len <= K = ",
                                                     in.num_keys, ", got ", in.valid_lens[i]));
    }
  }
  if (!in.head_mask.empty()) {
    if (static_cast<int64_t>(in.head_mask.size()) != c.num_heads) {
      return absl::InvalidArgumentError(absl::StrCat("head_mask: expected ", c.num_heads,
                                                     " entries (one per head), got ",
                                                     in.head_mask.size()));
    }
    for (size_t i = 0; i < in.head_mask.size(); ++i) {
      if (!std::isfinite(in.head_mask[i])) {
        return absl::InvalidArgumentError(absl::StrCat("head_mask[", i, "]: not finite"));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status MultiHeadAttention::Forward(const AttentionInputs& inputs, float* output,
                                         float* attention) const {
  MHA_RETURN_IF_ERROR(CheckInputs(inputs));
  if (output == nullptr) return absl::InvalidArgumentError("output: missing");
  return impl_->Forward(inputs, output, attention);
}

double MultiHeadAttention::Flops(const ModelConfig& c, int64_t batch, int64_t num_queries,
                                 int64_t num_keys) {
  const double b = batch, q = num_queries, k = num_keys, e = c.num_hiddens;
  const double projections = 2 * b * e * (q * c.query_size + k * c.key_size +
                                           k * c.value_size + q * e);
  const double attention = 2 * 2 * b * q * k * e;  // scores and context, all heads
  return projections + attention;
}

}  // namespace mha::core

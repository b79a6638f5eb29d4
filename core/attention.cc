#include "core/attention.h"

#include <omp.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
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

// A Forward call runs as slices of batch rows of at most this many rows x max(Q, K) x
// p_o activation elements (4 MiB of f32 per activation plane; MultiHeadAttention::Forward).
constexpr int64_t kSliceElements = int64_t{1} << 20;

// valid_lens entries per batch row: 0 (no mask), 1 (one per row) or Q (one per query).
// CheckInputs has refused any other count.
int64_t ValidLensPerRow(const AttentionInputs& in) {
  if (in.valid_lens.empty()) return 0;
  return in.valid_lens.size() == static_cast<size_t>(in.batch * in.num_queries) ? in.num_queries
                                                                                 : 1;
}

// Below this size the head-major repack runs on the calling thread (see Forward).
constexpr int64_t kParallelBytes = 256 << 10;
// A Forward call gets one OpenMP thread per this many FLOPs, up to Options::num_threads
// (PyTorch's grain-size idea). Measured with mha_core_bench Rows/ on 2 cores: a toy
// request (3 MFLOP) took 29 us on one thread and 47 us on two, the `small` shape (9
// MFLOP) the same on both, 8 toy rows (24 MFLOP) about the same, 16 toy rows (48 MFLOP)
// 463 us on one and 354 us on two.
constexpr double kFlopsPerThread = 16e6;

// The threads a primitive created here and now is planned for: oneDNN runs inline
// inside a parallel region, else on this thread's omp_get_max_threads(). Part of every
// primitive cache key, because a call's thread count follows its size (Forward).
int64_t PlanThreads() { return omp_in_parallel() ? 1 : omp_get_max_threads(); }

// A matmul with a caller-owned scratchpad. Debian's oneDNN is built with
// DNNL_ENABLE_CONCURRENT_EXEC, where a library-managed scratchpad belongs to the
// primitive, so one primitive run from two threads at once would share it. With
// scratchpad_mode::user every execution brings its own, and primitives are safe to
// share between threads.
struct Matmul {
  dnnl::matmul prim;
  memory::desc weights;  // the layout the primitive chose (for format_tag::any)
  memory::desc scratchpad;

  static Matmul Make(const dnnl::matmul::desc& desc, dnnl::primitive_attr attr) {
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    dnnl::matmul::primitive_desc pd(desc, attr, CpuEngine());
    return {dnnl::matmul(pd), pd.weights_desc(), pd.scratchpad_desc()};
  }
};

// The arguments of one thread's block GEMMs. A memory object is made once per
// (argument, shape) and re-pointed with set_data_handle afterwards, so a block
// costs no allocation: with tiny blocks the allocations cost more than the math.
// Not thread-safe: one per OpenMP thread.
class Bindings {
 public:
  // A 2-D plain operand (rows, cols) with row stride `ld` (or column-major when
  // `transposed`), element type `dt`, at `ptr`.
  void Bind(int arg, int64_t rows, int64_t cols, int64_t ld, bool transposed, Dt dt,
            const void* ptr) {
    const std::array<int64_t, 6> key{arg, rows, cols, ld, transposed, static_cast<int64_t>(dt)};
    auto it = memories_.find(key);
    if (it == memories_.end()) {
      const memory::dims strides = transposed ? memory::dims{1, ld} : memory::dims{ld, 1};
      it = memories_.emplace(key, memory(memory::desc({rows, cols}, dt, strides), CpuEngine(),
                                         const_cast<void*>(ptr)))
               .first;
    } else {
      it->second.set_data_handle(const_cast<void*>(ptr));
    }
    args_[arg] = it->second;
  }

  // Any operand, keyed by argument and descriptor (for the projections' 2-D and 3-D
  // views). The argument is part of the key: src and dst often share a descriptor.
  void Bind(int arg, const memory::desc& md, const void* ptr) {
    for (auto& d : described_) {
      if (d.arg == arg && d.md == md) {
        d.mem.set_data_handle(const_cast<void*>(ptr));
        args_[arg] = d.mem;
        return;
      }
    }
    described_.push_back({arg, md, memory(md, CpuEngine(), const_cast<void*>(ptr))});
    args_[arg] = described_.back().mem;
  }
  void Set(int arg, const memory& mem) { args_[arg] = mem; }
  void Erase(int arg) {
    if (args_.contains(arg)) args_.erase(arg);
  }

  void Execute(const Matmul& m, dnnl::stream& stream) {
    const size_t bytes = m.scratchpad.get_size();
    if (bytes > 0) {
      if (scratchpad_.size() < bytes) scratchpad_.resize(bytes);
      const std::array<int64_t, 6> key{DNNL_ARG_SCRATCHPAD, static_cast<int64_t>(bytes)};
      auto it = memories_.find(key);
      if (it == memories_.end()) {
        it = memories_.emplace(key, memory(m.scratchpad, CpuEngine(), scratchpad_.data())).first;
      } else {
        it->second.set_data_handle(scratchpad_.data());
      }
      args_[DNNL_ARG_SCRATCHPAD] = it->second;
    }
    m.prim.execute(stream, args_);
  }

 private:
  absl::flat_hash_map<std::array<int64_t, 6>, memory> memories_;
  struct Described {
    int arg;
    memory::desc md;
    memory mem;
  };
  std::vector<Described> described_;
  std::unordered_map<int, memory> args_;
  std::vector<char> scratchpad_;
};

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
  void Run(dnnl::stream& stream, Bindings& args, int64_t batch, int64_t rows, const void* src,
           int64_t src_ld, int64_t src_bs, void* dst, Dt dst_dt, int64_t dst_ld,
           int64_t dst_bs) const {
    const std::array<int64_t, 8> key{batch,  rows,   src_ld,
                                     src_bs, dst_ld, dst_bs,
                                     static_cast<int64_t>(dst_dt), PlanThreads()};
    const std::shared_ptr<const Entry> entry = Lookup(key);
    const Entry& e = *entry;
    args.Bind(DNNL_ARG_SRC, e.src_md, src);
    args.Bind(DNNL_ARG_DST, e.dst_md, dst);
    args.Set(DNNL_ARG_WEIGHTS, e.weights);
    if (bias_.empty()) {
      args.Erase(DNNL_ARG_BIAS);
    } else {
      args.Set(DNNL_ARG_BIAS, e.bias);
    }
    args.Execute(e.matmul, stream);
  }

 private:
  struct Entry {
    Matmul matmul;
    memory::desc src_md, dst_md, bias_md;
    memory weights, bias;  // read-only, shared by every call
  };

  // Entries are shared so that a cache reset never frees one a caller still runs.
  std::shared_ptr<const Entry> Lookup(const std::array<int64_t, 8>& key) const {
    absl::MutexLock lock(&mu_);
    auto it = cache_.find(key);
    if (it != cache_.end()) return it->second;
    if (cache_.size() >= kMaxCachedPrimitives) cache_.clear();
    const auto [batch, rows, src_ld, src_bs, dst_ld, dst_bs, dst_dt, threads] = key;
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
    e->matmul = Matmul::Make(dnnl::matmul::desc(e->src_md, w_any, e->bias_md, e->dst_md), {});
    e->weights = PackedWeights(e->matmul.weights, memory::desc(w_dims, dt_, w_strides));
    if (!bias_.empty()) {
      e->bias = memory(e->bias_md, CpuEngine(), const_cast<float*>(bias_.data()));
    }
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
  mutable absl::flat_hash_map<std::array<int64_t, 8>, std::shared_ptr<const Entry>> cache_
      ABSL_GUARDED_BY(mu_);
  mutable std::vector<std::pair<memory::desc, memory>> packed_ ABSL_GUARDED_BY(mu_);
};

std::vector<float> Stack(std::initializer_list<const std::vector<float>*> parts) {
  std::vector<float> out;
  for (const auto* p : parts) out.insert(out.end(), p->begin(), p->end());
  return out;
}

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
  // Q, K, V after projection, repacked head-major: (B, h, L, p), dense, in act_.
  struct HeadMajor {
    const char* q;    // (B, h, Q, p)
    const char* k;    // (B, h, kv_rows, p)
    const char* v;    // (B, h, kv_rows, p)
    int64_t kv_rows;  // key rows projected per batch row (the largest key limit)
  };
  struct TaskScratch {
    std::vector<float> s;     // scores / f32 probabilities (query_block, key_block)
    std::vector<float> o;     // context accumulator (query_block, p)
    std::vector<uint16_t> p;  // bf16 probabilities
    Bindings bindings;        // oneDNN arguments and scratchpad
    std::optional<dnnl::stream> stream;
  };

  // (mq, nk) f32 = q (mq, p) k^T / sqrt(p); all operands dense.
  Matmul ScorePrimitive(int64_t mq, int64_t nk) const;
  // o (mq, p) f32 (+)= P (mq, nk) v (nk, p).
  Matmul ContextPrimitive(int64_t mq, int64_t nk, bool accumulate) const;
  std::optional<Matmul> FindMatmul(const std::array<int64_t, 5>& key) const;
  Matmul AddMatmul(const std::array<int64_t, 5>& key, const dnnl::matmul::desc& desc,
                   const dnnl::primitive_attr& attr) const;

  void AttendTask(int64_t b, int64_t h, int64_t qb, const AttentionInputs& in,
                  const HeadMajor& hm, const std::vector<int32_t>& limits, float* ctx,
                  float* attention, dnnl::stream& stream, TaskScratch& scratch) const;

  // Buffers of one Forward call, kept between calls: first-touching fresh pages is
  // expensive (and on some VMs very expensive), so a call reuses the memory of an
  // earlier one. A pool holds one workspace per concurrent call.
  struct Workspace {
    std::vector<char> xq, xk, xv;  // bf16 copies of the inputs
    std::vector<char> proj, kv;    // projections, row-major
    std::vector<char> heads;       // Q, K, V head-major
    std::vector<char> ctx;         // concatenated heads, f32 (B*Q, p_o)
    std::vector<TaskScratch> scratch;  // one per OpenMP thread
    Bindings bindings;                 // oneDNN arguments of the projections
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
    Workspace* operator->() { return ws_.get(); }

   private:
    WorkspacePool& pool_;
    std::unique_ptr<Workspace> ws_;
  };
  // Grows (never shrinks) a buffer; contents are not preserved.
  static void Grow(std::vector<char>& buf, size_t bytes) {
    if (buf.size() < bytes) {
      buf = std::vector<char>();
      buf.resize(bytes);
    }
  }

  const ModelConfig c_;
  const Options o_;
  mutable WorkspacePool workspaces_;
  const Dt act_;
  std::unique_ptr<Linear> q_, k_, v_, kv_, qkv_, o_lin_;
  mutable absl::Mutex mu_;
  mutable absl::flat_hash_map<std::array<int64_t, 5>, Matmul> attn_cache_
      ABSL_GUARDED_BY(mu_);
};

std::optional<Matmul> MultiHeadAttention::Impl::FindMatmul(
    const std::array<int64_t, 5>& key) const {
  absl::ReaderMutexLock lock(&mu_);
  auto it = attn_cache_.find(key);
  if (it == attn_cache_.end()) return std::nullopt;
  return it->second;
}

Matmul MultiHeadAttention::Impl::AddMatmul(const std::array<int64_t, 5>& key,
                                           const dnnl::matmul::desc& desc,
                                           const dnnl::primitive_attr& attr) const {
  Matmul prim = Matmul::Make(desc, attr);
  absl::MutexLock lock(&mu_);
  if (attn_cache_.size() >= kMaxCachedPrimitives) attn_cache_.clear();
  return attn_cache_.try_emplace(key, prim).first->second;  // a handle: copies share it
}

Matmul MultiHeadAttention::Impl::ScorePrimitive(int64_t mq, int64_t nk) const {
  const int64_t p = c_.head_size();
  const std::array<int64_t, 5> key{0, mq, nk, 0, PlanThreads()};
  if (auto prim = FindMatmul(key)) return *prim;
  dnnl::primitive_attr attr;
  attr.set_output_scales(0, {1.0f / std::sqrt(static_cast<float>(p))});
  return AddMatmul(key, dnnl::matmul::desc(memory::desc({mq, p}, act_, {p, 1}),
                                           memory::desc({p, nk}, act_, {1, p}),
                                           memory::desc({mq, nk}, Dt::f32, {nk, 1})),
                   attr);
}

Matmul MultiHeadAttention::Impl::ContextPrimitive(int64_t mq, int64_t nk,
                                                        bool accumulate) const {
  const int64_t p = c_.head_size();
  const std::array<int64_t, 5> key{1, mq, nk, accumulate, PlanThreads()};
  if (auto prim = FindMatmul(key)) return *prim;
  dnnl::primitive_attr attr;
  if (accumulate) {
    dnnl::post_ops ops;
    ops.append_sum(1.0f);
    attr.set_post_ops(ops);
  }
  return AddMatmul(key, dnnl::matmul::desc(memory::desc({mq, nk}, act_, {nk, 1}),
                                           memory::desc({nk, p}, act_, {p, 1}),
                                           memory::desc({mq, p}, Dt::f32, {p, 1})),
                   attr);
}

void MultiHeadAttention::Impl::AttendTask(int64_t b, int64_t h, int64_t qb,
                                          const AttentionInputs& in, const HeadMajor& hm,
                                          const std::vector<int32_t>& limits, float* ctx,
                                          float* attention, dnnl::stream& stream,
                                          TaskScratch& scratch) const {
  const int64_t Q = in.num_queries, K = in.num_keys, H = c_.num_heads, E = c_.num_hiddens;
  const int64_t p = c_.head_size();
  const size_t asz = SizeOf(act_);
  const bool bf16 = act_ == Dt::bf16;
  const int64_t i0 = qb * o_.query_block;
  const int64_t mq = std::min(o_.query_block, Q - i0);
  const int32_t* lim = &limits[b * Q + i0];
  const char* q = hm.q + ((b * H + h) * Q + i0) * p * asz;
  const char* k = hm.k + (b * H + h) * hm.kv_rows * p * asz;
  const char* v = hm.v + (b * H + h) * hm.kv_rows * p * asz;
  float* c = ctx + (b * Q + i0) * E + h * p;
  float* a = attention == nullptr ? nullptr : attention + ((b * H + h) * Q + i0) * K;
  const float factor = in.head_mask.empty() ? 1.0f : in.head_mask[h];
  const int64_t max_lim = *std::max_element(lim, lim + mq);

  if (a != nullptr) std::fill_n(a, mq * K, 0.0f);
  if (max_lim == 0 || (factor == 0.0f && a == nullptr)) {
    for (int64_t i = 0; i < mq; ++i) std::fill_n(c + i * E, p, 0.0f);
    return;
  }

  // Every operand is dense, which is what lets oneDNN pick its brgemm kernels.
  const int64_t bk = a != nullptr ? max_lim : std::min(o_.key_block, max_lim);
  scratch.s.resize(std::max<size_t>(scratch.s.size(), mq * bk));
  scratch.o.resize(std::max<size_t>(scratch.o.size(), mq * p));
  if (bf16) scratch.p.resize(std::max<size_t>(scratch.p.size(), mq * bk));
  float* s = scratch.s.data();
  float* o = scratch.o.data();
  float m[256], l[256];  // query_block <= 256 (checked in Create)
  std::fill_n(m, mq, -std::numeric_limits<float>::infinity());
  std::fill_n(l, mq, 0.0f);

  for (int64_t j0 = 0; j0 < max_lim; j0 += bk) {
    const int64_t nk = std::min(bk, max_lim - j0);
    const bool first = j0 == 0;
    Bindings& args = scratch.bindings;
    args.Bind(DNNL_ARG_SRC, mq, p, p, false, act_, q);
    args.Bind(DNNL_ARG_WEIGHTS, p, nk, p, /*transposed=*/true, act_, k + j0 * p * asz);
    args.Bind(DNNL_ARG_DST, mq, nk, nk, false, Dt::f32, s);
    args.Execute(ScorePrimitive(mq, nk), stream);
    uint16_t* probs16 = bf16 ? scratch.p.data() : nullptr;
    for (int64_t i = 0; i < mq; ++i) {
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
    const void* probs = bf16 ? static_cast<const void*>(probs16) : s;
    args.Bind(DNNL_ARG_SRC, mq, nk, nk, false, act_, probs);
    args.Bind(DNNL_ARG_WEIGHTS, nk, p, p, false, act_, v + j0 * p * asz);
    args.Bind(DNNL_ARG_DST, mq, p, p, false, Dt::f32, o);
    args.Execute(ContextPrimitive(mq, nk, !first), stream);
  }
  // Final softmax normalisation and head_mask, written into this head's columns.
  for (int64_t i = 0; i < mq; ++i) {
    const float scale = l[i] > 0.0f ? factor / l[i] : 0.0f;
    const float* orow = o + i * p;
    float* crow = c + i * E;
    for (int64_t d = 0; d < p; ++d) crow[d] = orow[d] * scale;
  }
}

absl::Status MultiHeadAttention::Impl::Forward(const AttentionInputs& in, float* output,
                                               float* attention) const {
  const int64_t B = in.batch, Q = in.num_queries, K = in.num_keys;
  const int64_t E = c_.num_hiddens, H = c_.num_heads, p = c_.head_size();
  const size_t asz = SizeOf(act_);
  // oneDNN splits a primitive's work for the threads it asks OpenMP for and assumes
  // it gets them all: asking for more than OMP_THREAD_LIMIT silently skipped part of
  // the output (found when the sanitizer runs set OMP_THREAD_LIMIT=1).
  const int caller_threads = omp_get_max_threads();
  const int max_threads = std::min(o_.num_threads > 0 ? o_.num_threads : caller_threads,
                                   omp_get_thread_limit());
  // Small calls run on fewer threads (kFlopsPerThread): a fork/join and a partition of
  // a tiny GEMM cost more than they save, and the cores are left to other callers.
  const double flops = MultiHeadAttention::Flops(c_, B, Q, K);
  const int threads = static_cast<int>(
      std::clamp<double>(std::floor(flops / kFlopsPerThread), 1.0, max_threads));
  // This thread's ICV bounds oneDNN's regions too; the caller gets its own back.
  omp_set_num_threads(threads);
  const absl::Cleanup restore_threads = [caller_threads] { omp_set_num_threads(caller_threads); };

  // Per-query key limit: valid_lens and causal folded into one number.
  std::vector<int32_t> limits(static_cast<size_t>(B * Q));
  const int64_t lens_per_row = ValidLensPerRow(in);
  int64_t kv_rows = 0;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t i = 0; i < Q; ++i) {
      int64_t lim = K;
      if (lens_per_row == Q) {
        lim = in.valid_lens[b * Q + i];
      } else if (lens_per_row == 1) {
        lim = in.valid_lens[b];
      }
      if (in.causal) lim = std::min(lim, i + 1);
      limits[b * Q + i] = static_cast<int32_t>(lim);
      kv_rows = std::max(kv_rows, lim);
    }
  }

  WorkspaceLease ws(workspaces_);
  try {
    if (!ws->stream) ws->stream.emplace(CpuEngine());
    dnnl::stream& stream = *ws->stream;
    // bf16: activations are converted once, then every GEMM runs in bf16.
    auto as_act = [&](const float* x, int64_t n, std::vector<char>& tmp) -> const void* {
      if (act_ == Dt::f32) return x;
      Grow(tmp, n * 2);
      kernels::ToBf16(x, reinterpret_cast<uint16_t*>(tmp.data()), n);
      return tmp.data();
    };
    const void* xq = as_act(in.queries, B * Q * c_.query_size, ws->xq);

    // Projections into row-major buffers; key/value rows that no query can see are
    // never projected. q_src, k_src and v_src point at the first row of batch row 0;
    // rows are q_ld / kv_ld elements apart, key batch rows kv_bs apart.
    const char* q_src;
    const char* k_src;
    const char* v_src;
    int64_t q_ld, kv_ld, kv_bs;
    if (in.self_attention()) {
      const int64_t ld = 3 * E, d = c_.query_size;
      Grow(ws->proj, B * Q * ld * asz);
      char* base = ws->proj.data();
      if (kv_rows == K) {
        qkv_->Run(stream, ws->bindings, 1, B * Q, xq, d, 0, base, act_, ld, 0);
      } else {
        q_->Run(stream, ws->bindings, 1, B * Q, xq, d, 0, base, act_, ld, 0);
        if (kv_rows > 0) {
          kv_->Run(stream, ws->bindings, B, kv_rows, xq, d, Q * d, base + E * asz, act_, ld,
                   Q * ld);
        }
      }
      q_src = base;
      k_src = base + E * asz;
      v_src = base + 2 * E * asz;
      q_ld = kv_ld = ld;
      kv_bs = Q * ld;
    } else {
      const bool fuse_kv = in.keys == in.values && kv_ != nullptr;
      const int64_t ld = fuse_kv ? 2 * E : E;
      Grow(ws->proj, B * Q * E * asz);
      q_->Run(stream, ws->bindings, 1, B * Q, xq, c_.query_size, 0, ws->proj.data(), act_, E, 0);
      Grow(ws->kv, B * K * 2 * E * asz);
      char* kbase = ws->kv.data();
      // Fused: K and V side by side in each row; else V is a second (B*K, E) plane.
      char* vbase = fuse_kv ? kbase + E * asz : kbase + B * K * E * asz;
      // Contiguous rows run as one 2-D GEMM; a per-batch prefix as a 3-D one.
      const int64_t batch = kv_rows == K ? 1 : B;
      const int64_t rows = kv_rows == K ? B * K : kv_rows;
      const int64_t dk = c_.key_size, dv = c_.value_size;
      if (kv_rows > 0) {
        const void* xk = as_act(in.keys, B * K * dk, ws->xk);
        if (fuse_kv) {
          kv_->Run(stream, ws->bindings, batch, rows, xk, dk, K * dk, kbase, act_, ld, K * ld);
        } else {
          const void* xv = as_act(in.values, B * K * dv, ws->xv);
          k_->Run(stream, ws->bindings, batch, rows, xk, dk, K * dk, kbase, act_, ld, K * ld);
          v_->Run(stream, ws->bindings, batch, rows, xv, dv, K * dv, vbase, act_, ld, K * ld);
        }
      }
      q_src = ws->proj.data();
      k_src = kbase;
      v_src = vbase;
      q_ld = E;
      kv_ld = ld;
      kv_bs = K * ld;
    }

    // Repack head-major (B, h, L, p) so that every block GEMM has dense operands.
    Grow(ws->heads, (B * Q + 2 * B * kv_rows) * E * asz);
    char* qh = ws->heads.data();
    char* kh = qh + B * Q * E * asz;
    char* vh = kh + B * kv_rows * E * asz;
    const int64_t pb = p * asz;
    const int64_t rows_per_batch = std::max(Q, kv_rows);
    // Tiny problems run our loops on the calling thread: a fork/join costs more than
    // the work (measured on the "small" benchmark shape).
    const bool parallel_repack = B * (Q + 2 * kv_rows) * E * asz >= kParallelBytes;
    auto repack = [&](int64_t r) {
      const int64_t b = r / rows_per_batch, i = r % rows_per_batch;
      if (i < Q) {
        const char* src = q_src + (b * Q + i) * q_ld * asz;
        for (int64_t h = 0; h < H; ++h) {
          std::memcpy(qh + ((b * H + h) * Q + i) * pb, src + h * pb, pb);
        }
      }
      if (i < kv_rows) {
        const char* ksrc = k_src + (b * kv_bs + i * kv_ld) * asz;
        const char* vsrc = v_src + (b * kv_bs + i * kv_ld) * asz;
        for (int64_t h = 0; h < H; ++h) {
          std::memcpy(kh + ((b * H + h) * kv_rows + i) * pb, ksrc + h * pb, pb);
          std::memcpy(vh + ((b * H + h) * kv_rows + i) * pb, vsrc + h * pb, pb);
        }
      }
    };
    // Serial work runs outside any OpenMP construct: a one-thread team between the
    // full teams of oneDNN's regions makes libgomp re-dock its pool, and on a busy
    // machine waking it again cost milliseconds per call (Rows/ benchmarks).
    if (parallel_repack) {
#pragma omp parallel for num_threads(threads) schedule(static)
      for (int64_t r = 0; r < B * rows_per_batch; ++r) repack(r);
    } else {
      for (int64_t r = 0; r < B * rows_per_batch; ++r) repack(r);
    }

    // Attention: one task per (batch row, head, query block), key blocks inside.
    Grow(ws->ctx, B * Q * E * sizeof(float));
    float* ctx = reinterpret_cast<float*>(ws->ctx.data());
    const int64_t q_blocks = (Q + o_.query_block - 1) / o_.query_block;
    const int64_t tasks = B * H * q_blocks;
    // One thread runs every task itself. A team shares them out: run serially beside
    // multi-threaded primitives, each tiny block GEMM would fork a team of its own.
    const int team = static_cast<int>(std::min<int64_t>(threads, tasks));
    if (ws->scratch.size() < static_cast<size_t>(team)) ws->scratch.resize(team);
    const HeadMajor hm{qh, kh, vh, kv_rows};
    FirstError error;
    auto run_tasks = [&](TaskScratch& scratch, int64_t t) {
      if (error.failed()) return;
      if (!scratch.stream) scratch.stream.emplace(CpuEngine());
      const int64_t b = t / (H * q_blocks), h = (t / q_blocks) % H, qb = t % q_blocks;
      try {
        AttendTask(b, h, qb, in, hm, limits, ctx, attention, *scratch.stream, scratch);
      } catch (const dnnl::error& e) {
        error.Set(DnnlMessage(e));
      } catch (const std::exception& e) {
        error.Set(e.what());
      }
    };
    if (team > 1) {
#pragma omp parallel num_threads(team)
      {
        TaskScratch& scratch = ws->scratch[omp_get_thread_num()];
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < tasks; ++t) run_tasks(scratch, t);
      }
    } else {
      // Block GEMMs run inline here, as they do inside a team (one task on many threads).
      omp_set_num_threads(1);
      for (int64_t t = 0; t < tasks; ++t) run_tasks(ws->scratch[0], t);
      omp_set_num_threads(threads);
    }
    MHA_RETURN_IF_ERROR(error.status());

    const void* ctx_act = as_act(ctx, B * Q * E, ws->xq);  // the queries' copy is spent
    o_lin_->Run(stream, ws->bindings, 1, B * Q, ctx_act, E, 0, output, Dt::f32, E, 0);
    stream.wait();
  } catch (const dnnl::error& e) {
    return absl::InternalError(DnnlMessage(e));
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError("out of memory in MultiHeadAttention::Forward");
  } catch (const std::exception& e) {
    return absl::InternalError(e.what());
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
                                                     " entries (one per head) or none, got ",
                                                     in.head_mask.size()));
    }
    for (size_t i = 0; i < in.head_mask.size(); ++i) {
      if (!std::isfinite(in.head_mask[i])) {
        return absl::InvalidArgumentError(absl::StrCat("head_mask[", i,
                                                       "]: expected a finite value, got ",
                                                       in.head_mask[i]));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status MultiHeadAttention::Forward(const AttentionInputs& inputs, float* output,
                                         float* attention) const {
  MHA_RETURN_IF_ERROR(CheckInputs(inputs));
  if (output == nullptr) return absl::InvalidArgumentError("output: missing");
  // Batch rows are independent. A call whose activations outgrow the caches runs as
  // even slices of rows: 64 BERT-sized rows of 32 tokens took 45 ms in one call and
  // 2 x 14 ms as two (mha_core_bench Rows/).
  const int64_t B = inputs.batch, Q = inputs.num_queries, K = inputs.num_keys;
  const int64_t h = config_.num_heads, E = config_.num_hiddens;
  const int64_t max_rows = std::max<int64_t>(1, kSliceElements / (std::max(Q, K) * E));
  const int64_t slices = (B + max_rows - 1) / max_rows;
  if (slices == 1) return impl_->Forward(inputs, output, attention);
  const int64_t rows = (B + slices - 1) / slices;
  const int64_t lens_per_row = ValidLensPerRow(inputs);
  for (int64_t b0 = 0; b0 < B; b0 += rows) {
    AttentionInputs slice = inputs;
    slice.batch = std::min(rows, B - b0);
    slice.queries = inputs.queries + b0 * Q * config_.query_size;
    if (!inputs.self_attention()) {
      slice.keys = inputs.keys + b0 * K * config_.key_size;
      slice.values = inputs.values + b0 * K * config_.value_size;
    }
    if (lens_per_row > 0) {
      slice.valid_lens = inputs.valid_lens.subspan(b0 * lens_per_row, slice.batch * lens_per_row);
    }
    MHA_RETURN_IF_ERROR(impl_->Forward(slice, output + b0 * Q * E,
                                       attention == nullptr ? nullptr
                                                            : attention + b0 * h * Q * K));
  }
  return absl::OkStatus();
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

#include "core/attention_impl.h"

#include <omp.h>

#include <algorithm>
#include <cstring>
#include <initializer_list>
#include <vector>

namespace mha::core {
namespace {

// From this many floats AsActivation converts on the call's threads (a 256 KB input).
constexpr int64_t kParallelConvertFloats = 64 << 10;

// An int8 model's weights as its s8 GEMMs see them, each output row rounded to its
// 255 levels, in f32. Where oneDNN has no bf16 matmul (below AVX-512), its s8 GEMMs
// were measured far outside the int8 bound (oneDNN's guide: without VNNI they may
// saturate), so such a CPU multiplies these instead (docs/core.md, "Precision on
// CPUs without AVX-512").
std::vector<float> Int8Levels(const std::vector<float>& w, int64_t n, int64_t k) {
  std::vector<int8_t> q(w.size());
  std::vector<float> scales(n), out(w.size());
  kernels::QuantizeRows(w.data(), k, n, k, q.data(), scales.data());
  for (int64_t i = 0; i < n * k; ++i) out[i] = q[i] * scales[i / k];
  return out;
}

std::vector<float> Stack(std::initializer_list<const std::vector<float>*> parts) {
  std::vector<float> out;
  for (const auto* p : parts) out.insert(out.end(), p->begin(), p->end());
  return out;
}

// The largest divisor of n that is at most `most` (>= 1).
int64_t LargestDivisorAtMost(int64_t n, int64_t most) {
  for (int64_t d = std::min(n, most); d > 1; --d) {
    if (n % d == 0) return d;
  }
  return 1;
}

}  // namespace

MultiHeadAttention::Impl::Impl(const ModelConfig& c, const Weights& weights, const Options& o)
    : c_(c),
      o_(o),
      act_(c.precision == Precision::kF32 || !internal::Bf16MatmulsSupported() ? Dt::f32
                                                                               : Dt::bf16),
      weights_(c.precision == Precision::kInt8 && act_ == Dt::bf16 ? Dt::s8 : act_),
      in_(c.precision == Precision::kBf16 ? act_ : Dt::f32) {
  const int64_t group = c.num_heads / c.kv_heads();
  heads_per_task_ = LargestDivisorAtMost(group, o.query_block);
  heads_per_paged_task_ = LargestDivisorAtMost(group, kPagedQueryRows);
  if (c.attention_only()) return;  // no weights, no rope, dot-product scoring
  const int64_t e = c.num_hiddens, ekv = c.kv_hiddens();
  // The four matrices as given, or at their int8 levels (Int8Levels); biases and the
  // scoring weights always as given.
  const bool levels = c.precision == Precision::kInt8 && weights_ != Dt::s8;
  std::vector<float> lq, lk, lv, lo;
  if (levels) {
    lq = Int8Levels(weights.w_q, e, c.query_size);
    lk = Int8Levels(weights.w_k, ekv, c.key_size);
    lv = Int8Levels(weights.w_v, ekv, c.value_size);
    lo = Int8Levels(weights.w_o, e, e);
  }
  const std::vector<float>& w_q = levels ? lq : weights.w_q;
  const std::vector<float>& w_k = levels ? lk : weights.w_k;
  const std::vector<float>& w_v = levels ? lv : weights.w_v;
  const std::vector<float>& w_o = levels ? lo : weights.w_o;
  auto bias = [&](const std::vector<float>& b) { return b.empty() ? nullptr : b.data(); };
  q_ = std::make_unique<Linear>(w_q.data(), bias(weights.b_q), e, c.query_size, weights_);
  k_ = std::make_unique<Linear>(w_k.data(), bias(weights.b_k), ekv, c.key_size, weights_);
  v_ = std::make_unique<Linear>(w_v.data(), bias(weights.b_v), ekv, c.value_size, weights_);
  // A decode step's W_o and stacked Q/K/V projections of a few rows run by hand
  // (ForwardPaged); f32 models keep a panel copy of those weights for it (Linear).
  o_lin_ =
      std::make_unique<Linear>(w_o.data(), bias(weights.b_o), e, e, weights_, /*row_path=*/true);
  if (c.key_size == c.value_size) {
    const auto kv_w = Stack({&w_k, &w_v});
    const auto kv_b = Stack({&weights.b_k, &weights.b_v});
    kv_ = std::make_unique<Linear>(kv_w.data(), c.bias ? kv_b.data() : nullptr, 2 * ekv, c.key_size,
                                   weights_);
  }
  if (c.SupportsSelfAttention()) {
    const auto qkv_w = Stack({&w_q, &w_k, &w_v});
    const auto qkv_b = Stack({&weights.b_q, &weights.b_k, &weights.b_v});
    qkv_ = std::make_unique<Linear>(qkv_w.data(), c.bias ? qkv_b.data() : nullptr, e + 2 * ekv,
                                    c.query_size, weights_, /*row_path=*/true);
  }
  if (c.rope) rope_.emplace(c);
  if (c.scoring == Scoring::kAdditive) {
    score_q_ = ToActivation(weights.score_w_q);
    score_k_ = ToActivation(weights.score_w_k);
    score_v_ = weights.score_w_v;
  }
}

int MultiHeadAttention::Impl::ThreadsFor(const AttentionInputs& in, int max_threads,
                                         ThreadRule rule) const {
  const double flops = MultiHeadAttention::Flops(c_, in.batch, in.num_queries, in.num_keys);
  // A lone call that will run as one region gets its threads sooner. Whether it will
  // is told here from the largest valid length (every key row projected); a causal
  // (B, Q) mask that hides the last keys from every query runs on these threads but
  // not as one region.
  if (rule == ThreadRule::kAlone && flops < internal::kOneRegionMaxFlops && in.self_attention()) {
    int64_t largest = in.valid_lens.empty() ? in.num_keys : 0;
    for (const int32_t len : in.valid_lens) largest = std::max<int64_t>(largest, len);
    if (RunsAsOneRegion(in, std::min(largest, in.num_keys))) {
      return internal::ThreadsForFlops(flops, o_.num_threads, max_threads,
                                       internal::kOneRegionFlopsPerThread);
    }
  }
  return internal::ThreadsForFlops(flops, o_.num_threads, max_threads);
}

std::vector<char> MultiHeadAttention::Impl::ToActivation(const std::vector<float>& w) const {
  std::vector<char> out(w.size() * internal::SizeOf(act_));
  if (act_ == Dt::f32) {
    std::memcpy(out.data(), w.data(), out.size());
  } else {
    kernels::ToBf16(w.data(), reinterpret_cast<uint16_t*>(out.data()),
                    static_cast<int64_t>(w.size()));
  }
  return out;
}

const void* MultiHeadAttention::Impl::AsActivation(const float* x, int64_t n,
                                                   std::vector<char>& tmp) const {
  // bf16: activations are converted once, then every GEMM runs in bf16.
  if (act_ == Dt::f32) return x;
  internal::Grow(tmp, n * 2);
  auto* y = reinterpret_cast<uint16_t*>(tmp.data());
  // A large input is converted on the call's threads (a BERT batch's queries took
  // 0.45 ms on one: docs/performance.md, "int8 models").
  const int threads = n >= kParallelConvertFloats ? omp_get_max_threads() : 1;
  if (threads > 1) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int t = 0; t < threads; ++t) {
      const int64_t a = n * t / threads / 16 * 16;
      const int64_t b = t + 1 == threads ? n : n * (t + 1) / threads / 16 * 16;
      kernels::ToBf16(x + a, y + a, b - a);
    }
  } else {
    kernels::ToBf16(x, y, n);
  }
  return tmp.data();
}

}  // namespace mha::core

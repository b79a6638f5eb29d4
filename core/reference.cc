#include "core/reference.h"

#include <algorithm>
#include <cmath>

namespace mha::core {
namespace {

// y (rows, out) = x (rows, in) W^T (+ b), W (out, in).
std::vector<double> Linear(const float* x, int64_t rows, int64_t in, const std::vector<float>& w,
                           const std::vector<float>& b, int64_t out) {
  std::vector<double> y(static_cast<size_t>(rows * out));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t o = 0; o < out; ++o) {
      double acc = b.empty() ? 0.0 : b[o];
      for (int64_t i = 0; i < in; ++i) acc += double{x[r * in + i]} * w[o * in + i];
      y[r * out + o] = acc;
    }
  }
  return y;
}

// Additive scoring's projections of every row's head slices: y (rows, h, p_a) with
// y[r, h] = A_h x[r, head h's p columns], for x (rows, p_o) and A (h, p_a, p).
std::vector<double> ProjectHeads(const ModelConfig& c, const std::vector<float>& a,
                                 const std::vector<double>& x, int64_t rows) {
  const int64_t H = c.num_heads, P = c.head_size(), E = c.num_hiddens, pa = c.additive_hidden;
  std::vector<double> y(static_cast<size_t>(rows * H * pa), 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t f = 0; f < pa; ++f) {
        double& acc = y[(r * H + h) * pa + f];
        for (int64_t d = 0; d < P; ++d)
          acc += double{a[(h * pa + f) * P + d]} * x[r * E + h * P + d];
      }
    }
  }
  return y;
}

double DotScore(const double* q, const double* k, int64_t p) {
  double s = 0;
  for (int64_t d = 0; d < p; ++d) s += q[d] * k[d];
  return s / std::sqrt(static_cast<double>(p));
}

// w_v . tanh(aq + ak) for head h, aq and ak its projected query and key (p_a each).
double AdditiveScore(const Weights& w, int64_t h, int64_t pa, const double* aq, const double* ak) {
  double s = 0;
  for (int64_t f = 0; f < pa; ++f) s += double{w.score_w_v[h * pa + f]} * std::tanh(aq[f] + ak[f]);
  return s;
}

}  // namespace

ReferenceResult ReferenceForward(const ModelConfig& c, const Weights& w,
                                 const AttentionInputs& in) {
  const int64_t B = in.batch, Q = in.num_queries, K = in.num_keys;
  const int64_t H = c.num_heads, P = c.head_size(), E = c.num_hiddens;
  const float* keys = in.self_attention() ? in.queries : in.keys;
  const float* values = in.self_attention() ? in.queries : in.values;
  const int64_t dk = in.self_attention() ? c.query_size : c.key_size;
  const int64_t dv = in.self_attention() ? c.query_size : c.value_size;

  const std::vector<double> q = Linear(in.queries, B * Q, c.query_size, w.w_q, w.b_q, E);
  const std::vector<double> k = Linear(keys, B * K, dk, w.w_k, w.b_k, E);
  const std::vector<double> v = Linear(values, B * K, dv, w.w_v, w.b_v, E);

  const bool additive = c.scoring == Scoring::kAdditive;
  const int64_t pa = c.additive_hidden;
  const std::vector<double> aq =
      additive ? ProjectHeads(c, w.score_w_q, q, B * Q) : std::vector<double>();
  const std::vector<double> ak =
      additive ? ProjectHeads(c, w.score_w_k, k, B * K) : std::vector<double>();

  ReferenceResult r;
  r.attention.assign(static_cast<size_t>(B * H * Q * K), 0.0);
  std::vector<double> concat(static_cast<size_t>(B * Q * E), 0.0);
  std::vector<double> scores(static_cast<size_t>(K));

  for (int64_t b = 0; b < B; ++b) {
    for (int64_t i = 0; i < Q; ++i) {
      int64_t limit = K;
      if (in.valid_lens.size() == static_cast<size_t>(B)) limit = in.valid_lens[b];
      if (in.valid_lens.size() == static_cast<size_t>(B * Q)) limit = in.valid_lens[b * Q + i];
      if (in.causal) limit = std::min(limit, i + 1);
      for (int64_t h = 0; h < H; ++h) {
        double* a = &r.attention[((b * H + h) * Q + i) * K];
        if (limit > 0) {
          double max_score = -INFINITY;
          for (int64_t j = 0; j < limit; ++j) {
            scores[j] = additive
                            ? AdditiveScore(w, h, pa, &aq[((b * Q + i) * H + h) * pa],
                                            &ak[((b * K + j) * H + h) * pa])
                            : DotScore(&q[(b * Q + i) * E + h * P], &k[(b * K + j) * E + h * P], P);
            max_score = std::max(max_score, scores[j]);
          }
          double sum = 0;
          for (int64_t j = 0; j < limit; ++j) sum += a[j] = std::exp(scores[j] - max_score);
          for (int64_t j = 0; j < limit; ++j) a[j] /= sum;
        }
        const double factor = in.head_mask.empty() ? 1.0 : in.head_mask[h];
        for (int64_t d = 0; d < P; ++d) {
          double acc = 0;
          for (int64_t j = 0; j < limit; ++j) acc += a[j] * v[(b * K + j) * E + h * P + d];
          concat[(b * Q + i) * E + h * P + d] = acc * factor;
        }
      }
    }
  }

  r.output.assign(static_cast<size_t>(B * Q * E), 0.0);
  for (int64_t row = 0; row < B * Q; ++row) {
    for (int64_t o = 0; o < E; ++o) {
      double acc = w.b_o.empty() ? 0.0 : w.b_o[o];
      for (int64_t i = 0; i < E; ++i) acc += concat[row * E + i] * w.w_o[o * E + i];
      r.output[row * E + o] = acc;
    }
  }
  return r;
}

}  // namespace mha::core

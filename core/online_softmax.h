// The online softmax of the attention passes (dense and paged): the running maximum
// and sum of a block of query rows, moved on block of keys by block of keys, and the
// final normalisation of the accumulated context.
//
// For row i, after blocks 1..t of scores s: m = max over all scores so far,
// l = sum of exp(s - m), o = sum of exp(s - m) v. A new block with maximum m_b moves
// m to max(m, m_b) and rescales l and o by exp(m_old - m) before its own terms are
// added; the context is o / l at the end (0 for a row that saw no key).
//
// Internal to core/.
#ifndef MHA_CORE_ONLINE_SOFTMAX_H_
#define MHA_CORE_ONLINE_SOFTMAX_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numbers>

#include "core/kernels.h"

namespace mha::core::internal {

// Query rows per block at most (MultiHeadAttention::Options::query_block): a task
// keeps its rows' statistics on the stack.
inline constexpr int64_t kMaxQueryBlock = 256;

struct RowStats {
  float max[kMaxQueryBlock];  // running maximum score
  float sum[kMaxQueryBlock];  // running sum of exp(score - max)
  // Scores in log2 units (kernels::ExpSubSum's base2): exp is 2^ throughout, and Lse
  // turns back to natural logarithms.
  bool base2 = false;

  // No key seen by any of the first `rows` rows.
  void Reset(int64_t rows, bool in_base2 = false) {
    std::fill_n(max, rows, -std::numeric_limits<float>::infinity());
    std::fill_n(sum, rows, 0.0f);
    base2 = in_base2;
  }

  // Row i meets n > 0 more scores s[0, n): exp_sub_sum(m) turns the block's scores
  // into exp(s - m) and returns their sum. The reference m moves to the block's
  // maximum only when that exceeds it by more than kLazyRescale (and at the first
  // block); the context accumulated so far (o, p floats) and the running sum are then
  // rescaled to it. Below that, the block's exponentials are at most e^8 (2^8 in
  // base2) and nothing is rescaled: the context and the log-sum-exp do not depend on
  // the reference, and `max` stays within kLazyRescale of the true maximum.
  static constexpr float kLazyRescale = 8.0f;
  template <typename ExpSubSum>
  void Update(int64_t i, const float* s, int64_t n, float* o, int64_t p, ExpSubSum exp_sub_sum) {
    Rebase(i, kernels::RowMax(s, n), o, p);
    sum[i] += exp_sub_sum(max[i]);
  }

  // Update of rows [i0, i1) at once, each meeting n > 0 scores in place (row i's at
  // s + (i - i0) * n, its context at o + (i - i0) * p): the rows' maxima in one call,
  // the references row by row, then every row's exponentials in one call.
  void UpdateRows(int64_t i0, int64_t i1, float* s, int64_t n, float* o, int64_t p) {
    float block_max[kMaxQueryBlock];
    kernels::RowMaxes(s, n, i1 - i0, block_max);
    for (int64_t i = i0; i < i1; ++i) Rebase(i, block_max[i - i0], o + (i - i0) * p, p);
    kernels::ExpSubSumRows(s, n, max + i0, sum + i0, i1 - i0, base2);
  }

  // Row i's reference for a block whose maximum is block_max (Update's rule).
  void Rebase(int64_t i, float block_max, float* o, int64_t p) {
    if (max[i] == -std::numeric_limits<float>::infinity()) {
      max[i] = block_max;  // the first scores: nothing accumulated yet, o not read
    } else if (block_max > max[i] + kLazyRescale) {
      const float alpha = base2 ? std::exp2(max[i] - block_max) : std::exp(max[i] - block_max);
      kernels::Scale(o, alpha, p);
      sum[i] *= alpha;
      max[i] = block_max;
    }
  }

  // ctx[i * ld + d] = o[i * p + d] * factor / sum[i] for the first `rows` rows: the
  // normalised context (times a head's mask factor), 0 for a row that saw no key.
  void Normalise(int64_t rows, const float* o, int64_t p, float factor, float* ctx,
                 int64_t ld) const {
    for (int64_t i = 0; i < rows; ++i) NormaliseRow(i, o + i * p, p, factor, ctx + i * ld);
  }
  // Row i's log-sum-exp of every score it met, max + log(sum); -inf for no score.
  // In base2, (max + log2(sum)) ln 2.
  float Lse(int64_t i) const {
    if (sum[i] <= 0.0f) return -std::numeric_limits<float>::infinity();
    return base2 ? (max[i] + std::log2(sum[i])) * std::numbers::ln2_v<float>
                 : max[i] + std::log(sum[i]);
  }
  // The same for row i alone: ctx[d] = o[d] * factor / sum[i].
  void NormaliseRow(int64_t i, const float* o, int64_t p, float factor, float* ctx) const {
    const float scale = sum[i] > 0.0f ? factor / sum[i] : 0.0f;
    for (int64_t d = 0; d < p; ++d) ctx[d] = o[d] * scale;
  }
};

}  // namespace mha::core::internal

#endif  // MHA_CORE_ONLINE_SOFTMAX_H_

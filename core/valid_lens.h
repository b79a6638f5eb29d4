// The layout of a forward call's valid_lens, read in one place by the core and by
// the server (which merges and splits requests).
//
// valid_lens holds 0, B or B*Q int32 entries:
//   empty        no key mask: every query of every row sees all K keys
//   B entries    one key length per batch row: query q of row b sees keys
//                j < valid_lens[b]
//   B*Q entries  one key length per query: valid_lens[b * Q + q]
// When Q == 1 the two non-empty layouts are the same.
//
// Worked example, B = 2, Q = 3, K = 5:
//   {}                      -> at(b, q) == 5 for every b, q; per_row() == 0
//   {4, 2}                  -> at(1, 0) == at(1, 2) == 2;    per_row() == 1
//   {1, 2, 3, 5, 5, 0}      -> at(0, 2) == 3, at(1, 2) == 0; per_row() == 3;
//                              rows(1, 1) == {5, 5, 0}
//
// A view: the entries must outlive it. Counts and ranges are checked by
// MultiHeadAttention::CheckInputs, not here.
#ifndef MHA_CORE_VALID_LENS_H_
#define MHA_CORE_VALID_LENS_H_

#include <cstdint>
#include <span>

namespace mha::core {

class ValidLens {
 public:
  ValidLens(std::span<const int32_t> lens, int64_t batch, int64_t num_queries, int64_t num_keys)
      : lens_(lens),
        num_keys_(num_keys),
        per_row_(lens.empty()                                               ? 0
                 : static_cast<int64_t>(lens.size()) == batch * num_queries ? num_queries
                                                                            : 1) {}

  // Entries per batch row: 0 (no mask), 1 (per row) or Q (per query).
  int64_t per_row() const { return per_row_; }
  bool per_query() const { return per_row_ > 1; }

  // The number of keys query q of batch row b sees before any causal limit.
  int32_t at(int64_t b, int64_t q) const {
    if (per_row_ == 0) return static_cast<int32_t>(num_keys_);
    return per_row_ == 1 ? lens_[b] : lens_[b * per_row_ + q];
  }

  // Batch row b's entries: per_row() of them.
  std::span<const int32_t> row(int64_t b) const { return rows(b, 1); }
  // Batch rows [first, first + count)'s entries: count * per_row() of them (none
  // without a mask), the valid_lens of that slice of the batch.
  std::span<const int32_t> rows(int64_t first, int64_t count) const {
    return lens_.subspan(first * per_row_, count * per_row_);
  }

 private:
  std::span<const int32_t> lens_;
  int64_t num_keys_;
  int64_t per_row_;
};

}  // namespace mha::core

#endif  // MHA_CORE_VALID_LENS_H_

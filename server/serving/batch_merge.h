// Merging requests into one forward call, and splitting its output back: the
// tensor side of dynamic batching (the batcher only decides who runs together).
//
// Requests merge when they agree on self- vs cross-attention, causal and head_mask,
// and for a rotary model on K - Q (CanMerge). Shorter requests are zero-padded to the
// longest Q and K, and their padded keys are masked through valid_lens, so each
// request's output equals its output when run alone, up to float rounding.
//
// Worked example, toy model (d_q = d_k = d_v = p_o = 100), cross-attention:
//   part 0: B 1, Q 3, K 5, valid_lens {}          (every key valid)
//   part 1: B 2, Q 4, K 2, valid_lens {1, 2}      (one per row)
//   merged: B 3, Q 4, K 5
//     queries (3, 4, 100): row 0 = part 0 with query 3 zero; rows 1-2 = part 1
//     keys, values (3, 5, 100): rows 1-2 zero from key 2 on
//     valid_lens (3): {5, 1, 2}   (one per row: no part has one per query)
//   output (3, 4, 100): part 0 gets row 0, queries 0-2; part 1 rows 1-2.
// If any part has one valid_len per query, the merged call has B*Q entries: a
// part's per-row length is repeated over its queries, and padded query positions
// get 0 (no keys: no work, and their rows are dropped).
// Self-attention parts pad Q and K together (K = Q = the longest length).
//
// Not thread-safe: one BatchMerger per worker. Its buffers grow and are reused,
// never shrunk, so steady-state batches touch no new pages.
#ifndef MHA_SERVER_SERVING_BATCH_MERGE_H_
#define MHA_SERVER_SERVING_BATCH_MERGE_H_

#include <cstdint>
#include <span>
#include <vector>

#include "core/attention.h"
#include "core/config.h"

namespace mha::server {

// One request of a merged call: its inputs and where its output (B, Q, p_o) goes.
struct BatchPart {
  const core::AttentionInputs* inputs = nullptr;
  float* output = nullptr;
};

// Whether two requests can run in one forward call.
// `positions`: the model has rotary positions (ModelConfig::rope), where query i of a
// request sits at K - Q + i; such requests merge only with equal K - Q.
bool CanMerge(const core::AttentionInputs& a, const core::AttentionInputs& b,
              bool positions = false);

class BatchMerger {
 public:
  // The merged inputs of `parts` (at least one; all CanMerge with the first), as
  // views into this merger's buffers: valid until the next Merge.
  core::AttentionInputs Merge(std::span<const BatchPart> parts, const core::ModelConfig& config);

  // Where the merged call writes its output: (B, Q, p_o) of the last Merge.
  float* output() { return output_.data(); }

  // Copies each part's rows of output() to its BatchPart::output.
  void Scatter(std::span<const BatchPart> parts, const core::ModelConfig& config) const;

 private:
  void MergeValidLens(std::span<const BatchPart> parts);

  int64_t queries_ = 0;  // padded Q of the last Merge
  int64_t keys_ = 0;     // padded K
  std::vector<float> queries_buffer_, keys_buffer_, values_buffer_, output_;
  std::vector<int32_t> valid_lens_;
};

}  // namespace mha::server

#endif  // MHA_SERVER_SERVING_BATCH_MERGE_H_

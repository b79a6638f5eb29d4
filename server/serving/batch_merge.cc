#include "server/serving/batch_merge.h"

#include <algorithm>
#include <cstring>

namespace mha::server {
namespace {

// Copies B rows of `length` x `width` floats into a buffer whose rows hold
// `padded` x `width`, starting at row `row0`.
void CopyIn(const float* source, int64_t batch, int64_t length, int64_t width, float* dest,
            int64_t row0, int64_t padded) {
  for (int64_t b = 0; b < batch; ++b) {
    std::memcpy(dest + (row0 + b) * padded * width, source + b * length * width,
                sizeof(float) * length * width);
  }
}

}  // namespace

bool CanMerge(const core::AttentionInputs& a, const core::AttentionInputs& b, bool positions) {
  // Padding to the longest Q and K keeps a query's position K - Q + i only when every
  // part has the same K - Q (self-attention: 0).
  if (positions && a.num_keys - a.num_queries != b.num_keys - b.num_queries) return false;
  return a.self_attention() == b.self_attention() && a.causal == b.causal &&
         std::equal(a.head_mask.begin(), a.head_mask.end(), b.head_mask.begin(), b.head_mask.end());
}

core::AttentionInputs BatchMerger::Merge(std::span<const BatchPart> parts,
                                         const core::ModelConfig& config) {
  const core::AttentionInputs& first = *parts.front().inputs;
  const bool self = first.self_attention();
  int64_t rows = 0;
  queries_ = keys_ = 0;
  for (const BatchPart& part : parts) {
    rows += part.inputs->batch;
    queries_ = std::max(queries_, part.inputs->num_queries);
    keys_ = std::max(keys_, part.inputs->num_keys);
  }
  if (self) keys_ = queries_;
  queries_buffer_.assign(rows * queries_ * config.query_size, 0.0f);
  if (!self) {
    keys_buffer_.assign(rows * keys_ * config.key_size, 0.0f);
    values_buffer_.assign(rows * keys_ * config.value_size, 0.0f);
  }
  int64_t row0 = 0;
  for (const BatchPart& part : parts) {
    const core::AttentionInputs& in = *part.inputs;
    CopyIn(in.queries, in.batch, in.num_queries, config.query_size, queries_buffer_.data(), row0,
           queries_);
    if (!self) {
      CopyIn(in.keys, in.batch, in.num_keys, config.key_size, keys_buffer_.data(), row0, keys_);
      CopyIn(in.values, in.batch, in.num_keys, config.value_size, values_buffer_.data(), row0,
             keys_);
    }
    row0 += in.batch;
  }
  MergeValidLens(parts);
  output_.resize(rows * queries_ * config.num_hiddens);
  return core::AttentionInputs{
      .batch = rows,
      .num_queries = queries_,
      .num_keys = keys_,
      .queries = queries_buffer_.data(),
      .keys = self ? nullptr : keys_buffer_.data(),
      .values = self ? nullptr : values_buffer_.data(),
      .valid_lens = valid_lens_,
      .causal = first.causal,
      .head_mask = first.head_mask,
  };
}

void BatchMerger::MergeValidLens(std::span<const BatchPart> parts) {
  bool per_query = false;  // any part with one valid_len per query
  bool needed = false;     // any part with valid_lens, or with padded keys
  int64_t rows = 0;
  for (const BatchPart& part : parts) {
    const core::AttentionInputs& in = *part.inputs;
    per_query = per_query || in.lens().per_query();
    needed = needed || !in.valid_lens.empty() || in.num_keys < keys_;
    rows += in.batch;
  }
  valid_lens_.assign(needed ? (per_query ? rows * queries_ : rows) : 0, 0);
  if (!needed) return;
  int64_t row0 = 0;
  for (const BatchPart& part : parts) {
    const core::AttentionInputs& in = *part.inputs;
    const core::ValidLens lens = in.lens();
    for (int64_t b = 0; b < in.batch; ++b) {
      if (!per_query) {
        valid_lens_[row0 + b] = lens.at(b, 0);
        continue;
      }
      // Padded query positions keep 0.
      for (int64_t q = 0; q < in.num_queries; ++q) {
        valid_lens_[(row0 + b) * queries_ + q] = lens.at(b, q);
      }
    }
    row0 += in.batch;
  }
}

void BatchMerger::Scatter(std::span<const BatchPart> parts, const core::ModelConfig& config) const {
  const int64_t p_o = config.num_hiddens;
  int64_t row0 = 0;
  for (const BatchPart& part : parts) {
    const core::AttentionInputs& in = *part.inputs;
    const int64_t width = in.num_queries * p_o;
    for (int64_t b = 0; b < in.batch; ++b) {
      std::memcpy(part.output + b * width, output_.data() + (row0 + b) * queries_ * p_o,
                  sizeof(float) * width);
    }
    row0 += in.batch;
  }
}

}  // namespace mha::server

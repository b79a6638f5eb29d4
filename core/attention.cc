#include "core/attention.h"

#include <algorithm>
#include <cmath>
#include <span>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "core/attention_impl.h"

// The layer's public entry points: every input check (dense and paged) before any
// work, the dense call's slicing into batch rows, and exceptions mapped to a status
// once per entry point (internal::Guarded).

namespace mha::core {
namespace {

// A Forward call runs as slices of batch rows of at most this many rows x max(Q, K) x
// p_o activation elements (4 MiB of f32 per activation plane).
constexpr int64_t kSliceElements = int64_t{1} << 20;

// Dimensions, tensors present, and self-attention allowed by the model.
absl::Status CheckSizes(const AttentionInputs& in, const ModelConfig& c) {
  // Bounds keep every element count and offset comfortably inside int64.
  constexpr int64_t kMaxRows = int64_t{1} << 31;
  if (in.batch < 1) {
    return absl::InvalidArgumentError(absl::StrCat("batch: expected >= 1, got ", in.batch));
  }
  if (in.num_queries < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("queries: expected >= 1 query, got ", in.num_queries));
  }
  if (in.num_keys < 1) {
    return absl::InvalidArgumentError(absl::StrCat("keys: expected >= 1 key, got ", in.num_keys));
  }
  if (in.batch * in.num_queries > kMaxRows || in.batch * in.num_keys > kMaxRows) {
    return absl::InvalidArgumentError("batch * length: exceeds 2^31 rows");
  }
  if (in.queries == nullptr) return absl::InvalidArgumentError("queries: missing");
  if ((in.keys == nullptr) != (in.values == nullptr)) {
    return absl::InvalidArgumentError(
        "keys, values: give both or neither (neither = self-attention)");
  }
  if (in.self_attention() && c.attention_only()) {
    return absl::InvalidArgumentError(
        "keys: required, an attention-only model (projections NONE) takes projected keys and "
        "values");
  }
  if (in.self_attention() && !c.SupportsSelfAttention()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "keys: required, the model's key_size ", c.key_size, " / value_size ", c.value_size,
        " differ from query_size ", c.query_size, " so it cannot self-attend"));
  }
  if (in.self_attention() && in.num_keys != in.num_queries) {
    return absl::InvalidArgumentError(absl::StrCat(
        "keys: self-attention has K == Q, got K = ", in.num_keys, ", Q = ", in.num_queries));
  }
  if (c.rope && in.num_queries > in.num_keys) {
    return absl::InvalidArgumentError(absl::StrCat(
        "queries: a rotary model's queries are the last Q of its K positions, so Q <= K; got Q = ",
        in.num_queries, ", K = ", in.num_keys));
  }
  return absl::OkStatus();
}

// valid_lens: a count the layout knows, each entry within 0..K.
absl::Status CheckValidLens(const AttentionInputs& in) {
  const size_t vl = in.valid_lens.size();
  // Any count but 0, B and B*Q reads as one per row, and then B entries are needed.
  if (vl != static_cast<size_t>(in.batch * in.lens().per_row())) {
    return absl::InvalidArgumentError(absl::StrCat("valid_lens: expected 0, B = ", in.batch,
                                                   " or B*Q = ", in.batch * in.num_queries,
                                                   " entries, got ", vl));
  }
  for (size_t i = 0; i < vl; ++i) {
    if (in.valid_lens[i] < 0 || in.valid_lens[i] > in.num_keys) {
      return absl::InvalidArgumentError(
          absl::StrCat("valid_lens[", i, "]: expected 0 <= valid_len <= K = ", in.num_keys,
                       ", got ", in.valid_lens[i]));
    }
  }
  return absl::OkStatus();
}

// head_mask: none, or one finite factor per head.
absl::Status CheckHeadMask(std::span<const float> head_mask, int64_t num_heads) {
  if (head_mask.empty()) return absl::OkStatus();
  if (static_cast<int64_t>(head_mask.size()) != num_heads) {
    return absl::InvalidArgumentError(absl::StrCat("head_mask: expected ", num_heads,
                                                   " entries (one per head) or none, got ",
                                                   head_mask.size()));
  }
  for (size_t i = 0; i < head_mask.size(); ++i) {
    if (!std::isfinite(head_mask[i])) {
      return absl::InvalidArgumentError(
          absl::StrCat("head_mask[", i, "]: expected a finite value, got ", head_mask[i]));
    }
  }
  return absl::OkStatus();
}

// Step i of a paged call: a cache of the model's shape and precision with room for its
// new keys, used by no other step; its queries, keys and values consistent.
absl::Status CheckStep(std::span<const PagedStep> steps, size_t i, const ModelConfig& c) {
  const PagedStep& s = steps[i];
  auto error = [i](const char* field, const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat("step ", i, ": ", field, ": ", what));
  };
  if (s.cache == nullptr) return error("cache", "missing");
  if (s.cache->bf16() != c.cache_bf16()) {
    return error("cache",
                 absl::StrCat("holds ", s.cache->bf16() ? "bf16" : "f32", ", the model's cache is ",
                              c.cache_bf16() ? "bf16" : "f32", " (kv_cache_precision)"));
  }
  if (s.cache->num_heads() != c.kv_heads() || s.cache->head_size() != c.head_size()) {
    return error("cache", absl::StrCat("made for ", s.cache->num_heads(), " heads of ",
                                       s.cache->head_size(), ", the model caches ", c.kv_heads(),
                                       " key/value heads of ", c.head_size()));
  }
  if (s.num_queries < 0)
    return error("queries", absl::StrCat("expected >= 0 rows, got ", s.num_queries));
  if (s.num_queries > 0 && (s.queries == nullptr || s.output == nullptr)) {
    return error("queries, output", "missing");
  }
  if (c.attention_only() && s.keys == nullptr) {
    return error("keys",
                 "required: an attention-only model (projections NONE) takes each "
                 "step's projected keys and values");
  }
  if ((s.keys == nullptr) != (s.values == nullptr)) {
    return error("keys, values", "give both or neither (neither = self-attention)");
  }
  if (s.keys != nullptr && c.rope) {
    return error("keys", "a rotary model's steps are self-attention (keys and values omitted)");
  }
  if (s.keys == nullptr) {
    if (!c.SupportsSelfAttention()) {
      return error("keys",
                   absl::StrCat("required: the model's key_size ", c.key_size, " / value_size ",
                                c.value_size, " differ from query_size ", c.query_size));
    }
  } else if (s.num_keys < 0) {
    return error("keys", absl::StrCat("expected >= 0 rows, got ", s.num_keys));
  }
  if (s.causal && s.new_keys() != s.num_queries) {
    return error("keys", absl::StrCat("a causal step appends as many keys as it has queries, got ",
                                      s.new_keys(), " keys for ", s.num_queries, " queries"));
  }
  if (s.cache->size() + s.new_keys() > s.cache->capacity()) {
    return error("cache",
                 absl::StrCat("room for ", s.cache->capacity() - s.cache->size(),
                              " more tokens, the step appends ", s.new_keys(), " (Reserve first)"));
  }
  for (size_t j = 0; j < i; ++j) {
    if (steps[j].cache == s.cache) return error("cache", absl::StrCat("also step ", j, "'s"));
  }
  return absl::OkStatus();
}

}  // namespace

MultiHeadAttention::MultiHeadAttention(const ModelConfig& config, const Options& options,
                                       std::unique_ptr<Impl> impl)
    : config_(config), options_(options), impl_(std::move(impl)) {}

MultiHeadAttention::~MultiHeadAttention() = default;

void MultiHeadAttention::ShareWorkspacesWith(const MultiHeadAttention& other) {
  impl_->ShareWorkspaces(*other.impl_);
}

absl::StatusOr<std::unique_ptr<MultiHeadAttention>> MultiHeadAttention::Create(
    const ModelConfig& config, const Weights& weights) {
  return Create(config, weights, Options{});
}

absl::StatusOr<std::unique_ptr<MultiHeadAttention>> MultiHeadAttention::Create(
    const ModelConfig& config, const Weights& weights, const Options& options) {
  MHA_RETURN_IF_ERROR(config.Validate());
  MHA_RETURN_IF_ERROR(weights.Validate(config));
  if (options.query_block < 1 || options.query_block > internal::kMaxQueryBlock) {
    return absl::InvalidArgumentError(
        absl::StrCat("query_block: expected 1..", internal::kMaxQueryBlock));
  }
  if (options.key_block < 1 || options.key_block > 65536) {
    return absl::InvalidArgumentError("key_block: expected 1..65536");
  }
  if (options.num_threads < 0) return absl::InvalidArgumentError("num_threads: expected >= 0");
  std::unique_ptr<Impl> impl;
  MHA_RETURN_IF_ERROR(internal::Guarded("MultiHeadAttention::Create", [&] {
    impl = std::make_unique<Impl>(config, weights, options);
    return absl::OkStatus();
  }));
  return std::unique_ptr<MultiHeadAttention>(
      new MultiHeadAttention(config, options, std::move(impl)));
}

absl::Status MultiHeadAttention::CheckInputs(const AttentionInputs& in) const {
  MHA_RETURN_IF_ERROR(CheckSizes(in, config_));
  MHA_RETURN_IF_ERROR(CheckValidLens(in));
  return CheckHeadMask(in.head_mask, config_.num_heads);
}

int MultiHeadAttention::Prepare(int64_t max_rows, int64_t max_keys, ThreadRule rule) const {
  return impl_->Prepare(max_rows, max_keys, rule);
}

Precision MultiHeadAttention::GemmPrecision() const { return impl_->GemmPrecision(); }

int MultiHeadAttention::Threads(const AttentionInputs& inputs, ThreadRule rule) const {
  return impl_->ThreadsFor(inputs, /*max_threads=*/0, rule);
}

absl::Status MultiHeadAttention::Forward(const AttentionInputs& inputs, float* output,
                                         float* attention, int max_threads, float* lse) const {
  MHA_RETURN_IF_ERROR(CheckInputs(inputs));
  if (output == nullptr) return absl::InvalidArgumentError("output: missing");
  // Batch rows are independent. A call whose activations would outgrow the caches
  // runs as even slices of rows, each within kSliceElements.
  const int64_t B = inputs.batch, Q = inputs.num_queries, K = inputs.num_keys;
  const int64_t h = config_.num_heads, E = config_.num_hiddens;
  const int64_t max_rows = std::max<int64_t>(1, kSliceElements / (std::max(Q, K) * E));
  const int64_t slices = (B + max_rows - 1) / max_rows;
  const int64_t rows = (B + slices - 1) / slices;
  auto forward = [&](const AttentionInputs& in, float* out, float* weights, float* l) {
    return internal::Guarded("MultiHeadAttention::Forward",
                             [&] { return impl_->Forward(in, out, weights, max_threads, l); });
  };
  if (slices == 1) return forward(inputs, output, attention, lse);
  const ValidLens lens = inputs.lens();
  for (int64_t b0 = 0; b0 < B; b0 += rows) {
    AttentionInputs slice = inputs;
    slice.batch = std::min(rows, B - b0);
    slice.queries = inputs.queries + b0 * Q * config_.query_size;
    if (!inputs.self_attention()) {
      slice.keys = inputs.keys + b0 * K * config_.key_size;
      slice.values = inputs.values + b0 * K * config_.value_size;
    }
    slice.valid_lens = lens.rows(b0, slice.batch);
    MHA_RETURN_IF_ERROR(forward(slice, output + b0 * Q * E,
                                attention == nullptr ? nullptr : attention + b0 * h * Q * K,
                                lse == nullptr ? nullptr : lse + b0 * h * Q));
  }
  return absl::OkStatus();
}

absl::Status MultiHeadAttention::ForwardPaged(std::span<const PagedStep> steps,
                                              int max_threads) const {
  return ForwardPaged(
      steps, [](size_t) {}, max_threads);
}

absl::Status MultiHeadAttention::ForwardPaged(std::span<const PagedStep> steps,
                                              absl::FunctionRef<void(size_t)> step_done,
                                              int max_threads) const {
  const ModelConfig& c = config_;
  if (c.scoring != Scoring::kDotProduct) {
    return absl::InvalidArgumentError(
        "scoring: attention sessions need dot-product scoring; this model is additive");
  }
  for (size_t i = 0; i < steps.size(); ++i) MHA_RETURN_IF_ERROR(CheckStep(steps, i, c));
  if (steps.empty()) return absl::OkStatus();
  return internal::Guarded("MultiHeadAttention::ForwardPaged",
                           [&] { return impl_->ForwardPaged(steps, max_threads, step_done); });
}

double MultiHeadAttention::Flops(const ModelConfig& c, int64_t batch, int64_t num_queries,
                                 int64_t num_keys) {
  const double b = batch, q = num_queries, k = num_keys, e = c.num_hiddens;
  const double ekv = static_cast<double>(c.kv_hiddens());
  const double projections =
      c.attention_only()
          ? 0.0
          : 2 * b * (e * (q * c.query_size + q * e) + ekv * (k * c.key_size + k * c.value_size));
  const double context = 2 * b * q * k * e;  // all heads
  if (c.scoring == Scoring::kDotProduct) return projections + 2 * b * q * k * e + context;
  // Additive: A_q q and A_k k per head, then per (query, key, feature) an add, a
  // tanh and a multiply-add, counted as 4.
  const double pa = c.additive_hidden, h = c.num_heads;
  return projections + 2 * b * (q + k) * e * pa + 4 * b * h * q * k * pa + context;
}

}  // namespace mha::core

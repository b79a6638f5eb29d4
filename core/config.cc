#include "core/config.h"

#include <cmath>
#include <string>

#include "absl/strings/str_cat.h"

namespace mha::core {

absl::string_view PrecisionName(Precision precision) {
  switch (precision) {
    case Precision::kF32:
      return "f32";
    case Precision::kBf16:
      return "bf16";
    case Precision::kInt8:
      return "int8";
  }
  return "unknown";
}

absl::string_view ScoringName(Scoring scoring) {
  switch (scoring) {
    case Scoring::kDotProduct:
      return "dot_product";
    case Scoring::kAdditive:
      return "additive";
  }
  return "unknown";
}

absl::StatusOr<Precision> ParsePrecision(absl::string_view name) {
  if (name == "f32" || name == "fp32" || name == "float32") return Precision::kF32;
  if (name == "bf16" || name == "bfloat16") return Precision::kBf16;
  if (name == "int8" || name == "i8") return Precision::kInt8;
  return absl::InvalidArgumentError(
      absl::StrCat("precision: expected \"f32\", \"bf16\" or \"int8\", got \"", name, "\""));
}

namespace {

// Validate's checks, in the order it runs them: the first failure is the answer.

// Each dimension is bounded so that every product of two of them fits easily in
// int64 and no weight matrix exceeds 2^31 elements.
absl::Status CheckSizes(const ModelConfig& c) {
  constexpr int64_t kMaxDim = 1 << 16;
  auto check_dim = [](absl::string_view name, int64_t v) -> absl::Status {
    if (v < 1 || v > kMaxDim) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": expected 1 <= ", name, " <= ", kMaxDim, ", got ", v));
    }
    return absl::OkStatus();
  };
  for (auto [name, v] : {std::pair<absl::string_view, int64_t>{"num_hiddens", c.num_hiddens},
                         {"num_heads", c.num_heads},
                         {"query_size", c.query_size},
                         {"key_size", c.key_size},
                         {"value_size", c.value_size}}) {
    if (absl::Status s = check_dim(name, v); !s.ok()) return s;
  }
  if (c.num_hiddens % c.num_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat("num_hiddens: must be divisible by num_heads (",
                                                   c.num_hiddens, " % ", c.num_heads, " = ",
                                                   c.num_hiddens % c.num_heads, ")"));
  }
  if (c.scoring == Scoring::kAdditive) return check_dim("additive_hidden", c.additive_hidden);
  if (c.additive_hidden != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("additive_hidden: only for scoring ADDITIVE, got ", c.additive_hidden,
                     " with ", ScoringName(c.scoring), " scoring"));
  }
  return absl::OkStatus();
}

absl::Status CheckGrouping(const ModelConfig& c) {
  if (c.num_kv_heads < 0 || c.num_kv_heads > c.num_heads ||
      (c.num_kv_heads > 0 && c.num_heads % c.num_kv_heads != 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "num_kv_heads: expected 0 (= num_heads) or a divisor of num_heads = ", c.num_heads,
        ", got ", c.num_kv_heads));
  }
  if (c.kv_heads() != c.num_heads && c.scoring != Scoring::kDotProduct) {
    return absl::InvalidArgumentError(absl::StrCat("num_kv_heads: grouped key/value heads (",
                                                   c.kv_heads(), " of ", c.num_heads,
                                                   ") need dot-product scoring"));
  }
  return absl::OkStatus();
}

absl::Status CheckRope(const ModelConfig& c) {
  if (!c.rope) return absl::OkStatus();
  if (!std::isfinite(c.rope->theta) || c.rope->theta < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rope.theta: expected 0 (= 10000) or a finite value > 0, got ", c.rope->theta));
  }
  if (c.rope->rotary_dim < 0 || c.rope->rotary_dim > c.head_size() || c.rope->rotary_dim % 2 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("rotary_dim: expected 0 (= the head size) or an even number <= the head size ",
                     c.head_size(), ", got ", c.rope->rotary_dim));
  }
  if (c.rotary_dim() % 2 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rotary_dim: 0 means the head size, ", c.head_size(), ", which is odd; give an even one"));
  }
  if (c.scoring != Scoring::kDotProduct) {
    return absl::InvalidArgumentError("rope: rotary embeddings need dot-product scoring");
  }
  return absl::OkStatus();
}

absl::Status CheckPrecision(const ModelConfig& c) {
  if (c.kv_cache_precision == Precision::kF32 && c.precision == Precision::kBf16) {
    return absl::InvalidArgumentError(
        "kv_cache_precision: a bf16 model's cache is bf16; f32 is for f32 models");
  }
  if (c.precision == Precision::kInt8 && c.scoring != Scoring::kDotProduct) {
    return absl::InvalidArgumentError(
        "precision: int8 quantizes the projections of dot-product scoring only; additive "
        "scoring needs f32 or bf16");
  }
  if (c.precision == Precision::kInt8 && c.attention_only()) {
    return absl::InvalidArgumentError(
        "precision: int8 quantizes weights, and projections: NONE has none; use f32 or bf16");
  }
  return absl::OkStatus();
}

absl::Status CheckAttentionOnly(const ModelConfig& c) {
  if (!c.attention_only()) return absl::OkStatus();
  auto none = [](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat("projections: NONE ", what));
  };
  if (c.query_size != c.num_hiddens) {
    return none(absl::StrCat("takes projected queries: query_size must be num_hiddens = ",
                             c.num_hiddens, ", got ", c.query_size));
  }
  if (c.key_size != c.kv_hiddens() || c.value_size != c.kv_hiddens()) {
    return none(absl::StrCat("takes projected keys and values: key_size and value_size must be ",
                             "num_kv_heads * head size = ", c.kv_hiddens(), ", got ", c.key_size,
                             " and ", c.value_size));
  }
  if (c.bias) return none("has no weights, so no bias");
  if (c.rope) return none("takes q and k already rotated: rope must be absent");
  if (c.scoring != Scoring::kDotProduct) return none("needs dot-product scoring");
  return absl::OkStatus();
}

}  // namespace

absl::Status ModelConfig::Validate() const {
  for (auto check : {CheckSizes, CheckGrouping, CheckRope, CheckPrecision, CheckAttentionOnly}) {
    if (absl::Status s = check(*this); !s.ok()) return s;
  }
  if (!(dropout >= 0.0f && dropout < 1.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("dropout: expected 0 <= dropout < 1, got ", dropout));
  }
  return absl::OkStatus();
}

}  // namespace mha::core

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

absl::Status ModelConfig::Validate() const {
  // Each dimension is bounded so that every product of two of them fits easily in
  // int64 and no weight matrix exceeds 2^31 elements.
  constexpr int64_t kMaxDim = 1 << 16;
  auto check_dim = [](absl::string_view name, int64_t v) -> absl::Status {
    if (v < 1 || v > kMaxDim) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": expected 1 <= ", name, " <= ", kMaxDim, ", got ", v));
    }
    return absl::OkStatus();
  };
  for (auto [name, v] : {std::pair<absl::string_view, int64_t>{"num_hiddens", num_hiddens},
                         {"num_heads", num_heads},
                         {"query_size", query_size},
                         {"key_size", key_size},
                         {"value_size", value_size}}) {
    if (absl::Status s = check_dim(name, v); !s.ok()) return s;
  }
  if (num_hiddens % num_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat("num_hiddens: must be divisible by num_heads (",
                                                   num_hiddens, " % ", num_heads, " = ",
                                                   num_hiddens % num_heads, ")"));
  }
  if (scoring == Scoring::kAdditive) {
    if (absl::Status s = check_dim("additive_hidden", additive_hidden); !s.ok()) return s;
  } else if (additive_hidden != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("additive_hidden: only for scoring ADDITIVE, got ", additive_hidden, " with ",
                     ScoringName(scoring), " scoring"));
  }
  if (num_kv_heads < 0 || num_kv_heads > num_heads ||
      (num_kv_heads > 0 && num_heads % num_kv_heads != 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "num_kv_heads: expected 0 (= num_heads) or a divisor of num_heads = ", num_heads, ", got ",
        num_kv_heads));
  }
  if (kv_heads() != num_heads && scoring != Scoring::kDotProduct) {
    return absl::InvalidArgumentError(absl::StrCat("num_kv_heads: grouped key/value heads (",
                                                   kv_heads(), " of ", num_heads,
                                                   ") need dot-product scoring"));
  }
  if (rope) {
    if (!std::isfinite(rope->theta) || rope->theta < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "rope.theta: expected 0 (= 10000) or a finite value > 0, got ", rope->theta));
    }
    if (rope->rotary_dim < 0 || rope->rotary_dim > head_size() || rope->rotary_dim % 2 != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "rotary_dim: expected 0 (= the head size) or an even number <= the head size ",
          head_size(), ", got ", rope->rotary_dim));
    }
    if (rotary_dim() % 2 != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "rotary_dim: 0 means the head size, ", head_size(), ", which is odd; give an even one"));
    }
    if (scoring != Scoring::kDotProduct) {
      return absl::InvalidArgumentError("rope: rotary embeddings need dot-product scoring");
    }
  }
  if (kv_cache_precision == Precision::kF32 && precision == Precision::kBf16) {
    return absl::InvalidArgumentError(
        "kv_cache_precision: a bf16 model's cache is bf16; f32 is for f32 models");
  }
  if (precision == Precision::kInt8 && scoring != Scoring::kDotProduct) {
    return absl::InvalidArgumentError(
        "precision: int8 quantizes the projections of dot-product scoring only; additive "
        "scoring needs f32 or bf16");
  }
  if (precision == Precision::kInt8 && attention_only()) {
    return absl::InvalidArgumentError(
        "precision: int8 quantizes weights, and projections: NONE has none; use f32 or bf16");
  }
  if (attention_only()) {
    auto none = [](const std::string& what) {
      return absl::InvalidArgumentError(absl::StrCat("projections: NONE ", what));
    };
    if (query_size != num_hiddens) {
      return none(absl::StrCat("takes projected queries: query_size must be num_hiddens = ",
                               num_hiddens, ", got ", query_size));
    }
    if (key_size != kv_hiddens() || value_size != kv_hiddens()) {
      return none(absl::StrCat("takes projected keys and values: key_size and value_size must be ",
                               "num_kv_heads * head size = ", kv_hiddens(), ", got ", key_size,
                               " and ", value_size));
    }
    if (bias) return none("has no weights, so no bias");
    if (rope) return none("takes q and k already rotated: rope must be absent");
    if (scoring != Scoring::kDotProduct) return none("needs dot-product scoring");
  }
  if (!(dropout >= 0.0f && dropout < 1.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("dropout: expected 0 <= dropout < 1, got ", dropout));
  }
  return absl::OkStatus();
}

}  // namespace mha::core

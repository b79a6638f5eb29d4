#include "core/weights.h"

#include <cmath>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "base/splitmix64.h"
#include "base/status_macros.h"
#include "core/safetensors.h"

namespace mha::core {
namespace {

// Uniform in [-1, 1) from 24 bits: the weights' own conversion, older than
// SplitMix64::Signed() and kept so that seeded weights stay the same.
float Symmetric(SplitMix64& rng) { return static_cast<float>((rng.Next() >> 40) * 0x1p-23 - 1.0); }

uint64_t HashName(absl::string_view name) {
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a
  for (char c : name) h = (h ^ static_cast<uint8_t>(c)) * 0x100000001b3ull;
  return h;
}

std::vector<float> Uniform(absl::string_view name, uint64_t seed, int64_t n, int64_t fan_in) {
  SplitMix64 rng(seed ^ HashName(name));
  const float bound = 1.0f / std::sqrt(static_cast<float>(fan_in));
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = bound * Symmetric(rng);
  return v;
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("(", absl::StrJoin(shape, ", "), ")");
}

// Fetches one float tensor of the expected shape and marks its name used.
absl::StatusOr<std::vector<float>> Take(const SafetensorsFile& file, const std::string& name,
                                        const std::vector<int64_t>& shape,
                                        std::set<std::string>& used) {
  auto it = file.tensors().find(name);
  if (it == file.tensors().end()) {
    return absl::InvalidArgumentError(
        absl::StrCat(file.source(), ": missing tensor \"", name, "\" ", ShapeString(shape)));
  }
  used.insert(name);
  if (it->second.shape != shape) {
    return absl::InvalidArgumentError(absl::StrCat(file.source(), ": tensor \"", name,
                                                   "\": expected shape ", ShapeString(shape),
                                                   ", got ", ShapeString(it->second.shape)));
  }
  auto values = it->second.ToFloat(name);
  if (!values.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(file.source(), ": ", values.status().message()));
  }
  return values;
}

std::vector<float> Slice(const std::vector<float>& v, int64_t begin, int64_t n) {
  return std::vector<float>(v.begin() + begin, v.begin() + begin + n);
}

absl::Status LoadTorchNaming(const SafetensorsFile& file, const ModelConfig& c, Weights& w,
                             std::set<std::string>& used) {
  const int64_t e = c.num_hiddens;
  if (c.query_size != e) {
    return absl::InvalidArgumentError(absl::StrCat(
        file.source(), ": nn.MultiheadAttention weights need query_size == num_hiddens (",
        c.query_size, " != ", e, ")"));
  }
  if (file.tensors().contains("in_proj_weight")) {
    if (c.key_size != e || c.value_size != e) {
      return absl::InvalidArgumentError(
          absl::StrCat(file.source(),
                       ": tensor \"in_proj_weight\" is packed, which needs key_size == "
                       "value_size == num_hiddens; export q_proj_weight, k_proj_weight and "
                       "v_proj_weight instead"));
    }
    MHA_ASSIGN_OR_RETURN(std::vector<float> packed, Take(file, "in_proj_weight", {3 * e, e}, used));
    w.w_q = Slice(packed, 0, e * e);
    w.w_k = Slice(packed, e * e, e * e);
    w.w_v = Slice(packed, 2 * e * e, e * e);
  } else {
    MHA_ASSIGN_OR_RETURN(w.w_q, Take(file, "q_proj_weight", {e, c.query_size}, used));
    MHA_ASSIGN_OR_RETURN(w.w_k, Take(file, "k_proj_weight", {e, c.key_size}, used));
    MHA_ASSIGN_OR_RETURN(w.w_v, Take(file, "v_proj_weight", {e, c.value_size}, used));
  }
  MHA_ASSIGN_OR_RETURN(w.w_o, Take(file, "out_proj.weight", {e, e}, used));
  if (c.bias) {
    MHA_ASSIGN_OR_RETURN(std::vector<float> packed, Take(file, "in_proj_bias", {3 * e}, used));
    w.b_q = Slice(packed, 0, e);
    w.b_k = Slice(packed, e, e);
    w.b_v = Slice(packed, 2 * e, e);
    MHA_ASSIGN_OR_RETURN(w.b_o, Take(file, "out_proj.bias", {e}, used));
  }
  return absl::OkStatus();
}

// One additive scoring tensor: `per_head` (h, ...) as stored, or `shared`, whose
// values every head repeats.
absl::StatusOr<std::vector<float>> TakePerHead(const SafetensorsFile& file, const std::string& name,
                                               const std::vector<int64_t>& shared,
                                               const std::vector<int64_t>& per_head,
                                               std::set<std::string>& used) {
  const auto it = file.tensors().find(name);
  if (it != file.tensors().end() && it->second.shape == per_head) {
    return Take(file, name, per_head, used);
  }
  if (it != file.tensors().end() && it->second.shape != shared) {
    return absl::InvalidArgumentError(
        absl::StrCat(file.source(), ": tensor \"", name, "\": expected shape ", ShapeString(shared),
                     " (shared by every head) or ", ShapeString(per_head), " (one per head), got ",
                     ShapeString(it->second.shape)));
  }
  MHA_ASSIGN_OR_RETURN(std::vector<float> one, Take(file, name, shared, used));
  std::vector<float> stacked;
  stacked.reserve(one.size() * per_head[0]);
  for (int64_t h = 0; h < per_head[0]; ++h) stacked.insert(stacked.end(), one.begin(), one.end());
  return stacked;
}

absl::Status LoadAdditiveScoring(const SafetensorsFile& file, const ModelConfig& c, Weights& w,
                                 std::set<std::string>& used) {
  const int64_t h = c.num_heads, p = c.head_size(), pa = c.additive_hidden;
  MHA_ASSIGN_OR_RETURN(w.score_w_q,
                       TakePerHead(file, "attention.W_q.weight", {pa, p}, {h, pa, p}, used));
  MHA_ASSIGN_OR_RETURN(w.score_w_k,
                       TakePerHead(file, "attention.W_k.weight", {pa, p}, {h, pa, p}, used));
  MHA_ASSIGN_OR_RETURN(w.score_w_v,
                       TakePerHead(file, "attention.w_v.weight", {1, pa}, {h, pa}, used));
  return absl::OkStatus();
}

absl::Status LoadD2lNaming(const SafetensorsFile& file, const ModelConfig& c, Weights& w,
                           std::set<std::string>& used) {
  const int64_t p = c.num_hiddens;
  MHA_ASSIGN_OR_RETURN(w.w_q, Take(file, "W_q.weight", {p, c.query_size}, used));
  MHA_ASSIGN_OR_RETURN(w.w_k, Take(file, "W_k.weight", {p, c.key_size}, used));
  MHA_ASSIGN_OR_RETURN(w.w_v, Take(file, "W_v.weight", {p, c.value_size}, used));
  MHA_ASSIGN_OR_RETURN(w.w_o, Take(file, "W_o.weight", {p, p}, used));
  if (c.bias) {
    MHA_ASSIGN_OR_RETURN(w.b_q, Take(file, "W_q.bias", {p}, used));
    MHA_ASSIGN_OR_RETURN(w.b_k, Take(file, "W_k.bias", {p}, used));
    MHA_ASSIGN_OR_RETURN(w.b_v, Take(file, "W_v.bias", {p}, used));
    MHA_ASSIGN_OR_RETURN(w.b_o, Take(file, "W_o.bias", {p}, used));
  }
  if (c.scoring == Scoring::kAdditive) MHA_RETURN_IF_ERROR(LoadAdditiveScoring(file, c, w, used));
  return absl::OkStatus();
}

// One Hugging Face tensor: the error names it and the shape expected, with the
// formula it follows (`k_proj.weight: expected (G·d_h, d_k) = (32, 128)`).
absl::StatusOr<std::vector<float>> TakeNamed(const SafetensorsFile& file, const std::string& name,
                                             const std::vector<int64_t>& shape,
                                             absl::string_view formula,
                                             std::set<std::string>& used) {
  const std::string expected =
      absl::StrCat(name, ": expected ", formula, " = ", ShapeString(shape));
  auto it = file.tensors().find(name);
  if (it == file.tensors().end()) {
    return absl::InvalidArgumentError(absl::StrCat(file.source(), ": missing tensor ", expected));
  }
  if (it->second.shape != shape) {
    return absl::InvalidArgumentError(
        absl::StrCat(file.source(), ": ", expected, ", got ", ShapeString(it->second.shape)));
  }
  return Take(file, name, shape, used);
}

// Hugging Face attention modules (Llama, Mistral, Qwen2).
absl::Status LoadHuggingFaceNaming(const SafetensorsFile& file, const ModelConfig& c, Weights& w,
                                   std::set<std::string>& used) {
  const int64_t e = c.num_hiddens, ekv = c.kv_hiddens();
  MHA_ASSIGN_OR_RETURN(w.w_q,
                       TakeNamed(file, "q_proj.weight", {e, c.query_size}, "(h·d_h, d_q)", used));
  MHA_ASSIGN_OR_RETURN(w.w_k,
                       TakeNamed(file, "k_proj.weight", {ekv, c.key_size}, "(G·d_h, d_k)", used));
  MHA_ASSIGN_OR_RETURN(w.w_v,
                       TakeNamed(file, "v_proj.weight", {ekv, c.value_size}, "(G·d_h, d_v)", used));
  MHA_ASSIGN_OR_RETURN(w.w_o, TakeNamed(file, "o_proj.weight", {e, e}, "(p_o, h·d_h)", used));
  if (c.bias) {
    MHA_ASSIGN_OR_RETURN(w.b_q, TakeNamed(file, "q_proj.bias", {e}, "(h·d_h)", used));
    MHA_ASSIGN_OR_RETURN(w.b_k, TakeNamed(file, "k_proj.bias", {ekv}, "(G·d_h)", used));
    MHA_ASSIGN_OR_RETURN(w.b_v, TakeNamed(file, "v_proj.bias", {ekv}, "(G·d_h)", used));
    // Optional, as Qwen2's: absent = zero.
    if (file.tensors().contains("o_proj.bias")) {
      MHA_ASSIGN_OR_RETURN(w.b_o, TakeNamed(file, "o_proj.bias", {e}, "(p_o)", used));
    } else {
      w.b_o.assign(static_cast<size_t>(e), 0.0f);
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status Weights::Validate(const ModelConfig& c) const {
  const int64_t p = c.num_hiddens, h = c.num_heads, pa = c.additive_hidden;
  const int64_t pkv = c.kv_hiddens();  // G * head_size: p_o unless grouped
  const bool additive = c.scoring == Scoring::kAdditive;
  // Optional tensors say which setting their expected size follows.
  const std::string bias = absl::StrCat(" (bias=", c.bias, ")");
  const std::string scoring = absl::StrCat(" (scoring ", ScoringName(c.scoring), ")");
  struct Expect {
    absl::string_view name;
    const std::vector<float>& v;
    int64_t n;
    absl::string_view why;
  };
  // An attention-only layer (projections NONE) has no weights at all.
  const bool full = !c.attention_only();
  const std::string none = full ? "" : " (projections NONE)";
  const Expect expects[] = {
      {"W_q", w_q, full ? p * c.query_size : 0, none},
      {"W_k", w_k, full ? pkv * c.key_size : 0, none},
      {"W_v", w_v, full ? pkv * c.value_size : 0, none},
      {"W_o", w_o, full ? p * p : 0, none},
      {"b_q", b_q, c.bias ? p : 0, bias},
      {"b_k", b_k, c.bias ? pkv : 0, bias},
      {"b_v", b_v, c.bias ? pkv : 0, bias},
      {"b_o", b_o, c.bias ? p : 0, bias},
      {"score_w_q", score_w_q, additive ? h * pa * c.head_size() : 0, scoring},
      {"score_w_k", score_w_k, additive ? h * pa * c.head_size() : 0, scoring},
      {"score_w_v", score_w_v, additive ? h * pa : 0, scoring},
  };
  for (const Expect& e : expects) {
    if (static_cast<int64_t>(e.v.size()) != e.n) {
      return absl::InvalidArgumentError(absl::StrCat("weights ", e.name, ": expected ", e.n,
                                                     " values", e.why, ", got ", e.v.size()));
    }
  }
  return absl::OkStatus();
}

Weights SeededWeights(const ModelConfig& c, uint64_t seed) {
  const int64_t p = c.num_hiddens, pkv = c.kv_hiddens();
  Weights w;
  if (c.attention_only()) return w;  // projections NONE: no weights
  // A grouped model's K and V weights are the first G * head_size rows of what the
  // same seed gives a multi-head one.
  w.w_q = Uniform("W_q.weight", seed, p * c.query_size, c.query_size);
  w.w_k = Uniform("W_k.weight", seed, pkv * c.key_size, c.key_size);
  w.w_v = Uniform("W_v.weight", seed, pkv * c.value_size, c.value_size);
  w.w_o = Uniform("W_o.weight", seed, p * p, p);
  if (c.bias) {
    w.b_q = Uniform("W_q.bias", seed, p, c.query_size);
    w.b_k = Uniform("W_k.bias", seed, pkv, c.key_size);
    w.b_v = Uniform("W_v.bias", seed, pkv, c.value_size);
    w.b_o = Uniform("W_o.bias", seed, p, p);
  }
  if (c.scoring == Scoring::kAdditive) {
    const int64_t h = c.num_heads, pa = c.additive_hidden, hp = c.head_size();
    w.score_w_q = Uniform("attention.W_q.weight", seed, h * pa * hp, hp);
    w.score_w_k = Uniform("attention.W_k.weight", seed, h * pa * hp, hp);
    w.score_w_v = Uniform("attention.w_v.weight", seed, h * pa, pa);
  }
  return w;
}

absl::StatusOr<Weights> WeightsFromSafetensors(const SafetensorsFile& file,
                                               const ModelConfig& config) {
  MHA_RETURN_IF_ERROR(config.Validate());
  const auto& t = file.tensors();
  const bool torch =
      t.contains("in_proj_weight") || t.contains("q_proj_weight") || t.contains("out_proj.weight");
  const bool d2l = t.contains("W_q.weight") || t.contains("W_o.weight");
  const bool hf = t.contains("q_proj.weight") || t.contains("o_proj.weight");
  if (torch + d2l + hf > 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        file.source(),
        ": mixes namings: nn.MultiheadAttention (in_proj_weight, out_proj.*), "
        "d2l (W_q.weight, ...) and Hugging Face (q_proj.weight, ...); use one naming"));
  }
  if (!torch && !d2l && !hf) {
    return absl::InvalidArgumentError(absl::StrCat(
        file.source(),
        ": no known weight names; expected nn.MultiheadAttention "
        "(in_proj_weight, out_proj.weight, ...), d2l (W_q.weight, ...) or Hugging Face "
        "(q_proj.weight, k_proj.weight, v_proj.weight, o_proj.weight)"));
  }
  if (!d2l && config.scoring == Scoring::kAdditive) {
    return absl::InvalidArgumentError(
        absl::StrCat(file.source(),
                     ": additive scoring needs d2l names (W_q.weight, ..., "
                     "attention.W_q.weight, attention.W_k.weight, attention.w_v.weight); "
                     "nn.MultiheadAttention and Hugging Face names have no additive form"));
  }
  if (!hf && config.kv_heads() != config.num_heads) {
    return absl::InvalidArgumentError(absl::StrCat(
        file.source(), ": num_kv_heads: a grouped-query model (", config.kv_heads(),
        " key/value heads for ", config.num_heads,
        " query heads) loads from Hugging Face names (q_proj.weight, k_proj.weight, ...) or "
        "seeded weights; nn.MultiheadAttention and d2l names have one key/value head per "
        "query head"));
  }
  Weights w;
  std::set<std::string> used;
  MHA_RETURN_IF_ERROR(hf      ? LoadHuggingFaceNaming(file, config, w, used)
                      : torch ? LoadTorchNaming(file, config, w, used)
                              : LoadD2lNaming(file, config, w, used));
  for (const auto& [name, view] : t) {
    if (!used.contains(name)) {
      return absl::InvalidArgumentError(absl::StrCat(
          file.source(), ": unexpected tensor \"", name, "\" ", ShapeString(view.shape),
          config.bias ? "" : " (the model config says bias: false)"));
    }
  }
  return w;
}

absl::StatusOr<Weights> LoadSafetensorsWeights(const std::string& path, const ModelConfig& config) {
  MHA_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsFile> file, SafetensorsFile::Open(path));
  return WeightsFromSafetensors(*file, config);
}

}  // namespace mha::core

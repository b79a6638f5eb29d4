// libFuzzer target (c): config.pbtxt text -> ParseModelConfig -> ResolveModelConfig
// (sizes, precision, limits, grouped-query heads, rotary positions, the session
// cache), as LoadModel does. A config that resolves must give a valid core
// configuration and positive limits; when its seeded weights are small the layer is
// built (MultiHeadAttention::Create) and runs one forward pass (a rotary one also a
// causal pass with Q < K).
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/strings/string_view.h"
#include "core/attention.h"
#include "core/weights.h"
#include "server/models/model_repository.h"
#include "tests/fuzz/fuzz_util.h"

namespace {
constexpr int64_t kMaxBuiltWeights = int64_t{1} << 14;  // floats; larger layers only resolve
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::string_view text(reinterpret_cast<const char*>(data), size);
  auto proto = mha::server::ParseModelConfig(text, "config.pbtxt");
  if (!proto.ok()) {
    MHA_FUZZ_CHECK(proto.status().code() == absl::StatusCode::kInvalidArgument);
    return 0;
  }
  const mha::server::ModelRepository::Options defaults;
  auto resolved = mha::server::ResolveModelConfig(*proto, "fuzz", defaults);
  if (!resolved.ok()) {
    MHA_FUZZ_CHECK(resolved.status().code() == absl::StatusCode::kInvalidArgument, "%s\n",
                   resolved.status().ToString().c_str());
    return 0;
  }
  const mha::core::ModelConfig& c = resolved->config;
  MHA_FUZZ_CHECK(c.Validate().ok());
  MHA_FUZZ_CHECK(c.head_size() * c.num_heads == c.num_hiddens);
  // Issue 34's fields, resolved: G divides h; rope's theta finite and positive, its
  // rotary_dim even and within the head; a bf16 model's cache is bf16.
  MHA_FUZZ_CHECK(c.kv_heads() >= 1 && c.num_heads % c.kv_heads() == 0);
  if (c.rope) {
    MHA_FUZZ_CHECK(std::isfinite(c.rope_theta()) && c.rope_theta() > 0);
    MHA_FUZZ_CHECK(c.rotary_dim() >= 2 && c.rotary_dim() % 2 == 0 &&
                   c.rotary_dim() <= c.head_size());
  }
  MHA_FUZZ_CHECK(c.precision != mha::core::Precision::kBf16 || c.cache_bf16());
  const mha::server::ModelLimits& l = resolved->limits;
  MHA_FUZZ_CHECK(l.max_batch_size >= 1 && l.max_sequence_length >= 1 && l.max_request_bytes >= 1 &&
                 l.max_attention_elements >= 1);
  const mha::server::BatchingPolicy& b = resolved->batching;
  MHA_FUZZ_CHECK(b.max_batch_size >= 1 && b.max_batch_size <= l.max_batch_size &&
                 b.max_queue_size >= 1 && b.max_batch_tokens >= 1 &&
                 b.max_queue_delay >= absl::ZeroDuration());

  const int64_t weights =
      c.num_hiddens * (c.query_size + c.key_size + c.value_size + c.num_hiddens) +
      (2 * c.num_hiddens + c.num_heads) * c.additive_hidden;
  if (!proto->has_seeded() || weights > kMaxBuiltWeights) return 0;
  mha::core::MultiHeadAttention::Options options;
  options.num_threads = 1;
  auto layer = mha::core::MultiHeadAttention::Create(
      c, mha::core::SeededWeights(c, proto->seeded().seed()), options);
  MHA_FUZZ_CHECK(layer.ok(), "%s\n", layer.status().ToString().c_str());
  const int64_t batch = 1, length = 3;
  std::vector<float> queries(batch * length * c.query_size, 0.25f);
  std::vector<float> keys(batch * length * c.key_size, -0.5f);
  std::vector<float> values(batch * length * c.value_size, 1.0f);
  std::vector<float> output(batch * length * c.num_hiddens);
  const absl::Status forward = (*layer)->Forward({.batch = batch,
                                                  .num_queries = length,
                                                  .num_keys = length,
                                                  .queries = queries.data(),
                                                  .keys = keys.data(),
                                                  .values = values.data()},
                                                 output.data());
  MHA_FUZZ_CHECK(forward.ok(), "%s\n", forward.ToString().c_str());
  for (float v : output) MHA_FUZZ_CHECK(std::isfinite(v));
  if (c.rope) {
    // Q < K, bottom-right causal: the last query sees every key, the first all but one.
    const absl::Status causal = (*layer)->Forward({.batch = batch,
                                                   .num_queries = length - 1,
                                                   .num_keys = length,
                                                   .queries = queries.data(),
                                                   .keys = keys.data(),
                                                   .values = values.data(),
                                                   .causal = true},
                                                  output.data());
    MHA_FUZZ_CHECK(causal.ok(), "%s\n", causal.ToString().c_str());
  }
  return 0;
}

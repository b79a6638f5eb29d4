// The seeds' toy example (d2l, "Multi-Head Attention"): p_o 100, h 5, queries
// (2, 4, 100), keys and values (2, 6, 100), valid_lens [3, 2], the inputs from
// SplitMix64(0) (base/splitmix64.h) and the weights SeededWeights(config, 0): the
// request and model of `attention_client infer` against `attention_server` with
// no flags, which prints the same rows. Prints the output shape and the first
// values of each row.
#include <cstdio>
#include <vector>

#include "base/output_rows.h"
#include "base/splitmix64.h"
#include "core/attention.h"

int main() {
  using namespace mha::core;
  const ModelConfig config;  // the defaults are the toy sizes
  auto mha = MultiHeadAttention::Create(config, SeededWeights(config, /*seed=*/0));
  if (!mha.ok()) {
    std::fprintf(stderr, "%s\n", mha.status().ToString().c_str());
    return 1;
  }
  constexpr int64_t kBatch = 2, kQueries = 4, kKeys = 6;
  std::vector<float> queries(kBatch * kQueries * config.query_size),
      keys(kBatch * kKeys * config.key_size), values(kBatch * kKeys * config.value_size),
      out(kBatch * kQueries * config.num_hiddens);
  mha::SplitMix64 inputs(/*seed=*/0);
  for (std::vector<float>* tensor : {&queries, &keys, &values}) {
    for (float& x : *tensor) x = inputs.Signed();
  }
  const int32_t lens[] = {3, 2};
  AttentionInputs in{.batch = kBatch,
                     .num_queries = kQueries,
                     .num_keys = kKeys,
                     .queries = queries.data(),
                     .keys = keys.data(),
                     .values = values.data(),
                     .valid_lens = lens};
  if (absl::Status s = (*mha)->Forward(in, out.data()); !s.ok()) {
    std::fprintf(stderr, "%s\n", s.ToString().c_str());
    return 1;
  }
  std::printf("output shape: (%lld, %lld, %lld)\n", static_cast<long long>(kBatch),
              static_cast<long long>(kQueries), static_cast<long long>(config.num_hiddens));
  for (int64_t b = 0; b < kBatch; ++b) {
    for (int64_t q = 0; q < kQueries; ++q) {
      std::printf("%s\n", mha::OutputRow(out.data(), kQueries, config.num_hiddens, b, q).c_str());
    }
  }
  return 0;
}

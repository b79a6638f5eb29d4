// The seeds' toy example (d2l, "Multi-Head Attention"): p_o 100, h 5, queries
// (2, 4, 100), keys = values (2, 6, 100), valid_lens [3, 2]. Prints the output shape
// and the first values of each row.
#include <cmath>
#include <cstdio>
#include <vector>

#include "core/attention.h"

int main() {
  using namespace mha::core;
  const ModelConfig config;  // the defaults are the toy sizes
  auto mha = MultiHeadAttention::Create(config, SeededWeights(config, /*seed=*/0));
  if (!mha.ok()) {
    std::fprintf(stderr, "%s\n", mha.status().ToString().c_str());
    return 1;
  }
  // Deterministic inputs in [-1, 1]; d2l uses ones, which makes every row equal.
  std::vector<float> x(2 * 4 * 100), y(2 * 6 * 100), out(2 * 4 * 100);
  for (size_t i = 0; i < x.size(); ++i) x[i] = std::sin(0.37f * static_cast<float>(i));
  for (size_t i = 0; i < y.size(); ++i) y[i] = std::cos(0.11f * static_cast<float>(i));
  const int32_t lens[] = {3, 2};
  AttentionInputs in{.batch = 2, .num_queries = 4, .num_keys = 6, .queries = x.data(),
                     .keys = y.data(), .values = y.data(), .valid_lens = lens};
  if (absl::Status s = (*mha)->Forward(in, out.data()); !s.ok()) {
    std::fprintf(stderr, "%s\n", s.ToString().c_str());
    return 1;
  }
  std::printf("output shape: (2, 4, 100)\n");
  for (int row = 0; row < 8; ++row) {
    std::printf("[%d, %d, :4] =", row / 4, row % 4);
    for (int j = 0; j < 4; ++j) std::printf(" %+.5f", out[row * 100 + j]);
    std::printf("\n");
  }
  return 0;
}

// The first values of each output row, as mha_toy_example and `attention_client
// infer` print them, so that the two can be compared line for line:
//
//   [0, 0, :4] = +0.12345 -0.06789 +0.00120 -0.31416
#ifndef MHA_BASE_OUTPUT_ROWS_H_
#define MHA_BASE_OUTPUT_ROWS_H_

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>

namespace mha {

// Row (b, q) of a (B, Q, n) row-major output: its first min(n, 4) values.
inline std::string OutputRow(const float* output, int64_t num_queries, int64_t n, int64_t b,
                             int64_t q) {
  const int64_t count = std::min<int64_t>(n, 4);
  char text[64];  // the longest float in %+.5f is 47 characters
  std::snprintf(text, sizeof(text), "[%lld, %lld, :%lld] =", static_cast<long long>(b),
                static_cast<long long>(q), static_cast<long long>(count));
  std::string row = text;
  for (int64_t j = 0; j < count; ++j) {
    std::snprintf(text, sizeof(text), " %+.5f", output[(b * num_queries + q) * n + j]);
    row += text;
  }
  return row;
}

}  // namespace mha

#endif  // MHA_BASE_OUTPUT_ROWS_H_

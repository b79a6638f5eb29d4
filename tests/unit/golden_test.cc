// Checks the core against outputs that PyTorch computed (tests/golden/make_golden.py):
// nn.MultiheadAttention under its own weight naming, and a d2l-style module with
// dot-product or additive scoring (shared by the heads, or one set per head).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "core/attention.h"
#include "core/safetensors.h"
#include "core/weights.h"
#include "gtest/gtest.h"

namespace mha::core {
namespace {

// PyTorch computed in float64 and stored float32.
constexpr double kTolerance = 1e-4;

std::vector<std::string> Cases() {
  std::vector<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(MHA_GOLDEN_DIR)) {
    const std::string file = entry.path().filename().string();
    const std::string suffix = ".io.safetensors";
    if (file.size() > suffix.size() && file.ends_with(suffix)) {
      names.push_back(file.substr(0, file.size() - suffix.size()));
    }
  }
  std::sort(names.begin(), names.end());
  return names;
}

int64_t Meta(const SafetensorsFile& f, const std::string& key) {
  int64_t v = -1;
  EXPECT_TRUE(absl::SimpleAtoi(f.metadata().at(key), &v)) << key;
  return v;
}

class GoldenTest : public ::testing::TestWithParam<std::string> {};

TEST_P(GoldenTest, MatchesPyTorch) {
  const std::string base = std::string(MHA_GOLDEN_DIR) + "/" + GetParam();
  auto io = SafetensorsFile::Open(base + ".io.safetensors").value();
  ModelConfig c{.num_hiddens = Meta(*io, "num_hiddens"),
                .num_heads = Meta(*io, "num_heads"),
                .query_size = Meta(*io, "query_size"),
                .key_size = Meta(*io, "key_size"),
                .value_size = Meta(*io, "value_size"),
                .bias = io->metadata().at("bias") == "true"};
  if (io->metadata().contains("scoring")) {
    ASSERT_EQ(io->metadata().at("scoring"), "additive");
    c.scoring = Scoring::kAdditive;
    c.additive_hidden = Meta(*io, "additive_hidden");
  }
  auto weights = LoadSafetensorsWeights(base + ".weights.safetensors", c);
  ASSERT_TRUE(weights.ok()) << weights.status();
  auto mha = MultiHeadAttention::Create(c, *weights).value();

  const TensorView qv = io->Get("queries").value();
  const std::vector<float> queries = qv.ToFloat("queries").value();
  std::vector<float> keys, values;
  AttentionInputs in{.batch = qv.shape[0],
                     .num_queries = qv.shape[1],
                     .num_keys = qv.shape[1],
                     .queries = queries.data(),
                     .causal = io->metadata().at("causal") == "true"};
  if (io->tensors().contains("keys")) {
    const TensorView kv = io->Get("keys").value();
    keys = kv.ToFloat("keys").value();
    values = io->Get("values").value().ToFloat("values").value();
    in.num_keys = kv.shape[1];
    in.keys = keys.data();
    in.values = values.data();
  }
  std::vector<int32_t> lens;
  if (io->tensors().contains("valid_lens")) {
    const TensorView lv = io->Get("valid_lens").value();
    ASSERT_EQ(lv.dtype, DType::kI32);
    lens.resize(lv.num_elements());
    std::memcpy(lens.data(), lv.data, lv.num_bytes);
    in.valid_lens = lens;
  }
  const std::vector<float> expected = io->Get("output").value().ToFloat("output").value();
  std::vector<float> out(expected.size());
  ASSERT_TRUE(mha->Forward(in, out.data()).ok());

  const int64_t e = c.num_hiddens;
  int64_t compared = 0, nan_rows = 0;
  for (int64_t row = 0; row < in.batch * in.num_queries; ++row) {
    if (std::isnan(expected[row * e])) {
      // PyTorch's all-masked row: ours is a zero context, so the output is b_o.
      ++nan_rows;
      for (int64_t o = 0; o < e; ++o) {
        EXPECT_EQ(out[row * e + o], c.bias ? weights->b_o[o] : 0.0f) << "row " << row;
      }
      continue;
    }
    for (int64_t o = 0; o < e; ++o) {
      EXPECT_NEAR(out[row * e + o], expected[row * e + o], kTolerance)
          << "row " << row << " col " << o;
      ++compared;
    }
  }
  EXPECT_GT(compared, 0);
  RecordProperty("nan_rows", static_cast<int>(nan_rows));
}

INSTANTIATE_TEST_SUITE_P(PyTorch, GoldenTest, ::testing::ValuesIn(Cases()),
                         [](const auto& info) { return info.param; });

TEST(GoldenFilesTest, AllCasesPresent) { EXPECT_GE(Cases().size(), 7u); }

}  // namespace
}  // namespace mha::core

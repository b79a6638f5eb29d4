// Checks the core against outputs that PyTorch computed (tests/golden/make_golden.py):
// nn.MultiheadAttention under its own weight naming, and a d2l-style module with
// dot-product or additive scoring (shared by the heads, or one set per head).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "core/attention.h"
#include "core/safetensors.h"
#include "core/weights.h"
#include "gtest/gtest.h"
#include "tests/unit/test_util.h"

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

// One golden case: the layer's config and weights, its inputs and PyTorch's output.
struct Golden {
  ModelConfig config;
  Weights weights;
  std::vector<float> queries, keys, values, expected;
  std::vector<int32_t> lens;
  AttentionInputs in;
};

std::unique_ptr<Golden> Load(const std::string& name) {
  const std::string base = std::string(MHA_GOLDEN_DIR) + "/" + name;
  auto io = SafetensorsFile::Open(base + ".io.safetensors").value();
  auto g = std::make_unique<Golden>();
  ModelConfig& c = g->config;
  c = {.num_hiddens = Meta(*io, "num_hiddens"),
       .num_heads = Meta(*io, "num_heads"),
       .query_size = Meta(*io, "query_size"),
       .key_size = Meta(*io, "key_size"),
       .value_size = Meta(*io, "value_size"),
       .bias = io->metadata().at("bias") == "true"};
  if (io->metadata().contains("scoring")) {
    EXPECT_EQ(io->metadata().at("scoring"), "additive");
    c.scoring = Scoring::kAdditive;
    c.additive_hidden = Meta(*io, "additive_hidden");
  }
  auto weights = LoadSafetensorsWeights(base + ".weights.safetensors", c);
  EXPECT_TRUE(weights.ok()) << weights.status();
  g->weights = std::move(weights).value();
  const TensorView qv = io->Get("queries").value();
  g->queries = qv.ToFloat("queries").value();
  AttentionInputs& in = g->in;
  in = {.batch = qv.shape[0],
        .num_queries = qv.shape[1],
        .num_keys = qv.shape[1],
        .queries = g->queries.data(),
        .causal = io->metadata().at("causal") == "true"};
  if (io->tensors().contains("keys")) {
    const TensorView kv = io->Get("keys").value();
    g->keys = kv.ToFloat("keys").value();
    g->values = io->Get("values").value().ToFloat("values").value();
    in.num_keys = kv.shape[1];
    in.keys = g->keys.data();
    in.values = g->values.data();
  }
  if (io->tensors().contains("valid_lens")) {
    const TensorView lv = io->Get("valid_lens").value();
    EXPECT_EQ(lv.dtype, DType::kI32);
    g->lens.resize(lv.num_elements());
    std::memcpy(g->lens.data(), lv.data, lv.num_bytes);
    in.valid_lens = g->lens;
  }
  g->expected = io->Get("output").value().ToFloat("output").value();
  return g;
}

class GoldenTest : public ::testing::TestWithParam<std::string> {};

TEST_P(GoldenTest, MatchesPyTorch) {
  const std::unique_ptr<Golden> g = Load(GetParam());
  const ModelConfig& c = g->config;
  const std::vector<float>& expected = g->expected;
  auto mha = MultiHeadAttention::Create(c, g->weights).value();
  std::vector<float> out(expected.size());
  ASSERT_TRUE(mha->Forward(g->in, out.data()).ok());

  const int64_t e = c.num_hiddens;
  int64_t compared = 0, nan_rows = 0;
  for (int64_t row = 0; row < g->in.batch * g->in.num_queries; ++row) {
    if (std::isnan(expected[row * e])) {
      // PyTorch's all-masked row: ours is a zero context, so the output is b_o.
      ++nan_rows;
      for (int64_t o = 0; o < e; ++o) {
        EXPECT_EQ(out[row * e + o], c.bias ? g->weights.b_o[o] : 0.0f) << "row " << row;
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

// The same layer made int8 (issue 37): relative Frobenius error <= 2e-2 against
// PyTorch's f32 output (rows PyTorch leaves NaN skipped), the max abs error recorded
// (docs/core.md, "int8 models"). Additive scoring is refused naming `precision`.
TEST_P(GoldenTest, Int8WithinBoundOfPyTorch) {
  const std::unique_ptr<Golden> g = Load(GetParam());
  ModelConfig c = g->config;
  c.precision = Precision::kInt8;
  auto mha = MultiHeadAttention::Create(c, g->weights);
  if (c.scoring == Scoring::kAdditive) {
    ASSERT_FALSE(mha.ok());
    EXPECT_TRUE(absl::StartsWith(mha.status().message(), "precision")) << mha.status();
    return;
  }
  ASSERT_TRUE(mha.ok()) << mha.status();
  std::vector<float> out(g->expected.size());
  ASSERT_TRUE((*mha)->Forward(g->in, out.data()).ok());
  const double err = ::mha::testing::RelativeFrobenius(out, g->expected);
  double max_abs = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    if (!std::isnan(g->expected[i])) {
      max_abs = std::max(max_abs, std::abs(double{out[i]} - double{g->expected[i]}));
    }
  }
  EXPECT_LE(err, 2e-2);
  RecordProperty("relative_frobenius", absl::StrCat(err));
  RecordProperty("max_abs", absl::StrCat(max_abs));
  std::cout << GetParam() << " int8: relative Frobenius " << err << ", max abs " << max_abs << "\n";
}

INSTANTIATE_TEST_SUITE_P(PyTorch, GoldenTest, ::testing::ValuesIn(Cases()),
                         [](const auto& info) { return info.param; });

TEST(GoldenFilesTest, AllCasesPresent) { EXPECT_GE(Cases().size(), 7u); }

}  // namespace
}  // namespace mha::core

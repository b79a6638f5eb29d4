#include "core/weights.h"

#include <fstream>
#include <random>

#include "absl/strings/match.h"
#include "core/safetensors.h"
#include "gtest/gtest.h"
#include "tests/unit/test_util.h"

namespace mha::core {
namespace {

using ::mha::testing::RandomVector;

std::vector<float> Concat(std::initializer_list<std::vector<float>> parts) {
  std::vector<float> out;
  for (const auto& p : parts) out.insert(out.end(), p.begin(), p.end());
  return out;
}

absl::StatusOr<Weights> Load(const std::vector<NamedTensor>& tensors, const ModelConfig& c) {
  auto file = SafetensorsFile::FromBuffer(SerializeSafetensors(tensors));
  if (!file.ok()) return file.status();
  return WeightsFromSafetensors(**file, c);
}

void ExpectError(const absl::StatusOr<Weights>& w, const char* needle) {
  ASSERT_FALSE(w.ok()) << needle;
  EXPECT_EQ(w.status().code(), absl::StatusCode::kInvalidArgument) << w.status();
  EXPECT_TRUE(absl::StrContains(w.status().message(), needle)) << w.status();
}

class WeightsTest : public ::testing::Test {
 protected:
  // p_o 8, h 2, d_q 8 (PyTorch needs d_q == p_o), d_k 5, d_v 3.
  ModelConfig config_{.num_hiddens = 8,
                      .num_heads = 2,
                      .query_size = 8,
                      .key_size = 5,
                      .value_size = 3,
                      .bias = true};
  std::mt19937_64 rng_{42};
  std::vector<float> wq_ = RandomVector(rng_, 8 * 8), wk_ = RandomVector(rng_, 8 * 5),
                     wv_ = RandomVector(rng_, 8 * 3), wo_ = RandomVector(rng_, 8 * 8),
                     bq_ = RandomVector(rng_, 8), bk_ = RandomVector(rng_, 8),
                     bv_ = RandomVector(rng_, 8), bo_ = RandomVector(rng_, 8);

  std::vector<NamedTensor> D2l() const {
    return {F32Tensor("W_q.weight", {8, 8}, wq_), F32Tensor("W_k.weight", {8, 5}, wk_),
            F32Tensor("W_v.weight", {8, 3}, wv_), F32Tensor("W_o.weight", {8, 8}, wo_),
            F32Tensor("W_q.bias", {8}, bq_),      F32Tensor("W_k.bias", {8}, bk_),
            F32Tensor("W_v.bias", {8}, bv_),      F32Tensor("W_o.bias", {8}, bo_)};
  }
  std::vector<NamedTensor> TorchSeparate() const {
    return {F32Tensor("q_proj_weight", {8, 8}, wq_),
            F32Tensor("k_proj_weight", {8, 5}, wk_),
            F32Tensor("v_proj_weight", {8, 3}, wv_),
            F32Tensor("in_proj_bias", {24}, Concat({bq_, bk_, bv_})),
            F32Tensor("out_proj.weight", {8, 8}, wo_),
            F32Tensor("out_proj.bias", {8}, bo_)};
  }
  void ExpectLoaded(const Weights& w) const {
    EXPECT_EQ(w.w_q, wq_);
    EXPECT_EQ(w.w_k, wk_);
    EXPECT_EQ(w.w_v, wv_);
    EXPECT_EQ(w.w_o, wo_);
    EXPECT_EQ(w.b_q, bq_);
    EXPECT_EQ(w.b_k, bk_);
    EXPECT_EQ(w.b_v, bv_);
    EXPECT_EQ(w.b_o, bo_);
  }
};

TEST_F(WeightsTest, LoadsD2lNaming) { ExpectLoaded(Load(D2l(), config_).value()); }

TEST_F(WeightsTest, LoadsTorchSeparateProjections) {
  ExpectLoaded(Load(TorchSeparate(), config_).value());
}

TEST_F(WeightsTest, LoadsTorchPackedInProjection) {
  ModelConfig c = config_;
  c.key_size = c.value_size = 8;
  wk_ = RandomVector(rng_, 64);
  wv_ = RandomVector(rng_, 64);
  const std::vector<NamedTensor> t = {F32Tensor("in_proj_weight", {24, 8}, Concat({wq_, wk_, wv_})),
                                      F32Tensor("in_proj_bias", {24}, Concat({bq_, bk_, bv_})),
                                      F32Tensor("out_proj.weight", {8, 8}, wo_),
                                      F32Tensor("out_proj.bias", {8}, bo_)};
  ExpectLoaded(Load(t, c).value());
  ExpectError(Load(t, config_), "in_proj_weight");  // packed needs d_k == d_v == p_o
}

TEST_F(WeightsTest, LoadsFromAFileOnDisk) {
  const std::string path = ::testing::TempDir() + "/w.safetensors";
  {
    std::ofstream f(path, std::ios::binary);
    f << SerializeSafetensors(D2l());
  }
  ExpectLoaded(LoadSafetensorsWeights(path, config_).value());
  EXPECT_EQ(LoadSafetensorsWeights(path + ".missing", config_).status().code(),
            absl::StatusCode::kNotFound);
}

TEST_F(WeightsTest, MissingTensorIsNamed) {
  auto t = D2l();
  t.erase(t.begin() + 2);  // W_v.weight
  ExpectError(Load(t, config_), "missing tensor \"W_v.weight\" (8, 3)");
  auto torch = TorchSeparate();
  torch.pop_back();
  ExpectError(Load(torch, config_), "missing tensor \"out_proj.bias\"");
}

TEST_F(WeightsTest, ExtraTensorIsNamed) {
  auto t = D2l();
  t.push_back(F32Tensor("bias_k", {1, 1, 8}, std::vector<float>(8)));
  ExpectError(Load(t, config_), "unexpected tensor \"bias_k\"");
  ModelConfig no_bias = config_;
  no_bias.bias = false;
  ExpectError(Load(D2l(), no_bias), "unexpected tensor \"W_k.bias\"");
}

TEST_F(WeightsTest, MisShapedTensorIsNamed) {
  auto t = D2l();
  t[1] = F32Tensor("W_k.weight", {5, 8}, wk_);  // transposed
  ExpectError(Load(t, config_), "\"W_k.weight\": expected shape (8, 5), got (5, 8)");
}

TEST_F(WeightsTest, NonFloatTensorIsNamed) {
  auto t = D2l();
  t[3] = {"W_o.weight", DType::kI32, {8, 8}, std::string(8 * 8 * 4, '\0')};
  ExpectError(Load(t, config_), "\"W_o.weight\": expected a float dtype");
}

TEST_F(WeightsTest, HalfPrecisionTensorsAreConverted) {
  auto t = D2l();
  std::string half(8 * 2, '\0');  // eight half-precision 0.0 values
  t[7] = {"W_o.bias", DType::kF16, {8}, half};
  const Weights w = Load(t, config_).value();
  EXPECT_EQ(w.b_o, std::vector<float>(8, 0.0f));
}

TEST_F(WeightsTest, MixedOrUnknownNamingIsRejected) {
  auto t = D2l();
  t.push_back(F32Tensor("out_proj.weight", {8, 8}, wo_));
  ExpectError(Load(t, config_), "use one naming");
  ExpectError(Load({F32Tensor("weight", {1}, {1})}, config_), "no known weight names");
}

TEST_F(WeightsTest, TorchNamingNeedsQuerySizeEqualToHiddens) {
  ModelConfig c = config_;
  c.query_size = 4;
  ExpectError(Load(TorchSeparate(), c), "query_size == num_hiddens");
}

TEST(SeededWeightsTest, DeterministicBoundedAndSeedDependent) {
  const ModelConfig c{.num_hiddens = 12,
                      .num_heads = 3,
                      .query_size = 7,
                      .key_size = 5,
                      .value_size = 9,
                      .bias = true};
  const Weights a = SeededWeights(c, 1), b = SeededWeights(c, 1), other = SeededWeights(c, 2);
  EXPECT_TRUE(a.Validate(c).ok());
  EXPECT_EQ(a.w_q, b.w_q);
  EXPECT_EQ(a.b_o, b.b_o);
  EXPECT_NE(a.w_q, other.w_q);
  const float bound = 1.0f / std::sqrt(7.0f);
  for (float x : a.w_q) EXPECT_LE(std::abs(x), bound);
}

TEST(WeightsValidateTest, NamesTheWrongTensor) {
  const ModelConfig c{
      .num_hiddens = 4, .num_heads = 2, .query_size = 4, .key_size = 4, .value_size = 4};
  Weights w = SeededWeights(c, 0);
  w.w_v.pop_back();
  EXPECT_TRUE(absl::StrContains(w.Validate(c).message(), "W_v"));
}

// Additive scoring: p_o 8, h 2 (p 4), p_a 3; the d2l tensors plus attention.*.
class AdditiveWeightsTest : public WeightsTest {
 protected:
  AdditiveWeightsTest() {
    config_.scoring = Scoring::kAdditive;
    config_.additive_hidden = 3;
  }
  std::vector<float> aq_ = RandomVector(rng_, 2 * 3 * 4), ak_ = RandomVector(rng_, 2 * 3 * 4),
                     av_ = RandomVector(rng_, 2 * 3);

  std::vector<NamedTensor> PerHead() const {
    auto t = D2l();
    t.push_back(F32Tensor("attention.W_q.weight", {2, 3, 4}, aq_));
    t.push_back(F32Tensor("attention.W_k.weight", {2, 3, 4}, ak_));
    t.push_back(F32Tensor("attention.w_v.weight", {2, 3}, av_));
    return t;
  }
  // Head 0's parameters as d2l's one AdditiveAttention module stores them.
  std::vector<NamedTensor> Shared() const {
    auto t = D2l();
    t.push_back(F32Tensor("attention.W_q.weight", {3, 4}, Head0(aq_, 12)));
    t.push_back(F32Tensor("attention.W_k.weight", {3, 4}, Head0(ak_, 12)));
    t.push_back(F32Tensor("attention.w_v.weight", {1, 3}, Head0(av_, 3)));
    return t;
  }
  static std::vector<float> Head0(const std::vector<float>& v, size_t n) {
    return std::vector<float>(v.begin(), v.begin() + n);
  }
};

TEST_F(AdditiveWeightsTest, LoadsOneSetPerHead) {
  const Weights w = Load(PerHead(), config_).value();
  ExpectLoaded(w);
  EXPECT_EQ(w.score_w_q, aq_);
  EXPECT_EQ(w.score_w_k, ak_);
  EXPECT_EQ(w.score_w_v, av_);
  EXPECT_TRUE(w.Validate(config_).ok());
}

TEST_F(AdditiveWeightsTest, SharedParametersRepeatForEveryHead) {
  const Weights w = Load(Shared(), config_).value();
  EXPECT_EQ(w.score_w_q, Concat({Head0(aq_, 12), Head0(aq_, 12)}));
  EXPECT_EQ(w.score_w_k, Concat({Head0(ak_, 12), Head0(ak_, 12)}));
  EXPECT_EQ(w.score_w_v, Concat({Head0(av_, 3), Head0(av_, 3)}));
}

TEST_F(AdditiveWeightsTest, ErrorsNameTheScoringTensor) {
  auto missing = PerHead();
  missing.pop_back();
  ExpectError(Load(missing, config_), "missing tensor \"attention.w_v.weight\" (1, 3)");
  auto shaped = PerHead();
  shaped[9] = F32Tensor("attention.W_k.weight", {4, 3}, Head0(ak_, 12));
  ExpectError(Load(shaped, config_),
              "\"attention.W_k.weight\": expected shape (3, 4) (shared by every head) or "
              "(2, 3, 4) (one per head), got (4, 3)");
  ModelConfig dot = config_;
  dot.scoring = Scoring::kDotProduct;
  dot.additive_hidden = 0;
  ExpectError(Load(PerHead(), dot), "unexpected tensor \"attention.");
  ExpectError(Load(TorchSeparate(), config_), "additive scoring needs d2l names");
}

TEST_F(AdditiveWeightsTest, SeededDrawsOneSetPerHead) {
  const Weights w = SeededWeights(config_, 5);
  ASSERT_TRUE(w.Validate(config_).ok());
  EXPECT_NE(Head0(w.score_w_q, 12),
            std::vector<float>(w.score_w_q.begin() + 12, w.score_w_q.end()));
  Weights short_v = w;
  short_v.score_w_v.pop_back();
  EXPECT_TRUE(absl::StrContains(short_v.Validate(config_).message(), "score_w_v: expected 6"))
      << short_v.Validate(config_);
}

// Hugging Face attention modules: q_proj/k_proj/v_proj/o_proj, K and V with G heads.
class HuggingFaceWeightsTest : public ::testing::Test {
 protected:
  // p_o 8, h 4 (d_h 2), G 2: K and V are (4, d).
  ModelConfig config_{.num_hiddens = 8,
                      .num_heads = 4,
                      .query_size = 6,
                      .key_size = 5,
                      .value_size = 3,
                      .bias = true,
                      .num_kv_heads = 2};
  std::mt19937_64 rng_{7};
  std::vector<float> wq_ = RandomVector(rng_, 8 * 6), wk_ = RandomVector(rng_, 4 * 5),
                     wv_ = RandomVector(rng_, 4 * 3), wo_ = RandomVector(rng_, 8 * 8),
                     bq_ = RandomVector(rng_, 8), bk_ = RandomVector(rng_, 4),
                     bv_ = RandomVector(rng_, 4), bo_ = RandomVector(rng_, 8);

  std::vector<NamedTensor> Tensors(bool with_o_bias = true) const {
    std::vector<NamedTensor> t = {
        F32Tensor("q_proj.weight", {8, 6}, wq_), F32Tensor("k_proj.weight", {4, 5}, wk_),
        F32Tensor("v_proj.weight", {4, 3}, wv_), F32Tensor("o_proj.weight", {8, 8}, wo_),
        F32Tensor("q_proj.bias", {8}, bq_),      F32Tensor("k_proj.bias", {4}, bk_),
        F32Tensor("v_proj.bias", {4}, bv_)};
    if (with_o_bias) t.push_back(F32Tensor("o_proj.bias", {8}, bo_));
    return t;
  }
};

TEST_F(HuggingFaceWeightsTest, LoadsGroupedProjections) {
  const Weights w = Load(Tensors(), config_).value();
  EXPECT_EQ(w.w_q, wq_);
  EXPECT_EQ(w.w_k, wk_);
  EXPECT_EQ(w.w_v, wv_);
  EXPECT_EQ(w.w_o, wo_);
  EXPECT_EQ(w.b_k, bk_);
  EXPECT_EQ(w.b_o, bo_);
  EXPECT_TRUE(w.Validate(config_).ok());
}

TEST_F(HuggingFaceWeightsTest, OutputBiasIsOptionalAsQwen2s) {
  const Weights w = Load(Tensors(/*with_o_bias=*/false), config_).value();
  EXPECT_EQ(w.b_o, std::vector<float>(8, 0.0f));
  EXPECT_EQ(w.b_v, bv_);
}

TEST_F(HuggingFaceWeightsTest, ErrorsNameTheTensorAndTheShapeExpected) {
  std::vector<NamedTensor> t = Tensors();
  t[1] = F32Tensor("k_proj.weight", {8, 5}, RandomVector(rng_, 8 * 5));  // h heads, not G
  ExpectError(Load(t, config_), "k_proj.weight: expected (G·d_h, d_k) = (4, 5), got (8, 5)");
  t = Tensors();
  t.erase(t.begin() + 5);  // k_proj.bias
  ExpectError(Load(t, config_), "missing tensor k_proj.bias: expected (G·d_h) = (4)");
  ModelConfig no_bias = config_;
  no_bias.bias = false;
  ExpectError(Load(Tensors(), no_bias), "unexpected tensor");
  // Other namings cannot hold G < h.
  ModelConfig d2l = config_;
  ExpectError(Load({F32Tensor("W_q.weight", {8, 6}, wq_)}, d2l), "num_kv_heads");
  // Namings do not mix.
  t = Tensors();
  t.push_back(F32Tensor("W_o.weight", {8, 8}, wo_));
  ExpectError(Load(t, config_), "mixes namings");
}

}  // namespace
}  // namespace mha::core

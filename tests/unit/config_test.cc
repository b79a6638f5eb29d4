#include "core/config.h"

#include "absl/strings/match.h"
#include "gtest/gtest.h"

namespace mha::core {
namespace {

TEST(ConfigTest, DefaultsAreTheSeedsToySizes) {
  const ModelConfig c;
  EXPECT_EQ(c.num_hiddens, 100);
  EXPECT_EQ(c.num_heads, 5);
  EXPECT_EQ(c.head_size(), 20);
  EXPECT_TRUE(c.Validate().ok());
  EXPECT_TRUE(c.SupportsSelfAttention());
}

TEST(ConfigTest, HeadsMustDivideHiddens) {
  ModelConfig c{.num_hiddens = 100, .num_heads = 3};
  const absl::Status s = c.Validate();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(s.message(), "num_hiddens")) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "num_heads")) << s;
}

TEST(ConfigTest, EachDimensionIsRangeChecked) {
  const struct {
    ModelConfig config;
    const char* field;
  } cases[] = {
      {{.num_hiddens = 0}, "num_hiddens"}, {{.num_heads = 0}, "num_heads"},
      {{.num_heads = -5}, "num_heads"},    {{.query_size = 0}, "query_size"},
      {{.key_size = -1}, "key_size"},      {{.value_size = 1 << 20}, "value_size"},
      {{.dropout = 1.0f}, "dropout"},      {{.dropout = -0.1f}, "dropout"},
  };
  for (const auto& c : cases) {
    const absl::Status s = c.config.Validate();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.field;
    EXPECT_TRUE(absl::StartsWith(s.message(), c.field)) << s;
  }
  EXPECT_TRUE((ModelConfig{.dropout = 0.1f}).Validate().ok());  // identity at inference
}

TEST(ConfigTest, ParsesPrecisionNames) {
  EXPECT_EQ(ParsePrecision("f32").value(), Precision::kF32);
  EXPECT_EQ(ParsePrecision("bf16").value(), Precision::kBf16);
  EXPECT_EQ(PrecisionName(Precision::kBf16), "bf16");
  EXPECT_EQ(ParsePrecision("fp8").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ConfigTest, AdditiveScoringNeedsItsHiddenSizeAndOnlyIt) {
  ModelConfig additive{.scoring = Scoring::kAdditive, .additive_hidden = 16};
  EXPECT_TRUE(additive.Validate().ok());
  additive.additive_hidden = 0;
  EXPECT_TRUE(absl::StartsWith(additive.Validate().message(), "additive_hidden: expected 1 <="))
      << additive.Validate();
  const ModelConfig dot{.additive_hidden = 16};
  EXPECT_EQ(dot.Validate().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(dot.Validate().message(), "only for scoring ADDITIVE"))
      << dot.Validate();
  EXPECT_EQ(ScoringName(Scoring::kAdditive), "additive");
}

}  // namespace
}  // namespace mha::core

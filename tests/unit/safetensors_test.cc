#include "core/safetensors.h"

#include <cstring>
#include <fstream>

#include "absl/strings/match.h"
#include "gtest/gtest.h"

namespace mha::core {
namespace {

std::string WithHeader(const std::string& json, const std::string& data) {
  std::string out(8, '\0');
  const uint64_t n = json.size();
  std::memcpy(out.data(), &n, 8);
  return out + json + data;
}

void ExpectInvalid(const std::string& bytes, const char* needle) {
  auto file = SafetensorsFile::FromBuffer(bytes);
  ASSERT_FALSE(file.ok()) << needle;
  EXPECT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument) << file.status();
  EXPECT_TRUE(absl::StrContains(file.status().message(), needle)) << file.status();
}

TEST(SafetensorsTest, RoundTripsTensorsAndMetadata) {
  const std::string bytes = SerializeSafetensors(
      {F32Tensor("a", {2, 3}, {1, 2, 3, 4, 5, 6}), F32Tensor("b", {1}, {-7})},
      {{"format", "pt"}});
  auto file = SafetensorsFile::FromBuffer(bytes).value();
  ASSERT_EQ(file->tensors().size(), 2u);
  const TensorView a = file->Get("a").value();
  EXPECT_EQ(a.shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(a.ToFloat("a").value(), (std::vector<float>{1, 2, 3, 4, 5, 6}));
  EXPECT_EQ(file->Get("b").value().ToFloat("b").value(), std::vector<float>{-7});
  EXPECT_EQ(file->metadata().at("format"), "pt");
  EXPECT_EQ(file->Get("c").status().code(), absl::StatusCode::kNotFound);
}

TEST(SafetensorsTest, ConvertsHalfAndBfloat16) {
  // 1.0, -2.0, 0.5 in IEEE half; 1.0, -2.0 in bfloat16.
  const uint16_t half[] = {0x3c00, 0xc000, 0x3800, 0x0001};
  const uint16_t bf16[] = {0x3f80, 0xc000};
  std::string h(reinterpret_cast<const char*>(half), sizeof(half));
  std::string b(reinterpret_cast<const char*>(bf16), sizeof(bf16));
  auto file = SafetensorsFile::FromBuffer(SerializeSafetensors(
                                              {{"h", DType::kF16, {4}, h},
                                               {"b", DType::kBf16, {2}, b}}))
                  .value();
  const auto hv = file->Get("h").value().ToFloat("h").value();
  EXPECT_EQ(hv[0], 1.0f);
  EXPECT_EQ(hv[1], -2.0f);
  EXPECT_EQ(hv[2], 0.5f);
  EXPECT_FLOAT_EQ(hv[3], 5.9604645e-8f);  // smallest subnormal half
  EXPECT_EQ(file->Get("b").value().ToFloat("b").value(), (std::vector<float>{1.0f, -2.0f}));
}

TEST(SafetensorsTest, NonFloatTensorIsNamedOnConversion) {
  auto file = SafetensorsFile::FromBuffer(
                  SerializeSafetensors({{"ids", DType::kI32, {1}, std::string(4, '\0')}}))
                  .value();
  const auto v = file->Get("ids").value().ToFloat("ids");
  EXPECT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(v.status().message(), "\"ids\"")) << v.status();
  EXPECT_TRUE(absl::StrContains(v.status().message(), "I32")) << v.status();
}

TEST(SafetensorsTest, RejectsTruncatedFile) {
  ExpectInvalid("", "truncated");
  ExpectInvalid("abc", "truncated");
}

TEST(SafetensorsTest, RejectsHeaderLongerThanFile) {
  std::string bytes = WithHeader("{}", "");
  const uint64_t n = 1000;
  std::memcpy(bytes.data(), &n, 8);
  ExpectInvalid(bytes, "header length 1000");
}

TEST(SafetensorsTest, RejectsTruncatedData) {
  std::string bytes = SerializeSafetensors({F32Tensor("w", {4}, {1, 2, 3, 4})});
  bytes.resize(bytes.size() - 4);
  ExpectInvalid(bytes, "\"w\"");
}

TEST(SafetensorsTest, RejectsBadJson) {
  ExpectInvalid(WithHeader("{\"a\": ", ""), "JSON");
  ExpectInvalid(WithHeader("[1, 2]", ""), "JSON object");
}

TEST(SafetensorsTest, RejectsMalformedEntriesNamingTheTensor) {
  ExpectInvalid(WithHeader(R"({"w": 3})", ""), "\"w\": entry is not an object");
  ExpectInvalid(WithHeader(R"({"w": {"shape": [1], "data_offsets": [0, 4]}})", "abcd"),
                "\"w\": missing \"dtype\"");
  ExpectInvalid(WithHeader(R"({"w": {"dtype": "F32", "data_offsets": [0, 4]}})", "abcd"),
                "\"w\": missing \"shape\"");
  ExpectInvalid(WithHeader(R"({"w": {"dtype": "F32", "shape": [1]}})", "abcd"),
                "\"w\": \"data_offsets\"");
  ExpectInvalid(WithHeader(R"({"w": {"dtype": "Q4", "shape": [1], "data_offsets": [0, 4]}})",
                           "abcd"),
                "\"w\": unknown dtype \"Q4\"");
  ExpectInvalid(WithHeader(R"({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}})",
                           "abcd"),
                "\"w\": shape entries");
}

TEST(SafetensorsTest, RejectsOffsetsOutOfRange) {
  ExpectInvalid(
      WithHeader(R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})", "abcd"),
      "\"w\": data_offsets [0, 8] out of range");
  ExpectInvalid(
      WithHeader(R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}})", "abcd"),
      "\"w\": data_offsets");
}

TEST(SafetensorsTest, RejectsShapeThatDisagreesWithSize) {
  ExpectInvalid(
      WithHeader(R"({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}})",
                 std::string(8, '\0')),
      "\"w\": shape [3] of F32 needs 12 bytes");
  // A shape whose element count overflows must not wrap around to a small number.
  ExpectInvalid(WithHeader(R"({"w": {"dtype": "F32", "shape": [1099511627776, 1099511627776,
                   1099511627776], "data_offsets": [0, 8]}})",
                           std::string(8, '\0')),
                "\"w\": shape");
}

TEST(SafetensorsTest, RejectsOverlappingTensors) {
  ExpectInvalid(WithHeader(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                               "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})",
                           std::string(8, '\0')),
                "overlap");
}

TEST(SafetensorsTest, RejectsNonStringMetadata) {
  ExpectInvalid(WithHeader(R"({"__metadata__": {"n": 3}})", ""), "__metadata__ \"n\"");
}

TEST(SafetensorsTest, OpensMappedFileAndReportsMissingPath) {
  const std::string path = ::testing::TempDir() + "/mapped.safetensors";
  {
    std::ofstream f(path, std::ios::binary);
    f << SerializeSafetensors({F32Tensor("x", {3}, {1, 2, 3})});
  }
  auto file = SafetensorsFile::Open(path).value();
  EXPECT_EQ(file->Get("x").value().ToFloat("x").value(), (std::vector<float>{1, 2, 3}));
  const auto missing = SafetensorsFile::Open(path + ".nope");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(absl::StrContains(missing.status().message(), ".nope"));
}

}  // namespace
}  // namespace mha::core

// The KServe v2 HTTP body codec: request bodies (JSON and binary tensor data) to
// ModelInferRequest with exact bytes, every refusal with its code and the field it
// names, and response bodies parsed back bit-exactly.
#include "server/kserve_http/http_codec.h"

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <random>
#include <tuple>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "google/protobuf/util/message_differencer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace mha::server {
namespace {

using inference::InferParameter;
using inference::ModelInferRequest;
using inference::ModelInferResponse;
using ::testing::HasSubstr;
using Json = nlohmann::json;

template <typename T>
std::string Raw(std::initializer_list<T> values) {
  std::string out(values.size() * sizeof(T), '\0');
  std::memcpy(out.data(), std::data(values), out.size());
  return out;
}

ModelInferRequest ParseOk(absl::string_view body, std::optional<int64_t> header_length = {}) {
  absl::StatusOr<ModelInferRequest> parsed = ParseInferRequest("m", "1", body, header_length);
  EXPECT_TRUE(parsed.ok()) << parsed.status();
  return parsed.ok() ? *std::move(parsed) : ModelInferRequest();
}

// A body with one input of `datatype`, `shape` and `data` (JSON text).
std::string OneInput(absl::string_view datatype, absl::string_view shape, absl::string_view data) {
  return absl::StrCat(R"({"inputs": [{"name": "x", "datatype": ")", datatype, R"(", "shape": )",
                      shape, R"(, "data": )", data, "}]}");
}

TEST(HttpCodecTest, FlatFp32DataBecomesRawBytes) {
  const ModelInferRequest request = ParseOk(R"({
      "id": "r1",
      "inputs": [{"name": "q", "datatype": "FP32", "shape": [2, 2], "data": [1, 2.5, -3, 0.1]}]
  })");
  EXPECT_EQ(request.model_name(), "m");
  EXPECT_EQ(request.model_version(), "1");
  EXPECT_EQ(request.id(), "r1");
  ASSERT_EQ(request.inputs_size(), 1);
  EXPECT_EQ(request.inputs(0).name(), "q");
  EXPECT_EQ(request.inputs(0).datatype(), "FP32");
  EXPECT_THAT(request.inputs(0).shape(), ::testing::ElementsAre(2, 2));
  EXPECT_FALSE(request.inputs(0).has_contents());
  ASSERT_EQ(request.raw_input_contents_size(), 1);
  EXPECT_EQ(request.raw_input_contents(0), Raw<float>({1.0f, 2.5f, -3.0f, 0.1f}));
  EXPECT_EQ(request.outputs_size(), 0);
}

TEST(HttpCodecTest, NestedDataMatchesFlat) {
  const ModelInferRequest nested =
      ParseOk(OneInput("INT32", "[2, 1, 3]", "[[[1, 2, 3]], [[4, 5, 6]]]"));
  const ModelInferRequest flat = ParseOk(OneInput("INT32", "[2, 1, 3]", "[1, 2, 3, 4, 5, 6]"));
  EXPECT_EQ(nested.raw_input_contents(0), Raw<int32_t>({1, 2, 3, 4, 5, 6}));
  EXPECT_EQ(flat.raw_input_contents(0), nested.raw_input_contents(0));
  // Rank 0 holds one value; a zero dimension holds none, flat or nested.
  EXPECT_EQ(ParseOk(OneInput("INT64", "[]", "[7]")).raw_input_contents(0), Raw<int64_t>({7}));
  EXPECT_EQ(ParseOk(OneInput("FP32", "[2, 0]", "[]")).raw_input_contents(0), "");
  EXPECT_EQ(ParseOk(OneInput("FP32", "[2, 0]", "[[], []]")).raw_input_contents(0), "");
}

TEST(HttpCodecTest, EveryJsonDatatypeAtItsLimits) {
  const auto raw = [](absl::string_view datatype, absl::string_view data) {
    return ParseOk(OneInput(datatype, "[2]", data)).raw_input_contents(0);
  };
  EXPECT_EQ(raw("BOOL", "[true, false]"), std::string("\x01\x00", 2));
  EXPECT_EQ(raw("INT8", "[-128, 127]"), Raw<int8_t>({-128, 127}));
  EXPECT_EQ(raw("UINT8", "[0, 255]"), Raw<uint8_t>({0, 255}));
  EXPECT_EQ(raw("INT16", "[-32768, 32767]"), Raw<int16_t>({-32768, 32767}));
  EXPECT_EQ(raw("UINT16", "[0, 65535]"), Raw<uint16_t>({0, 65535}));
  EXPECT_EQ(raw("INT32", "[-2147483648, 2147483647]"),
            Raw<int32_t>({std::numeric_limits<int32_t>::min(), 2147483647}));
  EXPECT_EQ(raw("UINT32", "[0, 4294967295]"), Raw<uint32_t>({0, 4294967295u}));
  EXPECT_EQ(
      raw("INT64", "[-9223372036854775808, 9223372036854775807]"),
      Raw<int64_t>({std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max()}));
  EXPECT_EQ(raw("UINT64", "[0, 18446744073709551615]"),
            Raw<uint64_t>({0, std::numeric_limits<uint64_t>::max()}));
  EXPECT_EQ(raw("FP32", "[3.4028234663852886e38, -1e-45]"),
            Raw<float>({std::numeric_limits<float>::max(), -1e-45f}));
  EXPECT_EQ(raw("FP64", "[0.1, -1.7976931348623157e308]"),
            Raw<double>({0.1, -std::numeric_limits<double>::max()}));
}

TEST(HttpCodecTest, BinaryInputsFollowTheJsonHeader) {
  const std::string header = R"({"inputs": [
      {"name": "a", "datatype": "FP16", "shape": [1, 2],
       "parameters": {"binary_data_size": 4, "note": "kept"}},
      {"name": "b", "datatype": "INT64", "shape": [2], "data": [5, -6]},
      {"name": "c", "datatype": "FP32", "shape": [3], "parameters": {"binary_data_size": 12}}]})";
  const std::string a = Raw<uint16_t>({0x3c00, 0xc000});
  const std::string c = Raw<float>({1.0f, std::nanf(""), -0.0f});
  const ModelInferRequest request =
      ParseOk(absl::StrCat(header, a, c), static_cast<int64_t>(header.size()));
  ASSERT_EQ(request.inputs_size(), 3);
  ASSERT_EQ(request.raw_input_contents_size(), 3);
  EXPECT_EQ(request.raw_input_contents(0), a);
  EXPECT_EQ(request.raw_input_contents(1), Raw<int64_t>({5, -6}));
  EXPECT_EQ(request.raw_input_contents(2), c);
  // binary_data_size is the transport's; the other parameters stay.
  EXPECT_EQ(request.inputs(0).parameters().count("binary_data_size"), 0);
  EXPECT_EQ(request.inputs(0).parameters().at("note").string_param(), "kept");
  EXPECT_TRUE(request.inputs(2).parameters().empty());
}

// The HTTP front gives up the body: the large tensor that ends it takes the body's
// buffer; the others are copied; the result equals the copying parse.
TEST(HttpCodecTest, TheTensorEndingAGivenUpBodyTakesItsBuffer) {
  const std::string header = R"({"inputs": [
      {"name": "a", "datatype": "FP32", "shape": [20000], "parameters": {"binary_data_size": 80000}},
      {"name": "b", "datatype": "FP32", "shape": [30000], "parameters": {"binary_data_size": 120000}}]})";
  std::vector<float> a(20000), b(30000);
  for (size_t i = 0; i < a.size(); ++i) a[i] = static_cast<float>(i) * 0.5f;
  for (size_t i = 0; i < b.size(); ++i) b[i] = -static_cast<float>(i);
  const std::string a_raw(reinterpret_cast<const char*>(a.data()), a.size() * sizeof(float));
  const std::string b_raw(reinterpret_cast<const char*>(b.data()), b.size() * sizeof(float));
  const std::string whole = absl::StrCat(header, a_raw, b_raw);
  std::string body = whole;
  const char* buffer = body.data();
  const absl::StatusOr<ModelInferRequest> given =
      ParseInferRequest("m", "1", &body, static_cast<int64_t>(header.size()));
  ASSERT_TRUE(given.ok()) << given.status();
  ASSERT_EQ(given->raw_input_contents_size(), 2);
  EXPECT_EQ(given->raw_input_contents(0), a_raw);
  EXPECT_EQ(given->raw_input_contents(1), b_raw);
  EXPECT_EQ(given->raw_input_contents(1).data(), buffer);  // the body's own buffer
  EXPECT_EQ(ParseOk(whole, static_cast<int64_t>(header.size())).SerializeAsString(),
            given->SerializeAsString());
  // A body with bytes left after its last tensor is refused as before.
  std::string longer = whole + "x";
  EXPECT_EQ(ParseInferRequest("m", "1", &longer, static_cast<int64_t>(header.size()))
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(HttpCodecTest, HeaderLengthOfTheWholeBodyMeansNoBinaryData) {
  const std::string body = OneInput("UINT8", "[1]", "[9]");
  EXPECT_EQ(ParseOk(body, static_cast<int64_t>(body.size())).raw_input_contents(0), "\x09");
}

TEST(HttpCodecTest, ParametersOfEveryJsonType) {
  const ModelInferRequest request = ParseOk(R"({
      "parameters": {"b": true, "i": -5, "max": 9223372036854775807,
                     "u": 18446744073709551615, "d": 1.5, "s": "text",
                     "binary_data_output": false},
      "inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [0],
                  "parameters": {"n": 3}}],
      "outputs": [{"name": "y", "parameters": {"binary_data": true, "f": -0.25}},
                  {"name": "z"}],
      "extension_field": {"ignored": [1, 2]}
  })");
  const auto& p = request.parameters();
  EXPECT_TRUE(p.at("b").has_bool_param() && p.at("b").bool_param());
  EXPECT_EQ(p.at("i").int64_param(), -5);
  EXPECT_EQ(p.at("max").int64_param(), std::numeric_limits<int64_t>::max());
  EXPECT_EQ(p.at("u").uint64_param(), std::numeric_limits<uint64_t>::max());
  EXPECT_EQ(p.at("d").double_param(), 1.5);
  EXPECT_EQ(p.at("s").string_param(), "text");
  EXPECT_TRUE(p.at("binary_data_output").has_bool_param());
  EXPECT_EQ(request.inputs(0).parameters().at("n").int64_param(), 3);
  ASSERT_EQ(request.outputs_size(), 2);
  EXPECT_EQ(request.outputs(0).name(), "y");
  EXPECT_TRUE(request.outputs(0).parameters().at("binary_data").bool_param());
  EXPECT_EQ(request.outputs(0).parameters().at("f").double_param(), -0.25);
  EXPECT_EQ(request.outputs(1).name(), "z");
  EXPECT_TRUE(request.outputs(1).parameters().empty());
}

TEST(HttpCodecTest, DuplicateInputNamesKeepTheirOrder) {
  const ModelInferRequest request = ParseOk(R"({"inputs": [
      {"name": "x", "datatype": "INT8", "shape": [1], "data": [1]},
      {"name": "x", "datatype": "INT8", "shape": [1], "data": [2]}]})");
  ASSERT_EQ(request.raw_input_contents_size(), 2);
  EXPECT_EQ(request.raw_input_contents(0), "\x01");
  EXPECT_EQ(request.raw_input_contents(1), "\x02");
}

struct BadBody {
  std::string name;
  std::string body;
  std::optional<int64_t> header_length;
  std::string message;  // a substring the message must contain
};

void PrintTo(const BadBody& c, std::ostream* os) { *os << c.name; }

class HttpCodecErrorTest : public ::testing::TestWithParam<BadBody> {};

TEST_P(HttpCodecErrorTest, IsInvalidArgumentNamingTheField) {
  const BadBody& c = GetParam();
  const absl::StatusOr<ModelInferRequest> parsed =
      ParseInferRequest("m", "", c.body, c.header_length);
  ASSERT_FALSE(parsed.ok());
  EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument) << parsed.status();
  EXPECT_THAT(parsed.status().message(), HasSubstr(c.message));
}

std::string Binary(absl::string_view json, absl::string_view tail) {
  return absl::StrCat(json, tail);
}

std::string Repeat(absl::string_view text, int times) {
  std::string out;
  for (int i = 0; i < times; ++i) absl::StrAppend(&out, text);
  return out;
}

const std::string kTwoFloatsBinary =
    R"({"inputs": [{"name": "k", "datatype": "FP32", "shape": [2], )"
    R"("parameters": {"binary_data_size": 8}}]})";

INSTANTIATE_TEST_SUITE_P(
    Refusals, HttpCodecErrorTest,
    ::testing::Values(
        // Guards before parsing.
        BadBody{"DepthBomb", std::string(100000, '['), {}, "JSON nesting deeper than 32"},
        BadBody{"ObjectDepthBomb", Repeat(R"({"a": )", 33), {}, "JSON nesting deeper than 32"},
        BadBody{"HeaderLengthNegative", "{}", -1,
                "Inference-Header-Content-Length: expected 0 to 2 (the body's size), got -1"},
        BadBody{"HeaderLengthPastBody", "{}", 3,
                "Inference-Header-Content-Length: expected 0 to 2 (the body's size), got 3"},
        BadBody{"InvalidJson",
                R"({"inputs": [1, 2)",
                {},
                "request body: invalid JSON: parse error at line 1, column 17"},
        BadBody{"NumberOverflow",
                R"({"inputs": [1e400]})",
                {},
                "request body: invalid JSON: number overflow"},
        BadBody{"HeaderLengthCutsTheJson", R"({"inputs": []})", 5, "invalid JSON"},
        // Structure.
        BadBody{
            "NotAnObject", "[]", {}, "request body: expected a JSON object, got an empty array"},
        BadBody{"IdNotString", R"({"id": 5, "inputs": []})", {}, "id: expected a string, got 5"},
        BadBody{"InputsMissing", R"({"id": "a"})", {}, "inputs: required"},
        BadBody{"InputsNotArray", R"({"inputs": {}})", {}, "inputs: expected an array"},
        BadBody{"InputNotObject", R"({"inputs": [3]})", {}, "inputs[0]: expected an object, got 3"},
        BadBody{
            "NameMissing", R"({"inputs": [{"datatype": "FP32"}]})", {}, "inputs[0].name: required"},
        BadBody{"NameNotString",
                R"({"inputs": [{"name": ["q"]}]})",
                {},
                "inputs[0].name: expected a string, got an array"},
        BadBody{"DatatypeMissing",
                R"({"inputs": [{"name": "q", "shape": [1]}]})",
                {},
                R"(inputs[0] ("q").datatype: required)"},
        BadBody{"DatatypeUnknown",
                OneInput("FP8", "[1]", "[1]"),
                {},
                R"(inputs[0] ("x").datatype: expected one of BOOL, UINT8, UINT16, UINT32, )"
                R"(UINT64, INT8, INT16, INT32, INT64, FP16, FP32, FP64, BF16, got "FP8")"},
        BadBody{"Bytes",
                OneInput("BYTES", "[1]", R"(["a"])"),
                {},
                R"(inputs[0] ("x").datatype: BYTES is not served)"},
        BadBody{"ShapeMissing",
                R"({"inputs": [{"name": "q", "datatype": "FP32", "data": [1]}]})",
                {},
                R"(inputs[0] ("q").shape: required)"},
        BadBody{"ShapeNotArray",
                OneInput("FP32", "3", "[1, 2, 3]"),
                {},
                R"(inputs[0] ("x").shape: expected an array of integers, got 3)"},
        BadBody{"ShapeNotIntegers",
                OneInput("FP32", "[1.5]", "[1]"),
                {},
                R"(inputs[0] ("x").shape: expected an array of integers, got an array with 1.5)"},
        BadBody{"ShapePastInt64",
                OneInput("FP32", "[9223372036854775808]", "[1]"),
                {},
                R"(inputs[0] ("x").shape: expected an array of integers)"},
        BadBody{"ShapeNegative",
                OneInput("FP32", "[2, -1]", "[1]"),
                {},
                R"(inputs[0] ("x").shape: dimensions must be >= 0, got (2, -1))"},
        BadBody{
            "ShapeOverflow",
            OneInput("FP32", "[4294967296, 4294967296]", "[1]"),
            {},
            R"(inputs[0] ("x").shape: (4294967296, 4294967296) of FP32 is more than 2^63 bytes)"},
        BadBody{"BytesOverflow",
                OneInput("FP64", "[2305843009213693952]", "[1]"),
                {},
                "is more than 2^63 bytes"},
        // Data.
        BadBody{"NoData",
                R"({"inputs": [{"name": "q", "datatype": "FP32", "shape": [1]}]})",
                {},
                R"(inputs[0] ("q"): expected data or parameters.binary_data_size)"},
        BadBody{"DataNotArray",
                OneInput("FP32", "[1]", "1"),
                {},
                R"(inputs[0] ("x").data: expected an array, got 1)"},
        BadBody{"FlatCountShort",
                OneInput("FP32", "[2, 2]", "[1, 2, 3]"),
                {},
                R"(inputs[0] ("x").data: shape (2, 2) needs 4 values, got 3)"},
        BadBody{"ClaimedHugeShapeFlat",
                OneInput("FP32", "[1099511627776]", "[1, 2, 3]"),
                {},
                R"(inputs[0] ("x").data: shape (1099511627776) needs 1099511627776 values, got 3)"},
        BadBody{"ClaimedHugeShapeNested",
                OneInput("FP32", "[1099511627776, 3]", "[[1, 2, 3]]"),
                {},
                R"(inputs[0] ("x").data: expected an array of 1099511627776 (dimension 0 of )"
                R"(shape (1099511627776, 3)), got an array of 1)"},
        BadBody{"NestedRowShort",
                OneInput("FP32", "[2, 2]", "[[1, 2], [3]]"),
                {},
                R"(inputs[0] ("x").data[1]: expected an array of 2 (dimension 1 of shape (2, 2)), )"
                R"(got an array of 1)"},
        BadBody{"NestedScalarForRow",
                OneInput("FP32", "[2, 2]", "[[1, 2], 3]"),
                {},
                R"(inputs[0] ("x").data[1]: expected an array of 2 (dimension 1 of shape )"
                R"((2, 2)), got 3)"},
        BadBody{"NestedTooDeep",
                OneInput("FP32", "[1, 2]", "[[[1], [2]]]"),
                {},
                R"(inputs[0] ("x").data[0][0]: nested deeper than shape (1, 2))"},
        BadBody{"NestedRankZero",
                OneInput("FP32", "[]", "[[1]]"),
                {},
                R"(inputs[0] ("x").data: nested deeper than shape ())"},
        BadBody{"Fp16AsJson",
                OneInput("FP16", "[1]", "[1]"),
                {},
                R"(inputs[0] ("x").data: FP16 cannot be sent as JSON numbers; send it as )"
                R"(binary data (parameters.binary_data_size))"},
        BadBody{"Bf16AsJson",
                OneInput("BF16", "[1]", "[1]"),
                {},
                R"(inputs[0] ("x").data: BF16 cannot be sent as JSON numbers)"},
        BadBody{"Int8OutOfRange",
                OneInput("INT8", "[3]", "[1, 2, 128]"),
                {},
                R"(inputs[0] ("x").data[2]: 128 is out of range for INT8 [-128, 127])"},
        BadBody{"Uint8Negative",
                OneInput("UINT8", "[1, 2]", "[[0, -1]]"),
                {},
                R"(inputs[0] ("x").data[0][1]: -1 is out of range for UINT8 [0, 255])"},
        BadBody{"Int64PastRange",
                OneInput("INT64", "[1]", "[9223372036854775808]"),
                {},
                R"(inputs[0] ("x").data[0]: 9223372036854775808 is out of range for INT64)"},
        BadBody{"Uint64Negative",
                OneInput("UINT64", "[1]", "[-1]"),
                {},
                R"(inputs[0] ("x").data[0]: -1 is out of range for UINT64)"},
        BadBody{"FloatForInt",
                OneInput("INT32", "[2]", "[1, 1.5]"),
                {},
                R"(inputs[0] ("x").data[1]: expected an integer for INT32, got 1.5)"},
        BadBody{"BoolForInt",
                OneInput("INT32", "[1]", "[true]"),
                {},
                R"(inputs[0] ("x").data[0]: expected an integer for INT32, got true)"},
        BadBody{"StringForFloat",
                OneInput("FP32", "[1, 1]", R"([["x"]])"),
                {},
                R"(inputs[0] ("x").data[0][0]: expected a number for FP32, got "x")"},
        BadBody{"NullForFloat",
                OneInput("FP64", "[1]", "[null]"),
                {},
                R"(inputs[0] ("x").data[0]: expected a number for FP64, got null)"},
        BadBody{"ObjectForFloat",
                OneInput("FP32", "[1]", R"([{"v": 1}])"),
                {},
                R"(inputs[0] ("x").data[0]: expected a number for FP32, got an object)"},
        BadBody{"NumberForBool",
                OneInput("BOOL", "[1]", "[1]"),
                {},
                R"(inputs[0] ("x").data[0]: expected true or false, got 1)"},
        BadBody{"Fp32OutOfRange",
                OneInput("FP32", "[1]", "[-1e39]"),
                {},
                R"(inputs[0] ("x").data[0]: -1e+39 is out of range for FP32)"},
        // Binary data.
        BadBody{"DataAndBinary",
                R"({"inputs": [{"name": "q", "datatype": "FP32", "shape": [1], "data": [1], )"
                R"("parameters": {"binary_data_size": 4}}]})",
                {},
                R"(inputs[0] ("q"): has both data and parameters.binary_data_size)"},
        BadBody{"BinaryTailShort", Binary(kTwoFloatsBinary, std::string(4, '\0')),
                static_cast<int64_t>(kTwoFloatsBinary.size()),
                R"(inputs[0] ("k").parameters.binary_data_size: 8 bytes, but only 4 bytes of )"
                R"(binary data are left after the JSON header)"},
        BadBody{"BinarySizeMismatchesShape",
                R"({"inputs": [{"name": "k", "datatype": "FP32", "shape": [2], )"
                R"("parameters": {"binary_data_size": 6}}]})",
                {},
                R"(inputs[0] ("k").parameters.binary_data_size: shape (2) of FP32 is 8 bytes, )"
                R"(got 6)"},
        BadBody{"BinaryWithoutHeaderLength",
                kTwoFloatsBinary,
                {},
                R"(inputs[0] ("k").parameters.binary_data_size: 8 bytes, but the request has )"
                R"(no binary data (no Inference-Header-Content-Length header))"},
        BadBody{"BinaryLeftOver", Binary(kTwoFloatsBinary, std::string(12, '\0')),
                static_cast<int64_t>(kTwoFloatsBinary.size()),
                "Inference-Header-Content-Length: 12 bytes of binary data follow the JSON "
                "header, but the inputs' parameters.binary_data_size claim 8"},
        BadBody{"BinaryNoInputClaims", Binary(OneInput("INT8", "[1]", "[1]"), "xyz"),
                static_cast<int64_t>(OneInput("INT8", "[1]", "[1]").size()),
                "3 bytes of binary data follow the JSON header, but the inputs' "
                "parameters.binary_data_size claim 0"},
        BadBody{"BinarySizeNegative",
                R"({"inputs": [{"name": "k", "datatype": "FP32", "shape": [0], )"
                R"("parameters": {"binary_data_size": -4}}]})",
                {},
                R"(inputs[0] ("k").parameters.binary_data_size: expected an integer >= 0, )"
                R"(got -4)"},
        BadBody{"BinarySizeString",
                R"({"inputs": [{"name": "k", "datatype": "FP32", "shape": [0], )"
                R"("parameters": {"binary_data_size": "8"}}]})",
                {},
                R"(inputs[0] ("k").parameters.binary_data_size: expected an integer >= 0, )"
                R"(got "8")"},
        // Parameters and outputs.
        BadBody{"ParametersNotObject",
                R"({"parameters": [], "inputs": []})",
                {},
                "parameters: expected an object, got an empty array"},
        BadBody{"ParameterObject",
                R"({"parameters": {"p": {}}, "inputs": []})",
                {},
                "parameters.p: expected a bool, number or string, got an object"},
        BadBody{"ParameterNull",
                R"({"parameters": {"p": null}, "inputs": []})",
                {},
                "parameters.p: expected a bool, number or string, got null"},
        BadBody{"InputParameterArray",
                R"({"inputs": [{"name": "q", "datatype": "FP32", "shape": [1], "data": [1], )"
                R"("parameters": {"p": [1]}}]})",
                {},
                R"(inputs[0] ("q").parameters.p: expected a bool, number or string, got an array)"},
        BadBody{"BinaryDataOutputNotBool",
                R"({"parameters": {"binary_data_output": 1}, "inputs": []})",
                {},
                "parameters.binary_data_output: expected true or false"},
        BadBody{"OutputsNotArray",
                R"({"inputs": [], "outputs": "y"})",
                {},
                R"(outputs: expected an array, got "y")"},
        BadBody{"OutputNotObject",
                R"({"inputs": [], "outputs": [[]]})",
                {},
                "outputs[0]: expected an object, got an empty array"},
        BadBody{"OutputNameMissing",
                R"({"inputs": [], "outputs": [{}]})",
                {},
                "outputs[0].name: required"},
        BadBody{"OutputParameterNull",
                R"({"inputs": [], "outputs": [{"name": "y", "parameters": {"p": null}}]})",
                {},
                R"(outputs[0] ("y").parameters.p: expected a bool, number or string, got null)"},
        BadBody{
            "BinaryDataNotBool",
            R"({"inputs": [], "outputs": [{"name": "y", "parameters": {"binary_data": "yes"}}]})",
            {},
            R"(outputs[0] ("y").parameters.binary_data: expected true or false)"}),
    [](const ::testing::TestParamInfo<BadBody>& info) { return info.param.name; });

TEST(HttpCodecTest, DepthCountsBracketsOutsideStringsOnly) {
  // 40 brackets and an escaped quote inside a string are text, not nesting.
  const std::string body =
      absl::StrCat(R"({"id": "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[\"{{{{", "inputs": [)",
                   R"({"name": "x", "datatype": "INT8", "shape": [1], "data": [1]}]})");
  EXPECT_EQ(ParseOk(body).id(), R"([[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["{{{{)");
  // 32 levels are allowed: the depth limit is not off by one.
  std::string deep = R"({"inputs": [], "x": )";
  for (int i = 0; i < 31; ++i) deep += "[";
  for (int i = 0; i < 31; ++i) deep += "]";
  ParseOk(deep + "}");
  EXPECT_THAT(
      ParseInferRequest("m", "", R"({"x": )" + std::string(32, '[') + std::string(32, ']') + "}",
                        std::nullopt)
          .status()
          .message(),
      HasSubstr("JSON nesting deeper than 32"));
}

TEST(HttpCodecTest, LongNamesAreAbbreviatedInMessages) {
  const std::string name(10000, 'n');
  const absl::StatusOr<ModelInferRequest> parsed =
      ParseInferRequest("m", "",
                        absl::StrCat(R"({"inputs": [{"name": ")", name,
                                     R"(", "datatype": "FP32", "shape": [1], "data": [true]}]})"),
                        std::nullopt);
  ASSERT_FALSE(parsed.ok());
  EXPECT_THAT(parsed.status().message(), HasSubstr("... (10000 bytes)"));
  EXPECT_LT(parsed.status().message().size(), 300u);
}

ModelInferResponse::InferOutputTensor* AddOutput(ModelInferResponse* response,
                                                 absl::string_view name, absl::string_view datatype,
                                                 std::vector<int64_t> shape, std::string raw) {
  ModelInferResponse::InferOutputTensor* output = response->add_outputs();
  output->set_name(std::string(name));
  output->set_datatype(std::string(datatype));
  for (int64_t d : shape) output->add_shape(d);
  *response->add_raw_output_contents() = std::move(raw);
  return output;
}

ModelInferResponse BasicResponse() {
  ModelInferResponse response;
  response.set_model_name("attention");
  response.set_model_version("1");
  return response;
}

TEST(HttpCodecTest, JsonResponse) {
  ModelInferResponse response = BasicResponse();
  response.set_id("r1");
  (*response.mutable_parameters())["sequence"].set_int64_param(3);
  AddOutput(&response, "output", "FP32", {1, 3}, Raw<float>({0.1f, -2.5f, 1e-45f}));
  AddOutput(&response, "ints", "INT32", {2}, Raw<int32_t>({-7, 2147483647}));
  AddOutput(&response, "longs", "UINT64", {1}, Raw<uint64_t>({18446744073709551615u}));
  AddOutput(&response, "flags", "BOOL", {2}, std::string("\x01\x00", 2));
  AddOutput(&response, "half", "FP16", {4}, Raw<uint16_t>({0x3c00, 0xc000, 0x0001, 0x7bff}));
  AddOutput(&response, "brain", "BF16", {1}, Raw<uint16_t>({0x3e20}));
  AddOutput(&response, "wide", "FP64", {1}, Raw<double>({0.1}));
  AddOutput(&response, "empty", "FP32", {0, 4}, "");

  const absl::StatusOr<HttpBody> encoded = EncodeInferResponse(ModelInferRequest(), response);
  ASSERT_TRUE(encoded.ok()) << encoded.status();
  EXPECT_EQ(encoded->content_type, "application/json");
  EXPECT_EQ(encoded->header_length, -1);
  EXPECT_EQ(encoded->body,
            R"({"model_name":"attention","model_version":"1","id":"r1",)"
            R"("parameters":{"sequence":3},"outputs":[)"
            R"({"name":"output","datatype":"FP32","shape":[1,3],"data":[0.1,-2.5,1e-45]},)"
            R"({"name":"ints","datatype":"INT32","shape":[2],"data":[-7,2147483647]},)"
            R"({"name":"longs","datatype":"UINT64","shape":[1],"data":[18446744073709551615]},)"
            R"({"name":"flags","datatype":"BOOL","shape":[2],"data":[true,false]},)"
            R"({"name":"half","datatype":"FP16","shape":[4],)"
            R"("data":[1.0,-2.0,5.9604645e-08,65504.0]},)"
            R"({"name":"brain","datatype":"BF16","shape":[1],"data":[0.15625]},)"
            R"({"name":"wide","datatype":"FP64","shape":[1],"data":[0.1]},)"
            R"({"name":"empty","datatype":"FP32","shape":[0,4],"data":[]}]})");
}

TEST(HttpCodecTest, EmptyIdAndParametersAreOmitted) {
  ModelInferResponse response = BasicResponse();
  const absl::StatusOr<HttpBody> encoded = EncodeInferResponse(ModelInferRequest(), response);
  ASSERT_TRUE(encoded.ok()) << encoded.status();
  EXPECT_EQ(encoded->body, R"({"model_name":"attention","model_version":"1","outputs":[]})");
}

TEST(HttpCodecTest, Fp32PrintsRoundTripBitExactly) {
  std::vector<float> values = {0.1f,
                               -0.0f,
                               0.0f,
                               1.0f / 3,
                               std::numeric_limits<float>::max(),
                               -std::numeric_limits<float>::max(),
                               std::numeric_limits<float>::min(),
                               std::numeric_limits<float>::denorm_min(),
                               std::nextafter(1.0f, 2.0f),
                               16777217.0f,
                               3.4028235e38f};
  std::mt19937 random(7);
  while (values.size() < 200000) {
    const float f = std::bit_cast<float>(static_cast<uint32_t>(random()));
    if (std::isfinite(f)) values.push_back(f);
  }
  std::string raw(values.size() * sizeof(float), '\0');
  std::memcpy(raw.data(), values.data(), raw.size());
  ModelInferResponse response = BasicResponse();
  AddOutput(&response, "y", "FP32", {static_cast<int64_t>(values.size())}, raw);
  const absl::StatusOr<HttpBody> encoded = EncodeInferResponse(ModelInferRequest(), response);
  ASSERT_TRUE(encoded.ok()) << encoded.status();
  const Json data = Json::parse(encoded->body)["outputs"][0]["data"];
  ASSERT_EQ(data.size(), values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    const float back = static_cast<float>(data[i].get<double>());
    ASSERT_EQ(std::bit_cast<uint32_t>(back), std::bit_cast<uint32_t>(values[i]))
        << "index " << i << ": " << values[i] << " printed as " << data[i].dump();
  }
}

TEST(HttpCodecTest, BinaryOutputsFollowTheJsonHeader) {
  ModelInferRequest request;
  request.add_outputs()->set_name("b");
  (*request.mutable_outputs(0)->mutable_parameters())["binary_data"].set_bool_param(true);
  ModelInferResponse response = BasicResponse();
  AddOutput(&response, "a", "INT64", {2}, Raw<int64_t>({1, -1}));
  auto* b = AddOutput(&response, "b", "FP32", {2}, Raw<float>({0.5f, std::nanf("")}));
  (*b->mutable_parameters())["note"].set_string_param("n");
  AddOutput(&response, "c", "UINT8", {0}, "");

  const absl::StatusOr<HttpBody> encoded = EncodeInferResponse(request, response);
  ASSERT_TRUE(encoded.ok()) << encoded.status();
  EXPECT_EQ(encoded->content_type, "application/octet-stream");
  ASSERT_GT(encoded->header_length, 0);
  const std::string header = encoded->body.substr(0, encoded->header_length);
  EXPECT_EQ(encoded->body.substr(encoded->header_length), Raw<float>({0.5f, std::nanf("")}));
  const Json json = Json::parse(header);
  EXPECT_EQ(json["outputs"][0]["data"], Json::parse("[1, -1]"));
  EXPECT_EQ(json["outputs"][1], Json::parse(R"({"name": "b", "datatype": "FP32", "shape": [2],
                            "parameters": {"binary_data_size": 8, "note": "n"}})"));
  EXPECT_EQ(json["outputs"][2]["data"], Json::array());
}

TEST(HttpCodecTest, TheHeadEncodingListsTheBinaryOutputsInsteadOfCopyingThem) {
  ModelInferRequest request;
  ModelInferResponse response = BasicResponse();
  AddOutput(&response, "a", "FP32", {2}, Raw<float>({1.5f, -2.0f}));
  AddOutput(&response, "b", "INT64", {1}, Raw<int64_t>({7}));
  (*request.mutable_parameters())["binary_data_output"].set_bool_param(true);
  (*request.add_outputs()->mutable_parameters())["binary_data"].set_bool_param(false);
  request.mutable_outputs(0)->set_name("b");
  const absl::StatusOr<HttpBody> whole = EncodeInferResponse(request, response);
  const absl::StatusOr<HttpBody> head = EncodeInferResponseHead(request, response);
  ASSERT_TRUE(whole.ok() && head.ok());
  EXPECT_EQ(head->binary_outputs, std::vector<int>{0});
  EXPECT_EQ(head->header_length, whole->header_length);
  EXPECT_EQ(head->body.size(), static_cast<size_t>(head->header_length));
  EXPECT_EQ(head->content_type, "application/octet-stream");
  EXPECT_EQ(head->body + response.raw_output_contents(0), whole->body);
  EXPECT_TRUE(whole->binary_outputs.empty());
}

TEST(HttpCodecTest, BinaryDataOutputUnlessTheOutputSaysOtherwise) {
  const ModelInferRequest request = ParseOk(R"({
      "parameters": {"binary_data_output": true},
      "inputs": [],
      "outputs": [{"name": "json", "parameters": {"binary_data": false}}]
  })");
  ModelInferResponse response = BasicResponse();
  AddOutput(&response, "bin1", "INT16", {1}, Raw<int16_t>({-2}));
  AddOutput(&response, "json", "INT16", {1}, Raw<int16_t>({3}));
  AddOutput(&response, "bin2", "UINT16", {2}, Raw<uint16_t>({4, 5}));

  const absl::StatusOr<HttpBody> encoded = EncodeInferResponse(request, response);
  ASSERT_TRUE(encoded.ok()) << encoded.status();
  EXPECT_EQ(encoded->content_type, "application/octet-stream");
  const Json json = Json::parse(encoded->body.substr(0, encoded->header_length));
  EXPECT_EQ(json["outputs"][0]["parameters"]["binary_data_size"], 2);
  EXPECT_FALSE(json["outputs"][0].contains("data"));
  EXPECT_EQ(json["outputs"][1]["data"], Json::parse("[3]"));
  EXPECT_FALSE(json["outputs"][1].contains("parameters"));
  EXPECT_EQ(json["outputs"][2]["parameters"]["binary_data_size"], 4);
  EXPECT_EQ(encoded->body.substr(encoded->header_length),
            Raw<int16_t>({-2}) + Raw<uint16_t>({4, 5}));
}

TEST(HttpCodecTest, InconsistentResponsesAreInternalErrors) {
  const auto encode = [](const ModelInferResponse& response) {
    return EncodeInferResponse(ModelInferRequest(), response).status();
  };
  ModelInferResponse missing_raw = BasicResponse();
  AddOutput(&missing_raw, "y", "FP32", {1}, Raw<float>({1}));
  missing_raw.clear_raw_output_contents();
  EXPECT_EQ(encode(missing_raw).code(), absl::StatusCode::kInternal);
  EXPECT_THAT(encode(missing_raw).message(), HasSubstr("1 outputs but 0 raw_output_contents"));

  ModelInferResponse short_raw = BasicResponse();
  AddOutput(&short_raw, "y", "FP32", {2}, Raw<float>({1}));
  EXPECT_EQ(encode(short_raw).code(), absl::StatusCode::kInternal);
  EXPECT_THAT(encode(short_raw).message(),
              HasSubstr(R"(response outputs[0] ("y"): 4 bytes for shape (2) of FP32)"));

  ModelInferResponse bytes = BasicResponse();
  AddOutput(&bytes, "s", "BYTES", {1}, "abc");
  EXPECT_EQ(encode(bytes).code(), absl::StatusCode::kInternal);
  EXPECT_THAT(encode(bytes).message(), HasSubstr(R"(datatype "BYTES" has no HTTP encoding)"));
}

TEST(HttpCodecTest, NonFiniteJsonOutputsAreErrorsNamingTheOutput) {
  for (const float bad : {std::numeric_limits<float>::infinity(), std::nanf("")}) {
    ModelInferResponse response = BasicResponse();
    AddOutput(&response, "fine", "FP32", {1}, Raw<float>({1.0f}));
    AddOutput(&response, "output", "FP32", {3}, Raw<float>({0.5f, 2.0f, bad}));
    const absl::StatusOr<HttpBody> encoded = EncodeInferResponse(ModelInferRequest(), response);
    ASSERT_FALSE(encoded.ok());
    EXPECT_EQ(encoded.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(encoded.status().message(), HasSubstr(R"(outputs[1] ("output"): element 2 is )"));
    EXPECT_THAT(encoded.status().message(), HasSubstr("parameters.binary_data: true"));
  }
}

TEST(HttpCodecTest, BytesAfterTheJsonValueAreRefused) {
  for (const std::string& tail : {std::string("\0garbage", 8), std::string(" x")}) {
    const absl::StatusOr<ModelInferRequest> parsed =
        ParseInferRequest("m", "", absl::StrCat(R"({"inputs": []})", tail), std::nullopt);
    ASSERT_FALSE(parsed.ok());
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(parsed.status().message(), HasSubstr("invalid JSON"));
  }
}

TEST(HttpCodecTest, RepositoryBodyListsItsParameters) {
  const absl::StatusOr<RepositoryBody> body =
      ParseRepositoryBody(R"({"parameters": {"unload_dependents": false, "config": "{}"}})");
  ASSERT_TRUE(body.ok()) << body.status();
  ASSERT_EQ(body->parameters.size(), 2u);
  EXPECT_EQ(body->parameters[0].name, "config");
  EXPECT_FALSE(body->parameters[0].is_bool);
  EXPECT_EQ(body->parameters[1].name, "unload_dependents");
  EXPECT_TRUE(body->parameters[1].is_bool);
  EXPECT_TRUE(ParseRepositoryBody("")->parameters.empty());
}

TEST(HttpCodecTest, StatisticsAreJsonNumbers) {
  inference::ModelStatisticsResponse response;
  inference::ModelStatistics* m = response.add_model_stats();
  m->set_name("m");
  m->set_version("1");
  m->set_inference_count(uint64_t{1} << 40);
  m->set_last_inference(1700000000000);
  m->mutable_inference_stats()->mutable_compute_infer()->set_count(33711);
  m->mutable_inference_stats()->mutable_compute_infer()->set_ns(18446744073709551615u);
  inference::InferBatchStatistics* b = m->add_batch_stats();
  b->set_batch_size(4);
  b->mutable_compute_infer()->set_count(2);
  const Json json = Json::parse(StatisticsBody(response));
  const Json& model = json["model_stats"][0];
  EXPECT_EQ(model["name"], "m");
  EXPECT_EQ(model["inference_count"], uint64_t{1} << 40);
  EXPECT_TRUE(model["last_inference"].is_number_unsigned());
  EXPECT_EQ(model["execution_count"], 0);
  EXPECT_EQ(model["inference_stats"]["compute_infer"]["count"], 33711);
  EXPECT_EQ(model["inference_stats"]["compute_infer"]["ns"].get<uint64_t>(), 18446744073709551615u);
  for (const char* name : {"success", "fail", "queue", "compute_input", "compute_infer",
                           "compute_output", "cache_hit", "cache_miss"}) {
    EXPECT_TRUE(model["inference_stats"][name]["count"].is_number()) << name;
    EXPECT_TRUE(model["inference_stats"][name]["ns"].is_number()) << name;
  }
  EXPECT_EQ(model["batch_stats"][0]["batch_size"], 4);
  EXPECT_EQ(model["batch_stats"][0]["compute_infer"]["count"], 2);
  EXPECT_EQ(model["batch_stats"][0]["compute_output"]["count"], 0);
}

TEST(HttpCodecTest, ErrorBodiesAreCappedAtOneKiB) {
  const std::string long_message(9000, 'x');
  const std::string error = Json::parse(ErrorBody(long_message))["error"];
  EXPECT_LE(error.size(), 1024u);
  EXPECT_THAT(error, ::testing::EndsWith("... (9000 bytes)"));
  EXPECT_EQ(Json::parse(ErrorBody("short"))["error"], "short");
  // Cut at a character boundary: two-byte characters stay whole.
  std::string accents;
  for (int i = 0; i < 3000; ++i) accents += "\xc3\xa9";
  const std::string cut = Json::parse(ErrorBody(accents))["error"];
  EXPECT_LE(cut.size(), 1024u);
  EXPECT_EQ(cut.find("\xef\xbf\xbd"), std::string::npos) << "no replacement character";
  EXPECT_THAT(cut, ::testing::EndsWith("... (6000 bytes)"));
}

TEST(HttpCodecTest, ErrorBodyEscapes) {
  EXPECT_EQ(ErrorBody("inputs[0] (\"q\"): bad\nnext \\ line"),
            R"({"error":"inputs[0] (\"q\"): bad\nnext \\ line"})");
  EXPECT_EQ(Json::parse(ErrorBody("tab\there"))["error"], "tab\there");
  // Invalid UTF-8 (quoted from a hostile body) still gives valid JSON.
  EXPECT_EQ(Json::parse(ErrorBody("a\xff"))["error"], "a\xef\xbf\xbd");
}

}  // namespace
}  // namespace mha::server

namespace mha::server {
namespace {

// Triton's system shared memory: an input naming a region carries no data and gets
// no raw_input_contents entry; an output written into one is sent with its
// parameters and no data, binary or not.
TEST(HttpCodecSharedMemoryTest, InputsInARegionHaveNoRawEntry) {
  const ModelInferRequest request = ParseOk(R"({"inputs": [
      {"name": "queries", "datatype": "FP32", "shape": [1, 2, 2],
       "parameters": {"shared_memory_region": "in", "shared_memory_byte_size": 16,
                      "shared_memory_offset": 64}},
      {"name": "keys", "datatype": "FP32", "shape": [1], "data": [1.5]}],
      "outputs": [{"name": "output", "parameters": {"shared_memory_region": "out",
                                                    "shared_memory_byte_size": 4096}}]})");
  ASSERT_EQ(request.inputs_size(), 2);
  ASSERT_EQ(request.raw_input_contents_size(), 1);  // keys only
  EXPECT_EQ(request.raw_input_contents(0), std::string("\0\0\xc0\x3f", 4));
  const auto& parameters = request.inputs(0).parameters();
  EXPECT_EQ(parameters.at("shared_memory_region").string_param(), "in");
  EXPECT_EQ(parameters.at("shared_memory_byte_size").int64_param(), 16);
  EXPECT_EQ(parameters.at("shared_memory_offset").int64_param(), 64);
  EXPECT_EQ(request.outputs(0).parameters().at("shared_memory_region").string_param(), "out");
}

TEST(HttpCodecSharedMemoryTest, DataAndARegionAreRefused) {
  for (const char* body :
       {R"({"inputs": [{"name": "q", "datatype": "FP32", "shape": [1], "data": [1],
            "parameters": {"shared_memory_region": "r", "shared_memory_byte_size": 4}}]})",
        R"({"inputs": [{"name": "q", "datatype": "FP32", "shape": [1],
            "parameters": {"shared_memory_region": "r", "binary_data_size": 4}}]})"}) {
    const absl::StatusOr<ModelInferRequest> parsed =
        ParseInferRequest("m", "1", body, std::optional<int64_t>(std::strlen(body)));
    ASSERT_FALSE(parsed.ok()) << body;
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(parsed.status().message()),
                HasSubstr("inputs[0] (\"q\"): has parameters.shared_memory_region and"));
  }
}

TEST(HttpCodecSharedMemoryTest, OutputsInARegionCarryNoData) {
  ModelInferRequest request;
  (*request.mutable_parameters())["binary_data_output"].set_bool_param(true);
  ModelInferResponse response = BasicResponse();
  auto* shm = AddOutput(&response, "output", "FP32", {2, 3}, "");
  (*shm->mutable_parameters())["shared_memory_region"].set_string_param("out");
  (*shm->mutable_parameters())["shared_memory_byte_size"].set_int64_param(24);
  AddOutput(&response, "lse", "FP32", {1}, Raw<float>({0.5f}));
  const absl::StatusOr<HttpBody> encoded = EncodeInferResponse(request, response);
  ASSERT_TRUE(encoded.ok()) << encoded.status();
  const Json json = Json::parse(encoded->body.substr(0, encoded->header_length));
  EXPECT_EQ(json["outputs"][0], Json::parse(R"({"name": "output", "datatype": "FP32",
      "shape": [2, 3]})"));
  EXPECT_EQ(encoded->body.substr(encoded->header_length), Raw<float>({0.5f}));  // lse only
  // A shared-memory output with bytes is the server's bug.
  *response.mutable_raw_output_contents(0) = std::string(24, '\0');
  EXPECT_EQ(EncodeInferResponse(request, response).status().code(), absl::StatusCode::kInternal);
}

}  // namespace
}  // namespace mha::server

// --- The fast path (http_codec.h, http_codec_internal) ---

namespace mha::server {
namespace {

namespace internal = http_codec_internal;
using google::protobuf::util::MessageDifferencer;

// attention_client's binary request (client/sdk/kserve.cc ToHttpRequest): compact
// JSON, every input binary, the output asked for as binary.
constexpr char kClientHead[] =
    R"({"id":"42","parameters":{"binary_data_output":true},"inputs":[)"
    R"({"datatype":"FP32","name":"queries","parameters":{"binary_data_size":16},"shape":[1,2,2]},)"
    R"({"datatype":"INT32","name":"valid_lens","parameters":{"binary_data_size":4},"shape":[1]}],)"
    R"("outputs":[{"name":"output","parameters":{"binary_data":true}}]})";

std::string ClientTail() {
  return absl::StrCat(Raw<float>({1.0f, -2.0f, 0.5f, 3.0f}), Raw<int32_t>({2}));
}

TEST(HttpCodecFastPathTest, TheClientsRequestAndItsAnswerTakeItAndEqualTheGeneralPath) {
  const std::string body = absl::StrCat(kClientHead, ClientTail());
  const int64_t head = static_cast<int64_t>(std::strlen(kClientHead));
  const std::optional<ModelInferRequest> fast = internal::ParseFast("m", "1", body, head);
  const absl::StatusOr<ModelInferRequest> general = internal::ParseGeneral("m", "1", body, head);
  ASSERT_TRUE(fast.has_value());
  ASSERT_TRUE(general.ok()) << general.status();
  EXPECT_TRUE(MessageDifferencer::Equals(*fast, *general))
      << fast->DebugString() << "\n" << general->DebugString();
  EXPECT_EQ(fast->raw_input_contents(1), Raw<int32_t>({2}));

  ModelInferResponse response = BasicResponse();
  response.set_id("42");
  AddOutput(&response, "output", "FP32", {1, 2, 3}, Raw<float>({1, 2, 3, 4, 5, 6}));
  for (const bool split : {false, true}) {
    const std::optional<HttpBody> out = internal::EncodeFast(*fast, response, split);
    const absl::StatusOr<HttpBody> expected = internal::EncodeGeneral(*fast, response, split);
    ASSERT_TRUE(out.has_value());
    ASSERT_TRUE(expected.ok()) << expected.status();
    EXPECT_EQ(out->body, expected->body);
    EXPECT_EQ(out->header_length, expected->header_length);
    EXPECT_EQ(out->content_type, expected->content_type);
    EXPECT_EQ(out->binary_outputs, expected->binary_outputs);
  }
}

// Whatever the fast path does not read goes the general way, whose answer (a
// result, or a refusal naming the field) ParseInferRequest returns unchanged.
TEST(HttpCodecFastPathTest, OtherFormsGoTheGeneralWay) {
  const std::string tail = ClientTail();
  const std::string head = kClientHead;
  const auto swap = [&](const std::string& from, const std::string& to) {
    std::string changed = head;
    const size_t at = changed.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    if (at != std::string::npos) changed.replace(at, from.size(), to);
    return changed;
  };
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"an escape in a string", swap(R"("queries")", R"("quer\u0069es")")},
      {"a string that is not ASCII", swap(R"("42")", "\"\xc3\xa9\"")},
      {"a fractional parameter", swap(R"({"binary_data_output":true})", R"({"t":1.5})")},
      {"an exponent in a dimension", swap("[1,2,2]", "[1,2,2e0]")},
      {"-0", swap("[1]", "[-0]")},
      {"a key twice", swap(R"("name":"queries",)", R"("name":"x","name":"queries",)")},
      {"a key the general path ignores", swap(R"({"id":"42",)", R"({"id":"42","x":[],)")},
      {"a string for binary_data", swap(R"({"binary_data":true})", R"({"binary_data":"yes"})")},
      {"lse asked for as JSON", swap(R"({"name":"output","parameters":{"binary_data":true}})",
                                     R"({"name":"lse","parameters":{"binary_data":false}})")},
      {"a size that is not the shape's", swap(R"({"binary_data_size":4})", R"({"binary_data_size":8})")},
      {"a shared-memory input",
       swap(R"({"binary_data_size":4})", R"({"binary_data_size":4,"shared_memory_region":"r"})")},
      {"BYTES", swap(R"("INT32")", R"("BYTES")")},
      {"an unknown datatype", swap(R"("INT32")", R"("INT31")")},
      {"no inputs", swap(R"("inputs":[)", R"("inputz":[)")},
  };
  for (const auto& [what, changed] : cases) {
    SCOPED_TRACE(what);
    const std::string body = changed + tail;
    const int64_t length = static_cast<int64_t>(changed.size());
    EXPECT_FALSE(internal::ParseFast("m", "1", body, length).has_value());
    const absl::StatusOr<ModelInferRequest> answered = ParseInferRequest("m", "1", body, length);
    const absl::StatusOr<ModelInferRequest> general = internal::ParseGeneral("m", "1", body, length);
    EXPECT_EQ(answered.status(), general.status());
    if (answered.ok()) {
      EXPECT_TRUE(MessageDifferencer::Equals(*answered, *general));
    }
  }
  // The body around a correct head: bytes after the JSON, binary bytes left over or
  // missing, no Inference-Header-Content-Length.
  const int64_t length = static_cast<int64_t>(head.size());
  for (const auto& [body, header_length] :
       std::vector<std::pair<std::string, std::optional<int64_t>>>{
           {head + " x" + tail, length + 2},
           {head + tail + "x", length},
           {head + tail.substr(1), length},
           {head, std::nullopt}}) {
    EXPECT_FALSE(internal::ParseFast("m", "1", body, header_length).has_value());
    EXPECT_EQ(ParseInferRequest("m", "1", body, header_length).status().code(),
              absl::StatusCode::kInvalidArgument);
  }
}

TEST(HttpCodecFastPathTest, ResponsesOfOtherFormsGoTheGeneralWay) {
  const std::string body = absl::StrCat(kClientHead, ClientTail());
  const ModelInferRequest request =
      ParseOk(body, static_cast<int64_t>(std::strlen(kClientHead)));
  const auto answer = [] {
    ModelInferResponse response = BasicResponse();
    AddOutput(&response, "output", "FP32", {1}, Raw<float>({1}));
    return response;
  };
  ModelInferResponse with_parameters = answer();
  (*with_parameters.mutable_parameters())["p"].set_int64_param(1);
  ModelInferResponse in_shared_memory = answer();
  (*in_shared_memory.mutable_outputs(0)->mutable_parameters())["shared_memory_region"]
      .set_string_param("r");
  in_shared_memory.mutable_raw_output_contents(0)->clear();
  ModelInferResponse quoted_id = answer();
  quoted_id.set_id("a\"b");
  ModelInferResponse as_json = answer();
  as_json.mutable_outputs(0)->set_name("attention");  // the request asks binary for "output" only
  ModelInferRequest no_binary = request;
  no_binary.mutable_parameters()->erase("binary_data_output");
  for (const auto& [what, req, response] :
       std::vector<std::tuple<std::string, ModelInferRequest, ModelInferResponse>>{
           {"response parameters", request, with_parameters},
           {"an output in shared memory", request, in_shared_memory},
           {"a quote in the id", request, quoted_id},
           {"an output sent as JSON", no_binary, as_json}}) {
    SCOPED_TRACE(what);
    EXPECT_FALSE(internal::EncodeFast(req, response, true).has_value());
    const absl::StatusOr<HttpBody> answered = EncodeInferResponseHead(req, response);
    const absl::StatusOr<HttpBody> general = internal::EncodeGeneral(req, response, true);
    ASSERT_EQ(answered.status(), general.status());
    if (answered.ok()) {
      EXPECT_EQ(answered->body, general->body);
    }
  }
}

}  // namespace
}  // namespace mha::server

// The attention.v1 codec in-process: every validation rule with its exact status
// code and a message naming the field (server/attention_v1/codec.h lists the rules), and the
// response encoding. The same rules over gRPC: tests/integration/validation_test.cc.
#include "server/attention_v1/codec.h"

#include <algorithm>
#include <functional>
#include <limits>
#include <memory>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "server/models/model_repository.h"
#include "tests/integration/client_util.h"
#include "tests/temp_dir.h"

namespace mha::server {
namespace {

using attention::v1::AttendRequest;
using attention::v1::AttendResponse;
using attention::v1::Tensor;
using ::mha::testing::MakeTensor;
using ::mha::testing::TempDir;
using ::mha::testing::ToyRequest;

struct Case {
  std::string name;
  std::function<void(AttendRequest&)> mutate;  // applied to ToyRequest()
  absl::StatusCode code;
  std::string message;  // a substring the message must contain
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

// The models and limits of the integration test's server, loaded in-process.
class CodecTest : public ::testing::TestWithParam<Case> {
 protected:
  static void SetUpTestSuite() {
    TempDir dir;
    ::mha::testing::WriteValidationModels(dir);
    models_ = ModelRepository::Create({.path = dir.path(),
                                       .default_limits = {.max_batch_size = 4,
                                                          .max_sequence_length = 16,
                                                          .max_request_bytes = 200000,
                                                          .max_attention_elements = 1000},
                                       .num_threads = 1})
                  .value()
                  .release();
  }
  static void TearDownTestSuite() { delete models_; }

  static absl::StatusOr<ValidatedRequest> Decode(const AttendRequest& request) {
    absl::StatusOr<std::shared_ptr<const Model>> model = models_->Find(request.model());
    if (!model.ok()) return model.status();
    return ValidateRequest(request, **model);
  }

  static ModelRepository* models_;
};

ModelRepository* CodecTest::models_ = nullptr;

TEST_P(CodecTest, RejectsWithCodeAndField) {
  const Case& c = GetParam();
  AttendRequest request = ToyRequest();
  c.mutate(request);
  const absl::Status status = Decode(request).status();
  EXPECT_EQ(status.code(), c.code) << status;
  EXPECT_TRUE(absl::StrContains(status.message(), c.message))
      << "message: " << status.message() << "\nexpected to contain: " << c.message;
}

void SetShape(Tensor* t, std::vector<int64_t> shape) {
  t->clear_shape();
  for (int64_t d : shape) t->add_shape(d);
}
void Resize(Tensor* t, int n) { t->mutable_data()->Resize(n, 0.5f); }

// Moves a tensor's values from data to raw (little-endian float32 bytes).
void ToRaw(Tensor* t) {
  t->set_raw(std::string(reinterpret_cast<const char*>(t->data().data()),
                         sizeof(float) * static_cast<size_t>(t->data_size())));
  t->clear_data();
}

using StatusCode = absl::StatusCode;
const float kNan = std::numeric_limits<float>::quiet_NaN();
const float kInf = std::numeric_limits<float>::infinity();

const Case kCases[] = {
    {"UnknownModel", [](AttendRequest& r) { r.set_model("nope"); }, StatusCode::kNotFound,
     "model: unknown model \"nope\"; served: cross, default, small_requests"},
    {"QueriesMissing", [](AttendRequest& r) { r.clear_queries(); }, StatusCode::kInvalidArgument,
     "queries: required, shape (B, Q, d_q = 100)"},
    {"QueriesEmptyTensor", [](AttendRequest& r) { r.mutable_queries()->Clear(); },
     StatusCode::kInvalidArgument, "queries: expected rank 3 (B, Q, d_q), got shape ()"},
    {"QueriesRank2",
     [](AttendRequest& r) {
       SetShape(r.mutable_queries(), {8, 100});
     },
     StatusCode::kInvalidArgument, "queries: expected rank 3 (B, Q, d_q), got shape (8, 100)"},
    {"QueriesZeroDim",
     [](AttendRequest& r) {
       SetShape(r.mutable_queries(), {0, 4, 100});
       Resize(r.mutable_queries(), 0);
     },
     StatusCode::kInvalidArgument, "queries: every dimension of (B, Q, d_q) must be >= 1"},
    {"QueriesNegativeDim",
     [](AttendRequest& r) {
       SetShape(r.mutable_queries(), {2, -4, 100});
     },
     StatusCode::kInvalidArgument, "queries: every dimension of (B, Q, d_q) must be >= 1"},
    {"QueriesDataShort", [](AttendRequest& r) { Resize(r.mutable_queries(), 799); },
     StatusCode::kInvalidArgument, "queries: shape (2, 4, 100) needs 800 values, data has 799"},
    {"QueriesShapeOverflow",
     [](AttendRequest& r) {
       SetShape(r.mutable_queries(), {int64_t{1} << 40, int64_t{1} << 40, 100});
     },
     StatusCode::kInvalidArgument, "needs more than 2^63 values, data has 800"},
    {"QueriesFeatureSize",
     [](AttendRequest& r) {
       SetShape(r.mutable_queries(), {2, 4, 99});
       Resize(r.mutable_queries(), 792);
     },
     StatusCode::kInvalidArgument, "queries: expected shape (2, 4, 100), got (2, 4, 99)"},
    {"KeysWithoutValues", [](AttendRequest& r) { r.clear_values(); }, StatusCode::kInvalidArgument,
     "values: required when keys are given"},
    {"ValuesWithoutKeys", [](AttendRequest& r) { r.clear_keys(); }, StatusCode::kInvalidArgument,
     "keys: required when values are given"},
    {"KeysRank4",
     [](AttendRequest& r) {
       SetShape(r.mutable_keys(), {2, 6, 10, 10});
     },
     StatusCode::kInvalidArgument, "keys: expected rank 3 (B, K, d_k), got shape (2, 6, 10, 10)"},
    {"KeysFeatureSize",
     [](AttendRequest& r) {
       SetShape(r.mutable_keys(), {2, 6, 99});
       Resize(r.mutable_keys(), 2 * 6 * 99);
     },
     StatusCode::kInvalidArgument, "keys: expected shape (2, 6, 100), got (2, 6, 99)"},
    {"KeysBatchSize",
     [](AttendRequest& r) {
       SetShape(r.mutable_keys(), {3, 4, 100});
     },
     StatusCode::kInvalidArgument, "keys: expected shape (2, 4, 100), got (3, 4, 100)"},
    {"ValuesLength",
     [](AttendRequest& r) {
       SetShape(r.mutable_values(), {2, 5, 100});
       Resize(r.mutable_values(), 1000);
     },
     StatusCode::kInvalidArgument, "values: expected shape (2, 6, 100), got (2, 5, 100)"},
    {"ValuesDataLong", [](AttendRequest& r) { Resize(r.mutable_values(), 1201); },
     StatusCode::kInvalidArgument, "values: shape (2, 6, 100) needs 1200 values, data has 1201"},
    {"SelfAttentionOnCrossOnlyModel",
     [](AttendRequest& r) {
       r.set_model("cross");
       *r.mutable_queries() = MakeTensor({2, 4, 4});
       r.clear_keys();
       r.clear_values();
     },
     StatusCode::kInvalidArgument,
     "keys: required, model cross has d_q = 4, d_k = 6, d_v = 3 and cannot self-attend"},
    {"ValuesFeatureSizeOfOtherModel",
     [](AttendRequest& r) {
       r.set_model("cross");
       *r.mutable_queries() = MakeTensor({2, 4, 4});
       *r.mutable_keys() = MakeTensor({2, 6, 6});
       *r.mutable_values() = MakeTensor({2, 6, 6});
     },
     StatusCode::kInvalidArgument, "values: expected shape (2, 6, 3), got (2, 6, 6)"},
    {"ValidLensCount", [](AttendRequest& r) { r.add_valid_lens(1); }, StatusCode::kInvalidArgument,
     "valid_lens: expected 0, B = 2 or B*Q = 8 entries, got 3"},
    {"ValidLensNegative", [](AttendRequest& r) { r.set_valid_lens(0, -1); },
     StatusCode::kInvalidArgument, "valid_lens[0]: expected 0 <= valid_len <= K = 6, got -1"},
    {"ValidLensOverK", [](AttendRequest& r) { r.set_valid_lens(1, 7); },
     StatusCode::kInvalidArgument, "valid_lens[1]: expected 0 <= valid_len <= K = 6, got 7"},
    {"ValidLensPerQueryOverK",
     [](AttendRequest& r) {
       r.clear_valid_lens();
       for (int i = 0; i < 8; ++i) r.add_valid_lens(i == 5 ? 9 : 2);
     },
     StatusCode::kInvalidArgument, "valid_lens[5]: expected 0 <= valid_len <= K = 6, got 9"},
    {"HeadMaskLength",
     [](AttendRequest& r) {
       for (int i = 0; i < 4; ++i) r.add_head_mask(1.0f);
     },
     StatusCode::kInvalidArgument, "head_mask: expected 5 entries (one per head) or none, got 4"},
    {"HeadMaskNonFinite",
     [](AttendRequest& r) {
       for (int i = 0; i < 5; ++i) r.add_head_mask(i == 2 ? kNan : 1.0f);
     },
     StatusCode::kInvalidArgument, "head_mask[2]: expected a finite value, got nan"},
    {"QueriesNan", [](AttendRequest& r) { r.mutable_queries()->set_data(17, kNan); },
     StatusCode::kInvalidArgument,
     "queries: non-finite value nan at index 17 (batch 0, position 0, feature 17)"},
    {"KeysInf", [](AttendRequest& r) { r.mutable_keys()->set_data(745, kInf); },
     StatusCode::kInvalidArgument,
     "keys: non-finite value inf at index 745 (batch 1, position 1, feature 45)"},
    {"ValuesNegativeInf", [](AttendRequest& r) { r.mutable_values()->set_data(1199, -kInf); },
     StatusCode::kInvalidArgument,
     "values: non-finite value -inf at index 1199 (batch 1, position 5, feature 99)"},
    {"BatchOverLimit",
     [](AttendRequest& r) {
       *r.mutable_queries() = MakeTensor({5, 4, 100});
       *r.mutable_keys() = MakeTensor({5, 6, 100});
       *r.mutable_values() = r.keys();
       r.clear_valid_lens();
     },
     StatusCode::kResourceExhausted,
     "queries: batch size 5 exceeds max_batch_size 4 of model default"},
    {"QueryLengthOverLimit",
     [](AttendRequest& r) {
       *r.mutable_queries() = MakeTensor({2, 17, 100});
     },
     StatusCode::kResourceExhausted,
     "queries: sequence length 17 exceeds max_sequence_length 16 of model default"},
    {"KeyLengthOverLimit",
     [](AttendRequest& r) {
       *r.mutable_keys() = MakeTensor({2, 17, 100});
       *r.mutable_values() = r.keys();
     },
     StatusCode::kResourceExhausted,
     "keys: sequence length 17 exceeds max_sequence_length 16 of model default"},
    {"AttentionWeightsOverLimit",
     [](AttendRequest& r) {
       *r.mutable_queries() = MakeTensor({2, 16, 100});
       *r.mutable_keys() = MakeTensor({2, 16, 100});
       *r.mutable_values() = r.keys();
       r.set_return_attention(true);
     },
     StatusCode::kResourceExhausted,
     "return_attention: B*h*Q*K = 2*5*16*16 weights exceed max_attention_elements 1000"},
    {"QueriesDataAndRaw",
     [](AttendRequest& r) { r.mutable_queries()->set_raw(std::string(16, '\0')); },
     StatusCode::kInvalidArgument,
     "queries: has both data (800 floats) and raw (16 bytes); send one"},
    {"KeysRawNotWholeFloats",
     [](AttendRequest& r) {
       ToRaw(r.mutable_keys());
       r.mutable_keys()->mutable_raw()->push_back('\0');
     },
     StatusCode::kInvalidArgument, "keys.raw: 4801 bytes is not a whole number of float32 values"},
    {"ValuesRawShort",
     [](AttendRequest& r) {
       ToRaw(r.mutable_values());
       r.mutable_values()->mutable_raw()->resize(4 * 1199);
     },
     StatusCode::kInvalidArgument, "values: shape (2, 6, 100) needs 1200 values, data has 1199"},
    {"QueriesRawNan",
     [](AttendRequest& r) {
       r.mutable_queries()->set_data(17, kNan);
       ToRaw(r.mutable_queries());
     },
     StatusCode::kInvalidArgument,
     "queries: non-finite value nan at index 17 (batch 0, position 0, feature 17)"},
    {"RequestBytesOverModelLimit", [](AttendRequest& r) { r.set_model("small_requests"); },
     StatusCode::kResourceExhausted, "exceeds max_request_bytes 2000 of model small_requests"},
};

INSTANTIATE_TEST_SUITE_P(Rules, CodecTest, ::testing::ValuesIn(kCases),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return info.param.name;
                         });

// The same rules do not fire on good requests to the other models.
TEST_F(CodecTest, GoodRequestsPass) {
  AttendRequest toy = ToyRequest();
  absl::StatusOr<ValidatedRequest> decoded = Decode(toy);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(decoded->inputs.batch, 2);
  EXPECT_EQ(decoded->inputs.num_queries, 4);
  EXPECT_EQ(decoded->inputs.num_keys, 6);
  EXPECT_EQ(decoded->inputs.queries, toy.queries().data().data());  // views, not copies
  EXPECT_EQ(decoded->inputs.valid_lens.size(), 2u);
  AttendRequest cross;
  cross.set_model("cross");
  *cross.mutable_queries() = MakeTensor({2, 4, 4});
  *cross.mutable_keys() = MakeTensor({2, 6, 6});
  *cross.mutable_values() = MakeTensor({2, 6, 3});
  decoded = Decode(cross);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(decoded->model->name, "cross");
  EXPECT_EQ(decoded->output_elements(), 2 * 4 * 8);
}

// A rotary model's queries are the last Q of its K positions: Q > K is refused at
// validation, naming queries (before the batcher; the core refuses it too).
TEST(RotaryValidationTest, MoreQueriesThanKeysAreRefusedNamingQueries) {
  TempDir dir;
  dir.Write("rotary/config.pbtxt",
            "num_hiddens: 8 num_heads: 4 num_kv_heads: 2 rope {} seeded { seed: 1 }");
  dir.Write("plain/config.pbtxt", "num_hiddens: 8 num_heads: 4 seeded { seed: 1 }");
  auto models = ModelRepository::Create({.path = dir.path(), .num_threads = 1}).value();
  const auto request = [](const char* model, int64_t q, int64_t k) {
    AttendRequest r;
    r.set_model(model);
    *r.mutable_queries() = MakeTensor({1, q, 8});
    *r.mutable_keys() = MakeTensor({1, k, 8});
    *r.mutable_values() = MakeTensor({1, k, 8});
    return r;
  };
  const absl::Status refused =
      ValidateRequest(request("rotary", 4, 3), *models->Find("rotary").value()).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StartsWith(refused.message(), "queries: model rotary has rotary positions"))
      << refused;
  EXPECT_TRUE(absl::StrContains(refused.message(), "Q <= K; got Q = 4, K = 3")) << refused;
  EXPECT_TRUE(ValidateRequest(request("rotary", 3, 4), *models->Find("rotary").value()).ok());
  EXPECT_TRUE(ValidateRequest(request("rotary", 3, 3), *models->Find("rotary").value()).ok());
  // Without rope Q > K stays allowed (top-left causal rule, no positions).
  EXPECT_TRUE(ValidateRequest(request("plain", 4, 3), *models->Find("plain").value()).ok());
}

TEST_F(CodecTest, PrepareResponseSizesOutputAndAskedForWeights) {
  AttendRequest request = ToyRequest();
  AttendResponse response;
  OutputViews views = PrepareResponse(Decode(request).value(), /*raw=*/false, &response);
  EXPECT_EQ(
      std::vector<int64_t>(response.output().shape().begin(), response.output().shape().end()),
      (std::vector<int64_t>{2, 4, 100}));
  ASSERT_EQ(response.output().data_size(), 800);
  EXPECT_EQ(views.output, response.output().data().data());
  EXPECT_EQ(views.attention, nullptr);
  EXPECT_FALSE(response.has_attention());

  request.set_return_attention(true);
  views = PrepareResponse(Decode(request).value(), /*raw=*/false, &response);
  EXPECT_EQ(std::vector<int64_t>(response.attention().shape().begin(),
                                 response.attention().shape().end()),
            (std::vector<int64_t>{2, 5, 4, 6}));
  ASSERT_EQ(response.attention().data_size(), 2 * 5 * 4 * 6);
  EXPECT_EQ(views.attention, response.attention().data().data());
}

TEST_F(CodecTest, RunForwardMatchesTheCoreAndEncodeTimingKeepsMicroseconds) {
  AttendRequest request = ToyRequest();
  const ValidatedRequest decoded = Decode(request).value();
  AttendResponse response;
  ASSERT_TRUE(RunForward(decoded, /*raw=*/false, &response).ok());
  std::vector<float> direct(decoded.output_elements());
  ASSERT_TRUE(decoded.model->attention->Forward(decoded.inputs, direct.data()).ok());
  EXPECT_EQ(std::vector<float>(response.output().data().begin(), response.output().data().end()),
            direct);

  EncodeTiming(
      {.queue = absl::Microseconds(12), .compute = absl::Microseconds(345), .batch_rows = 7},
      &response);
  EXPECT_EQ(response.timing().queue_us(), 12);
  EXPECT_EQ(response.timing().compute_us(), 345);
  EXPECT_EQ(response.timing().batch_rows(), 7);
}

}  // namespace
}  // namespace mha::server

namespace mha::server {
namespace {

// Raw inputs decode to the same values as data; a raw request is answered in raw,
// with the bytes of the data answer.
TEST_F(CodecTest, RawTensorsAnswerLikeDataInRaw) {
  AttendRequest request = ToyRequest();
  request.set_return_attention(true);
  AttendResponse by_data;
  ASSERT_TRUE(RunForward(Decode(request).value(), WantsRawResponse(request), &by_data).ok());
  EXPECT_TRUE(by_data.output().raw().empty());

  ToRaw(request.mutable_queries());
  ToRaw(request.mutable_keys());
  const ValidatedRequest decoded = Decode(request).value();
  EXPECT_EQ(decoded.inputs.queries, reinterpret_cast<const float*>(request.queries().raw().data()));
  ASSERT_TRUE(WantsRawResponse(request));
  AttendResponse by_raw;
  ASSERT_TRUE(RunForward(decoded, /*raw=*/true, &by_raw).ok());
  EXPECT_EQ(by_raw.output().data_size(), 0);
  EXPECT_EQ(by_raw.output().shape_size(), 3);
  EXPECT_TRUE(std::equal(by_raw.output().shape().begin(), by_raw.output().shape().end(),
                         by_data.output().shape().begin()));
  Tensor expected = by_data.output();
  ToRaw(&expected);
  EXPECT_EQ(by_raw.output().raw(), expected.raw());
  expected = by_data.attention();
  ToRaw(&expected);
  EXPECT_EQ(by_raw.attention().raw(), expected.raw());
}

}  // namespace
}  // namespace mha::server

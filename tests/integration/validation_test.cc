// Every validation rule against the real server: the exact status code and a
// message naming the field (server/validation.h lists the rules).
#include <functional>
#include <limits>

#include "gtest/gtest.h"
#include "absl/strings/match.h"
#include "tests/integration/client_util.h"
#include "tests/integration/server_process.h"

namespace mha::testing {
namespace {

struct Case {
  std::string name;
  std::function<void(AttendRequest&)> mutate;  // applied to ToyRequest()
  grpc::StatusCode code;
  std::string message;  // a substring the message must contain
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

class ValidationTest : public ::testing::TestWithParam<Case> {
 protected:
  static void SetUpTestSuite() {
    repository_ = new TempDir();
    repository_->Write("default/config.pbtxt",
                       "num_hiddens: 100 num_heads: 5 seeded { seed: 0 }");
    repository_->Write("cross/config.pbtxt",
                       "num_hiddens: 8 num_heads: 2 query_size: 4 key_size: 6 value_size: 3 "
                       "seeded { seed: 3 }");
    repository_->Write("small_requests/config.pbtxt",
                       "num_hiddens: 100 num_heads: 5 seeded { seed: 0 } "
                       "limits { max_request_bytes: 2000 }");
    auto server = ServerProcess::Start(
        {"--port=0", "--compute_threads=2", "--model_repository=" + repository_->path(),
         "--max_batch_size=4", "--max_sequence_length=16", "--max_attention_elements=1000",
         "--max_request_bytes=200000"});
    if (server.ok()) {
      server_ = server->release();
    } else {
      start_error_ = new std::string(server.status().ToString());
    }
  }
  // A failure in SetUpTestSuite would only skip the tests; fail each one instead.
  void SetUp() override { ASSERT_NE(server_, nullptr) << *start_error_; }
  static void TearDownTestSuite() {
    delete server_;
    delete repository_;
  }

  static TempDir* repository_;
  static ServerProcess* server_;
  static std::string* start_error_;
};

TempDir* ValidationTest::repository_ = nullptr;
ServerProcess* ValidationTest::server_ = nullptr;
std::string* ValidationTest::start_error_ = nullptr;

TEST_P(ValidationTest, RejectsWithCodeAndField) {
  const Case& c = GetParam();
  AttendRequest request = ToyRequest();
  c.mutate(request);
  auto stub = Connect(server_->target());
  AttendResponse response;
  const grpc::Status status = Attend(*stub, request, &response);
  EXPECT_EQ(status.error_code(), c.code) << status.error_message();
  EXPECT_TRUE(absl::StrContains(status.error_message(), c.message))
      << "message: " << status.error_message() << "\nexpected to contain: " << c.message;
}

void SetShape(Tensor* t, std::vector<int64_t> shape) {
  t->clear_shape();
  for (int64_t d : shape) t->add_shape(d);
}
void Resize(Tensor* t, int n) { t->mutable_data()->Resize(n, 0.5f); }

using grpc::StatusCode;
const float kNan = std::numeric_limits<float>::quiet_NaN();
const float kInf = std::numeric_limits<float>::infinity();

const Case kCases[] = {
    {"UnknownModel", [](AttendRequest& r) { r.set_model("nope"); }, StatusCode::NOT_FOUND,
     "model: unknown model \"nope\"; served: cross, default, small_requests"},
    {"QueriesMissing", [](AttendRequest& r) { r.clear_queries(); },
     StatusCode::INVALID_ARGUMENT, "queries: required, shape (B, Q, d_q = 100)"},
    {"QueriesEmptyTensor", [](AttendRequest& r) { r.mutable_queries()->Clear(); },
     StatusCode::INVALID_ARGUMENT, "queries: expected rank 3 (B, Q, d_q), got shape ()"},
    {"QueriesRank2",
     [](AttendRequest& r) { SetShape(r.mutable_queries(), {8, 100}); },
     StatusCode::INVALID_ARGUMENT, "queries: expected rank 3 (B, Q, d_q), got shape (8, 100)"},
    {"QueriesZeroDim",
     [](AttendRequest& r) {
       SetShape(r.mutable_queries(), {0, 4, 100});
       Resize(r.mutable_queries(), 0);
     },
     StatusCode::INVALID_ARGUMENT, "queries: every dimension of (B, Q, d_q) must be >= 1"},
    {"QueriesNegativeDim",
     [](AttendRequest& r) { SetShape(r.mutable_queries(), {2, -4, 100}); },
     StatusCode::INVALID_ARGUMENT, "queries: every dimension of (B, Q, d_q) must be >= 1"},
    {"QueriesDataShort", [](AttendRequest& r) { Resize(r.mutable_queries(), 799); },
     StatusCode::INVALID_ARGUMENT, "queries: shape (2, 4, 100) needs 800 values, data has 799"},
    {"QueriesShapeOverflow",
     [](AttendRequest& r) {
       SetShape(r.mutable_queries(), {int64_t{1} << 40, int64_t{1} << 40, 100});
     },
     StatusCode::INVALID_ARGUMENT, "needs more than 2^63 values, data has 800"},
    {"QueriesFeatureSize",
     [](AttendRequest& r) {
       SetShape(r.mutable_queries(), {2, 4, 99});
       Resize(r.mutable_queries(), 792);
     },
     StatusCode::INVALID_ARGUMENT, "queries: expected shape (2, 4, 100), got (2, 4, 99)"},
    {"KeysWithoutValues", [](AttendRequest& r) { r.clear_values(); },
     StatusCode::INVALID_ARGUMENT, "values: required when keys are given"},
    {"ValuesWithoutKeys", [](AttendRequest& r) { r.clear_keys(); },
     StatusCode::INVALID_ARGUMENT, "keys: required when values are given"},
    {"KeysRank4",
     [](AttendRequest& r) { SetShape(r.mutable_keys(), {2, 6, 10, 10}); },
     StatusCode::INVALID_ARGUMENT, "keys: expected rank 3 (B, K, d_k), got shape (2, 6, 10, 10)"},
    {"KeysFeatureSize",
     [](AttendRequest& r) {
       SetShape(r.mutable_keys(), {2, 6, 99});
       Resize(r.mutable_keys(), 2 * 6 * 99);
     },
     StatusCode::INVALID_ARGUMENT, "keys: expected shape (2, 6, 100), got (2, 6, 99)"},
    {"KeysBatchSize",
     [](AttendRequest& r) {
       SetShape(r.mutable_keys(), {3, 4, 100});
     },
     StatusCode::INVALID_ARGUMENT, "keys: expected shape (2, 4, 100), got (3, 4, 100)"},
    {"ValuesLength",
     [](AttendRequest& r) {
       SetShape(r.mutable_values(), {2, 5, 100});
       Resize(r.mutable_values(), 1000);
     },
     StatusCode::INVALID_ARGUMENT, "values: expected shape (2, 6, 100), got (2, 5, 100)"},
    {"ValuesDataLong", [](AttendRequest& r) { Resize(r.mutable_values(), 1201); },
     StatusCode::INVALID_ARGUMENT, "values: shape (2, 6, 100) needs 1200 values, data has 1201"},
    {"SelfAttentionOnCrossOnlyModel",
     [](AttendRequest& r) {
       r.set_model("cross");
       *r.mutable_queries() = MakeTensor({2, 4, 4});
       r.clear_keys();
       r.clear_values();
     },
     StatusCode::INVALID_ARGUMENT,
     "keys: required, model cross has d_q = 4, d_k = 6, d_v = 3 and cannot self-attend"},
    {"ValuesFeatureSizeOfOtherModel",
     [](AttendRequest& r) {
       r.set_model("cross");
       *r.mutable_queries() = MakeTensor({2, 4, 4});
       *r.mutable_keys() = MakeTensor({2, 6, 6});
       *r.mutable_values() = MakeTensor({2, 6, 6});
     },
     StatusCode::INVALID_ARGUMENT, "values: expected shape (2, 6, 3), got (2, 6, 6)"},
    {"ValidLensCount", [](AttendRequest& r) { r.add_valid_lens(1); },
     StatusCode::INVALID_ARGUMENT, "valid_lens: expected 0, B = 2 or B*Q = 8 entries, got 3"},
    {"ValidLensNegative", [](AttendRequest& r) { r.set_valid_lens(0, -1); },
     StatusCode::INVALID_ARGUMENT, "valid_lens[0]: expected 0 <= valid_len <= K = 6, got -1"},
    {"ValidLensOverK", [](AttendRequest& r) { r.set_valid_lens(1, 7); },
     StatusCode::INVALID_ARGUMENT, "valid_lens[1]: expected 0 <= valid_len <= K = 6, got 7"},
    {"ValidLensPerQueryOverK",
     [](AttendRequest& r) {
       r.clear_valid_lens();
       for (int i = 0; i < 8; ++i) r.add_valid_lens(i == 5 ? 9 : 2);
     },
     StatusCode::INVALID_ARGUMENT, "valid_lens[5]: expected 0 <= valid_len <= K = 6, got 9"},
    {"HeadMaskLength",
     [](AttendRequest& r) {
       for (int i = 0; i < 4; ++i) r.add_head_mask(1.0f);
     },
     StatusCode::INVALID_ARGUMENT, "head_mask: expected 5 entries (one per head) or none, got 4"},
    {"HeadMaskNonFinite",
     [](AttendRequest& r) {
       for (int i = 0; i < 5; ++i) r.add_head_mask(i == 2 ? kNan : 1.0f);
     },
     StatusCode::INVALID_ARGUMENT, "head_mask[2]: expected a finite value, got nan"},
    {"QueriesNan", [](AttendRequest& r) { r.mutable_queries()->set_data(17, kNan); },
     StatusCode::INVALID_ARGUMENT,
     "queries: non-finite value nan at index 17 (batch 0, position 0, feature 17)"},
    {"KeysInf", [](AttendRequest& r) { r.mutable_keys()->set_data(745, kInf); },
     StatusCode::INVALID_ARGUMENT,
     "keys: non-finite value inf at index 745 (batch 1, position 1, feature 45)"},
    {"ValuesNegativeInf", [](AttendRequest& r) { r.mutable_values()->set_data(1199, -kInf); },
     StatusCode::INVALID_ARGUMENT,
     "values: non-finite value -inf at index 1199 (batch 1, position 5, feature 99)"},
    {"BatchOverLimit",
     [](AttendRequest& r) {
       *r.mutable_queries() = MakeTensor({5, 4, 100});
       *r.mutable_keys() = MakeTensor({5, 6, 100});
       *r.mutable_values() = r.keys();
       r.clear_valid_lens();
     },
     StatusCode::RESOURCE_EXHAUSTED,
     "queries: batch size 5 exceeds max_batch_size 4 of model default"},
    {"QueryLengthOverLimit",
     [](AttendRequest& r) { *r.mutable_queries() = MakeTensor({2, 17, 100}); },
     StatusCode::RESOURCE_EXHAUSTED,
     "queries: sequence length 17 exceeds max_sequence_length 16 of model default"},
    {"KeyLengthOverLimit",
     [](AttendRequest& r) {
       *r.mutable_keys() = MakeTensor({2, 17, 100});
       *r.mutable_values() = r.keys();
     },
     StatusCode::RESOURCE_EXHAUSTED,
     "keys: sequence length 17 exceeds max_sequence_length 16 of model default"},
    {"AttentionWeightsOverLimit",
     [](AttendRequest& r) {
       *r.mutable_queries() = MakeTensor({2, 16, 100});
       *r.mutable_keys() = MakeTensor({2, 16, 100});
       *r.mutable_values() = r.keys();
       r.set_return_attention(true);
     },
     StatusCode::RESOURCE_EXHAUSTED,
     "return_attention: B*h*Q*K = 2*5*16*16 weights exceed max_attention_elements 1000"},
    {"RequestBytesOverModelLimit", [](AttendRequest& r) { r.set_model("small_requests"); },
     StatusCode::RESOURCE_EXHAUSTED, "exceeds max_request_bytes 2000 of model small_requests"},
    {"RequestBytesOverTransportLimit",
     [](AttendRequest& r) { *r.mutable_queries() = MakeTensor({1, 600, 100}); },
     StatusCode::RESOURCE_EXHAUSTED, "larger than max"},
};

INSTANTIATE_TEST_SUITE_P(Rules, ValidationTest, ::testing::ValuesIn(kCases),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return info.param.name;
                         });

// The same rules do not fire on good requests to the other models.
TEST_F(ValidationTest, GoodRequestsPass) {
  auto stub = Connect(server_->target());
  AttendResponse response;
  EXPECT_TRUE(Attend(*stub, ToyRequest(), &response).ok());
  AttendRequest cross;
  cross.set_model("cross");
  *cross.mutable_queries() = MakeTensor({2, 4, 4});
  *cross.mutable_keys() = MakeTensor({2, 6, 6});
  *cross.mutable_values() = MakeTensor({2, 6, 3});
  const grpc::Status status = Attend(*stub, cross, &response);
  EXPECT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(response.output().data_size(), 2 * 4 * 8);
}

}  // namespace
}  // namespace mha::testing

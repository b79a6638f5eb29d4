// Validation over gRPC against the real server: one rule of each kind reaches the
// client with its canonical code and message, plus the transport's own size limit.
// Every rule in-process: tests/unit/server/codec_test.cc.
#include <functional>
#include <limits>
#include <string>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
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
    WriteValidationModels(*repository_);
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

const Case kCases[] = {
    {"UnknownModel", [](AttendRequest& r) { r.set_model("nope"); }, StatusCode::NOT_FOUND,
     "model: unknown model \"nope\"; served: cross, default, small_requests"},
    {"QueriesFeatureSize",
     [](AttendRequest& r) {
       SetShape(r.mutable_queries(), {2, 4, 99});
       Resize(r.mutable_queries(), 792);
     },
     StatusCode::INVALID_ARGUMENT, "queries: expected shape (2, 4, 100), got (2, 4, 99)"},
    {"ValidLensOverK", [](AttendRequest& r) { r.set_valid_lens(1, 7); },
     StatusCode::INVALID_ARGUMENT, "valid_lens[1]: expected 0 <= valid_len <= K = 6, got 7"},
    {"QueriesNan", [](AttendRequest& r) { r.mutable_queries()->set_data(17, kNan); },
     StatusCode::INVALID_ARGUMENT,
     "queries: non-finite value nan at index 17 (batch 0, position 0, feature 17)"},
    {"QueriesDataAndRaw",
     [](AttendRequest& r) {
       r.mutable_queries()->set_raw(std::string(16, '\0'));
     },
     StatusCode::INVALID_ARGUMENT, "queries: has both data (800 floats) and raw (16 bytes)"},
    {"BatchOverLimit",
     [](AttendRequest& r) {
       *r.mutable_queries() = MakeTensor({5, 4, 100});
       *r.mutable_keys() = MakeTensor({5, 6, 100});
       *r.mutable_values() = r.keys();
       r.clear_valid_lens();
     },
     StatusCode::RESOURCE_EXHAUSTED,
     "queries: batch size 5 exceeds max_batch_size 4 of model default"},
    {"RequestBytesOverModelLimit", [](AttendRequest& r) { r.set_model("small_requests"); },
     StatusCode::RESOURCE_EXHAUSTED, "exceeds max_request_bytes 2000 of model small_requests"},
    {"RequestBytesOverTransportLimit",
     [](AttendRequest& r) {
       *r.mutable_queries() = MakeTensor({1, 600, 100});
     },
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

// Raw float32 bytes in, raw bytes out, the same values as with data.
TEST_F(ValidationTest, RawRequestIsAnsweredInRaw) {
  auto stub = Connect(server_->target());
  AttendRequest request = ToyRequest();
  AttendResponse by_data, by_raw;
  ASSERT_TRUE(Attend(*stub, request, &by_data).ok());
  for (Tensor* t : {request.mutable_queries(), request.mutable_keys(), request.mutable_values()}) {
    t->set_raw(std::string(reinterpret_cast<const char*>(t->data().data()),
                           sizeof(float) * static_cast<size_t>(t->data_size())));
    t->clear_data();
  }
  const grpc::Status status = Attend(*stub, request, &by_raw);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(by_raw.output().data_size(), 0);
  const std::string expected(reinterpret_cast<const char*>(by_data.output().data().data()),
                             sizeof(float) * static_cast<size_t>(by_data.output().data_size()));
  EXPECT_EQ(by_raw.output().raw(), expected);
}

}  // namespace
}  // namespace mha::testing

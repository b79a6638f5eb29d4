// The real attention_server on loopback, called with a real gRPC client.
#include <signal.h>
#include <sys/wait.h>

#include <atomic>
#include <cstring>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "core/safetensors.h"
#include "gtest/gtest.h"
#include "server/models/model_repository.h"
#include "tests/integration/client_util.h"
#include "tests/integration/server_process.h"

namespace mha::testing {
namespace {

using ::grpc::health::v1::Health;
using ::grpc::health::v1::HealthCheckRequest;
using ::grpc::health::v1::HealthCheckResponse;

class ServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto server = ServerProcess::Start({"--port=0", "--compute_threads=2"});
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    stub_ = Connect(server_->target());
  }
  // Every test also ends with a clean drain (and, in sanitizer builds, a server
  // free of reports: they make the exit status non-zero).
  void TearDown() override {
    if (server_ == nullptr) return;
    // An idle gRPC client reads the server's GOAWAY only on its 5 s backup poll;
    // closing the channel first keeps the drain immediate.
    stub_.reset();
    server_->Signal(SIGTERM);
    const std::optional<int> status = server_->WaitForExit(absl::Seconds(30));
    ASSERT_TRUE(status.has_value()) << "server did not exit";
    EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0) << server_->log();
  }

  std::unique_ptr<ServerProcess> server_;
  std::unique_ptr<AttentionService::Stub> stub_;
  const core::ModelConfig toy_;  // the embedded default model's sizes
};

TEST_F(ServerTest, ToyRequestMatchesCore) {
  const AttendRequest request = ToyRequest();
  AttendResponse response;
  ASSERT_TRUE(Attend(*stub_, request, &response).ok());
  EXPECT_EQ(
      std::vector<int64_t>(response.output().shape().begin(), response.output().shape().end()),
      (std::vector<int64_t>{2, 4, 100}));
  EXPECT_EQ(response.request_id(), "toy");
  EXPECT_EQ(response.timing().batch_rows(), 2);
  EXPECT_EQ(response.attention().data_size(), 0);
  const CoreResult expected = CoreForward(toy_, server::kDefaultModelSeed, request);
  EXPECT_LE(MaxAbsDiff(response.output().data(), expected.output), 1e-5f);
}

TEST_F(ServerTest, SelfAttentionMatchesCore) {
  AttendRequest request;
  *request.mutable_queries() = MakeTensor({3, 7, 100}, 0.5f);
  request.set_causal(true);
  request.add_valid_lens(7);
  request.add_valid_lens(4);
  request.add_valid_lens(0);  // every key masked: zero context
  AttendResponse response;
  ASSERT_TRUE(Attend(*stub_, request, &response).ok());
  ASSERT_EQ(response.output().data_size(), 3 * 7 * 100);
  const CoreResult expected = CoreForward(toy_, server::kDefaultModelSeed, request);
  EXPECT_LE(MaxAbsDiff(response.output().data(), expected.output), 1e-5f);
}

TEST_F(ServerTest, CrossAttentionWithPerQueryLengthsAndHeadMask) {
  AttendRequest request;
  *request.mutable_queries() = MakeTensor({2, 3, 100}, 0.1f);
  *request.mutable_keys() = MakeTensor({2, 9, 100}, 0.2f);
  *request.mutable_values() = MakeTensor({2, 9, 100}, 0.3f);
  for (int i = 0; i < 6; ++i) request.add_valid_lens(i + 1);
  for (float f : {1.0f, 0.0f, 1.0f, 0.5f, 1.0f}) request.add_head_mask(f);
  AttendResponse response;
  ASSERT_TRUE(Attend(*stub_, request, &response).ok());
  const CoreResult expected = CoreForward(toy_, server::kDefaultModelSeed, request);
  EXPECT_LE(MaxAbsDiff(response.output().data(), expected.output), 1e-5f);
}

TEST_F(ServerTest, ReturnAttentionGivesMaskedSoftmaxWeights) {
  AttendRequest request = ToyRequest();
  request.set_return_attention(true);
  AttendResponse response;
  ASSERT_TRUE(Attend(*stub_, request, &response).ok());
  const Tensor& weights = response.attention();
  ASSERT_EQ(std::vector<int64_t>(weights.shape().begin(), weights.shape().end()),
            (std::vector<int64_t>{2, 5, 4, 6}));
  const int valid[] = {3, 2};
  for (int b = 0; b < 2; ++b) {
    for (int row = 0; row < 5 * 4; ++row) {
      const float* w = weights.data().data() + (b * 20 + row) * 6;
      float sum = 0;
      for (int k = 0; k < 6; ++k) {
        if (k >= valid[b]) {
          EXPECT_EQ(w[k], 0.0f) << "batch " << b << " key " << k;
        }
        sum += w[k];
      }
      EXPECT_NEAR(sum, 1.0f, 1e-5f);
    }
  }
  const CoreResult expected = CoreForward(toy_, server::kDefaultModelSeed, request);
  EXPECT_LE(MaxAbsDiff(weights.data(), expected.attention), 1e-6f);
  EXPECT_LE(MaxAbsDiff(response.output().data(), expected.output), 1e-5f);
}

TEST_F(ServerTest, ExpiredDeadlineIsDeadlineExceeded) {
  AttendResponse response;
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() - std::chrono::milliseconds(1));
  EXPECT_EQ(stub_->Attend(&context, ToyRequest(), &response).error_code(),
            grpc::StatusCode::DEADLINE_EXCEEDED);
}

// The server side of both (dropped before compute) is checked in-process in
// compute_queue_test.cc; here the caller's view and that the server goes on.
TEST_F(ServerTest, ClientCancelIsCancelled) {
  AttendRequest heavy;
  *heavy.mutable_queries() = MakeTensor({48, 1024, 100});
  grpc::ClientContext context;
  AttendResponse response;
  absl::Mutex mu;
  bool done = false;
  grpc::Status status;
  stub_->async()->Attend(&context, &heavy, &response, [&](grpc::Status s) {
    absl::MutexLock lock(&mu);
    status = s;
    done = true;
  });
  context.TryCancel();
  {
    absl::MutexLock lock(&mu);
    mu.Await(absl::Condition(&done));
  }
  EXPECT_EQ(status.error_code(), grpc::StatusCode::CANCELLED);
  AttendResponse after;
  EXPECT_TRUE(Attend(*stub_, ToyRequest(), &after).ok());
}

// Streams `count` requests (batch sizes 1..3, distinct data) and checks the
// responses come back complete, in order, and equal to the core's.
void ExpectStreamAnsweredInOrder(AttentionService::Stub& stub, int count) {
  grpc::ClientContext context;
  SetTimeout(&context, std::chrono::seconds(60));
  auto stream = stub.AttendStream(&context);
  std::vector<AttendRequest> requests(count);
  for (int i = 0; i < count; ++i) {
    const int64_t batch = 1 + i % 3;
    *requests[i].mutable_queries() = MakeTensor({batch, 4, 100}, static_cast<float>(i));
    requests[i].set_request_id(absl::StrCat("r", i));
  }
  std::thread writer([&] {
    for (const AttendRequest& request : requests) {
      if (!stream->Write(request)) break;
    }
    stream->WritesDone();
  });
  std::vector<AttendResponse> responses;
  AttendResponse response;
  while (stream->Read(&response)) responses.push_back(response);
  writer.join();
  const grpc::Status status = stream->Finish();
  ASSERT_TRUE(status.ok()) << status.error_message();
  ASSERT_EQ(responses.size(), static_cast<size_t>(count));
  for (int i = 0; i < count; ++i) {
    ASSERT_EQ(responses[i].request_id(), absl::StrCat("r", i));
    ASSERT_EQ(responses[i].output().shape(0), 1 + i % 3);
  }
  for (int i : {0, count / 2 + 1, count - 1}) {
    const CoreResult expected =
        CoreForward(core::ModelConfig{}, server::kDefaultModelSeed, requests[i]);
    EXPECT_LE(MaxAbsDiff(responses[i].output().data(), expected.output), 1e-5f) << i;
  }
}

TEST_F(ServerTest, StreamOfThousandRequestsAnsweredInOrder) {
  ExpectStreamAnsweredInOrder(*stub_, 1000);
}

// Two workers finish out of order; the stream still answers in order.
TEST(ConcurrentWorkersTest, StreamAnsweredInOrder) {
  auto server = ServerProcess::Start({"--port=0", "--compute_threads=2", "--compute_workers=2"});
  ASSERT_TRUE(server.ok()) << server.status();
  auto stub = Connect((*server)->target());
  ExpectStreamAnsweredInOrder(*stub, 1000);
}

TEST_F(ServerTest, StreamEndsWithTheFirstFailingRequest) {
  grpc::ClientContext context;
  SetTimeout(&context, std::chrono::seconds(30));
  auto stream = stub_->AttendStream(&context);
  for (int i = 0; i < 5; ++i) {
    AttendRequest request = ToyRequest();
    request.set_request_id(absl::StrCat("s", i));
    if (i == 3) request.mutable_queries()->set_shape(2, 99);
    stream->Write(request);
  }
  stream->WritesDone();
  std::vector<std::string> ids;
  AttendResponse response;
  while (stream->Read(&response)) ids.push_back(response.request_id());
  const grpc::Status status = stream->Finish();
  EXPECT_EQ(ids, (std::vector<std::string>{"s0", "s1", "s2"}));
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StartsWith(status.error_message(), "request 3 (request_id \"s3\"): queries:"))
      << status.error_message();
}

TEST_F(ServerTest, GetModelAndListModelsDescribeTheDefaultModel) {
  grpc::ClientContext context;
  attention::v1::GetModelRequest get;
  attention::v1::ModelInfo info;
  ASSERT_TRUE(stub_->GetModel(&context, get, &info).ok());
  EXPECT_EQ(info.name(), "default");
  EXPECT_EQ(info.num_hiddens(), 100);
  EXPECT_EQ(info.num_heads(), 5);
  EXPECT_EQ(info.head_size(), 20);
  EXPECT_EQ(info.query_size(), 100);
  EXPECT_EQ(info.key_size(), 100);
  EXPECT_EQ(info.value_size(), 100);
  EXPECT_FALSE(info.bias());
  EXPECT_EQ(info.precision(), "f32");
  EXPECT_TRUE(info.supports_self_attention());
  const server::ModelLimits defaults;
  EXPECT_EQ(info.limits().max_batch_size(), defaults.max_batch_size);
  EXPECT_EQ(info.limits().max_sequence_length(), defaults.max_sequence_length);
  EXPECT_EQ(info.limits().max_request_bytes(), defaults.max_request_bytes);
  EXPECT_EQ(info.limits().max_attention_elements(), defaults.max_attention_elements);

  grpc::ClientContext list_context;
  attention::v1::ListModelsResponse list;
  ASSERT_TRUE(stub_->ListModels(&list_context, {}, &list).ok());
  ASSERT_EQ(list.models_size(), 1);
  EXPECT_EQ(list.models(0).name(), "default");

  grpc::ClientContext unknown_context;
  get.set_model("nope");
  const grpc::Status unknown = stub_->GetModel(&unknown_context, get, &info);
  EXPECT_EQ(unknown.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_TRUE(absl::StrContains(unknown.error_message(), "model: unknown model \"nope\""));
}

TEST_F(ServerTest, HealthIsServingOverallAndPerModel) {
  for (const char* service : {"", "default"}) {
    HealthCheckResponse response;
    ASSERT_TRUE(CheckHealth(server_->target(), service, &response).ok()) << service;
    EXPECT_EQ(response.status(), HealthCheckResponse::SERVING) << service;
  }
  HealthCheckResponse response;
  EXPECT_EQ(CheckHealth(server_->target(), "nope", &response).error_code(),
            grpc::StatusCode::NOT_FOUND);
}

// The two additive golden fixtures (tests/golden/make_golden.py: d2l's
// MultiHeadAttention with additive pooling, shared by the heads or one per head)
// served from their weight files: the server answers what PyTorch computed.
TEST(AdditiveServingTest, GoldenModelsServeWhatPyTorchComputed) {
  const std::string golden = std::string(MHA_SOURCE_DIR) + "/tests/golden/data/";
  struct Golden {
    std::string name, config;
  };
  const Golden cases[] = {
      {"d2l_additive_shared",
       "num_hiddens: 32 num_heads: 4 query_size: 12 key_size: 10 value_size: 7 bias: true "
       "scoring: ADDITIVE additive_hidden: 6"},
      {"d2l_additive_per_head",
       "num_hiddens: 24 num_heads: 3 scoring: ADDITIVE additive_hidden: 5"},
  };
  TempDir repository;
  for (const Golden& c : cases) {
    repository.Write(c.name + "/config.pbtxt", c.config);
    repository.Write(c.name + "/weights.safetensors",
                     ReadFile(golden + c.name + ".weights.safetensors"));
  }
  auto server = ServerProcess::Start(
      {"--port=0", "--compute_threads=2", "--model_repository=" + repository.path()});
  ASSERT_TRUE(server.ok()) << server.status();
  auto stub = Connect((*server)->target());
  for (const Golden& c : cases) {
    SCOPED_TRACE(c.name);
    auto io = core::SafetensorsFile::Open(golden + c.name + ".io.safetensors").value();
    auto tensor = [&](const std::string& name) {
      const core::TensorView view = io->Get(name).value();
      Tensor t;
      for (int64_t d : view.shape) t.add_shape(d);
      const std::vector<float> values = view.ToFloat(name).value();
      t.mutable_data()->Add(values.begin(), values.end());
      return t;
    };
    AttendRequest request;
    request.set_model(c.name);
    *request.mutable_queries() = tensor("queries");
    *request.mutable_keys() = tensor("keys");
    *request.mutable_values() = tensor("values");
    const core::TensorView lens = io->Get("valid_lens").value();
    std::vector<int32_t> len(lens.num_elements());  // the mapping is unaligned
    std::memcpy(len.data(), lens.data, len.size() * sizeof(int32_t));
    request.mutable_valid_lens()->Add(len.begin(), len.end());
    AttendResponse response;
    const grpc::Status status = Attend(*stub, request, &response);
    ASSERT_TRUE(status.ok()) << status.error_message();
    EXPECT_LE(MaxAbsDiff(response.output().data(), tensor("output").data()), 1e-4f);

    grpc::ClientContext context;
    attention::v1::GetModelRequest get;
    get.set_model(c.name);
    attention::v1::ModelInfo info;
    ASSERT_TRUE(stub->GetModel(&context, get, &info).ok());
    EXPECT_EQ(info.scoring(), "additive");
    EXPECT_EQ(info.additive_hidden(), c.name == "d2l_additive_shared" ? 6 : 5);
  }
}

}  // namespace
}  // namespace mha::testing

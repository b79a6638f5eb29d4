// The compute queue in-process, with the real toy model: expired and cancelled
// items are answered without compute; others are computed in FIFO order.
#include "server/compute_queue.h"

#include <vector>

#include "gtest/gtest.h"
#include "absl/synchronization/mutex.h"
#include "server/grpc_status.h"
#include "tests/integration/client_util.h"

namespace mha::server {
namespace {

using ::mha::testing::ToyRequest;

class ComputeQueueTest : public ::testing::Test {
 protected:
  void SetUp() override {
    models_ = ModelRepository::Create({}).value();
    request_ = ToyRequest();
    validated_ = ValidateRequest(request_, *models_).value();
  }

  // Submits one item and waits for its status.
  absl::Status RunOne(ComputeQueue& queue, WorkItem item) {
    absl::Mutex mu;
    bool done = false;
    absl::Status result;
    item.request = validated_;
    item.done = [&](absl::Status status) {
      absl::MutexLock lock(&mu);
      result = std::move(status);
      done = true;
    };
    absl::Status submitted = queue.Submit(std::move(item));
    if (!submitted.ok()) return submitted;
    absl::MutexLock lock(&mu);
    mu.Await(absl::Condition(&done));
    return result;
  }

  std::unique_ptr<ModelRepository> models_;
  attention::v1::AttendRequest request_;
  ValidatedRequest validated_;
};

TEST_F(ComputeQueueTest, ComputesAndFillsTiming) {
  auto queue = ComputeQueue::Create({}).value();
  attention::v1::AttendResponse response;
  ASSERT_TRUE(RunOne(*queue, WorkItem{.response = &response}).ok());
  EXPECT_EQ(response.output().data_size(), 2 * 4 * 100);
  EXPECT_EQ(response.timing().batch_rows(), 2);
  EXPECT_GE(response.timing().queue_us(), 0);
}

TEST_F(ComputeQueueTest, ExpiredDeadlineIsNotComputed) {
  auto queue = ComputeQueue::Create({}).value();
  attention::v1::AttendResponse response;
  const absl::Status status =
      RunOne(*queue, WorkItem{.response = &response, .deadline = absl::Now()});
  EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_FALSE(response.has_output());  // compute never ran
}

TEST_F(ComputeQueueTest, CancelledCallIsNotComputed) {
  auto queue = ComputeQueue::Create({}).value();
  attention::v1::AttendResponse response;
  const absl::Status status =
      RunOne(*queue, WorkItem{.response = &response, .cancelled = [] { return true; }});
  EXPECT_EQ(status.code(), absl::StatusCode::kCancelled);
  EXPECT_FALSE(response.has_output());
}

TEST_F(ComputeQueueTest, FullQueueIsResourceExhaustedAndShutdownDrains) {
  // One worker held busy by the first item's done callback until released.
  auto queue = ComputeQueue::Create({.num_workers = 1, .max_queue_size = 2}).value();
  absl::Mutex mu;
  bool release = false;
  std::vector<int> order;
  std::vector<attention::v1::AttendResponse> responses(4);
  auto item = [&](int i) {
    return WorkItem{.request = validated_,
                    .response = &responses[i],
                    .done = [&, i](absl::Status status) {
                      EXPECT_TRUE(status.ok());
                      absl::MutexLock lock(&mu);
                      order.push_back(i);
                      if (i == 0) mu.Await(absl::Condition(&release));
                    }};
  };
  ASSERT_TRUE(queue->Submit(item(0)).ok());
  {
    absl::MutexLock lock(&mu);  // item 0 is running, not queued
    mu.Await(absl::Condition(
        +[](std::vector<int>* o) { return !o->empty(); }, &order));
  }
  ASSERT_TRUE(queue->Submit(item(1)).ok());
  ASSERT_TRUE(queue->Submit(item(2)).ok());
  const absl::Status full = queue->Submit(item(3));
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(full.message().find("max_queue_size 2"), absl::string_view::npos);
  {
    absl::MutexLock lock(&mu);
    release = true;
  }
  queue->Shutdown();  // runs what is queued before returning
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(queue->Submit(item(3)).code(), absl::StatusCode::kUnavailable);
}

TEST(GrpcStatusTest, KeepsCodeAndMessage) {
  const grpc::Status s = ToGrpcStatus(absl::ResourceExhaustedError("limit x"));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(s.error_message(), "limit x");
  EXPECT_TRUE(ToGrpcStatus(absl::OkStatus()).ok());
}

}  // namespace
}  // namespace mha::server

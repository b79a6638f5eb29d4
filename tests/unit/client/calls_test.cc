#include "client/load/calls.h"

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <vector>

#include "gtest/gtest.h"

namespace mha::client {
namespace {

// A target no server listens on: every call fails with UNAVAILABLE, no network needed.
std::shared_ptr<grpc::Channel> DeadChannel() {
  return grpc::CreateChannel("unix:/nonexistent/mha_client_calls_test.sock",
                             grpc::InsecureChannelCredentials());
}

class FakeObserver : public CallObserver {
 public:
  void OnSample(int slot, const Sample& sample) override {
    std::lock_guard<std::mutex> lock(mu_);
    slots_.push_back(slot);
    samples_.push_back(sample);
    cv_.notify_all();
  }
  void OnStreamDone(absl::Span<const Sample> unanswered) override {
    std::lock_guard<std::mutex> lock(mu_);
    for (const Sample& sample : unanswered) samples_.push_back(sample);
    ++streams_done_;
    cv_.notify_all();
  }
  // Waits (up to 10 s) until `samples` samples and `streams` stream ends arrived.
  bool WaitFor(size_t samples, int streams) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, std::chrono::seconds(10),
                        [&] { return samples_.size() >= samples && streams_done_ >= streams; });
  }
  std::vector<int> slots() {
    std::lock_guard<std::mutex> lock(mu_);
    return slots_;
  }
  std::vector<Sample> samples() {
    std::lock_guard<std::mutex> lock(mu_);
    return samples_;
  }
  int streams_done() {
    std::lock_guard<std::mutex> lock(mu_);
    return streams_done_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<int> slots_;
  std::vector<Sample> samples_;
  int streams_done_ = 0;
};

TEST(CallsTest, NamesRpcsAndModes) {
  EXPECT_EQ(RpcName(Rpc::kAttend), "attend");
  EXPECT_EQ(RpcName(Rpc::kHealth), "health");
  EXPECT_EQ(ModeName(Mode::kUnary), "unary");
  EXPECT_EQ(ModeName(Mode::kStream), "stream");
  EXPECT_TRUE(SendsOnStreams({.rpc = Rpc::kAttend, .mode = Mode::kStream}));
  EXPECT_FALSE(SendsOnStreams({.rpc = Rpc::kAttend, .mode = Mode::kUnary}));
  EXPECT_FALSE(SendsOnStreams({.rpc = Rpc::kHealth, .mode = Mode::kStream}));
}

TEST(CallsTest, UnaryCallsReportAFailedSampleOnTheirSlot) {
  const attention::v1::AttendRequest request;
  for (Rpc rpc : {Rpc::kAttend, Rpc::kHealth}) {
    FakeObserver observer;
    CallSender sender({.channels = {DeadChannel()}, .request = &request, .rpc = rpc},
                      /*streams=*/0, &observer);
    const int64_t before = SteadyNowNs();
    sender.Send(3);
    sender.Send(5);
    ASSERT_TRUE(observer.WaitFor(2, 0)) << RpcName(rpc);
    std::vector<int> slots = observer.slots();
    std::sort(slots.begin(), slots.end());
    EXPECT_EQ(slots, (std::vector<int>{3, 5}));
    for (const Sample& sample : observer.samples()) {
      EXPECT_EQ(sample.code, grpc::StatusCode::UNAVAILABLE);
      EXPECT_GE(sample.end_ns, before);
      EXPECT_GE(sample.latency_ns, 0);
      EXPECT_LE(sample.latency_ns, sample.end_ns - before);
      EXPECT_EQ(sample.batch_rows, 0);  // no server timing without a response
    }
    EXPECT_EQ(observer.streams_done(), 0);
  }
}

TEST(CallsTest, EveryStreamEndsOnceAndEveryRequestOnItIsRecorded) {
  const attention::v1::AttendRequest request;
  FakeObserver observer;
  {
    CallSender sender({.channels = {DeadChannel()}, .request = &request, .mode = Mode::kStream},
                      /*streams=*/2, &observer);
    for (int slot = 0; slot < 6; ++slot) sender.Send(slot);
    ASSERT_TRUE(observer.WaitFor(6, 2));
    // Both streams have ended: a request for either is refused at once.
    sender.Send(7);
    ASSERT_TRUE(observer.WaitFor(7, 2));
    sender.CloseStreams();
  }
  EXPECT_EQ(observer.streams_done(), 2);
  const std::vector<Sample> samples = observer.samples();
  ASSERT_EQ(samples.size(), 7u);
  for (const Sample& sample : samples) EXPECT_NE(sample.code, grpc::StatusCode::OK);
  EXPECT_EQ(samples.back().code, grpc::StatusCode::UNAVAILABLE);
}

}  // namespace
}  // namespace mha::client

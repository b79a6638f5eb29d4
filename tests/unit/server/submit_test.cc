// The one submit path (server/serving/submit.h) in-process, with the embedded toy
// model and a real batcher: a request is accepted, computed and counted; refused
// before it is decoded (unknown model, warming model) or after (a decode error);
// dropped at its deadline (the call's or the front's own) or when cancelled. Each
// answer comes exactly once.
#include "server/serving/submit.h"

#include <memory>
#include <vector>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "server/models/model_repository.h"
#include "server/serving/batcher.h"
#include "server/serving/metrics.h"

namespace mha::server {
namespace {

// A self-attention request for the toy model (d_q = 100), B 1, Q 4, as views.
struct ToyRequest {
  std::vector<int64_t> shape = {1, 4, 100};
  std::vector<float> queries = std::vector<float>(400, 0.5f);
  std::vector<float> output = std::vector<float>(400, 0.0f);

  absl::StatusOr<Prepared> Decode(const Model& model) {
    RequestView view{.queries = TensorView{.shape = shape,
                                           .data = queries.data(),
                                           .size = static_cast<int64_t>(queries.size())}};
    absl::StatusOr<ValidatedRequest> validated = Validate(view, model);
    if (!validated.ok()) return validated.status();
    return Prepared{.request = *validated, .outputs = {.output = output.data()}};
  }
};

// What an Answer saw.
struct Answered {
  int calls = 0;
  absl::Status status;
};

class SubmitTest : public ::testing::Test {
 protected:
  // `warming`: the model admits warm-up items only (Batcher::AddModel).
  void Start(bool warming = false) {
    models_ = ModelRepository::Create({}).value();
    metrics_ = std::make_unique<Metrics>(std::vector<std::string>{"default"});
    // inline_max_flops 0: every request goes through the queue and a worker.
    batcher_ = Batcher::Create({.num_workers = 1, .inline_max_flops = 0}, metrics_.get()).value();
    ASSERT_TRUE(batcher_->AddModel(models_->Find("").value(), warming).ok());
    path_ = std::make_unique<RequestPath>(models_.get(), batcher_.get(), metrics_.get());
  }

  // Submits `request` as `call`, waits for its answer (the batcher drains), and
  // returns what the answer saw; `decoded` says whether decode ran.
  Answered Run(const Call& call, ToyRequest& request, bool* decoded = nullptr) {
    Answered answered;
    absl::Mutex mu;
    path_->Submit(
        call,
        [&](const Model& model) {
          if (decoded != nullptr) *decoded = true;
          return request.Decode(model);
        },
        [&](absl::Status status, const ComputeTiming&) {
          absl::MutexLock lock(&mu);
          ++answered.calls;
          answered.status = std::move(status);
        });
    batcher_->Shutdown();  // computes or drops what is queued, then joins
    absl::MutexLock lock(&mu);
    return answered;
  }

  ModelStatisticsSnapshot Stats(absl::string_view model = "default") const {
    return metrics_->Find(model)->Statistics();
  }

  std::unique_ptr<ModelRepository> models_;
  std::unique_ptr<Metrics> metrics_;
  std::unique_ptr<Batcher> batcher_;
  std::unique_ptr<RequestPath> path_;
};

TEST_F(SubmitTest, AcceptedRequestIsComputedAnsweredOnceAndCounted) {
  Start();
  ToyRequest request;
  const Answered answered = Run({.protocol = Protocol::kKserveHttp}, request);
  EXPECT_EQ(answered.calls, 1);
  EXPECT_TRUE(answered.status.ok()) << answered.status;
  float sum = 0;
  for (float v : request.output) sum += std::abs(v);
  EXPECT_GT(sum, 0.0f);  // the core wrote the output
  const ModelStatisticsSnapshot stats = Stats();
  EXPECT_EQ(stats.success.count, 1u);
  EXPECT_EQ(stats.fail.count, 0u);
  EXPECT_EQ(stats.inference_count, 1u);  // one batch row
  EXPECT_EQ(metrics_->ForModel("default").inflight().Value(), 0.0);
}

TEST_F(SubmitTest, UnknownModelIsRefusedBeforeDecodeAndCountedAsUnknown) {
  Start();
  ToyRequest request;
  bool decoded = false;
  const Answered answered = Run({.model = "nope"}, request, &decoded);
  EXPECT_EQ(answered.calls, 1);
  EXPECT_EQ(answered.status.code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(absl::StrContains(answered.status.message(), "nope")) << answered.status;
  EXPECT_FALSE(decoded);
  EXPECT_EQ(metrics_->ForModel(kUnknownModelLabel).Statistics().fail.count, 1u);
  EXPECT_EQ(Stats().fail.count, 0u);
}

TEST_F(SubmitTest, WarmingModelIsRefusedBeforeDecode) {
  Start(/*warming=*/true);
  ToyRequest request;
  bool decoded = false;
  const Answered answered = Run({}, request, &decoded);
  EXPECT_EQ(answered.calls, 1);
  EXPECT_EQ(answered.status.code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(absl::StrContains(answered.status.message(), "warming up")) << answered.status;
  EXPECT_FALSE(decoded);
  EXPECT_EQ(Stats().fail.count, 1u);  // counted under the model it named
}

TEST_F(SubmitTest, DecodeErrorIsTheAnswerAndNothingIsQueued) {
  Start();
  ToyRequest request;
  request.shape = {1, 4, 99};  // d_q is 100
  const Answered answered = Run({}, request);
  EXPECT_EQ(answered.calls, 1);
  EXPECT_EQ(answered.status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(answered.status.message(), "queries")) << answered.status;
  EXPECT_EQ(Stats().fail.count, 1u);
  EXPECT_EQ(Stats().execution_count, 0u);
}

TEST_F(SubmitTest, PassedCallDeadlineIsAnsweredDeadlineExceededUncomputed) {
  Start();
  ToyRequest request;
  const Answered answered = Run({.deadline = absl::Now() - absl::Seconds(1)}, request);
  EXPECT_EQ(answered.calls, 1);
  EXPECT_EQ(answered.status.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(Stats().execution_count, 0u);
  EXPECT_EQ(request.output, std::vector<float>(400, 0.0f));
}

TEST_F(SubmitTest, FrontsOwnDeadlineAppliesToo) {
  Start();
  ToyRequest request;
  Answered answered;
  absl::Mutex mu;
  path_->Submit(
      {},
      [&](const Model& model) -> absl::StatusOr<Prepared> {
        absl::StatusOr<Prepared> prepared = request.Decode(model);
        if (prepared.ok()) prepared->deadline = absl::Now() - absl::Seconds(1);
        return prepared;
      },
      [&](absl::Status status, const ComputeTiming&) {
        absl::MutexLock lock(&mu);
        ++answered.calls;
        answered.status = std::move(status);
      });
  batcher_->Shutdown();
  absl::MutexLock lock(&mu);
  EXPECT_EQ(answered.calls, 1);
  EXPECT_EQ(answered.status.code(), absl::StatusCode::kDeadlineExceeded);
}

TEST_F(SubmitTest, CancelledCallIsAnsweredCancelledUncomputed) {
  Start();
  ToyRequest request;
  const Answered answered = Run({.cancelled = [] { return true; }}, request);
  EXPECT_EQ(answered.calls, 1);
  EXPECT_EQ(answered.status.code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(Stats().execution_count, 0u);
  EXPECT_EQ(Stats().fail.count, 1u);
}

TEST_F(SubmitTest, SubmitAfterShutdownIsRefusedUnavailable) {
  Start();
  batcher_->Shutdown();
  ToyRequest request;
  bool decoded = false;
  const Answered answered = Run({}, request, &decoded);
  EXPECT_EQ(answered.calls, 1);
  EXPECT_EQ(answered.status.code(), absl::StatusCode::kUnavailable);
  EXPECT_FALSE(decoded);
}

TEST_F(SubmitTest, SubmitAndWaitReturnsTheAnswer) {
  Start();
  ToyRequest request;
  absl::StatusOr<Prepared> prepared = request.Decode(*models_->Find("").value());
  ASSERT_TRUE(prepared.ok());
  EXPECT_TRUE(SubmitAndWait(*batcher_, WorkItem{.model = models_->Find("").value(),
                                                .inputs = prepared->request.inputs,
                                                .output = request.output.data()})
                  .ok());
  EXPECT_EQ(Stats().execution_count, 1u);
}

}  // namespace
}  // namespace mha::server

// The batcher in-process, with the real toy model (requests decoded by the codec,
// as the service does): merged requests give the same output as requests run alone; requests that
// cannot share a call run apart; limits, queue bound, deadlines and cancellation hold; Shutdown
// drains.
//
// To make merging deterministic, each test holds the single worker busy inside
// the first request's `done` callback while it queues the rest.
#include "server/serving/batcher.h"

#include <time.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <functional>
#include <limits>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "core/kv_cache.h"
#include "gtest/gtest.h"
#include "server/attention_v1/codec.h"
#include "server/models/model_repository.h"
#include "tests/integration/client_util.h"

namespace mha::server {
namespace {

using attention::v1::AttendRequest;
using attention::v1::AttendResponse;
using ::mha::testing::MakeTensor;
using ::mha::testing::MaxAbsDiff;
using ::mha::testing::ToyRequest;

// A request for the toy model (d = 100): self-attention when k == 0.
AttendRequest Request(int64_t b, int64_t q, int64_t k, std::vector<int32_t> lens = {},
                      float offset = 0.0f) {
  AttendRequest request;
  *request.mutable_queries() = MakeTensor({b, q, 100}, offset);
  if (k > 0) {
    *request.mutable_keys() = MakeTensor({b, k, 100}, offset + 1.0f);
    *request.mutable_values() = MakeTensor({b, k, 100}, offset + 2.0f);
  }
  for (int32_t len : lens) request.add_valid_lens(len);
  return request;
}

// Runs requests through a one-worker batcher. Request 0 is submitted first and
// its `done` blocks the worker until every other request is queued, so those
// are batched by the policy alone.
class BatcherTest : public ::testing::Test {
 protected:
  struct Call {
    AttendRequest request;
    AttendResponse response;
    absl::Status status;
    bool done = false;
  };

  void MakeRepository(const BatchingPolicy& policy) {
    models_ = ModelRepository::Create({.default_batching = policy}).value();
  }

  const Model& model() const { return *models_->Find("").value(); }
  std::shared_ptr<const Model> shared_model() const { return models_->Find("").value(); }

  std::unique_ptr<Batcher> MakeBatcher(int num_workers = 1) {
    auto batcher = Batcher::Create({.num_workers = num_workers}, nullptr).value();
    EXPECT_TRUE(batcher->AddModel(shared_model()).ok());
    return batcher;
  }

  // `request` decoded, its response sized, answered through `done` (timing encoded).
  WorkItem Item(const AttendRequest& request, AttendResponse* response,
                std::function<void(absl::Status)> done) {
    const ValidatedRequest validated = ValidateRequest(request, model()).value();
    const OutputViews views = PrepareResponse(validated, /*raw=*/false, response);
    return WorkItem{.model = models_->Find(validated.model->name).value(),
                    .inputs = validated.inputs,
                    .output = views.output,
                    .attention = views.attention,
                    .done = [response, done = std::move(done)](absl::Status status,
                                                               const ComputeTiming& timing) {
                      if (status.ok()) EncodeTiming(timing, response);
                      done(std::move(status));
                    }};
  }

  // Submits every call (0 first, the rest while the worker is held) and waits
  // for all of them. Returns the Submit statuses. first_is_warmup: call 0 is a
  // warm-up pass.
  std::vector<absl::Status> RunAll(std::vector<Call>& calls,
                                   absl::Time deadline_for_rest = absl::InfiniteFuture(),
                                   bool first_is_warmup = false) {
    auto batcher = MakeBatcher();
    absl::Mutex mu;
    bool release = false;
    std::vector<absl::Status> submitted;
    for (size_t i = 0; i < calls.size(); ++i) {
      Call& call = calls[i];
      WorkItem item = Item(call.request, &call.response, [&, i](absl::Status status) {
        absl::MutexLock lock(&mu);
        calls[i].status = std::move(status);
        calls[i].done = true;
        if (i == 0) mu.Await(absl::Condition(&release));
      });
      item.deadline = i == 0 ? absl::InfiniteFuture() : deadline_for_rest;
      item.warmup = i == 0 && first_is_warmup;
      submitted.push_back(batcher->Submit(std::move(item)));
      if (i == 0 && submitted.back().ok()) {  // wait until request 0 is running, not queued
        absl::MutexLock lock(&mu);
        mu.Await(absl::Condition(&calls[0].done));
      }
    }
    {
      absl::MutexLock lock(&mu);
      release = true;
    }
    batcher->Shutdown();  // computes everything queued
    return submitted;
  }

  // The output of `request` computed on its own (RunForward, no batcher).
  std::vector<float> Alone(const AttendRequest& request) {
    AttendResponse response;
    auto validated = ValidateRequest(request, model()).value();
    EXPECT_TRUE(RunForward(validated, /*raw=*/false, &response).ok());
    return {response.output().data().begin(), response.output().data().end()};
  }

  std::unique_ptr<ModelRepository> models_;
};

TEST_F(BatcherTest, MixedLengthsMergeIntoOneCallAndMatchRunningAlone) {
  MakeRepository({.max_queue_delay = absl::ZeroDuration()});
  std::vector<Call> calls(6);
  calls[0].request = Request(1, 8, 8);
  // Cross-attention, lengths and mask kinds all different: one merged call.
  calls[1].request = Request(2, 4, 6, {3, 2}, 0.1f);           // the toy shape
  calls[2].request = Request(1, 7, 13, {}, 0.2f);              // no mask, longest K
  calls[3].request = Request(1, 5, 9, {1, 2, 3, 9, 0}, 0.3f);  // one len per query
  calls[4].request = Request(3, 1, 2, {2, 0, 1}, 0.4f);        // valid_len 0 row
  calls[5].request = Request(1, 16, 4, {4}, 0.5f);             // longest Q
  for (const absl::Status& s : RunAll(calls)) ASSERT_TRUE(s.ok()) << s;
  for (size_t i = 1; i < calls.size(); ++i) {
    SCOPED_TRACE(i);
    ASSERT_TRUE(calls[i].status.ok()) << calls[i].status;
    EXPECT_EQ(calls[i].response.timing().batch_rows(), 2 + 1 + 1 + 3 + 1);
    EXPECT_EQ(calls[i].response.output().shape(0), calls[i].request.queries().shape(0));
    EXPECT_EQ(calls[i].response.output().shape(1), calls[i].request.queries().shape(1));
    EXPECT_LE(MaxAbsDiff(calls[i].response.output().data(), Alone(calls[i].request)), 1e-5f);
  }
}

TEST_F(BatcherTest, SelfAttentionAndCausalMergeWithPadding) {
  MakeRepository({.max_queue_delay = absl::ZeroDuration()});
  std::vector<Call> calls(4);
  calls[0].request = Request(1, 4, 0);
  for (int i = 1; i <= 3; ++i) {
    calls[i].request = Request(1, 3 * i, 0, {}, 0.1f * i);  // self-attention, Q 3, 6, 9
    calls[i].request.set_causal(true);
  }
  calls[2].request.add_valid_lens(4);
  for (const absl::Status& s : RunAll(calls)) ASSERT_TRUE(s.ok()) << s;
  for (int i = 1; i <= 3; ++i) {
    SCOPED_TRACE(i);
    EXPECT_EQ(calls[i].response.timing().batch_rows(), 3);
    EXPECT_LE(MaxAbsDiff(calls[i].response.output().data(), Alone(calls[i].request)), 1e-5f);
  }
}

TEST_F(BatcherTest, RequestsThatCannotShareACallRunApart) {
  MakeRepository({.max_queue_delay = absl::ZeroDuration()});
  std::vector<Call> calls(6);
  calls[0].request = Request(1, 4, 6);
  calls[1].request = Request(2, 4, 6);  // cross
  calls[2].request = Request(1, 4, 0);  // self: not with cross
  calls[3].request = Request(1, 4, 6);  // joins 1
  calls[3].request.set_causal(true);    // ... no: causal
  calls[4].request = Request(1, 4, 6);
  calls[4].request.set_return_attention(true);  // weights: alone
  calls[5].request = Request(1, 4, 6);
  for (float f : {1.0f, 0.0f, 1.0f, 1.0f, 1.0f}) calls[5].request.add_head_mask(f);
  for (const absl::Status& s : RunAll(calls)) ASSERT_TRUE(s.ok()) << s;
  for (size_t i = 1; i < calls.size(); ++i) {
    SCOPED_TRACE(i);
    EXPECT_EQ(calls[i].response.timing().batch_rows(), calls[i].request.queries().shape(0));
    EXPECT_LE(MaxAbsDiff(calls[i].response.output().data(), Alone(calls[i].request)), 1e-5f);
  }
  EXPECT_EQ(calls[4].response.attention().data_size(), 1 * 5 * 4 * 6);
}

TEST_F(BatcherTest, BatchesStopAtMaxBatchSizeAndMaxBatchTokens) {
  MakeRepository(
      {.max_queue_delay = absl::ZeroDuration(), .max_batch_size = 4, .max_batch_tokens = 4 * 16});
  std::vector<Call> calls(7);
  calls[0].request = Request(1, 4, 4);
  calls[1].request = Request(2, 4, 4);
  calls[2].request = Request(2, 4, 4);   // 1 + 2 fill 4 rows
  calls[3].request = Request(3, 4, 4);   // next batch
  calls[4].request = Request(1, 32, 4);  // 3 + 1 rows, but 4 x 32 > 64 tokens: apart
  calls[5].request = Request(1, 4, 4);   // joins 3
  calls[6].request = Request(1, 4, 4);   // over 4 rows: next batch, with 4
  for (const absl::Status& s : RunAll(calls)) ASSERT_TRUE(s.ok()) << s;
  const std::vector<int64_t> rows = {4, 4, 4, 2, 4, 2};
  for (size_t i = 1; i < calls.size(); ++i) {
    SCOPED_TRACE(i);
    EXPECT_EQ(calls[i].response.timing().batch_rows(), rows[i - 1]);
    EXPECT_LE(MaxAbsDiff(calls[i].response.output().data(), Alone(calls[i].request)), 1e-5f);
  }
}

TEST_F(BatcherTest, DisabledBatchingRunsEachRequestAlone) {
  MakeRepository({.enabled = false});
  std::vector<Call> calls(4);
  for (int i = 0; i < 4; ++i) calls[i].request = Request(1 + i, 4, 6);
  for (const absl::Status& s : RunAll(calls)) ASSERT_TRUE(s.ok()) << s;
  for (int i = 1; i < 4; ++i) EXPECT_EQ(calls[i].response.timing().batch_rows(), 1 + i);
}

TEST_F(BatcherTest, OldestRequestWaitsForTheQueueDelay) {
  // A lone request is held for max_queue_delay in the hope of company.
  MakeRepository({.max_queue_delay = absl::Milliseconds(50)});
  std::vector<Call> calls(1);
  calls[0].request = ToyRequest();
  ASSERT_TRUE(RunAll(calls)[0].ok());
  ASSERT_TRUE(calls[0].status.ok());
  EXPECT_GE(calls[0].response.timing().queue_us(), 50000);
  EXPECT_EQ(calls[0].response.timing().batch_rows(), 2);
}

TEST_F(BatcherTest, ExpiredAndCancelledRequestsAreDroppedAtBatchFormation) {
  MakeRepository({.max_queue_delay = absl::ZeroDuration()});
  auto batcher = MakeBatcher();
  AttendRequest request = ToyRequest();
  AttendResponse response;
  auto run = [&](absl::Time deadline, std::function<bool()> cancelled) {
    absl::Mutex mu;
    bool done = false;
    absl::Status result;
    response.Clear();
    WorkItem item = Item(request, &response, [&](absl::Status status) {
      absl::MutexLock lock(&mu);
      result = std::move(status);
      done = true;
    });
    item.deadline = deadline;
    item.cancelled = std::move(cancelled);
    EXPECT_TRUE(batcher->Submit(std::move(item)).ok());
    absl::MutexLock lock(&mu);
    mu.Await(absl::Condition(&done));
    return result;
  };
  // The output was sized and zeroed by the codec; compute never ran, so it stays 0.
  auto untouched = [&] {
    for (float x : response.output().data()) {
      if (x != 0.0f) return false;
    }
    return !response.has_timing();
  };
  EXPECT_EQ(run(absl::Now(), nullptr).code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(untouched());
  EXPECT_EQ(run(absl::InfiniteFuture(), [] { return true; }).code(), absl::StatusCode::kCancelled);
  EXPECT_TRUE(untouched());
  EXPECT_TRUE(run(absl::InfiniteFuture(), nullptr).ok());
  EXPECT_EQ(response.output().data_size(), 2 * 4 * 100);
  EXPECT_FALSE(untouched());
}

TEST_F(BatcherTest, FullQueueIsResourceExhaustedAndShutdownDrains) {
  MakeRepository({.max_queue_delay = absl::ZeroDuration(), .max_queue_size = 2});
  std::vector<Call> calls(4);
  for (Call& call : calls) call.request = ToyRequest();
  const std::vector<absl::Status> submitted = RunAll(calls);
  EXPECT_TRUE(submitted[0].ok());
  EXPECT_TRUE(submitted[1].ok());
  EXPECT_TRUE(submitted[2].ok());
  EXPECT_EQ(submitted[3].code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(submitted[3].message().find("max_queue_size 2"), absl::string_view::npos)
      << submitted[3];
  EXPECT_TRUE(calls[1].done && calls[1].status.ok());
  EXPECT_TRUE(calls[2].done && calls[2].status.ok());
  EXPECT_FALSE(calls[3].done);
}

// max_queue_wait: request 0's forward call sets the model's time per token (t0 for
// its tokens), then the worker is held, so request i (i >= 1) finds i - 1 equal
// requests queued and an expected wait of (i - 1) x t0: exactly floor(W / t0) + 1 are
// admitted, the rest refused at once. t0 is read back from request 0's timing
// (whole microseconds, so the count is checked against both ends of t0's range).
TEST_F(BatcherTest, ExpectedQueueWaitOverMaxQueueWaitIsResourceExhausted) {
  const absl::Duration max_wait = absl::Milliseconds(50);
  MakeRepository({.max_queue_delay = absl::ZeroDuration(),
                  .max_queue_size = 1000,
                  .max_queue_wait = max_wait});
  std::vector<Call> calls(400);
  for (Call& call : calls) call.request = Request(8, 64, 0);  // 512 tokens
  // A model's first call of a shape creates its oneDNN primitives (tens of ms): make
  // request 0's the steady-state time, as it is in a server that has been serving.
  Alone(calls[0].request);
  const std::vector<absl::Status> submitted = RunAll(calls);

  const int64_t t0_us = calls[0].response.timing().compute_us();
  ASSERT_GT(t0_us, 0);
  const int64_t w_us = absl::ToInt64Microseconds(max_wait);
  const int64_t most = w_us / t0_us + 1;         // t0 at its lower end
  const int64_t least = w_us / (t0_us + 1) + 1;  // t0 just under t0_us + 1
  ASSERT_LT(most, static_cast<int64_t>(calls.size())) << "t0 " << t0_us << " us";
  int64_t admitted = 0;
  while (admitted < static_cast<int64_t>(submitted.size()) && submitted[admitted].ok()) {
    ++admitted;
  }
  EXPECT_GE(admitted - 1, least) << "t0 " << t0_us << " us";  // request 0 not counted
  EXPECT_LE(admitted - 1, most) << "t0 " << t0_us << " us";
  for (size_t i = admitted; i < submitted.size(); ++i) {
    ASSERT_EQ(submitted[i].code(), absl::StatusCode::kResourceExhausted) << i;
    ASSERT_NE(submitted[i].message().find("max_queue_wait_us 50000"), std::string::npos)
        << submitted[i];
    EXPECT_FALSE(calls[i].done);
  }
  for (int64_t i = 0; i < admitted; ++i) EXPECT_TRUE(calls[i].done && calls[i].status.ok());

  // Without the bound in time, the same queue admits every request.
  MakeRepository({.max_queue_delay = absl::ZeroDuration(), .max_queue_size = 1000});
  std::vector<Call> unbounded(admitted + 10);
  for (Call& call : unbounded) call.request = Request(8, 64, 0);
  for (const absl::Status& s : RunAll(unbounded)) EXPECT_TRUE(s.ok()) << s;
}

// Warm-up passes do not teach max_queue_wait the model's time per token: they are
// cold by design (weights packed, primitives made), and a fresh server seeded with
// them refused its first burst (the bert_base (8, 128) soak, docs/reliability.md).
// Call 0 is a warm-up pass held in its callback (after its forward call ended), so
// the model has computed nothing but warm-up: max_queue_size alone applies, and a
// bound of 1 ns still admits every request queued behind it.
TEST_F(BatcherTest, WarmUpPassesDoNotSetTheTimePerTokenForMaxQueueWait) {
  MakeRepository({.max_queue_delay = absl::ZeroDuration(),
                  .max_queue_size = 1000,
                  .max_queue_wait = absl::Nanoseconds(1)});
  std::vector<Call> calls(8);
  for (Call& call : calls) call.request = Request(8, 64, 0);
  const std::vector<absl::Status> submitted =
      RunAll(calls, absl::InfiniteFuture(), /*first_is_warmup=*/true);
  for (size_t i = 0; i < submitted.size(); ++i) {
    EXPECT_TRUE(submitted[i].ok()) << i << ": " << submitted[i];
  }
  for (const Call& call : calls) EXPECT_TRUE(call.done && call.status.ok()) << call.status;
}

// Admit answers what Submit would, without queueing: the service refuses with it
// before validating a request.
TEST_F(BatcherTest, AdmitAnswersAsSubmitWould) {
  MakeRepository({.max_queue_delay = absl::ZeroDuration(), .max_queue_size = 1});
  const Model* model = &this->model();
  auto batcher = MakeBatcher();
  absl::Mutex mu;
  bool running = false, release = false;
  std::vector<AttendRequest> requests(3, ToyRequest());
  std::vector<AttendResponse> responses(3);
  auto submit = [&](int i) {
    return batcher->Submit(Item(requests[i], &responses[i], [&, i](absl::Status) {
      if (i != 0) return;
      absl::MutexLock lock(&mu);
      running = true;
      mu.Await(absl::Condition(&release));
    }));
  };
  ASSERT_TRUE(submit(0).ok());
  {
    absl::MutexLock lock(&mu);
    mu.Await(absl::Condition(&running));  // the worker is held, the queue empty
  }
  EXPECT_TRUE(batcher->Admit(model).ok());
  ASSERT_TRUE(submit(1).ok());  // the queue is now full
  const absl::Status admitted = batcher->Admit(model);
  const absl::Status submitted = submit(2);
  EXPECT_EQ(admitted.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(admitted, submitted);
  EXPECT_EQ(batcher->queue_size(), 1);  // Admit queued nothing
  {
    absl::MutexLock lock(&mu);
    release = true;
  }
  batcher->Shutdown();
  EXPECT_EQ(batcher->Admit(model).code(), absl::StatusCode::kUnavailable);
}

TEST_F(BatcherTest, SubmitAfterShutdownIsUnavailable) {
  MakeRepository({});
  auto batcher = MakeBatcher();
  batcher->Shutdown();
  AttendRequest request = ToyRequest();
  AttendResponse response;
  const absl::Status s = batcher->Submit(Item(
      request, &response, [](absl::Status) { ADD_FAILURE() << "done after a refused Submit"; }));
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
}

TEST_F(BatcherTest, CreateAndAddModelNameTheBadField) {
  const absl::Status workers = Batcher::Create({.num_workers = 0}, nullptr).status();
  EXPECT_EQ(workers.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(workers.message().find("num_workers: expected >= 1, got 0"), std::string::npos)
      << workers;
  MakeRepository({});
  auto bad = std::make_shared<Model>();
  bad->name = "bad";
  bad->batching.max_queue_size = 0;
  const absl::Status queue = MakeBatcher()->AddModel(bad);
  EXPECT_EQ(queue.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(queue.message().find("model bad: max_queue_size: expected >= 1, got 0"),
            std::string::npos)
      << queue;
}

}  // namespace
}  // namespace mha::server

namespace mha::server {
namespace {

// A warming model admits warm-up items only; others get UNAVAILABLE naming the
// warm-up until SetReady.
TEST(BatcherWarmupTest, AWarmingModelAdmitsOnlyWarmupItems) {
  auto models = ModelRepository::Create({}).value();
  const std::shared_ptr<const Model> shared = models->Find("").value();
  const Model* model = shared.get();
  auto batcher = Batcher::Create({.num_workers = 1}, nullptr).value();
  ASSERT_TRUE(batcher->AddModel(shared, /*warming=*/true).ok());
  EXPECT_FALSE(batcher->IsReady(model));

  const attention::v1::AttendRequest request = ToyRequest();
  const ValidatedRequest validated = ValidateRequest(request, *model).value();
  std::vector<float> output(static_cast<size_t>(validated.output_elements()));
  absl::Mutex mu;
  int done = 0;
  const auto item = [&](bool warmup) {
    return WorkItem{.model = shared,
                    .inputs = validated.inputs,
                    .output = output.data(),
                    .done =
                        [&](absl::Status status, const ComputeTiming&) {
                          EXPECT_TRUE(status.ok()) << status;
                          absl::MutexLock lock(&mu);
                          ++done;
                        },
                    .warmup = warmup};
  };
  const absl::Status refused = batcher->Submit(item(/*warmup=*/false));
  EXPECT_EQ(refused.code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(absl::StrContains(refused.message(), "model default is warming up")) << refused;
  EXPECT_EQ(batcher->Admit(model).code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(batcher->Submit(item(/*warmup=*/true)).ok());

  batcher->SetReady(model);
  EXPECT_TRUE(batcher->IsReady(model));
  EXPECT_TRUE(batcher->Admit(model).ok());
  EXPECT_TRUE(batcher->Submit(item(/*warmup=*/false)).ok());
  batcher->Shutdown();
  absl::MutexLock lock(&mu);
  EXPECT_EQ(done, 2);
}

}  // namespace
}  // namespace mha::server

namespace mha::server {
namespace {

// Inline execution (Batcher::Options::inline_max_flops): a small request submitted
// while compute is idle runs on the submitting thread, before Submit returns, and
// answers exactly as the worker path does; larger ones, and any submitted while
// requests are queued, go to the workers.
class BatcherInlineTest : public BatcherTest {
 protected:
  struct Answer {
    absl::Status status;
    std::vector<float> output;
    std::vector<float> attention;
    std::thread::id thread;
    bool before_return = false;  // done was called before Submit returned
  };

  // Submits `request` to `batcher` and waits for its answer.
  Answer Submit(Batcher& batcher, const AttendRequest& request) {
    AttendResponse response;
    absl::Mutex mu;
    bool done = false;
    bool returned = false;
    Answer answer;
    WorkItem item = Item(request, &response, [&](absl::Status status) {
      absl::MutexLock lock(&mu);
      answer.status = std::move(status);
      answer.thread = std::this_thread::get_id();
      answer.before_return = !returned;
      done = true;
    });
    const absl::Status submitted = batcher.Submit(std::move(item));
    EXPECT_TRUE(submitted.ok()) << submitted;
    absl::MutexLock lock(&mu);
    returned = true;
    mu.Await(absl::Condition(&done));
    answer.output.assign(response.output().data().begin(), response.output().data().end());
    answer.attention.assign(response.attention().data().begin(), response.attention().data().end());
    return answer;
  }

  std::unique_ptr<Batcher> MakeInlineBatcher(double inline_max_flops) {
    auto batcher =
        Batcher::Create({.num_workers = 1, .inline_max_flops = inline_max_flops}, nullptr).value();
    EXPECT_TRUE(batcher->AddModel(shared_model()).ok());
    return batcher;
  }
};

TEST_F(BatcherInlineTest, SmallRequestsRunInlineAndAnswerAsTheWorkerDoes) {
  MakeRepository({.max_queue_delay = absl::ZeroDuration()});
  std::vector<AttendRequest> requests = {
      Request(2, 4, 6, {3, 2}),           // the toy request: per-row valid_lens
      Request(1, 5, 9, {1, 2, 3, 9, 0}),  // one valid_len per query
      Request(2, 4, 6),                   // no mask
      Request(1, 7, 0),                   // self-attention
      Request(3, 1, 2, {2, 0, 1}, 0.4f),  // a valid_len 0 row
  };
  requests.push_back(Request(1, 6, 0, {}, 0.2f));
  requests.back().set_causal(true);
  requests.push_back(Request(1, 6, 0, {4}, 0.3f));
  requests.back().set_causal(true);  // causal and valid_lens
  requests.push_back(Request(1, 4, 6, {5}, 0.5f));
  requests.back().set_return_attention(true);
  requests.push_back(Request(1, 4, 6, {}, 0.6f));
  for (float f : {1.0f, 0.0f, 1.0f, 1.0f, 0.5f}) requests.back().add_head_mask(f);

  auto inline_batcher = MakeInlineBatcher(2e6);
  auto worker_batcher = MakeInlineBatcher(0);
  for (size_t i = 0; i < requests.size(); ++i) {
    SCOPED_TRACE(i);
    const Answer in = Submit(*inline_batcher, requests[i]);
    const Answer queued = Submit(*worker_batcher, requests[i]);
    ASSERT_TRUE(in.status.ok()) << in.status;
    ASSERT_TRUE(queued.status.ok()) << queued.status;
    EXPECT_TRUE(in.before_return);
    EXPECT_EQ(in.thread, std::this_thread::get_id());
    EXPECT_NE(queued.thread, std::this_thread::get_id());
    // The same forward call on the same shapes: bit for bit.
    EXPECT_EQ(in.output, queued.output);
    EXPECT_EQ(in.attention, queued.attention);
    // And the answer a request computed with no batcher at all gives.
    EXPECT_LE(MaxAbsDiff(in.output, Alone(requests[i])), 1e-6f);
  }
}

TEST_F(BatcherInlineTest, LargerRequestsGoToTheWorkers) {
  MakeRepository({.max_queue_delay = absl::ZeroDuration()});
  const AttendRequest request = Request(2, 4, 6, {3, 2});  // 0.82 MFLOP
  EXPECT_TRUE(Submit(*MakeInlineBatcher(1e6), request).before_return);
  const Answer queued = Submit(*MakeInlineBatcher(0.5e6), request);
  ASSERT_TRUE(queued.status.ok()) << queued.status;
  EXPECT_NE(queued.thread, std::this_thread::get_id());
}

TEST_F(BatcherInlineTest, AModelThatWaitsForCompanyQueues) {
  MakeRepository({.max_queue_delay = absl::Microseconds(100)});
  const Answer queued = Submit(*MakeInlineBatcher(2e6), Request(2, 4, 6, {3, 2}));
  ASSERT_TRUE(queued.status.ok()) << queued.status;
  EXPECT_NE(queued.thread, std::this_thread::get_id());
}

// While requests are queued, a small one queues behind them (arrival order holds
// for the scheduler, and under load requests merge).
TEST_F(BatcherInlineTest, SmallRequestsQueueBehindQueuedOnes) {
  MakeRepository({.max_queue_delay = absl::ZeroDuration()});
  auto batcher = MakeInlineBatcher(2e6);
  std::vector<Call> calls(3);
  calls[0].request = Request(8, 32, 0);            // 60 MFLOP: to the worker, which it holds
  calls[1].request = Request(8, 32, 0, {}, 0.1f);  // queued behind it
  calls[2].request = Request(2, 4, 6, {3, 2});     // small, but requests are queued
  absl::Mutex mu;
  bool release = false;
  std::vector<std::thread::id> threads(calls.size());
  for (size_t i = 0; i < calls.size(); ++i) {
    ASSERT_TRUE(batcher
                    ->Submit(Item(calls[i].request, &calls[i].response,
                                  [&, i](absl::Status status) {
                                    absl::MutexLock lock(&mu);
                                    calls[i].status = std::move(status);
                                    calls[i].done = true;
                                    threads[i] = std::this_thread::get_id();
                                    if (i == 0) mu.Await(absl::Condition(&release));
                                  }))
                    .ok());
    if (i == 0) {  // wait until request 0 is being answered by the worker
      absl::MutexLock lock(&mu);
      mu.Await(absl::Condition(&calls[0].done));
    }
  }
  {
    absl::MutexLock lock(&mu);
    EXPECT_FALSE(calls[2].done);  // not run inline
    release = true;
  }
  batcher->Shutdown();
  for (size_t i = 0; i < calls.size(); ++i) {
    SCOPED_TRACE(i);
    ASSERT_TRUE(calls[i].status.ok()) << calls[i].status;
    EXPECT_NE(threads[i], std::this_thread::get_id());
    EXPECT_LE(MaxAbsDiff(calls[i].response.output().data(), Alone(calls[i].request)), 1e-5f);
  }
}

// Session steps (WorkItem::step) of the toy model through a one-worker batcher,
// for the gathering of steps (BatchingPolicy::session_gather). Each session is a
// causal self-attention cache stepped one token at a time.
class BatcherGatherTest : public ::testing::Test {
 protected:
  struct Session {
    explicit Session(core::KvCachePool* pool) : cache(pool, 5, 20) {}
    core::KvSequence cache;
    std::vector<float> query = std::vector<float>(100, 0.5f);
    std::vector<float> output = std::vector<float>(100);
    core::PagedStep step;
    // The last step's answer.
    absl::Mutex mu;
    bool done = false;
    absl::Status status;
    ComputeTiming timing;
  };

  void Start(absl::Duration gather, double inline_max_flops = 0) {
    models_ = ModelRepository::Create({.default_batching = {.session_gather = gather}}).value();
    batcher_ =
        Batcher::Create({.num_workers = 1, .inline_max_flops = inline_max_flops}, nullptr).value();
    ASSERT_TRUE(batcher_->AddModel(model()).ok());
  }
  std::shared_ptr<const Model> model() const { return models_->Find("").value(); }

  // Submits the session's next one-token step; Wait() for its answer.
  void Submit(Session& s, bool warmup = false) {
    ASSERT_TRUE(s.cache.Reserve(1).ok());
    s.step = core::PagedStep{.num_queries = 1,
                             .queries = s.query.data(),
                             .causal = true,
                             .cache = &s.cache,
                             .output = s.output.data()};
    {
      absl::MutexLock lock(&s.mu);
      s.done = false;
    }
    ASSERT_TRUE(
        batcher_
            ->Submit(WorkItem{
                .model = model(),
                .inputs = {.batch = 1, .num_queries = 1, .num_keys = 0, .queries = s.query.data()},
                .done =
                    [&s](absl::Status status, const ComputeTiming& timing) {
                      absl::MutexLock lock(&s.mu);
                      s.status = std::move(status);
                      s.timing = timing;
                      s.done = true;
                    },
                .warmup = warmup,
                .step = &s.step})
            .ok());
  }
  static ComputeTiming Wait(Session& s) {
    absl::MutexLock lock(&s.mu);
    s.mu.Await(absl::Condition(&s.done));
    EXPECT_TRUE(s.status.ok()) << s.status;
    return s.timing;
  }
  ComputeTiming Step(Session& s) {
    Submit(s);
    return Wait(s);
  }
  // a and b step; b's last step comes as soon as its answer, so b is awaited after
  // it. Each of those steps runs at once: a first step is not prompt, so it waits
  // for no one and no one waits for it.
  void AwaitB(Session& a, Session& b) {
    EXPECT_LT(Step(a).queue, absl::Seconds(5));
    EXPECT_LT(Step(b).queue, absl::Seconds(5));
    EXPECT_LT(Step(b).queue, absl::Seconds(5));
  }
  // With b awaited (AwaitB), submits a's step and runs `meanwhile` 50 ms later.
  // Returns a's timing, checked to have waited those 50 ms but not session_gather
  // (the tests' 10 s).
  ComputeTiming StepWhileBIsAwaited(Session& a, Session& b,
                                    const std::function<void()>& meanwhile) {
    AwaitB(a, b);
    Submit(a);
    absl::SleepFor(absl::Milliseconds(50));
    meanwhile();
    const ComputeTiming t = Wait(a);
    EXPECT_GE(t.queue, absl::Milliseconds(50));
    EXPECT_LT(t.queue, absl::Seconds(5));
    return t;
  }

  core::KvCachePool pool_{int64_t{64} << 20};
  std::unique_ptr<ModelRepository> models_;
  std::unique_ptr<Batcher> batcher_;
};

TEST_F(BatcherGatherTest, AStepWaitsForAPromptSessionOfThePreviousCall) {
  Start(absl::Seconds(10));
  Session a(&pool_), b(&pool_);
  EXPECT_EQ(StepWhileBIsAwaited(a, b, [&] { Submit(b); }).batch_rows, 2);  // one call
  EXPECT_EQ(Wait(b).batch_rows, 2);
}

// From its second step on, a lone session is awaited and the idle worker polls for
// its next step: each step is taken at once, not when the 10 s poll ends.
TEST_F(BatcherGatherTest, ALoneSessionNeverWaits) {
  Start(absl::Seconds(10));
  Session a(&pool_);
  for (int i = 0; i < 5; ++i) {
    const ComputeTiming t = Step(a);
    EXPECT_EQ(t.batch_rows, 1);
    EXPECT_LT(t.queue, absl::Seconds(2)) << "step " << i;  // not session_gather
  }
}

TEST_F(BatcherGatherTest, ASessionThatGoesQuietCostsOneWaitThenIsNotAwaited) {
  Start(absl::Milliseconds(300));
  Session a(&pool_), b(&pool_);
  AwaitB(a, b);
  Submit(a);  // waits for b, which comes
  Submit(b);
  Wait(a);
  Wait(b);
  // Both prompt and in the last call. b goes quiet: a waits session_gather once ...
  EXPECT_GE(Step(a).queue, absl::Milliseconds(300));
  // ... and then b, not in the last call, is not awaited.
  EXPECT_LT(Step(a).queue, absl::Milliseconds(300));
}

TEST_F(BatcherGatherTest, AnEndedSessionIsNotAwaited) {
  Start(absl::Seconds(10));
  Session a(&pool_), b(&pool_);
  const ComputeTiming t =
      StepWhileBIsAwaited(a, b, [&] { batcher_->SessionEnded(model().get(), &b.step); });
  EXPECT_EQ(t.batch_rows, 1);
}

TEST_F(BatcherGatherTest, NoGatheringWhenSessionGatherIsZero) {
  Start(absl::ZeroDuration());
  Session a(&pool_), b(&pool_);
  AwaitB(a, b);
  Submit(a);
  absl::SleepFor(absl::Milliseconds(300));
  Submit(b);
  const ComputeTiming ta = Wait(a);
  Wait(b);
  EXPECT_EQ(ta.batch_rows, 1);
  EXPECT_LT(ta.queue, absl::Milliseconds(300));
}

TEST_F(BatcherGatherTest, ASessionThatStepsLateIsNotAwaited) {
  Start(absl::Milliseconds(200));
  Session a(&pool_), b(&pool_);
  Step(a);
  Step(b);
  absl::SleepFor(absl::Milliseconds(400));
  Step(b);  // 400 ms after its answer: not prompt, so not awaited
  const ComputeTiming t = Step(a);
  EXPECT_EQ(t.batch_rows, 1);
  EXPECT_LT(t.queue, absl::Milliseconds(200));
}

TEST_F(BatcherGatherTest, WarmupStepsAreNotAwaited) {
  Start(absl::Seconds(10));
  Session warm(&pool_), a(&pool_);
  for (int i = 0; i < 3; ++i) {
    Submit(warm, /*warmup=*/true);
    EXPECT_LT(Wait(warm).queue, absl::Seconds(5));
  }
  EXPECT_LT(Step(a).queue, absl::Seconds(5));  // the warm-up is not awaited
}

TEST_F(BatcherGatherTest, AQueuedRequestEndsTheWait) {
  Start(absl::Seconds(10));
  Session a(&pool_), b(&pool_);
  // a waits for b until a request comes, which no step may hold up.
  const attention::v1::AttendRequest request = ToyRequest();
  const ValidatedRequest validated = ValidateRequest(request, *model()).value();
  std::vector<float> output(static_cast<size_t>(validated.output_elements()));
  absl::Notification computed;
  StepWhileBIsAwaited(a, b, [&] {
    ASSERT_TRUE(batcher_
                    ->Submit(WorkItem{.model = model(),
                                      .inputs = validated.inputs,
                                      .output = output.data(),
                                      .done =
                                          [&](absl::Status status, const ComputeTiming&) {
                                            EXPECT_TRUE(status.ok()) << status;
                                            computed.Notify();
                                          }})
                    .ok());
  });
  EXPECT_TRUE(computed.WaitForNotificationWithTimeout(absl::Seconds(5)));
}

TEST_F(BatcherGatherTest, ShutdownEndsTheWait) {
  Start(absl::Seconds(10));
  Session a(&pool_), b(&pool_);
  // Shutdown computes what is queued, without waiting.
  StepWhileBIsAwaited(a, b, [&] { batcher_->Shutdown(); });
}

// The process's CPU time: the worker's poll is the only thing running meanwhile.
absl::Duration ProcessCpu() {
  timespec t;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return absl::DurationFromTimespec(t);
}

// While a lone session is awaited, the idle worker polls for its step instead of
// sleeping, and stops session_gather after the answer.
TEST_F(BatcherGatherTest, TheWorkerPollsForALoneSessionForSessionGather) {
  Start(absl::Milliseconds(400));
  Session a(&pool_);
  Step(a);
  Step(a);  // prompt: a is awaited from its answer on
  // The worker polls from the answer on (read as its state, not as CPU time: a
  // yielding poll gets little of a core a busy neighbour wants)...
  const absl::Time answered = absl::Now();
  bool polled = false;
  while (!polled && absl::Now() - answered < absl::Milliseconds(300)) {
    polled = batcher_->polling();
    absl::SleepFor(absl::Milliseconds(1));
  }
  EXPECT_TRUE(polled);
  // ...and stops at the end of the gather window, after which it takes no CPU.
  absl::SleepFor(absl::Milliseconds(500));
  EXPECT_FALSE(batcher_->polling());
  const absl::Duration start = ProcessCpu();
  absl::SleepFor(absl::Seconds(1));
  EXPECT_LT(ProcessCpu() - start, absl::Milliseconds(300));
}

TEST_F(BatcherGatherTest, ShutdownEndsThePollAtOnce) {
  Start(absl::Seconds(10));
  Session a(&pool_);
  Step(a);
  Step(a);
  absl::SleepFor(absl::Milliseconds(50));
  const absl::Time start = absl::Now();
  batcher_->Shutdown();
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));  // not the 10 s poll
}

TEST_F(BatcherGatherTest, AnAwaitedSessionsStepDoesNotRunInline) {
  Start(absl::Seconds(10), /*inline_max_flops=*/1e9);
  Session a(&pool_), b(&pool_);
  // AwaitB's steps run inline (nothing else was queued or computing); then b is
  // awaited, so a's step is queued and waits for b's.
  EXPECT_EQ(StepWhileBIsAwaited(a, b, [&] { Submit(b); }).batch_rows, 2);
  Wait(b);
}

// Two session steps of an attention-only model in one call on one compute thread:
// the core finishes the first step's heads (and writes its output) before it starts
// the second's. Answered when the call has ended (the default), each step's `done`
// finds both outputs written and both report the call's time; answered as the steps
// end (Options::answer_steps_as_they_end), the first step's `done` comes before the
// second step's output is written.
class BatcherSessionAnswersTest : public ::testing::TestWithParam<bool> {
 protected:
  static constexpr int64_t kHeads = 4, kKvHeads = 2, kDh = 16;
  struct Session {
    explicit Session(core::KvCachePool* pool) : cache(pool, kKvHeads, kDh) {}
    core::KvSequence cache;
    std::vector<float> query = std::vector<float>(kHeads * kDh, 0.5f);
    std::vector<float> key = std::vector<float>(kKvHeads * kDh, 0.25f);
    std::vector<float> value = std::vector<float>(kKvHeads * kDh, 1.0f);
    std::vector<float> output =
        std::vector<float>(kHeads * kDh, std::numeric_limits<float>::quiet_NaN());
    core::PagedStep step;
    // Its answer (a Mutex, not a Notification: TSan sees absl::Mutex through
    // tests/sanitizers/tsan_absl_sync.cc).
    absl::Mutex mu;
    bool done = false;
    absl::Status status;
    ComputeTiming timing;
    bool other_written = false;  // the other step's output, when `done` ran
    int order = 0;               // 1: answered first
  };
  static bool Written(const Session& s) {
    return std::all_of(s.output.begin(), s.output.end(), [](float x) { return std::isfinite(x); });
  }
};

TEST_P(BatcherSessionAnswersTest, StepsAreAnsweredAtTheCallsEndUnlessAsTheyEnd) {
  const bool as_they_end = GetParam();
  core::ModelConfig config;
  config.num_heads = kHeads;
  config.num_kv_heads = kKvHeads;
  config.num_hiddens = config.query_size = kHeads * kDh;
  config.key_size = config.value_size = kKvHeads * kDh;
  config.projections = core::Projections::kNone;
  auto model = std::make_shared<Model>();
  model->name = "worker";
  model->config = config;
  // Both steps in one call: the first waits for the second (a full batch).
  model->batching = {.max_queue_delay = absl::Seconds(30), .max_batch_size = 2};
  model->attention =
      core::MultiHeadAttention::Create(config, core::Weights{}, {.num_threads = 1}).value();
  ASSERT_TRUE(model->config.attention_only());
  auto batcher =
      Batcher::Create({.num_workers = 1, .answer_steps_as_they_end = as_they_end}, nullptr).value();
  ASSERT_TRUE(batcher->AddModel(model).ok());

  core::KvCachePool pool(int64_t{16} << 20);
  Session a(&pool), b(&pool);
  std::atomic<int> answers{0};
  for (auto [s, other] : {std::pair{&a, &b}, std::pair{&b, &a}}) {
    ASSERT_TRUE(s->cache.Reserve(1).ok());
    s->step = core::PagedStep{.num_queries = 1,
                              .queries = s->query.data(),
                              .num_keys = 1,
                              .keys = s->key.data(),
                              .values = s->value.data(),
                              .causal = true,
                              .cache = &s->cache,
                              .output = s->output.data()};
    ASSERT_TRUE(
        batcher
            ->Submit(WorkItem{
                .model = model,
                .inputs = {.batch = 1, .num_queries = 1, .num_keys = 1, .queries = s->query.data()},
                .done =
                    [s, other, &answers](absl::Status status, const ComputeTiming& timing) {
                      absl::MutexLock lock(&s->mu);
                      s->order = ++answers;
                      s->other_written = Written(*other);
                      s->status = std::move(status);
                      s->timing = timing;
                      s->done = true;
                    },
                .step = &s->step})
            .ok());
  }
  for (Session* s : {&a, &b}) {
    absl::MutexLock lock(&s->mu);
    ASSERT_TRUE(s->mu.AwaitWithTimeout(absl::Condition(&s->done), absl::Seconds(60)));
    ASSERT_TRUE(s->status.ok()) << s->status;
    EXPECT_EQ(s->timing.batch_rows, 2);  // one call
    // One new token attended by itself: each head's context is that token's value.
    for (float x : s->output) EXPECT_FLOAT_EQ(x, 1.0f);
    EXPECT_EQ(s->cache.size(), 1);
  }
  Session& first = a.order == 1 ? a : b;
  Session& second = a.order == 1 ? b : a;
  EXPECT_TRUE(second.other_written);
  if (as_they_end) {
    EXPECT_FALSE(first.other_written) << "answered only when the call had ended";
    EXPECT_LT(first.timing.compute, second.timing.compute);
  } else {
    EXPECT_TRUE(first.other_written) << "answered before the call had ended";
    EXPECT_EQ(first.timing.compute, second.timing.compute);  // the call's time
  }
  batcher->Shutdown();
}

INSTANTIATE_TEST_SUITE_P(Answers, BatcherSessionAnswersTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "AsTheyEnd" : "AtTheCallsEnd";
                         });

}  // namespace
}  // namespace mha::server

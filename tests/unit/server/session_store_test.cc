// The session store (server/serving/session_store.h) in-process, without a
// transport: a recording SessionStream, the embedded toy model and a real batcher.
// A session opens and reads, steps (its cache growing across steps), and ends
// once for each reason: client, error, cache_budget, token_limit, idle_timeout,
// shutdown, each counted in mha_session_ends_total.
#include "server/serving/session_store.h"

#include <prometheus/registry.h>

#include <cmath>
#include <memory>
#include <vector>

#include "absl/strings/match.h"
#include "absl/synchronization/mutex.h"
#include "gtest/gtest.h"
#include "server/models/model_repository.h"
#include "server/serving/batcher.h"

namespace mha::server {
namespace {

// Records what the store asks of the transport.
class RecordingStream final : public SessionStream {
 public:
  void Read() override {
    absl::MutexLock lock(&mu_);
    ++reads_;
  }
  void Write(const ComputeTiming& /*timing*/, int64_t context) override {
    absl::MutexLock lock(&mu_);
    ++writes_;
    context_ = context;
  }
  void End(const absl::Status& status) override {
    absl::MutexLock lock(&mu_);
    ++ends_;
    status_ = status;
  }

  int reads() {
    absl::MutexLock lock(&mu_);
    return reads_;
  }
  // Waits for the n-th write (up to 10 s); returns its context.
  int64_t WaitForWrite(int n) {
    absl::MutexLock lock(&mu_);
    auto written = [this, n]() ABSL_NO_THREAD_SAFETY_ANALYSIS { return writes_ >= n || ends_ > 0; };
    mu_.AwaitWithTimeout(absl::Condition(&written), absl::Seconds(10));
    return writes_ >= n ? context_ : -1;
  }
  // Waits for End (up to `timeout`); returns its status, or nullopt.
  std::optional<absl::Status> WaitForEnd(absl::Duration timeout = absl::Seconds(10)) {
    absl::MutexLock lock(&mu_);
    auto ended = [this]() ABSL_NO_THREAD_SAFETY_ANALYSIS { return ends_ > 0; };
    mu_.AwaitWithTimeout(absl::Condition(&ended), timeout);
    if (ends_ == 0) return std::nullopt;
    EXPECT_EQ(ends_, 1);
    return status_;
  }

 private:
  absl::Mutex mu_;
  int reads_ ABSL_GUARDED_BY(mu_) = 0;
  int writes_ ABSL_GUARDED_BY(mu_) = 0;
  int ends_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t context_ ABSL_GUARDED_BY(mu_) = -1;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
};

// A self-attention step of `tokens` tokens for the toy model (d = 100).
struct ToyStep {
  explicit ToyStep(int64_t tokens)
      : queries(static_cast<size_t>(tokens) * 100, 0.25f),
        output(static_cast<size_t>(tokens) * 100, 0.0f) {
    step = core::PagedStep{.num_queries = tokens,
                           .queries = queries.data(),
                           .num_keys = tokens,
                           .output = output.data()};
  }
  std::vector<float> queries, output;
  core::PagedStep step;
};

class SessionStoreTest : public ::testing::Test {
 protected:
  void Start(SessionOptions options = {}) {
    models_ = ModelRepository::Create({}).value();
    batcher_ = Batcher::Create({.num_workers = 1}, nullptr).value();
    ASSERT_TRUE(batcher_->AddModel(ToyModel()).ok());
    store_ = std::make_unique<SessionStore>(options, batcher_.get(), registry_);
  }
  void TearDown() override {
    store_.reset();
    if (batcher_ != nullptr) batcher_->Shutdown();
  }

  std::shared_ptr<const Model> ToyModel() const { return models_->Find("", "").value(); }

  // mha_session_ends_total{reason}.
  double Ends(SessionEnd reason) {
    for (const prometheus::MetricFamily& family : registry_.Collect()) {
      if (family.name != "mha_session_ends_total") continue;
      for (const prometheus::ClientMetric& metric : family.metric) {
        for (const prometheus::ClientMetric::Label& label : metric.label) {
          if (label.name == "reason" && label.value == SessionEndLabel(reason)) {
            return metric.counter.value;
          }
        }
      }
    }
    return -1;
  }

  // Received + Step on `session`, then waits for the step's response.
  int64_t StepAndWait(SessionStore::Session* session, RecordingStream& stream, ToyStep& step,
                      int nth, bool first) {
    EXPECT_TRUE(session->Received());
    session->Step(first ? ToyModel() : nullptr, step.step, absl::InfiniteFuture(), nullptr);
    return stream.WaitForWrite(nth);
  }

  prometheus::Registry registry_;
  std::unique_ptr<ModelRepository> models_;
  std::unique_ptr<Batcher> batcher_;
  std::unique_ptr<SessionStore> store_;
};

TEST_F(SessionStoreTest, OpensStepsWithAGrowingCacheAndEndsOnHalfClose) {
  Start();
  RecordingStream stream;
  SessionStore::Session* session = store_->Open(&stream);
  EXPECT_EQ(stream.reads(), 1);
  EXPECT_EQ(store_->active(), 1);
  EXPECT_EQ(session->model(), nullptr);

  ToyStep first(2);
  EXPECT_EQ(StepAndWait(session, stream, first, 1, /*first=*/true), 2);
  float sum = 0;
  for (float v : first.output) sum += std::abs(v);
  EXPECT_GT(sum, 0.0f);  // the core wrote the step's output
  session->Written(true);
  EXPECT_EQ(stream.reads(), 2);

  ToyStep second(1);
  EXPECT_EQ(StepAndWait(session, stream, second, 2, /*first=*/false), 3);
  EXPECT_EQ(session->cached(), 3);
  EXPECT_EQ(session->model(), ToyModel().get());
  session->Written(true);
  EXPECT_GT(store_->pool().used_bytes(), 0);

  session->ClientDone();
  const std::optional<absl::Status> end = stream.WaitForEnd();
  ASSERT_TRUE(end.has_value());
  EXPECT_TRUE(end->ok()) << *end;
  EXPECT_EQ(Ends(SessionEnd::kClient), 1);
  EXPECT_EQ(store_->pool().used_bytes(), 0);  // the cache is released at the end
  store_->Close(session);
  EXPECT_EQ(store_->active(), 0);
}

TEST_F(SessionStoreTest, AStepOverTheCacheBudgetEndsTheSession) {
  Start({.cache_bytes = 1});  // not one block fits
  RecordingStream stream;
  SessionStore::Session* session = store_->Open(&stream);
  ASSERT_TRUE(session->Received());
  ToyStep step(2);
  session->Step(ToyModel(), step.step, absl::InfiniteFuture(), nullptr);
  const std::optional<absl::Status> end = stream.WaitForEnd();
  ASSERT_TRUE(end.has_value());
  EXPECT_EQ(end->code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(absl::StartsWith(end->message(), "step 0: --session_cache_bytes")) << *end;
  EXPECT_EQ(Ends(SessionEnd::kCacheBudget), 1);
  store_->Close(session);
}

TEST_F(SessionStoreTest, TheReasonAStatusCarriesEndsTheSession) {
  EXPECT_EQ(SessionEndOf(absl::InvalidArgumentError("x")), SessionEnd::kError);
  EXPECT_EQ(SessionEndOf(WithSessionEnd(absl::ResourceExhaustedError("context: over"),
                                        SessionEnd::kTokenLimit)),
            SessionEnd::kTokenLimit);
  Start();
  RecordingStream stream;
  SessionStore::Session* session = store_->Open(&stream);
  ASSERT_TRUE(session->Received());
  // The message text is not what decides: a token limit says so in the payload.
  session->Fail(WithSessionEnd(absl::ResourceExhaustedError("over the limit"),
                               SessionEnd::kTokenLimit));
  const std::optional<absl::Status> end = stream.WaitForEnd();
  ASSERT_TRUE(end.has_value());
  EXPECT_EQ(end->code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(end->message(), "step 0: over the limit");
  EXPECT_EQ(Ends(SessionEnd::kTokenLimit), 1);
  EXPECT_EQ(Ends(SessionEnd::kError), 0);
  store_->Close(session);
}

TEST_F(SessionStoreTest, AFailedStepEndsWithItsStatusPrefixedWithTheStep) {
  Start();
  RecordingStream stream;
  SessionStore::Session* session = store_->Open(&stream);
  ToyStep step(1);
  ASSERT_EQ(StepAndWait(session, stream, step, 1, /*first=*/true), 1);
  session->Written(true);
  ASSERT_TRUE(session->Received());
  session->Fail(absl::InvalidArgumentError("queries: bad"));
  const std::optional<absl::Status> end = stream.WaitForEnd();
  ASSERT_TRUE(end.has_value());
  EXPECT_EQ(end->code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(end->message(), "step 1: queries: bad");
  EXPECT_EQ(Ends(SessionEnd::kError), 1);
  EXPECT_EQ(store_->pool().used_bytes(), 0);
  store_->Close(session);
}

TEST_F(SessionStoreTest, AStepPastItsDeadlineEndsTheSessionUncomputed) {
  Start();
  RecordingStream stream;
  SessionStore::Session* session = store_->Open(&stream);
  ASSERT_TRUE(session->Received());
  ToyStep step(1);
  session->Step(ToyModel(), step.step, absl::Now() - absl::Seconds(1), nullptr);
  const std::optional<absl::Status> end = stream.WaitForEnd();
  ASSERT_TRUE(end.has_value());
  EXPECT_EQ(end->code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(absl::StartsWith(end->message(), "step 0: ")) << *end;
  EXPECT_EQ(Ends(SessionEnd::kError), 1);
  store_->Close(session);
}

TEST_F(SessionStoreTest, AWriteThatFailsEndsTheSessionAsTheClients) {
  Start();
  RecordingStream stream;
  SessionStore::Session* session = store_->Open(&stream);
  ToyStep step(1);
  ASSERT_EQ(StepAndWait(session, stream, step, 1, /*first=*/true), 1);
  session->Written(false);
  const std::optional<absl::Status> end = stream.WaitForEnd();
  ASSERT_TRUE(end.has_value());
  EXPECT_EQ(end->code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(Ends(SessionEnd::kClient), 1);
  store_->Close(session);
}

TEST_F(SessionStoreTest, AnIdleSessionEndsAfterTheTimeoutAndABusyOneDoesNot) {
  Start({.idle_timeout = absl::Milliseconds(100)});
  RecordingStream idle, busy;
  SessionStore::Session* idle_session = store_->Open(&idle);
  SessionStore::Session* busy_session = store_->Open(&busy);
  ASSERT_TRUE(busy_session->Received());  // computing: never idle
  const std::optional<absl::Status> end = idle.WaitForEnd(absl::Seconds(5));
  ASSERT_TRUE(end.has_value());
  EXPECT_EQ(end->code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(absl::StrContains(end->message(), "--session_idle_timeout")) << *end;
  EXPECT_EQ(Ends(SessionEnd::kIdleTimeout), 1);
  EXPECT_FALSE(busy.WaitForEnd(absl::Milliseconds(300)).has_value());
  busy_session->Fail(absl::CancelledError("done"));
  store_->Close(idle_session);
  store_->Close(busy_session);
}

TEST_F(SessionStoreTest, ShutdownEndsReadingSessionsAtOnceAndRefusesNewOnes) {
  Start();
  RecordingStream reading;
  SessionStore::Session* session = store_->Open(&reading);
  store_->Shutdown();
  const std::optional<absl::Status> end = reading.WaitForEnd();
  ASSERT_TRUE(end.has_value());
  EXPECT_EQ(end->code(), absl::StatusCode::kUnavailable);
  RecordingStream late;
  SessionStore::Session* refused = store_->Open(&late);
  const std::optional<absl::Status> refusal = late.WaitForEnd();
  ASSERT_TRUE(refusal.has_value());
  EXPECT_EQ(refusal->code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(absl::StrContains(refusal->message(), "no new sessions")) << *refusal;
  EXPECT_EQ(late.reads(), 0);
  EXPECT_EQ(Ends(SessionEnd::kShutdown), 2);
  store_->Close(session);
  store_->Close(refused);
}

TEST_F(SessionStoreTest, ShutdownEndsAComputingSessionAtItsNextMessage) {
  Start();
  RecordingStream stream;
  SessionStore::Session* session = store_->Open(&stream);
  ASSERT_TRUE(session->Received());
  store_->Shutdown();  // computing: it answers its step first
  ToyStep step(1);
  session->Step(ToyModel(), step.step, absl::InfiniteFuture(), nullptr);
  EXPECT_EQ(stream.WaitForWrite(1), 1);
  session->Written(true);
  EXPECT_EQ(stream.reads(), 2);
  EXPECT_FALSE(session->Received());  // the next message is not computed
  const std::optional<absl::Status> end = stream.WaitForEnd();
  ASSERT_TRUE(end.has_value());
  EXPECT_EQ(end->code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(Ends(SessionEnd::kShutdown), 1);
  store_->Close(session);
}

}  // namespace
}  // namespace mha::server

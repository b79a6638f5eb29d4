#include "server/attention_v1/session.h"

#include <malloc.h>
#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>

#include <algorithm>
#include <array>
#include <string>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "server/grpc_common/deadline.h"
#include "server/grpc_common/grpc_status.h"
#include "server/serving/metrics.h"
#include "server/attention_v1/session_codec.h"

namespace mha::server {
namespace {

using attention::v1::SessionRequest;
using attention::v1::SessionResponse;

// Why a session ended (mha_session_ends_total's reason label).
enum class EndReason { kClient, kError, kCacheBudget, kTokenLimit, kIdleTimeout, kShutdown };
constexpr std::array<const char*, 6> kEndReasons = {"client",      "error",        "cache_budget",
                                                    "token_limit", "idle_timeout", "shutdown"};

// Shutdown: how long a session whose computing step was answered waits for its
// client's next message or half-close before it ends (Session::OnWriteDone).
constexpr absl::Duration kShutdownGrace = absl::Seconds(1);

// Upper bounds of the step-duration histogram's context buckets, and their labels.
constexpr std::array<int64_t, 4> kContextBounds = {64, 512, 2048, 4096};
constexpr std::array<const char*, 5> kContextLabels = {"le64", "le512", "le2048", "le4096",
                                                       "gt4096"};

}  // namespace

struct SessionManager::Metrics {
  Metrics(prometheus::Registry& registry, int64_t budget)
      : active(prometheus::BuildGauge()
                   .Name("mha_sessions_active")
                   .Help("Open AttendSession streams")
                   .Register(registry)
                   .Add({})),
        opened(prometheus::BuildCounter()
                   .Name("mha_sessions_total")
                   .Help("AttendSession streams opened")
                   .Register(registry)
                   .Add({})),
        cached_tokens(prometheus::BuildGauge()
                          .Name("mha_session_cached_tokens")
                          .Help("Keys held in every session's K/V cache")
                          .Register(registry)
                          .Add({})),
        cache_bytes(prometheus::BuildGauge()
                        .Name("mha_session_cache_bytes")
                        .Help("Bytes of K/V cache blocks held by sessions")
                        .Register(registry)
                        .Add({})) {
    prometheus::BuildGauge()
        .Name("mha_session_cache_budget_bytes")
        .Help("The K/V cache's budget, --session_cache_bytes")
        .Register(registry)
        .Add({})
        .Set(static_cast<double>(budget));
    auto& ends_family = prometheus::BuildCounter()
                            .Name("mha_session_ends_total")
                            .Help("Sessions ended, by reason")
                            .Register(registry);
    for (size_t i = 0; i < kEndReasons.size(); ++i) {
      ends[i] = &ends_family.Add({{"reason", kEndReasons[i]}});
    }
    auto& steps_family = prometheus::BuildHistogram()
                             .Name("mha_session_step_duration_seconds")
                             .Help(
                                 "A session step from its message to its computed response, "
                                 "by keys cached after it")
                             .Register(registry);
    for (size_t i = 0; i < kContextLabels.size(); ++i) {
      steps[i] = &steps_family.Add({{"context", kContextLabels[i]}}, DurationBuckets());
    }
  }

  prometheus::Histogram& Step(int64_t context) {
    const auto it = std::lower_bound(kContextBounds.begin(), kContextBounds.end(), context);
    return *steps[it - kContextBounds.begin()];
  }

  prometheus::Gauge& active;
  prometheus::Counter& opened;
  prometheus::Gauge& cached_tokens;
  prometheus::Gauge& cache_bytes;
  std::array<prometheus::Counter*, kEndReasons.size()> ends{};
  std::array<prometheus::Histogram*, kContextLabels.size()> steps{};
};

// One AttendSession stream. Runs one step at a time:
//   kReading -> (message) kComputing -> (computed) kWriting -> (written) kReading
// and ends in kFinished. Only a kReading session is ended from outside (idle
// timeout, shutdown); a computing or writing one ends at its next transition. In
// kComputing only the step's own thread and then the worker touch the step, its
// cache and its response, so they are used without the lock.
// Owned by gRPC: deleted in OnDone.
class SessionManager::Session final
    : public grpc::ServerBidiReactor<SessionRequest, SessionResponse> {
 public:
  Session(SessionManager* manager, grpc::CallbackServerContext* context)
      : manager_(manager), context_(context) {
    const bool accepted = manager_->Add(this);
    absl::MutexLock lock(&mu_);
    if (!accepted) {
      FinishLocked(absl::UnavailableError("server is shutting down; no new sessions"),
                   EndReason::kShutdown);
      return;
    }
    idle_since_ = absl::Now();
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    {
      absl::MutexLock lock(&mu_);
      if (state_ == State::kFinished) return;  // ended while waiting (idle, shutdown)
      if (!ok) {                               // the client half-closed, or the call is gone
        FinishLocked(absl::OkStatus(), EndReason::kClient);
        return;
      }
      if (stop_requested_) {  // answered its last step, and the client has read it
        FinishLocked(ShutdownError(), EndReason::kShutdown);
        return;
      }
      state_ = State::kComputing;
      step_start_ = absl::Now();
    }
    absl::Status status = StartStep();  // may compute inline and call OnComputed
    if (status.ok()) return;
    absl::MutexLock lock(&mu_);
    FinishLocked(StepError(status), reason_);
  }

  void OnWriteDone(bool ok) override {
    absl::MutexLock lock(&mu_);
    if (!ok) {
      FinishLocked(absl::CancelledError("stream closed by the client"), EndReason::kClient);
      return;
    }
    ++steps_;
    response_.Clear();
    // Shutting down: the stream ends at the client's next message (or half-close),
    // or kShutdownGrace after this answer (ExpireIfIdle). Ending it at once would
    // let gRPC close the connection while the client's acknowledgements of a large
    // answer are unread, and a connection closed that way is reset, which can
    // discard the answer before the client reads it.
    state_ = State::kReading;
    idle_since_ = absl::Now();
    StartRead(&request_);
  }

  void OnDone() override {
    manager_->Remove(this);
    // The last callback ran on another thread; taking the lock orders its writes
    // before the members' destruction for readers of the code and for
    // ThreadSanitizer, which cannot see gRPC core's hand-off.
    { absl::MutexLock lock(&mu_); }
    delete this;
  }

  // The reaper, under the manager's lock: ends the session if it has waited for
  // its next message for longer than the idle timeout.
  void ExpireIfIdle(absl::Time now) {
    absl::MutexLock lock(&mu_);
    if (stop_requested_ && state_ == State::kReading && now - idle_since_ >= kShutdownGrace) {
      FinishLocked(ShutdownError(), EndReason::kShutdown);
      return;
    }
    const absl::Duration timeout = manager_->options_.idle_timeout;
    if (state_ != State::kReading || now - idle_since_ < timeout) return;
    FinishLocked(absl::DeadlineExceededError(absl::StrCat(
                     "session idle for over ", absl::FormatDuration(timeout),
                     " (--session_idle_timeout) after ", steps_, " steps; its cache of ",
                     cache_ != nullptr ? cache_->size() : 0, " tokens is released")),
                 EndReason::kIdleTimeout);
  }

  // Shutdown, under the manager's lock.
  void Stop() {
    absl::MutexLock lock(&mu_);
    stop_requested_ = true;
    if (state_ == State::kReading) FinishLocked(ShutdownError(), EndReason::kShutdown);
  }

 private:
  enum class State { kReading, kComputing, kWriting, kFinished };

  absl::Status ShutdownError() const {
    return absl::UnavailableError(absl::StrCat("server is shutting down; the session ended after ",
                                               steps_, " steps and its cache is released"));
  }

  absl::Status StepError(const absl::Status& status) const {
    return absl::Status(status.code(), absl::StrCat("step ", steps_, ": ", status.message()));
  }

  // Decodes the message, makes room in the cache and submits the step.
  absl::Status StartStep() {
    reason_ = EndReason::kError;
    const bool first = model_ == nullptr;
    if (first) {
      MHA_ASSIGN_OR_RETURN(model_,
                           manager_->models_->Find(request_.model(), request_.model_version()));
      settings_ = SettingsOf(request_);
    }
    const int64_t cached = cache_ != nullptr ? cache_->size() : 0;
    absl::StatusOr<SessionStepInput> input =
        DecodeSessionStep(request_, first, settings_, *model_, cached);
    if (!input.ok()) {
      if (input.status().code() == absl::StatusCode::kResourceExhausted &&
          absl::StartsWith(input.status().message(), "context:")) {
        reason_ = EndReason::kTokenLimit;
      }
      return input.status();
    }
    input_ = *input;
    const core::ModelConfig& c = model_->config;
    if (first) {
      cache_ = std::make_unique<core::KvSequence>(&manager_->pool_, c.num_heads, c.head_size(),
                                                  c.precision == core::Precision::kBf16);
    }
    if (absl::Status s = cache_->Reserve(input_.num_keys); !s.ok()) {
      reason_ = EndReason::kCacheBudget;
      return absl::ResourceExhaustedError(absl::StrCat("--session_cache_bytes: ", s.message(),
                                                       "; this session held ", cache_->size(),
                                                       " tokens"));
    }
    manager_->metrics_->cache_bytes.Set(static_cast<double>(manager_->pool_.used_bytes()));
    step_ = ToPagedStep(input_, settings_, cache_.get(),
                        PrepareSessionResponse(input_, *model_, &response_));
    return manager_->batcher_->Submit(WorkItem{
        .model = model_,
        .inputs = {.batch = 1,
                   .num_queries = input_.num_queries,
                   .num_keys = input_.num_keys,
                   .queries = input_.queries},
        .deadline = DeadlineOf(context_),
        .cancelled = [context = context_] { return context->IsCancelled(); },
        .done = [this](absl::Status status,
                       const ComputeTiming& timing) { OnComputed(std::move(status), timing); },
        .step = &step_,
    });
  }

  void OnComputed(absl::Status status, const ComputeTiming& timing) {
    absl::MutexLock lock(&mu_);
    if (!status.ok()) {
      FinishLocked(StepError(status), EndReason::kError);
      return;
    }
    Metrics& metrics = *manager_->metrics_;
    metrics.cached_tokens.Increment(static_cast<double>(input_.num_keys));
    metrics.Step(cache_->size()).Observe(absl::ToDoubleSeconds(absl::Now() - step_start_));
    response_.set_context_tokens(cache_->size());
    attention::v1::Timing* t = response_.mutable_timing();
    t->set_queue_us(absl::ToInt64Microseconds(timing.queue));
    t->set_compute_us(absl::ToInt64Microseconds(timing.compute));
    t->set_batch_rows(timing.batch_rows);
    state_ = State::kWriting;
    StartWrite(&response_);
  }

  // Ends the stream with `status` and releases the cache (no step is computing).
  void FinishLocked(const absl::Status& status, EndReason reason)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    state_ = State::kFinished;
    Metrics& metrics = *manager_->metrics_;
    metrics.ends[static_cast<size_t>(reason)]->Increment();
    if (cache_ != nullptr) {
      metrics.cached_tokens.Decrement(static_cast<double>(cache_->size()));
      cache_.reset();
      metrics.cache_bytes.Set(static_cast<double>(manager_->pool_.used_bytes()));
    }
    if (model_ != nullptr) manager_->batcher_->SessionEnded(model_.get(), &step_);
    model_.reset();  // a retired version can go
    Finish(ToGrpcStatus(status));
  }

  SessionManager* const manager_;
  grpc::CallbackServerContext* const context_;
  absl::Mutex mu_;
  State state_ ABSL_GUARDED_BY(mu_) = State::kReading;
  bool stop_requested_ ABSL_GUARDED_BY(mu_) = false;
  absl::Time idle_since_ ABSL_GUARDED_BY(mu_);
  int64_t steps_ ABSL_GUARDED_BY(mu_) = 0;  // answered

  // The step in progress and the session's state; see the class comment.
  SessionRequest request_;
  SessionResponse response_;
  std::shared_ptr<const Model> model_;
  SessionSettings settings_;
  std::unique_ptr<core::KvSequence> cache_;
  SessionStepInput input_;
  core::PagedStep step_;
  absl::Time step_start_;
  EndReason reason_ = EndReason::kError;
};

SessionManager::SessionManager(const SessionOptions& options, const ModelSource* models,
                               Batcher* batcher, prometheus::Registry& registry)
    : options_(options),
      models_(models),
      batcher_(batcher),
      pool_(options.cache_bytes),
      metrics_(std::make_unique<Metrics>(registry, options.cache_bytes)),
      reaper_([this] { ReapIdle(); }) {}

SessionManager::~SessionManager() {
  Shutdown();
  reaper_.join();
}

grpc::ServerBidiReactor<SessionRequest, SessionResponse>* SessionManager::Open(
    grpc::CallbackServerContext* context) {
  return new Session(this, context);
}

void SessionManager::Shutdown() {
  absl::MutexLock lock(&mu_);
  if (stopping_) return;
  stopping_ = true;
  for (Session* session : sessions_) session->Stop();
}

int64_t SessionManager::active() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(sessions_.size());
}

bool SessionManager::Add(Session* session) {
  absl::MutexLock lock(&mu_);
  if (stopping_) return false;
  sessions_.insert(session);
  metrics_->active.Increment();
  metrics_->opened.Increment();
  return true;
}

void SessionManager::Remove(Session* session) {
  {
    absl::MutexLock lock(&mu_);
    if (sessions_.erase(session) > 0) metrics_->active.Decrement();
    if (!sessions_.empty()) return;
  }
  // The last session is gone: its messages, buffers and blocks were freed across
  // gRPC's threads' malloc arenas; give those pages back so that memory after a
  // burst of sessions returns to what it was (a few milliseconds, once per burst).
  malloc_trim(0);
}

void SessionManager::ReapIdle() {
  // A session overstays its timeout by at most a quarter of it (at most 1 s).
  const absl::Duration period =
      std::clamp(options_.idle_timeout / 4, absl::Milliseconds(10), absl::Seconds(1));
  absl::MutexLock lock(&mu_);
  while (!stopping_) {
    mu_.AwaitWithTimeout(absl::Condition(&stopping_), period);
    const absl::Time now = absl::Now();
    for (Session* session : sessions_) session->ExpireIfIdle(now);
  }
  // Shutting down: sessions that answered a step computing at shutdown end at
  // their client's next message, or here after kShutdownGrace. Looks every 50 ms
  // until every session is gone, for at most twice the grace.
  const absl::Time give_up = absl::Now() + 2 * kShutdownGrace;
  auto none = [this]() ABSL_NO_THREAD_SAFETY_ANALYSIS { return sessions_.empty(); };
  while (!sessions_.empty() && absl::Now() < give_up) {
    mu_.AwaitWithTimeout(absl::Condition(&none), absl::Milliseconds(50));
    const absl::Time now = absl::Now();
    for (Session* session : sessions_) session->ExpireIfIdle(now);
  }
}

}  // namespace mha::server

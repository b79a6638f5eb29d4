#include "server/serving/session_store.h"

#include <malloc.h>
#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>

#include <algorithm>
#include <array>
#include <string>
#include <utility>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/types/optional.h"
#include "server/serving/metrics.h"

namespace mha::server {
namespace {

constexpr std::array<const char*, kNumSessionEnds> kEndLabels = {
    "client", "error", "cache_budget", "token_limit", "idle_timeout", "shutdown"};

// The status payload that carries a SessionEnd.
constexpr char kSessionEndUrl[] = "type.mha-serve/SessionEnd";

// Upper bounds of the step-duration histogram's context buckets, and their labels.
constexpr std::array<int64_t, 4> kContextBounds = {64, 512, 2048, 4096};
constexpr std::array<const char*, 5> kContextLabels = {"le64", "le512", "le2048", "le4096",
                                                       "gt4096"};

}  // namespace

absl::string_view SessionEndLabel(SessionEnd end) { return kEndLabels[static_cast<size_t>(end)]; }

absl::Status WithSessionEnd(absl::Status status, SessionEnd end) {
  status.SetPayload(kSessionEndUrl, absl::Cord(SessionEndLabel(end)));
  return status;
}

SessionEnd SessionEndOf(const absl::Status& status) {
  const absl::optional<absl::Cord> payload = status.GetPayload(kSessionEndUrl);
  if (!payload.has_value()) return SessionEnd::kError;
  for (size_t i = 0; i < kEndLabels.size(); ++i) {
    if (*payload == kEndLabels[i]) return static_cast<SessionEnd>(i);
  }
  return SessionEnd::kError;
}

struct SessionStore::Metrics {
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
    for (size_t i = 0; i < kEndLabels.size(); ++i) {
      ends[i] = &ends_family.Add({{"reason", kEndLabels[i]}});
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
  std::array<prometheus::Counter*, kNumSessionEnds> ends{};
  std::array<prometheus::Histogram*, kContextLabels.size()> steps{};
};

bool SessionStore::Session::Received() {
  absl::MutexLock lock(&mu_);
  if (state_ == State::kFinished) return false;  // ended while waiting (idle, shutdown)
  if (stop_requested_) {  // answered its last step, and the client has read it
    EndLocked(ShutdownError(), SessionEnd::kShutdown);
    return false;
  }
  state_ = State::kComputing;
  step_start_ = absl::Now();
  return true;
}

void SessionStore::Session::Step(std::shared_ptr<const Model> model, const core::PagedStep& step,
                                 absl::Time deadline, std::function<bool()> cancelled) {
  // Computing: only this thread, then the worker, touch the step and the cache.
  if (model_ == nullptr) {
    model_ = std::move(model);
    const core::ModelConfig& c = model_->config;
    cache_ = std::make_unique<core::KvSequence>(&store_->pool_, c.kv_heads(), c.head_size(),
                                                c.cache_bf16());
  }
  if (absl::Status s = cache_->Reserve(step.num_keys); !s.ok()) {
    absl::MutexLock lock(&mu_);
    EndLocked(StepError(absl::ResourceExhaustedError(
                  absl::StrCat("--session_cache_bytes: ", s.message(), "; this session held ",
                               cache_->size(), " tokens"))),
              SessionEnd::kCacheBudget);
    return;
  }
  store_->metrics_->cache_bytes.Set(static_cast<double>(store_->pool_.used_bytes()));
  step_ = step;
  step_.cache = cache_.get();
  const absl::Status submitted = store_->batcher_->Submit(WorkItem{
      .model = model_,
      .inputs = {.batch = 1,
                 .num_queries = step_.num_queries,
                 .num_keys = step_.num_keys,
                 .queries = step_.queries},
      .deadline = deadline,
      .cancelled = std::move(cancelled),
      .done = [this](absl::Status status,
                     const ComputeTiming& timing) { OnComputed(std::move(status), timing); },
      .step = &step_,
  });
  if (!submitted.ok()) Fail(submitted);
}

void SessionStore::Session::Fail(const absl::Status& status) {
  absl::MutexLock lock(&mu_);
  EndLocked(StepError(status), SessionEndOf(status));
}

void SessionStore::Session::OnComputed(absl::Status status, const ComputeTiming& timing) {
  absl::MutexLock lock(&mu_);
  if (!status.ok()) {
    EndLocked(StepError(status), SessionEnd::kError);
    return;
  }
  Metrics& metrics = *store_->metrics_;
  metrics.cached_tokens.Increment(static_cast<double>(step_.num_keys));
  metrics.Step(cache_->size()).Observe(absl::ToDoubleSeconds(absl::Now() - step_start_));
  state_ = State::kWriting;
  stream_->Write(timing, cache_->size());
}

void SessionStore::Session::Written(bool ok) {
  absl::MutexLock lock(&mu_);
  if (!ok) {
    EndLocked(absl::CancelledError("stream closed by the client"), SessionEnd::kClient);
    return;
  }
  ++steps_;
  // Shutting down: the session ends at the client's next message (or half-close),
  // or kShutdownGrace after this answer (ExpireIfIdle). Ending it at once would let
  // the transport close the connection while the client's acknowledgements of a
  // large answer are unread, and a connection closed that way is reset, which can
  // discard the answer before the client reads it.
  state_ = State::kReading;
  idle_since_ = absl::Now();
  stream_->Read();
}

void SessionStore::Session::ClientDone() {
  absl::MutexLock lock(&mu_);
  if (state_ == State::kFinished) return;
  EndLocked(absl::OkStatus(), SessionEnd::kClient);
}

bool SessionStore::Session::ExpireIfIdle(absl::Time now) {
  absl::MutexLock lock(&mu_);
  if (state_ == State::kComputing || state_ == State::kWriting) return true;
  if (stop_requested_ && state_ == State::kReading && now - idle_since_ >= kShutdownGrace) {
    EndLocked(ShutdownError(), SessionEnd::kShutdown);
    return false;
  }
  const absl::Duration timeout = store_->options_.idle_timeout;
  if (state_ != State::kReading || now - idle_since_ < timeout) return false;
  EndLocked(absl::DeadlineExceededError(
                absl::StrCat("session idle for over ", absl::FormatDuration(timeout),
                             " (--session_idle_timeout) after ", steps_, " steps; its cache of ",
                             cached(), " tokens is released")),
            SessionEnd::kIdleTimeout);
  return false;
}

void SessionStore::Session::Stop() {
  absl::MutexLock lock(&mu_);
  stop_requested_ = true;
  if (state_ == State::kReading) EndLocked(ShutdownError(), SessionEnd::kShutdown);
}

absl::Status SessionStore::Session::ShutdownError() const {
  return absl::UnavailableError(absl::StrCat("server is shutting down; the session ended after ",
                                             steps_, " steps and its cache is released"));
}

absl::Status SessionStore::Session::StepError(const absl::Status& status) const {
  return absl::Status(status.code(), absl::StrCat("step ", steps_, ": ", status.message()));
}

void SessionStore::Session::EndLocked(const absl::Status& status, SessionEnd reason) {
  if (state_ == State::kFinished) return;
  state_ = State::kFinished;
  Metrics& metrics = *store_->metrics_;
  metrics.ends[static_cast<size_t>(reason)]->Increment();
  if (cache_ != nullptr) {
    metrics.cached_tokens.Decrement(static_cast<double>(cache_->size()));
    cache_.reset();
    metrics.cache_bytes.Set(static_cast<double>(store_->pool_.used_bytes()));
  }
  if (model_ != nullptr) store_->batcher_->SessionEnded(model_.get(), &step_);
  model_.reset();  // a retired version can go
  stream_->End(status);
}

SessionStore::SessionStore(const SessionOptions& options, Batcher* batcher,
                           prometheus::Registry& registry)
    : options_(options),
      batcher_(batcher),
      pool_(options.cache_bytes),
      metrics_(std::make_unique<Metrics>(registry, options.cache_bytes)),
      reaper_([this] { ReapIdle(); }) {}

SessionStore::~SessionStore() {
  Shutdown();
  reaper_.join();
}

SessionStore::Session* SessionStore::Open(SessionStream* stream) {
  auto* session = new Session(this, stream);
  const bool accepted = Add(session);
  absl::MutexLock lock(&session->mu_);
  if (!accepted) {
    session->EndLocked(absl::UnavailableError("server is shutting down; no new sessions"),
                       SessionEnd::kShutdown);
    return session;
  }
  session->idle_since_ = absl::Now();
  stream->Read();
  return session;
}

void SessionStore::Close(Session* session) {
  bool last;
  {
    absl::MutexLock lock(&mu_);
    if (sessions_.erase(session) > 0) metrics_->active.Decrement();
    last = sessions_.empty();
  }
  // The last callback ran on another thread; taking the lock orders its writes
  // before the session's destruction for readers of the code and for
  // ThreadSanitizer, which cannot see the transport's hand-off.
  { absl::MutexLock lock(&session->mu_); }
  delete session;
  if (!last) return;
  // The last session is gone: its messages, buffers and blocks were freed across
  // the transport's threads' malloc arenas; give those pages back so that memory
  // after a burst of sessions returns to what it was (a few milliseconds, once per
  // burst).
  malloc_trim(0);
}

void SessionStore::Shutdown() {
  absl::MutexLock lock(&mu_);
  if (stopping_) return;
  stopping_ = true;
  for (Session* session : sessions_) session->Stop();
}

int64_t SessionStore::active() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(sessions_.size());
}

bool SessionStore::Add(Session* session) {
  absl::MutexLock lock(&mu_);
  if (stopping_) return false;
  sessions_.insert(session);
  metrics_->active.Increment();
  metrics_->opened.Increment();
  return true;
}

void SessionStore::ReapIdle() {
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
  // until every session is gone, for at most twice the grace after the last step
  // still computing or being written: a step can outlast the grace, and its
  // session must still end after its answer, not at --drain_timeout.
  absl::Time give_up = absl::Now() + 2 * kShutdownGrace;
  auto none = [this]() ABSL_NO_THREAD_SAFETY_ANALYSIS { return sessions_.empty(); };
  while (!sessions_.empty() && absl::Now() < give_up) {
    mu_.AwaitWithTimeout(absl::Condition(&none), absl::Milliseconds(50));
    const absl::Time now = absl::Now();
    for (Session* session : sessions_) {
      if (session->ExpireIfIdle(now)) give_up = std::max(give_up, now + 2 * kShutdownGrace);
    }
  }
}

}  // namespace mha::server

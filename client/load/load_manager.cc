#include "client/load/load_manager.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "client/sdk/status.h"

namespace mha::client {
namespace {

absl::Status CheckTarget(const LoadTarget& target) {
  const CallTarget& calls = target.calls;
  const bool http = calls.protocol == Protocol::kHttp;
  if (!http && calls.channels.empty()) return absl::InvalidArgumentError("load: no channel");
  const bool has_request = calls.protocol == Protocol::kKServe ? calls.infer_request != nullptr
                           : http                              ? calls.http_request != nullptr
                                                               : calls.request != nullptr;
  if (calls.rpc == Rpc::kAttend && !has_request) {
    return absl::InvalidArgumentError("load: no request");
  }
  if (calls.rpc == Rpc::kHealth && calls.mode == Mode::kStream) {
    return absl::InvalidArgumentError("--rpc=health is unary only (Health/Check)");
  }
  if (http && calls.mode == Mode::kStream) {
    return absl::InvalidArgumentError("--mode=stream needs a gRPC protocol (not --protocol=http)");
  }
  return absl::OkStatus();
}

}  // namespace

void Recorder::Add(const Sample& sample) {
  std::lock_guard<std::mutex> lock(mu_);
  samples_.push_back(sample);
  ++completed_;
  if (sample.code != grpc::StatusCode::OK) ++errors_[CodeName(sample.code)];
}

std::vector<Sample> Recorder::Take() {
  std::lock_guard<std::mutex> lock(mu_);
  return std::exchange(samples_, {});
}

int64_t Recorder::completed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return completed_;
}

std::map<std::string, int64_t> Recorder::errors() const {
  std::lock_guard<std::mutex> lock(mu_);
  return errors_;
}

std::chrono::nanoseconds BackoffDelay(int64_t consecutive_failures) {
  constexpr std::chrono::nanoseconds kFirst = std::chrono::milliseconds(1);
  constexpr std::chrono::nanoseconds kMost = std::chrono::milliseconds(100);
  if (consecutive_failures <= 0) return std::chrono::nanoseconds(0);
  // 1 ms << 7 is past the bound already; the shift stays small.
  return std::min(kMost, kFirst * (int64_t{1} << std::min<int64_t>(consecutive_failures - 1, 7)));
}

LoadManager::LoadManager(const LoadTarget& target, Recorder* recorder)
    : recorder_(recorder), target_(target), warming_up_(target.warmup) {}

void LoadManager::OpenCalls(int lanes) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    // Before opening: a stream may end at once.
    open_streams_ = SendsOnStreams(target_.calls) ? lanes : 0;
  }
  calls_ = std::make_unique<CallSender>(target_.calls, lanes, this);
}

void LoadManager::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    retries_.clear();
  }
  cv_.notify_all();
  StopSending();
  // No retry thread starts once stopping_ is set.
  if (retry_thread_.joinable()) retry_thread_.join();
  calls_->CloseStreams();
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [this] { return in_flight_ == 0 && open_streams_ == 0; });
}

void LoadManager::EndWarmup() {
  std::lock_guard<std::mutex> lock(mu_);
  recorder_->Take();
  warming_up_ = false;
  budget_used_ = in_flight_;  // they finish after the warm-up: measured
}

bool LoadManager::exhausted() const {
  std::lock_guard<std::mutex> lock(mu_);
  return ExhaustedLocked();
}

bool LoadManager::failing() const {
  std::lock_guard<std::mutex> lock(mu_);
  return FailingLocked();
}

std::chrono::nanoseconds LoadManager::Backoff() const {
  std::lock_guard<std::mutex> lock(mu_);
  return BackoffDelay(failures_in_a_row_);
}

bool LoadManager::ExhaustedLocked() const {
  return target_.max_requests > 0 && !warming_up_ && budget_used_ >= target_.max_requests;
}

bool LoadManager::FailingLocked() const {
  return target_.max_errors > 0 && failures_ >= target_.max_errors;
}

bool LoadManager::AcquireLocked() {
  if (stopping_ || ExhaustedLocked() || FailingLocked()) return false;
  sent_.fetch_add(1);
  if (!warming_up_) ++budget_used_;
  ++in_flight_;
  return true;
}

void LoadManager::RecordLocked(const Sample& sample) {
  // A request the manager's own Stop kept from being sent (a stream closed at the end
  // of a step) is neither a request nor a failure: its slot, acquired before the
  // stop, counted it in sent_.
  if (stopping_ && sample.code == grpc::StatusCode::CANCELLED) {
    if (!sample.sent) sent_.fetch_sub(1);
    return;
  }
  recorder_->Add(sample);
  if (sample.code == grpc::StatusCode::OK) {
    failures_in_a_row_ = 0;
  } else if (target_.allowed_errors.count(sample.code) == 0) {
    ++failures_in_a_row_;
    ++failures_;
  }
}

void LoadManager::RetryLocked(int slot, Clock::time_point when) {
  if (stopping_) return;
  retries_.emplace_back(when, slot);
  if (!retry_thread_.joinable()) retry_thread_ = std::thread(&LoadManager::SendRetries, this);
  cv_.notify_all();
}

void LoadManager::SendRetries() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stopping_) {
    if (retries_.empty()) {
      cv_.wait(lock);
      continue;
    }
    const auto next = std::min_element(retries_.begin(), retries_.end());
    if (const Clock::time_point when = next->first; Clock::now() < when) {
      // A copy: wait_until reads it while RetryLocked may grow retries_.
      cv_.wait_until(lock, when);
      continue;
    }
    const int slot = next->second;
    retries_.erase(next);
    if (!AcquireLocked()) continue;  // max_requests or max_errors: the slot stays idle
    lock.unlock();
    Issue(slot);
    lock.lock();
  }
}

int LoadManager::AcquireNow(int count) {
  std::lock_guard<std::mutex> lock(mu_);
  int taken = 0;
  while (taken < count && AcquireLocked()) ++taken;
  return taken;
}

bool LoadManager::AcquireAt(std::chrono::steady_clock::time_point when) {
  std::unique_lock<std::mutex> lock(mu_);
  if (cv_.wait_until(lock, when, [this] { return stopping_; })) return false;
  return AcquireLocked();
}

// gRPC's reactions may run inline inside the call that started an operation, so a
// refill sent from OnSample is queued on this thread instead of recursing: a
// failing server cannot grow the stack.
void LoadManager::Issue(int slot) {
  thread_local std::vector<std::pair<LoadManager*, int>>* trampoline = nullptr;
  if (trampoline != nullptr) {
    trampoline->emplace_back(this, slot);
    return;
  }
  std::vector<std::pair<LoadManager*, int>> queue = {{this, slot}};
  trampoline = &queue;
  while (!queue.empty()) {
    auto [manager, next] = queue.back();
    queue.pop_back();
    manager->calls_->Send(next);
  }
  trampoline = nullptr;
}

void LoadManager::OnSample(int slot, const Sample& sample) {
  bool again = false;
  {
    // Recorded under the lock, so that EndWarmup sees each request either in
    // flight or recorded.
    std::lock_guard<std::mutex> lock(mu_);
    RecordLocked(sample);
    --in_flight_;
    const std::chrono::nanoseconds backoff = BackoffDelay(failures_in_a_row_);
    if (RefillsFinishedSlots() && backoff.count() > 0) {
      RetryLocked(slot, Clock::now() + backoff);
    } else {
      again = RefillsFinishedSlots() && AcquireLocked();
    }
    if (!again) cv_.notify_all();  // under the lock: Stop's waiter may destroy us next
  }
  if (again) Issue(slot);
}

void LoadManager::OnStreamDone(absl::Span<const Sample> unanswered) {
  std::lock_guard<std::mutex> lock(mu_);
  for (const Sample& sample : unanswered) RecordLocked(sample);
  in_flight_ -= static_cast<int64_t>(unanswered.size());
  --open_streams_;
  cv_.notify_all();
}

absl::StatusOr<std::unique_ptr<ConcurrencyManager>> ConcurrencyManager::Create(
    const LoadTarget& target, int concurrency, Recorder* recorder) {
  MHA_RETURN_IF_ERROR(CheckTarget(target));
  if (concurrency < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("concurrency: expected >= 1, got ", concurrency));
  }
  std::unique_ptr<ConcurrencyManager> manager(new ConcurrencyManager(target, recorder));
  manager->OpenCalls(concurrency);
  const int slots = manager->AcquireNow(concurrency);
  for (int slot = 0; slot < slots; ++slot) manager->Issue(slot);
  return manager;
}

RequestSchedule::RequestSchedule(double rate, bool poisson, uint64_t seed)
    : rate_(rate), poisson_(poisson), engine_(seed), gap_(rate) {}

std::chrono::steady_clock::duration RequestSchedule::NextInterval() {
  return std::chrono::duration_cast<std::chrono::steady_clock::duration>(
      std::chrono::duration<double>(poisson_ ? gap_(engine_) : 1.0 / rate_));
}

absl::StatusOr<std::unique_ptr<RequestRateManager>> RequestRateManager::Create(
    const LoadTarget& target, double rate, bool poisson, uint64_t seed, Recorder* recorder) {
  MHA_RETURN_IF_ERROR(CheckTarget(target));
  if (!(rate > 0)) {
    return absl::InvalidArgumentError(absl::StrCat("request rate: expected > 0, got ", rate));
  }
  if ((target.calls.mode == Mode::kStream || target.calls.protocol == Protocol::kHttp) &&
      target.rate_streams < 1) {
    return absl::InvalidArgumentError("--streams: expected >= 1");
  }
  std::unique_ptr<RequestRateManager> manager(new RequestRateManager(target, recorder));
  manager->OpenCalls(target.rate_streams);
  manager->scheduler_ = std::thread(&RequestRateManager::SendOnSchedule, manager.get(),
                                    RequestSchedule(rate, poisson, seed));
  return manager;
}

void RequestRateManager::SendOnSchedule(RequestSchedule schedule) {
  auto next = std::chrono::steady_clock::now();
  for (int slot = 0;; ++slot) {
    next += schedule.NextInterval();
    // After failures the schedule slips by the backoff; it does not catch up.
    if (const std::chrono::nanoseconds backoff = Backoff(); backoff.count() > 0) {
      next = std::max<std::chrono::steady_clock::time_point>(
          next, std::chrono::steady_clock::now() + backoff);
    }
    if (!AcquireAt(next)) return;  // stopping, max_requests sent or max_errors failed
    Issue(slot);
  }
}

void RequestRateManager::StopSending() {
  if (scheduler_.joinable()) scheduler_.join();
}

}  // namespace mha::client

#include "client/load.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "client/status.h"

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
}

std::vector<Sample> Recorder::Take() {
  std::lock_guard<std::mutex> lock(mu_);
  return std::exchange(samples_, {});
}

int64_t Recorder::completed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return completed_;
}

LoadManager::LoadManager(const LoadTarget& target, Recorder* recorder)
    : recorder_(recorder), target_(target), max_requests_(target.max_requests) {}

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
  }
  cv_.notify_all();
  StopSending();
  calls_->CloseStreams();
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [this] { return in_flight_ == 0 && open_streams_ == 0; });
}

bool LoadManager::AcquireLocked() {
  if (stopping_) return false;
  if (max_requests_ > 0 && sent_.load() >= max_requests_) return false;
  sent_.fetch_add(1);
  ++in_flight_;
  return true;
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
  recorder_->Add(sample);
  bool again = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    --in_flight_;
    again = RefillsFinishedSlots() && AcquireLocked();
    if (!again) cv_.notify_all();  // under the lock: Stop's waiter may destroy us next
  }
  if (again) Issue(slot);
}

void LoadManager::OnStreamDone(absl::Span<const Sample> unanswered) {
  for (const Sample& sample : unanswered) recorder_->Add(sample);
  std::lock_guard<std::mutex> lock(mu_);
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
    if (!AcquireAt(next)) return;  // stopping, or max_requests sent
    Issue(slot);
  }
}

void RequestRateManager::StopSending() {
  if (scheduler_.joinable()) scheduler_.join();
}

}  // namespace mha::client

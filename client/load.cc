#include "client/load.h"

#include <chrono>
#include <condition_variable>
#include <deque>
#include <random>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "client/channel.h"
#include "proto/attention.grpc.pb.h"
#include "proto/grpc/health/v1/health.grpc.pb.h"

namespace mha::client {

int64_t SteadyNowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

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

bool LoadGenerator::Acquire() {
  if (max_requests_ <= 0) {
    sent_.fetch_add(1);
    return true;
  }
  if (sent_.fetch_add(1) >= max_requests_) {
    sent_.fetch_sub(1);
    return false;
  }
  return true;
}

namespace {

using attention::v1::AttendRequest;
using attention::v1::AttendResponse;
using attention::v1::AttentionService;
using grpc::health::v1::Health;
using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;

Sample MakeSample(int64_t start_ns, grpc::StatusCode code, const AttendResponse* response) {
  Sample sample;
  sample.end_ns = SteadyNowNs();
  sample.latency_ns = sample.end_ns - start_ns;
  sample.code = code;
  if (code == grpc::StatusCode::OK && response != nullptr) {
    sample.queue_us = response->timing().queue_us();
    sample.compute_us = response->timing().compute_us();
    sample.batch_rows = response->timing().batch_rows();
  }
  return sample;
}

class Generator;

// One AttendStream call carrying requests in order; the server answers in order,
// so the oldest pending start time belongs to each response.
class StreamCall : public grpc::ClientBidiReactor<AttendRequest, AttendResponse> {
 public:
  StreamCall(Generator* owner, int slot, const AttendRequest* request)
      : owner_(owner), slot_(slot), request_(request) {}

  void Start(AttentionService::Stub* stub, absl::Duration deadline) {
    SetTimeout(&context_, deadline);
    stub->async()->AttendStream(&context_, this);
    StartRead(&response_);
    StartCall();
  }

  // Queues one request; false once the stream is closing or has ended.
  bool Send(int64_t start_ns) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (closing_ || done_) return false;
      pending_.push_back(start_ns);
      if (writing_) {
        ++unwritten_;
        return true;
      }
      writing_ = true;
    }
    StartWrite(request_);
    return true;
  }

  // Half-closes the stream as soon as every pending request is answered.
  void Close() {
    bool half_close;
    {
      std::lock_guard<std::mutex> lock(mu_);
      closing_ = true;
      half_close = ShouldHalfCloseLocked();
    }
    if (half_close) StartWritesDone();
  }

  void OnWriteDone(bool ok) override {
    bool write_next = false, half_close = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!ok) {  // the stream is broken; OnDone follows
        writing_ = false;
        return;
      }
      if (unwritten_ > 0) {
        --unwritten_;
        write_next = true;
      } else {
        writing_ = false;
        half_close = ShouldHalfCloseLocked();
      }
    }
    if (write_next) StartWrite(request_);
    if (half_close) StartWritesDone();
  }

  void OnReadDone(bool ok) override;
  void OnDone(const grpc::Status& status) override;

 private:
  bool ShouldHalfCloseLocked() {
    if (!closing_ || writing_ || !pending_.empty() || writes_done_ || done_) return false;
    writes_done_ = true;
    return true;
  }

  Generator* const owner_;
  const int slot_;
  const AttendRequest* const request_;
  grpc::ClientContext context_;
  AttendResponse response_;
  std::mutex mu_;
  std::deque<int64_t> pending_;  // start times of requests not yet answered
  int64_t unwritten_ = 0;        // pending requests queued behind the write in progress
  bool writing_ = false, closing_ = false, writes_done_ = false, done_ = false;
};

struct UnaryCall {
  grpc::ClientContext context;
  AttendResponse response;
  HealthCheckResponse health;
  int64_t start_ns = 0;
};

// Both load modes. gRPC's reactions may run inline inside the call that started
// an operation, so Issue trampolines instead of recursing: a failing server
// cannot grow the stack.
class Generator : public LoadGenerator {
 public:
  Generator(const LoadTarget& target, Recorder* recorder)
      : LoadGenerator(target.max_requests), target_(target), recorder_(recorder) {
    for (const auto& channel : target.channels) {
      stubs_.push_back(AttentionService::NewStub(channel));
      health_stubs_.push_back(Health::NewStub(channel));
    }
  }
  ~Generator() override { Stop(); }

  void StartClosedLoop(int concurrency) {
    closed_loop_ = true;
    OpenStreams(concurrency);
    std::vector<int> slots;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (int slot = 0; slot < concurrency && Acquire(); ++slot) {
        ++in_flight_;
        slots.push_back(slot);
      }
    }
    for (int slot : slots) Issue(slot);
  }

  void StartOpenLoop(double rate, bool poisson, uint64_t seed) {
    OpenStreams(target_.rate_streams);
    scheduler_ = std::thread([this, rate, poisson, seed] { Schedule(rate, poisson, seed); });
  }

  void Stop() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    if (scheduler_.joinable()) scheduler_.join();
    for (StreamCall* stream : streams_) stream->Close();
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return in_flight_ == 0 && open_streams_ == 0; });
  }

  // A request finished (any status).
  void OnSample(int slot, const Sample& sample) {
    recorder_->Add(sample);
    bool again = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      --in_flight_;
      if (closed_loop_ && !stopping_ && Acquire()) {
        ++in_flight_;
        again = true;
      }
      if (!again) cv_.notify_all();  // under the lock: Stop's waiter may destroy us next
    }
    if (again) Issue(slot);
  }

  // A stream ended; `unanswered` requests on it will never get a response.
  void OnStreamDone(const grpc::Status& status, const std::deque<int64_t>& unanswered) {
    const grpc::StatusCode code = status.ok() ? grpc::StatusCode::UNKNOWN : status.error_code();
    for (int64_t start : unanswered) recorder_->Add(MakeSample(start, code, nullptr));
    std::lock_guard<std::mutex> lock(mu_);
    in_flight_ -= static_cast<int64_t>(unanswered.size());
    --open_streams_;
    cv_.notify_all();
  }

 private:
  void OpenStreams(int count) {
    if (target_.rpc != Rpc::kAttend || target_.mode != Mode::kStream) return;
    for (int slot = 0; slot < count; ++slot) {
      auto stream = std::make_unique<StreamCall>(this, slot, target_.request);
      streams_.push_back(stream.get());
      {
        std::lock_guard<std::mutex> lock(mu_);
        ++open_streams_;
      }
      stream->Start(stubs_[static_cast<size_t>(slot) % stubs_.size()].get(),
                    target_.stream_deadline);
      owned_streams_.push_back(std::move(stream));
    }
  }

  void Schedule(double rate, bool poisson, uint64_t seed) {
    std::mt19937_64 engine(seed);
    std::exponential_distribution<double> gap(rate);
    auto next = std::chrono::steady_clock::now();
    for (int slot = 0;; ++slot) {
      next += std::chrono::duration_cast<std::chrono::steady_clock::duration>(
          std::chrono::duration<double>(poisson ? gap(engine) : 1.0 / rate));
      {
        std::unique_lock<std::mutex> lock(mu_);
        if (cv_.wait_until(lock, next, [this] { return stopping_; })) return;
        if (!Acquire()) return;  // max_requests sent
        ++in_flight_;
      }
      Issue(slot);
    }
  }

  void Issue(int slot) {
    thread_local std::vector<std::pair<Generator*, int>>* trampoline = nullptr;
    if (trampoline != nullptr) {
      trampoline->emplace_back(this, slot);
      return;
    }
    std::vector<std::pair<Generator*, int>> queue = {{this, slot}};
    trampoline = &queue;
    while (!queue.empty()) {
      auto [generator, next] = queue.back();
      queue.pop_back();
      generator->IssueNow(next);
    }
    trampoline = nullptr;
  }

  void IssueNow(int slot) {
    if (!streams_.empty()) {
      StreamCall* stream = streams_[static_cast<size_t>(slot) % streams_.size()];
      const int64_t start = SteadyNowNs();
      // An ended stream takes no more requests: recorded as a failed request.
      if (!stream->Send(start))
        OnSample(slot, MakeSample(start, grpc::StatusCode::UNAVAILABLE, nullptr));
      return;
    }
    auto* call = new UnaryCall();
    SetTimeout(&call->context, target_.timeout);
    const size_t channel = static_cast<size_t>(slot) % stubs_.size();
    call->start_ns = SteadyNowNs();
    if (target_.rpc == Rpc::kHealth) {
      health_stubs_[channel]->async()->Check(
          &call->context, &health_request_, &call->health, [this, call, slot](grpc::Status status) {
            const Sample sample = MakeSample(call->start_ns, status.error_code(), nullptr);
            delete call;
            OnSample(slot, sample);
          });
    } else {
      stubs_[channel]->async()->Attend(&call->context, target_.request, &call->response,
                                       [this, call, slot](grpc::Status status) {
                                         const Sample sample = MakeSample(
                                             call->start_ns, status.error_code(), &call->response);
                                         delete call;
                                         OnSample(slot, sample);
                                       });
    }
  }

  const LoadTarget target_;
  Recorder* const recorder_;
  std::vector<std::unique_ptr<AttentionService::Stub>> stubs_;
  std::vector<std::unique_ptr<Health::Stub>> health_stubs_;
  const HealthCheckRequest health_request_;  // service "": the whole server
  bool closed_loop_ = false;
  std::vector<StreamCall*> streams_;  // fixed once started
  std::vector<std::unique_ptr<StreamCall>> owned_streams_;
  std::thread scheduler_;

  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  int64_t in_flight_ = 0;
  int open_streams_ = 0;
};

void StreamCall::OnReadDone(bool ok) {
  if (!ok) return;  // the stream ended; OnDone follows
  int64_t start = 0;
  bool have = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!pending_.empty()) {
      start = pending_.front();
      pending_.pop_front();
      have = true;
    }
  }
  const Sample sample = MakeSample(start, grpc::StatusCode::OK, &response_);
  StartRead(&response_);
  if (have) owner_->OnSample(slot_, sample);
  bool half_close;
  {
    std::lock_guard<std::mutex> lock(mu_);
    half_close = ShouldHalfCloseLocked();
  }
  if (half_close) StartWritesDone();
}

void StreamCall::OnDone(const grpc::Status& status) {
  std::deque<int64_t> unanswered;
  {
    std::lock_guard<std::mutex> lock(mu_);
    done_ = true;
    unanswered.swap(pending_);
  }
  owner_->OnStreamDone(status, unanswered);  // last: the owner may be destroyed after it
}

absl::Status CheckTarget(const LoadTarget& target) {
  if (target.channels.empty()) return absl::InvalidArgumentError("load: no channel");
  if (target.rpc == Rpc::kAttend && target.request == nullptr) {
    return absl::InvalidArgumentError("load: no request");
  }
  if (target.rpc == Rpc::kHealth && target.mode == Mode::kStream) {
    return absl::InvalidArgumentError("--rpc=health is unary only (Health/Check)");
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<LoadGenerator>> StartConcurrency(const LoadTarget& target,
                                                                int concurrency,
                                                                Recorder* recorder) {
  if (absl::Status status = CheckTarget(target); !status.ok()) return status;
  if (concurrency < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("concurrency: expected >= 1, got ", concurrency));
  }
  auto generator = std::make_unique<Generator>(target, recorder);
  generator->StartClosedLoop(concurrency);
  return generator;
}

absl::StatusOr<std::unique_ptr<LoadGenerator>> StartRate(const LoadTarget& target, double rate,
                                                         bool poisson, uint64_t seed,
                                                         Recorder* recorder) {
  if (absl::Status status = CheckTarget(target); !status.ok()) return status;
  if (!(rate > 0)) {
    return absl::InvalidArgumentError(absl::StrCat("request rate: expected > 0, got ", rate));
  }
  if (target.mode == Mode::kStream && target.rate_streams < 1) {
    return absl::InvalidArgumentError("--streams: expected >= 1");
  }
  auto generator = std::make_unique<Generator>(target, recorder);
  generator->StartOpenLoop(rate, poisson, seed);
  return generator;
}

}  // namespace mha::client

#include "client/calls.h"

#include <chrono>
#include <deque>
#include <mutex>
#include <utility>

#include "client/channel.h"

namespace mha::client {

using attention::v1::AttendRequest;
using attention::v1::AttendResponse;
using attention::v1::AttentionService;
using grpc::health::v1::Health;
using grpc::health::v1::HealthCheckResponse;

namespace {

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

struct UnaryCall {
  grpc::ClientContext context;
  AttendResponse response;
  HealthCheckResponse health;
  int64_t start_ns = 0;
};

}  // namespace

// One AttendStream call carrying requests in order; the server answers in order,
// so the oldest pending start time belongs to each response.
//
// Send and Close start operations from outside gRPC's reactions, so the stream is
// held (AddHold) while they may: without the hold the call could finish and free
// its state between Send's check and its StartWrite. The hold goes once the stream
// takes nothing more from outside: when it is closing or its read has failed, and
// no Send or Close is between its check and its operation.
class StreamCall : public grpc::ClientBidiReactor<AttendRequest, AttendResponse> {
 public:
  StreamCall(CallObserver* observer, int slot, const AttendRequest* request)
      : observer_(observer), slot_(slot), request_(request) {}

  void Start(AttentionService::Stub* stub, absl::Duration deadline) {
    SetTimeout(&context_, deadline);
    stub->async()->AttendStream(&context_, this);
    StartRead(&response_);
    AddHold();
    StartCall();
  }

  // Queues one request; false once the stream is closing or has ended.
  bool Send(int64_t start_ns) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (closing_ || !held_) return false;
      pending_.push_back(start_ns);
      if (writing_) {
        ++unwritten_;
        return true;
      }
      writing_ = true;
      ++starting_;
    }
    StartWrite(request_);
    Started();
    return true;
  }

  // Half-closes the stream as soon as every pending request is answered.
  void Close() {
    bool half_close;
    {
      std::lock_guard<std::mutex> lock(mu_);
      closing_ = true;
      half_close = held_ && ShouldHalfCloseLocked();
      ++starting_;
    }
    if (half_close) StartWritesDone();
    Started();
  }

  void OnWriteDone(bool ok) override;
  void OnReadDone(bool ok) override;
  void OnDone(const grpc::Status& status) override;

 private:
  bool ShouldHalfCloseLocked() {
    if (!closing_ || writing_ || !pending_.empty() || writes_done_ || done_) return false;
    writes_done_ = true;
    return true;
  }

  // True once when the hold can go: nothing more is started from outside.
  bool ShouldReleaseHoldLocked() {
    if (!held_ || starting_ > 0 || !(closing_ || read_failed_)) return false;
    held_ = false;
    return true;
  }

  // An operation started from outside a reaction has been started.
  void Started() {
    bool release;
    {
      std::lock_guard<std::mutex> lock(mu_);
      --starting_;
      release = ShouldReleaseHoldLocked();
    }
    if (release) RemoveHold();
  }

  CallObserver* const observer_;
  const int slot_;
  const AttendRequest* const request_;
  grpc::ClientContext context_;
  AttendResponse response_;
  std::mutex mu_;
  std::deque<int64_t> pending_;  // start times of requests not yet answered
  int64_t unwritten_ = 0;        // pending requests queued behind the write in progress
  int starting_ = 0;             // Send or Close calls about to start an operation
  bool writing_ = false, closing_ = false, writes_done_ = false, done_ = false;
  bool held_ = true, read_failed_ = false;
};

void StreamCall::OnWriteDone(bool ok) {
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

void StreamCall::OnReadDone(bool ok) {
  if (!ok) {  // the stream ended; OnDone follows once the hold is gone
    bool release;
    {
      std::lock_guard<std::mutex> lock(mu_);
      read_failed_ = true;
      release = ShouldReleaseHoldLocked();
    }
    if (release) RemoveHold();
    return;
  }
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
  if (have) observer_->OnSample(slot_, sample);
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
  const grpc::StatusCode code = status.ok() ? grpc::StatusCode::UNKNOWN : status.error_code();
  std::vector<Sample> failed;
  failed.reserve(unanswered.size());
  for (int64_t start : unanswered) failed.push_back(MakeSample(start, code, nullptr));
  observer_->OnStreamDone(failed);  // last: the observer may destroy this stream after it
}

std::string RpcName(Rpc rpc) { return rpc == Rpc::kHealth ? "health" : "attend"; }
std::string ModeName(Mode mode) { return mode == Mode::kStream ? "stream" : "unary"; }

int64_t SteadyNowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

bool SendsOnStreams(const CallTarget& target) {
  return target.rpc == Rpc::kAttend && target.mode == Mode::kStream;
}

CallSender::CallSender(const CallTarget& target, int streams, CallObserver* observer)
    : target_(target), observer_(observer) {
  for (const auto& channel : target.channels) {
    attend_stubs_.push_back(AttentionService::NewStub(channel));
    health_stubs_.push_back(Health::NewStub(channel));
  }
  if (!SendsOnStreams(target)) return;
  for (int slot = 0; slot < streams; ++slot) {
    streams_.push_back(std::make_unique<StreamCall>(observer, slot, target.request));
  }
  for (int slot = 0; slot < streams; ++slot) {
    streams_[static_cast<size_t>(slot)]->Start(
        attend_stubs_[static_cast<size_t>(slot) % attend_stubs_.size()].get(),
        target.stream_deadline);
  }
}

CallSender::~CallSender() = default;

void CallSender::Send(int slot) {
  if (streams_.empty()) {
    SendUnary(slot);
    return;
  }
  StreamCall* stream = streams_[static_cast<size_t>(slot) % streams_.size()].get();
  const int64_t start = SteadyNowNs();
  if (!stream->Send(start)) {
    observer_->OnSample(slot, MakeSample(start, grpc::StatusCode::UNAVAILABLE, nullptr));
  }
}

void CallSender::SendUnary(int slot) {
  auto* call = new UnaryCall();
  SetTimeout(&call->context, target_.timeout);
  const size_t channel = static_cast<size_t>(slot) % attend_stubs_.size();
  // The call is freed before the observer runs: the observer may send the next one.
  auto finish = [observer = observer_, call, slot](const grpc::Status& status,
                                                   const AttendResponse* response) {
    const Sample sample = MakeSample(call->start_ns, status.error_code(), response);
    delete call;
    observer->OnSample(slot, sample);
  };
  call->start_ns = SteadyNowNs();
  if (target_.rpc == Rpc::kHealth) {
    health_stubs_[channel]->async()->Check(
        &call->context, &health_request_, &call->health,
        [finish](grpc::Status status) { finish(status, nullptr); });
  } else {
    attend_stubs_[channel]->async()->Attend(
        &call->context, target_.request, &call->response,
        [finish, call](grpc::Status status) { finish(status, &call->response); });
  }
}

void CallSender::CloseStreams() {
  for (const auto& stream : streams_) stream->Close();
}

}  // namespace mha::client

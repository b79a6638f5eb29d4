#include "client/load/calls.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <utility>

#include "client/sdk/channel.h"
#include "proto/attention.grpc.pb.h"
#include "proto/grpc/health/v1/health.grpc.pb.h"
#include "proto/inference/grpc_service.grpc.pb.h"

namespace mha::client {

using attention::v1::AttendRequest;
using attention::v1::AttendResponse;
using attention::v1::AttentionService;
using grpc::health::v1::Health;
using grpc::health::v1::HealthCheckResponse;
using inference::GRPCInferenceService;
using inference::ModelInferRequest;
using inference::ModelInferResponse;
using inference::ModelStreamInferResponse;

namespace {

Sample MakeSample(int64_t start_ns, grpc::StatusCode code,
                  const attention::v1::Timing* timing = nullptr) {
  Sample sample;
  sample.end_ns = SteadyNowNs();
  sample.latency_ns = sample.end_ns - start_ns;
  sample.code = code;
  if (code == grpc::StatusCode::OK && timing != nullptr) {
    sample.queue_us = timing->queue_us();
    sample.compute_us = timing->compute_us();
    sample.batch_rows = timing->batch_rows();
  }
  return sample;
}

// A request that never left the client (Sample::sent).
Sample Unsent(int64_t start_ns, grpc::StatusCode code) {
  Sample sample = MakeSample(start_ns, code);
  sample.sent = false;
  return sample;
}

Sample ResponseSample(int64_t start_ns, const AttendResponse& response) {
  return MakeSample(start_ns, grpc::StatusCode::OK, &response.timing());
}

Sample ResponseSample(int64_t start_ns, const ModelInferResponse& response) {
  const std::optional<attention::v1::Timing> timing = TimingOf(response);
  return MakeSample(start_ns, grpc::StatusCode::OK, timing ? &*timing : nullptr);
}

Sample ResponseSample(int64_t start_ns, const ModelStreamInferResponse& response) {
  if (!response.error_message().empty()) return MakeSample(start_ns, grpc::StatusCode::UNKNOWN);
  return ResponseSample(start_ns, response.infer_response());
}

void OpenStream(AttentionService::Stub* stub, grpc::ClientContext* context,
                grpc::ClientBidiReactor<AttendRequest, AttendResponse>* reactor) {
  stub->async()->AttendStream(context, reactor);
}

void OpenStream(GRPCInferenceService::Stub* stub, grpc::ClientContext* context,
                grpc::ClientBidiReactor<ModelInferRequest, ModelStreamInferResponse>* reactor) {
  stub->async()->ModelStreamInfer(context, reactor);
}

}  // namespace

class CallSender::Impl {
 public:
  virtual ~Impl() = default;
  virtual void Send(int slot) = 0;
  virtual void CloseStreams() {}
};

namespace {

// One stream (AttendStream or ModelStreamInfer) carrying requests in order; the
// server answers in order, so the oldest pending start time belongs to each
// response.
//
// Send and Close start operations from outside gRPC's reactions, so the stream is
// held (AddHold) while they may: without the hold the call could finish and free
// its state between Send's check and its StartWrite. The hold goes once the stream
// takes nothing more from outside: when it is closing or its read has failed, and
// no Send or Close is between its check and its operation.
template <typename Request, typename Response>
class StreamCall : public grpc::ClientBidiReactor<Request, Response> {
 public:
  StreamCall(CallObserver* observer, int slot, const Request* request)
      : observer_(observer), slot_(slot), request_(request) {}

  template <typename Stub>
  void Start(Stub* stub, absl::Duration deadline) {
    SetTimeout(&context_, deadline);
    OpenStream(stub, &context_, this);
    this->StartRead(&response_);
    this->AddHold();
    this->StartCall();
  }

  // Queues one request: OK, or why it was not sent: CANCELLED once the client closed
  // the stream (the step ended), UNAVAILABLE once the stream has ended.
  grpc::StatusCode Send(int64_t start_ns) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (closing_) return grpc::StatusCode::CANCELLED;
      if (!held_) return grpc::StatusCode::UNAVAILABLE;
      pending_.push_back(start_ns);
      if (writing_) {
        ++unwritten_;
        return grpc::StatusCode::OK;
      }
      writing_ = true;
      ++starting_;
    }
    this->StartWrite(request_);
    Started();
    return grpc::StatusCode::OK;
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
    if (half_close) this->StartWritesDone();
    Started();
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
    if (write_next) this->StartWrite(request_);
    if (half_close) this->StartWritesDone();
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // the stream ended; OnDone follows once the hold is gone
      bool release;
      {
        std::lock_guard<std::mutex> lock(mu_);
        read_failed_ = true;
        release = ShouldReleaseHoldLocked();
      }
      if (release) this->RemoveHold();
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
    const Sample sample = ResponseSample(start, response_);
    this->StartRead(&response_);
    if (have) observer_->OnSample(slot_, sample);
    bool half_close;
    {
      std::lock_guard<std::mutex> lock(mu_);
      half_close = ShouldHalfCloseLocked();
    }
    if (half_close) this->StartWritesDone();
  }

  void OnDone(const grpc::Status& status) override {
    std::deque<int64_t> unanswered;
    {
      std::lock_guard<std::mutex> lock(mu_);
      done_ = true;
      unanswered.swap(pending_);
    }
    const grpc::StatusCode code = status.ok() ? grpc::StatusCode::UNKNOWN : status.error_code();
    std::vector<Sample> failed;
    failed.reserve(unanswered.size());
    for (int64_t start : unanswered) failed.push_back(MakeSample(start, code));
    observer_->OnStreamDone(failed);  // last: the observer may destroy this stream after it
  }

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
    if (release) this->RemoveHold();
  }

  CallObserver* const observer_;
  const int slot_;
  const Request* const request_;
  grpc::ClientContext context_;
  Response response_;
  std::mutex mu_;
  std::deque<int64_t> pending_;  // start times of requests not yet answered
  int64_t unwritten_ = 0;        // pending requests queued behind the write in progress
  int starting_ = 0;             // Send or Close calls about to start an operation
  bool writing_ = false, closing_ = false, writes_done_ = false, done_ = false;
  bool held_ = true, read_failed_ = false;
};

// `lanes` streams of one kind, opened round-robin over the channels.
template <typename Service, typename Request, typename Response>
class Streams final : public CallSender::Impl {
 public:
  Streams(const CallTarget& target, const Request* request, int lanes, CallObserver* observer)
      : observer_(observer) {
    for (const auto& channel : target.channels) stubs_.push_back(Service::NewStub(channel));
    for (int slot = 0; slot < lanes; ++slot) {
      streams_.push_back(std::make_unique<StreamCall<Request, Response>>(observer, slot, request));
    }
    for (size_t slot = 0; slot < streams_.size(); ++slot) {
      streams_[slot]->Start(stubs_[slot % stubs_.size()].get(), target.stream_deadline);
    }
  }

  void Send(int slot) override {
    const int64_t start = SteadyNowNs();
    const grpc::StatusCode code =
        streams_.empty() ? grpc::StatusCode::UNAVAILABLE
                         : streams_[static_cast<size_t>(slot) % streams_.size()]->Send(start);
    if (code != grpc::StatusCode::OK) observer_->OnSample(slot, Unsent(start, code));
  }

  void CloseStreams() override {
    for (const auto& stream : streams_) stream->Close();
  }

 private:
  CallObserver* const observer_;
  std::vector<std::unique_ptr<typename Service::Stub>> stubs_;
  std::vector<std::unique_ptr<StreamCall<Request, Response>>> streams_;  // fixed once made
};

// Unary gRPC calls, each with a context and response of its own, spread over the
// channels.
class UnaryCalls final : public CallSender::Impl {
 public:
  UnaryCalls(const CallTarget& target, CallObserver* observer)
      : target_(target), observer_(observer) {
    for (const auto& channel : target.channels) {
      attend_stubs_.push_back(AttentionService::NewStub(channel));
      infer_stubs_.push_back(GRPCInferenceService::NewStub(channel));
      health_stubs_.push_back(Health::NewStub(channel));
    }
  }

  void Send(int slot) override {
    auto* call = new Call();
    SetTimeout(&call->context, target_.timeout);
    const size_t channel = static_cast<size_t>(slot) % attend_stubs_.size();
    // The call is freed before the observer runs: the observer may send the next one.
    auto finish = [observer = observer_, call, slot](const grpc::Status& status,
                                                     const auto* response) {
      const Sample sample = status.ok() && response != nullptr
                                ? ResponseSample(call->start_ns, *response)
                                : MakeSample(call->start_ns, status.error_code());
      delete call;
      observer->OnSample(slot, sample);
    };
    const AttendResponse* no_response = nullptr;
    call->start_ns = SteadyNowNs();
    const bool kserve = target_.protocol == Protocol::kKServe;
    if (target_.rpc == Rpc::kHealth && kserve) {
      infer_stubs_[channel]->async()->ServerReady(
          &call->context, &ready_request_, &call->ready,
          [finish, no_response](grpc::Status status) { finish(status, no_response); });
    } else if (target_.rpc == Rpc::kHealth) {
      health_stubs_[channel]->async()->Check(
          &call->context, &health_request_, &call->health,
          [finish, no_response](grpc::Status status) { finish(status, no_response); });
    } else if (kserve) {
      const ModelInferRequest* infer =
          target_.slot_infer_requests != nullptr && !target_.slot_infer_requests->empty()
              ? &(*target_.slot_infer_requests)[static_cast<size_t>(slot) %
                                                target_.slot_infer_requests->size()]
              : target_.infer_request;
      infer_stubs_[channel]->async()->ModelInfer(
          &call->context, infer, &call->infer,
          [finish, call](grpc::Status status) { finish(status, &call->infer); });
    } else {
      attend_stubs_[channel]->async()->Attend(
          &call->context, target_.request, &call->attend,
          [finish, call](grpc::Status status) { finish(status, &call->attend); });
    }
  }

 private:
  struct Call {
    grpc::ClientContext context;
    AttendResponse attend;
    ModelInferResponse infer;
    HealthCheckResponse health;
    inference::ServerReadyResponse ready;
    int64_t start_ns = 0;
  };

  const CallTarget target_;
  CallObserver* const observer_;
  std::vector<std::unique_ptr<AttentionService::Stub>> attend_stubs_;
  std::vector<std::unique_ptr<GRPCInferenceService::Stub>> infer_stubs_;
  std::vector<std::unique_ptr<Health::Stub>> health_stubs_;
  const grpc::health::v1::HealthCheckRequest health_request_;  // service "": the server
  const inference::ServerReadyRequest ready_request_;
};

// HTTP: one keep-alive connection per lane, driven by a thread of its own that
// sends the lane's queued requests one after another.
class HttpLanes final : public CallSender::Impl {
 public:
  HttpLanes(const CallTarget& target, int lanes, CallObserver* observer)
      : target_(target), observer_(observer) {
    for (int i = 0; i < std::max(lanes, 1); ++i) {
      lanes_.push_back(std::make_unique<Lane>(target.http, target.timeout));
    }
    for (auto& lane : lanes_) lane->thread = std::thread(&HttpLanes::Run, this, lane.get());
  }

  ~HttpLanes() override {
    for (auto& lane : lanes_) {
      {
        std::lock_guard<std::mutex> lock(lane->mu);
        lane->stopping = true;
      }
      lane->cv.notify_all();
    }
    for (auto& lane : lanes_) lane->thread.join();
  }

  void Send(int slot) override {
    Lane& lane = *lanes_[static_cast<size_t>(slot) % lanes_.size()];
    {
      std::lock_guard<std::mutex> lock(lane.mu);
      lane.queue.emplace_back(slot, SteadyNowNs());
    }
    lane.cv.notify_one();
  }

 private:
  struct Lane {
    Lane(const HttpEndpoint& endpoint, absl::Duration timeout) : connection(endpoint, timeout) {}
    HttpConnection connection;  // used by `thread` alone
    std::mutex mu;
    std::condition_variable cv;
    std::deque<std::pair<int, int64_t>> queue;  // (slot, start) of requests not yet sent
    bool stopping = false;
    std::thread thread;
  };

  void Run(Lane* lane) {
    while (true) {
      std::pair<int, int64_t> next;
      {
        std::unique_lock<std::mutex> lock(lane->mu);
        lane->cv.wait(lock, [&] { return lane->stopping || !lane->queue.empty(); });
        if (lane->stopping) break;
        next = lane->queue.front();
        lane->queue.pop_front();
      }
      observer_->OnSample(next.first, Call(lane->connection, next.second));
    }
    std::deque<std::pair<int, int64_t>> cancelled;
    {
      std::lock_guard<std::mutex> lock(lane->mu);
      cancelled.swap(lane->queue);
    }
    for (const auto& [slot, start] : cancelled) {
      observer_->OnSample(slot, Unsent(start, grpc::StatusCode::CANCELLED));
    }
  }

  Sample Call(HttpConnection& connection, int64_t start_ns) {
    if (target_.rpc == Rpc::kHealth) {
      const absl::Status status = connection.Ready();
      return MakeSample(start_ns, static_cast<grpc::StatusCode>(status.code()));
    }
    const absl::StatusOr<ModelInferResponse> response = connection.Infer(*target_.http_request);
    if (!response.ok()) {
      return MakeSample(start_ns, static_cast<grpc::StatusCode>(response.status().code()));
    }
    return ResponseSample(start_ns, *response);
  }

  const CallTarget target_;
  CallObserver* const observer_;
  std::vector<std::unique_ptr<Lane>> lanes_;
};

}  // namespace

std::string RpcName(Rpc rpc) { return rpc == Rpc::kHealth ? "health" : "attend"; }
std::string ModeName(Mode mode) { return mode == Mode::kStream ? "stream" : "unary"; }

int64_t SteadyNowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

bool SendsOnStreams(const CallTarget& target) {
  return target.rpc == Rpc::kAttend && target.mode == Mode::kStream &&
         target.protocol != Protocol::kHttp;
}

CallSender::CallSender(const CallTarget& target, int lanes, CallObserver* observer) {
  if (target.protocol == Protocol::kHttp) {
    impl_ = std::make_unique<HttpLanes>(target, lanes, observer);
  } else if (!SendsOnStreams(target) || lanes < 1) {
    impl_ = std::make_unique<UnaryCalls>(target, observer);
  } else if (target.protocol == Protocol::kKServe) {
    impl_ = std::make_unique<
        Streams<GRPCInferenceService, ModelInferRequest, ModelStreamInferResponse>>(
        target, target.infer_request, lanes, observer);
  } else {
    impl_ = std::make_unique<Streams<AttentionService, AttendRequest, AttendResponse>>(
        target, target.request, lanes, observer);
  }
}

CallSender::~CallSender() = default;

void CallSender::Send(int slot) { impl_->Send(slot); }

void CallSender::CloseStreams() { impl_->CloseStreams(); }

}  // namespace mha::client

// The calls a load sends, as gRPC callback reactors: unary Attend, unary
// grpc.health.v1.Health/Check, or AttendStream streams that carry many requests
// each. Every finished request becomes a Sample handed to a CallObserver (the load
// manager, load.h), which decides what is sent next.
//
//   CallTarget target{.channels = {channel}, .request = &request};
//   CallSender sender(target, /*streams=*/0, &observer);  // unary Attend
//   sender.Send(3);  // on channel 3 % channels; later observer.OnSample(3, sample)
//
// gRPC may run a reaction inline, inside the call that started the operation: an
// observer can be called back from within Send on the sending thread.
#ifndef MHA_CLIENT_CALLS_H_
#define MHA_CLIENT_CALLS_H_

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "absl/types/span.h"
#include "proto/attention.grpc.pb.h"
#include "proto/grpc/health/v1/health.grpc.pb.h"

namespace mha::client {

enum class Rpc { kAttend, kHealth };
enum class Mode { kUnary, kStream };

std::string RpcName(Rpc rpc);     // "attend" | "health"
std::string ModeName(Mode mode);  // "unary" | "stream"

// One finished request as the client saw it.
struct Sample {
  int64_t end_ns = 0;      // steady clock
  int64_t latency_ns = 0;  // from the send (stream: queued for writing) to the response
  grpc::StatusCode code = grpc::StatusCode::OK;
  // AttendResponse.timing of a successful Attend; 0 otherwise.
  int64_t queue_us = 0, compute_us = 0, batch_rows = 0;
};

// The steady clock in nanoseconds, the time base of Sample.
int64_t SteadyNowNs();

// What every call of a load sends, and where. Every call carries a deadline: a
// unary call `timeout`, a stream `stream_deadline` (each request on a stream is
// bounded by the stream).
struct CallTarget {
  // Calls are spread over these channels (one HTTP/2 connection each, or a
  // round_robin channel over several servers).
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  const attention::v1::AttendRequest* request = nullptr;  // outlives the calls
  Rpc rpc = Rpc::kAttend;
  Mode mode = Mode::kUnary;                            // kStream only for kAttend
  absl::Duration timeout = absl::Seconds(10);          // unary deadline
  absl::Duration stream_deadline = absl::Seconds(60);  // a stream's whole life
};

// True when `target`'s requests travel on AttendStream streams.
bool SendsOnStreams(const CallTarget& target);

// Where calls report. Called from gRPC's threads (or inline from Send): an
// implementation is thread-safe.
class CallObserver {
 public:
  virtual ~CallObserver() = default;
  // A request sent on `slot` finished, with any status.
  virtual void OnSample(int slot, const Sample& sample) = 0;
  // A stream ended; `unanswered` holds a failed sample for each of its requests
  // that will never get a response. A stream's last call: the observer may destroy
  // the sender as soon as this returns.
  virtual void OnStreamDone(absl::Span<const Sample> unanswered) = 0;
};

class StreamCall;

// Sends the requests of one load: each on a unary call of its own, or, when
// SendsOnStreams(target), on one of `streams` streams opened by the constructor.
// Request `slot` goes to channel slot % channels (unary) or stream slot % streams.
// Thread-safe; `observer` outlives the sender, and a sender with streams is
// destroyed only after CloseStreams and every OnStreamDone.
class CallSender {
 public:
  // Each stream opened here ends with exactly one observer->OnStreamDone.
  CallSender(const CallTarget& target, int streams, CallObserver* observer);
  ~CallSender();
  CallSender(const CallSender&) = delete;
  CallSender& operator=(const CallSender&) = delete;

  // Sends one request; its sample reaches the observer later or inline. A request
  // for a stream that has ended is recorded as UNAVAILABLE at once.
  void Send(int slot);

  // Half-closes every stream as soon as its requests are answered. Idempotent.
  void CloseStreams();

 private:
  void SendUnary(int slot);

  const CallTarget target_;
  CallObserver* const observer_;
  std::vector<std::unique_ptr<attention::v1::AttentionService::Stub>> attend_stubs_;
  std::vector<std::unique_ptr<grpc::health::v1::Health::Stub>> health_stubs_;
  const grpc::health::v1::HealthCheckRequest health_request_;  // service "": the server
  std::vector<std::unique_ptr<StreamCall>> streams_;           // fixed once constructed
};

}  // namespace mha::client

#endif  // MHA_CLIENT_CALLS_H_

// The calls a load sends: unary Attend, unary grpc.health.v1.Health/Check, or
// AttendStream streams that carry many requests each (gRPC callback reactors); the
// same over the Open Inference Protocol (ModelInfer, ServerReady,
// ModelStreamInfer); or KServe v2 REST requests over HTTP, each concurrent slot on
// a keep-alive connection and a thread of its own. Every finished request becomes
// a Sample handed to a CallObserver (the load manager, load_manager.h), which decides what
// is sent next; the managers never see the protocol.
//
//   CallTarget target{.channels = {channel}, .request = &request};
//   CallSender sender(target, /*lanes=*/0, &observer);  // unary Attend
//   sender.Send(3);  // on channel 3 % channels; later observer.OnSample(3, sample)
//
// gRPC may run a reaction inline, inside the call that started the operation: an
// observer can be called back from within Send on the sending thread. HTTP calls
// report from their connection's thread.
#ifndef MHA_CLIENT_LOAD_CALLS_H_
#define MHA_CLIENT_LOAD_CALLS_H_

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "absl/types/span.h"
#include "client/sdk/channel.h"
#include "client/sdk/http.h"
#include "client/sdk/kserve.h"
#include "proto/attention.pb.h"
#include "proto/inference/grpc_service.pb.h"

namespace mha::client {

enum class Rpc { kAttend, kHealth };
enum class Mode { kUnary, kStream };

std::string RpcName(Rpc rpc);     // "attend" | "health"
std::string ModeName(Mode mode);  // "unary" | "stream"

// One finished request as the client saw it.
struct Sample {
  int64_t end_ns = 0;  // steady clock
  // From the send (stream: queued for writing; HTTP: queued for its connection) to
  // the response.
  int64_t latency_ns = 0;
  // A kserve stream's request answered with an error_message counts as UNKNOWN
  // (the message carries no code); HTTP statuses map as CodeFromHttpStatus.
  grpc::StatusCode code = grpc::StatusCode::OK;
  // The server's timing of a successful Attend (AttendResponse.timing, or TimingOf
  // an Open Inference Protocol response); 0 otherwise.
  int64_t queue_us = 0, compute_us = 0, batch_rows = 0;
  // false: the request never left the client (its stream had closed, or it waited
  // for an HTTP connection that closed), though its slot counted it as sent.
  bool sent = true;
};

// The steady clock in nanoseconds, the time base of Sample.
int64_t SteadyNowNs();

// What every call of a load sends, and where. Every call carries a deadline: a
// unary call `timeout`, a stream `stream_deadline` (each request on a stream is
// bounded by the stream); an HTTP call `timeout` per connect, read or write.
//
// kAttend sends, per protocol, `request` (attention), `infer_request` (kserve) or
// `http_request` (http); kHealth sends Health/Check of "", ServerReady or
// GET /v2/health/ready. Whatever is sent outlives the calls.
struct CallTarget {
  // gRPC protocols: calls are spread over these channels (one HTTP/2 connection
  // each, or a round_robin channel over several servers).
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  const attention::v1::AttendRequest* request = nullptr;
  Rpc rpc = Rpc::kAttend;
  Mode mode = Mode::kUnary;                            // kStream only for kAttend over gRPC
  absl::Duration timeout = absl::Seconds(10);          // unary deadline
  absl::Duration stream_deadline = absl::Seconds(60);  // a stream's whole life
  Protocol protocol = Protocol::kAttention;
  const inference::ModelInferRequest* infer_request = nullptr;
  // kserve unary: when set, slot s sends (*slot_infer_requests)[s % size] instead of
  // infer_request (each names its own shared-memory region, client/sdk/shared_memory.h).
  const std::vector<inference::ModelInferRequest>* slot_infer_requests = nullptr;
  const HttpRequest* http_request = nullptr;
  HttpEndpoint http;  // the HTTP server
};

// True when `target`'s requests travel on streams (AttendStream or ModelStreamInfer).
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

// Sends the requests of one load: over gRPC each on a unary call of its own, or,
// when SendsOnStreams(target), on one of `lanes` streams opened by the
// constructor; over HTTP on one of `lanes` connections (at least one), each with a
// thread that sends its requests in turn. Request `slot` goes to channel
// slot % channels (gRPC unary), or stream or connection slot % lanes. Thread-safe;
// `observer` outlives the sender, and a sender with streams is destroyed only after
// CloseStreams and every OnStreamDone. An HTTP sender's destructor waits for the
// request in progress on each connection and reports those still queued as
// CANCELLED.
class CallSender {
 public:
  // Each stream opened here ends with exactly one observer->OnStreamDone.
  CallSender(const CallTarget& target, int lanes, CallObserver* observer);
  ~CallSender();
  CallSender(const CallSender&) = delete;
  CallSender& operator=(const CallSender&) = delete;

  // Sends one request; its sample reaches the observer later or inline. A request
  // for a stream that has ended is recorded as UNAVAILABLE at once.
  void Send(int slot);

  // Half-closes every stream as soon as its requests are answered. Idempotent.
  void CloseStreams();

  // One way of sending (calls.cc): gRPC unary calls, streams, or HTTP connections.
  class Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace mha::client

#endif  // MHA_CLIENT_LOAD_CALLS_H_

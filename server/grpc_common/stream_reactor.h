// One bidirectional stream of requests answered in request order, for any gRPC
// front: attention.v1's AttendStream and the Open Inference Protocol's
// ModelStreamInfer are this reactor with their Front. Each request goes through
// the one submit path (server/serving/submit.h), which admits and counts it.
//
// Up to kMaxStreamInFlight requests of one stream are in the queue at once (reads
// pause beyond that: flow control).
//
// A Front is a struct of types and static functions:
//   using Request = ...;   // what the client sends
//   using Response = ...;  // what the stream writes, one per request
//   struct Decoded;        // what a request keeps while it computes
//   static constexpr Protocol kProtocol;
//   // true: the first failed request ends the stream with its status (after the
//   // responses before it) and no more requests are read; false: it is answered
//   // with Failed's response and the stream goes on.
//   static constexpr bool kEndStreamOnError;
//   static const std::string& ModelName(const Request&);
//   static const std::string& ModelVersion(const Request&);
//   static const std::string& RequestId(const Request&);  // for error messages
//   static void Begin(const Request&, Response*);  // before anything: echo the id
//   // Decodes and validates for `model` (found and admitted) and sizes `response`.
//   static absl::StatusOr<Prepared> Decode(const Request&, const Model&, Decoded*,
//                                          Response*);
//   static void Computed(const ComputeTiming&, Response*);  // after an OK forward
//   static void Failed(const absl::Status&, Response*);  // kEndStreamOnError false
//
// Thread safety: gRPC and the compute workers call in from their threads; the
// reactor serialises them with its own lock.
#ifndef MHA_SERVER_GRPC_COMMON_STREAM_REACTOR_H_
#define MHA_SERVER_GRPC_COMMON_STREAM_REACTOR_H_

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <deque>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "server/grpc_common/deadline.h"
#include "server/grpc_common/grpc_status.h"
#include "server/serving/abbreviate.h"
#include "server/serving/submit.h"

namespace mha::server {

inline constexpr int kMaxStreamInFlight = 32;

// Owned by itself: deleted when gRPC is done with it (OnDone) and no worker still
// holds a reference (every queued item holds one).
template <typename Front>
class OrderedStreamReactor final
    : public grpc::ServerBidiReactor<typename Front::Request, typename Front::Response> {
 public:
  using Request = typename Front::Request;
  using Response = typename Front::Response;

  OrderedStreamReactor(grpc::CallbackServerContext* context, const RequestPath* path)
      : context_(context), path_(path) {
    absl::MutexLock lock(&mu_);
    reading_ = true;
    this->StartRead(&incoming_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // half-close by the client, or the call is over
      absl::MutexLock lock(&mu_);
      reading_ = false;
      read_done_ = true;
      Advance();
      return;
    }
    Slot* slot;
    {
      // Consecutive reads complete on different gRPC threads; the lock (held when
      // the next StartRead was issued) is what orders them for readers of the code
      // and for ThreadSanitizer, which cannot see gRPC core's hand-off. The first
      // read also reads members the constructor set on another thread, so nothing
      // here is touched before the lock.
      absl::MutexLock lock(&mu_);
      if (stop_ || finished_) {  // a late message on a stream that is ending
        reading_ = false;
        Advance();
        return;
      }
      auto owned = std::make_unique<Slot>();
      slot = owned.get();
      slot->request.Swap(&incoming_);
      slot->index = next_index_++;
      // From here the stream cannot finish before this slot is done.
      slots_.push_back(std::move(owned));
    }
    Ref();  // released by the answer, which comes exactly once
    Front::Begin(slot->request, &slot->response);
    path_->Submit(
        Call{.protocol = Front::kProtocol,
             .model = Front::ModelName(slot->request),
             .version = Front::ModelVersion(slot->request),
             .deadline = DeadlineOf(context_),
             .cancelled = [context = context_] { return context->IsCancelled(); },
             .peer = [context = context_] { return context->peer(); }},
        [slot](const Model& model) {
          return Front::Decode(slot->request, model, &slot->decoded, &slot->response);
        },
        [this, slot](absl::Status status, const ComputeTiming& timing) {
          if (status.ok()) Front::Computed(timing, &slot->response);
          OnComputed(slot, std::move(status));
        });
    absl::MutexLock lock(&mu_);
    reading_ = false;
    Advance();
  }

  void OnWriteDone(bool ok) override {
    absl::MutexLock lock(&mu_);
    writing_ = false;
    slots_.pop_front();
    if (!ok && !stop_) {
      stop_ = true;
      final_status_ = absl::CancelledError("stream closed by the client");
    }
    Advance();
  }

  void OnDone() override { Unref(); }

 private:
  struct Slot {
    Request request;
    Response response;
    typename Front::Decoded decoded;
    int64_t index = 0;
    bool done = false;
    absl::Status status;  // not OK: the stream ends with it
  };

  void OnComputed(Slot* slot, absl::Status status) {
    {
      absl::MutexLock lock(&mu_);
      Complete(slot, std::move(status));
      Advance();
    }
    Unref();
  }

  void Complete(Slot* slot, absl::Status status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    slot->done = true;
    if (status.ok()) return;
    if (!Front::kEndStreamOnError) {
      Front::Failed(status, &slot->response);
      return;
    }
    no_more_reads_ = true;
    slot->status =
        absl::Status(status.code(), absl::StrCat("request ", slot->index, " (request_id \"",
                                                 Abbreviate(Front::RequestId(slot->request)),
                                                 "\"): ", status.message()));
  }

  // Starts whatever can happen next: a write of the oldest finished response, a
  // read, or Finish once nothing is left in flight.
  void Advance() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finished_) return;
    if (!stop_ && !writing_ && !slots_.empty() && slots_.front()->done) {
      Slot& front = *slots_.front();
      if (front.status.ok()) {
        writing_ = true;
        this->StartWrite(&front.response);
      } else {
        stop_ = true;
        final_status_ = front.status;
      }
    }
    if (stop_) {
      // Finish only when no worker is computing into a slot any more.
      if (writing_) return;
      for (const auto& slot : slots_) {
        if (!slot->done) return;
      }
      slots_.clear();
      finished_ = true;
      this->Finish(ToGrpcStatus(final_status_));
      return;
    }
    if (read_done_) {
      if (slots_.empty() && !writing_) {
        finished_ = true;
        this->Finish(grpc::Status::OK);
      }
      return;
    }
    if (!reading_ && !no_more_reads_ && static_cast<int>(slots_.size()) < kMaxStreamInFlight) {
      reading_ = true;
      this->StartRead(&incoming_);
    }
  }

  void Ref() { refs_.fetch_add(1, std::memory_order_relaxed); }
  void Unref() {
    if (refs_.fetch_sub(1, std::memory_order_acq_rel) == 1) delete this;
  }

  grpc::CallbackServerContext* const context_;
  const RequestPath* const path_;
  std::atomic<int> refs_{1};  // gRPC's, released in OnDone, plus one per unanswered request

  absl::Mutex mu_;
  Request incoming_ ABSL_GUARDED_BY(mu_);  // the read buffer (gRPC fills it)
  int64_t next_index_ ABSL_GUARDED_BY(mu_) = 0;
  std::deque<std::unique_ptr<Slot>> slots_ ABSL_GUARDED_BY(mu_);  // in request order
  bool reading_ ABSL_GUARDED_BY(mu_) = false;
  bool read_done_ ABSL_GUARDED_BY(mu_) = false;
  bool no_more_reads_ ABSL_GUARDED_BY(mu_) = false;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;  // ending with final_status_
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status final_status_ ABSL_GUARDED_BY(mu_);
};

}  // namespace mha::server

#endif  // MHA_SERVER_GRPC_COMMON_STREAM_REACTOR_H_

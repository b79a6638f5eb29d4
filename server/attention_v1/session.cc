#include "server/attention_v1/session.h"

#include <atomic>
#include <memory>
#include <utility>

#include "server/attention_v1/session_codec.h"
#include "server/grpc_common/deadline.h"
#include "server/grpc_common/grpc_status.h"

namespace mha::server {

using attention::v1::SessionRequest;
using attention::v1::SessionResponse;

// One AttendSession stream: reads a message, decodes it into a step for the
// store's session, writes the step's response, and finishes when the session
// ends. Owned by gRPC: deleted in OnDone. While a step computes only its own
// thread and then the worker touch the request, the response and the step.
class SessionManager::Reactor final
    : public grpc::ServerBidiReactor<SessionRequest, SessionResponse>,
      public SessionStream {
 public:
  Reactor(SessionManager* manager, grpc::CallbackServerContext* context)
      : manager_(manager), context_(context) {
    // Open may start the first read, whose OnReadDone runs on a gRPC thread; the
    // hand-off goes through gRPC core, which ThreadSanitizer cannot see, so the
    // pointer is published with release/acquire ordering that it can.
    session_.store(manager->store_.Open(this), std::memory_order_release);
  }

  // SessionStream: called by the store under the session's lock.
  void Read() override {
    response_.Clear();
    StartRead(&request_);
  }
  void Write(const ComputeTiming& timing, int64_t context) override {
    response_.set_context_tokens(context);
    attention::v1::Timing* t = response_.mutable_timing();
    t->set_queue_us(absl::ToInt64Microseconds(timing.queue));
    t->set_compute_us(absl::ToInt64Microseconds(timing.compute));
    t->set_batch_rows(timing.batch_rows);
    StartWrite(&response_);
  }
  void End(const absl::Status& status) override { Finish(ToGrpcStatus(status)); }

  void OnReadDone(bool ok) override {
    SessionStore::Session* const live = session();
    if (!ok) {  // the client half-closed, or the call is gone
      live->ClientDone();
      return;
    }
    if (!live->Received()) return;
    const bool first = live->model() == nullptr;
    std::shared_ptr<const Model> model;
    if (first) {
      absl::StatusOr<std::shared_ptr<const Model>> found =
          manager_->models_->Find(request_.model(), request_.model_version());
      if (!found.ok()) return live->Fail(found.status());
      model = *std::move(found);
      settings_ = SettingsOf(request_);
    }
    const Model& decoding = first ? *model : *live->model();
    absl::StatusOr<SessionStepInput> input =
        DecodeSessionStep(request_, first, settings_, decoding, live->cached());
    if (!input.ok()) return live->Fail(input.status());
    float* output = PrepareSessionResponse(*input, decoding, &response_);
    float* lse = settings_.return_lse ? PrepareSessionLse(*input, decoding, &response_) : nullptr;
    live->Step(std::move(model), ToPagedStep(*input, settings_, /*cache=*/nullptr, output, lse),
               DeadlineOf(context_), [context = context_] { return context->IsCancelled(); });
  }

  void OnWriteDone(bool ok) override { session()->Written(ok); }

  void OnDone() override {
    manager_->store_.Close(session());
    delete this;
  }

 private:
  SessionManager* const manager_;
  grpc::CallbackServerContext* const context_;
  SessionRequest request_;
  SessionResponse response_;
  SessionSettings settings_;
  SessionStore::Session* session() const { return session_.load(std::memory_order_acquire); }

  std::atomic<SessionStore::Session*> session_{nullptr};
};

grpc::ServerBidiReactor<SessionRequest, SessionResponse>* SessionManager::Open(
    grpc::CallbackServerContext* context) {
  return new Reactor(this, context);
}

}  // namespace mha::server

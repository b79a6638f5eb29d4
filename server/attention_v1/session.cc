#include "server/attention_v1/session.h"

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
class SessionManager::Reactor final : public grpc::ServerBidiReactor<SessionRequest, SessionResponse>,
                                      public SessionStream {
 public:
  Reactor(SessionManager* manager, grpc::CallbackServerContext* context)
      : manager_(manager), context_(context), session_(manager->store_.Open(this)) {}

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
    if (!ok) {  // the client half-closed, or the call is gone
      session_->ClientDone();
      return;
    }
    if (!session_->Received()) return;
    const bool first = session_->model() == nullptr;
    std::shared_ptr<const Model> model;
    if (first) {
      absl::StatusOr<std::shared_ptr<const Model>> found =
          manager_->models_->Find(request_.model(), request_.model_version());
      if (!found.ok()) return session_->Fail(found.status());
      model = *std::move(found);
      settings_ = SettingsOf(request_);
    }
    const Model& decoding = first ? *model : *session_->model();
    absl::StatusOr<SessionStepInput> input =
        DecodeSessionStep(request_, first, settings_, decoding, session_->cached());
    if (!input.ok()) return session_->Fail(input.status());
    float* output = PrepareSessionResponse(*input, decoding, &response_);
    session_->Step(std::move(model), ToPagedStep(*input, settings_, /*cache=*/nullptr, output),
                   DeadlineOf(context_), [context = context_] { return context->IsCancelled(); });
  }

  void OnWriteDone(bool ok) override { session_->Written(ok); }

  void OnDone() override {
    manager_->store_.Close(session_);
    delete this;
  }

 private:
  SessionManager* const manager_;
  grpc::CallbackServerContext* const context_;
  SessionRequest request_;
  SessionResponse response_;
  SessionSettings settings_;
  SessionStore::Session* const session_;  // last member: Open may call Read or End
};

grpc::ServerBidiReactor<SessionRequest, SessionResponse>* SessionManager::Open(
    grpc::CallbackServerContext* context) {
  return new Reactor(this, context);
}

}  // namespace mha::server

#include "server/attention_v1/session.h"

#include <atomic>
#include <memory>
#include <string>
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
      : manager_(manager), context_(context), opened_(absl::Now()) {
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
    if (++steps_ == 1) {
      // The store lets the model go when the session ends: keep its name now.
      if (const Model* model = session()->model(); model != nullptr) {
        model_name_ = model->name;
        model_version_ = model->version;
      }
    }
    // The step's Q: its output (1, Q, p_o), sized when its message was decoded.
    if (response_.output().shape_size() == 3) queries_ += response_.output().shape(1);
    queue_ += timing.queue;
    compute_ += timing.compute;
    context_tokens_ = context;
    response_.set_context_tokens(context);
    attention::v1::Timing* t = response_.mutable_timing();
    t->set_queue_us(absl::ToInt64Microseconds(timing.queue));
    t->set_compute_us(absl::ToInt64Microseconds(timing.compute));
    t->set_batch_rows(timing.batch_rows);
    StartWrite(&response_);
  }
  void End(const absl::Status& status) override {
    if (manager_->access_log_) {
      const std::string peer = context_->peer();
      manager_->access_log_(AccessRecord{.protocol = Protocol::kAttentionV1,
                                         .session = true,
                                         .model = model_name_,
                                         .version = model_version_,
                                         .batch = steps_ > 0 ? 1 : 0,
                                         .queries = queries_,
                                         .keys = context_tokens_,
                                         .steps = steps_,
                                         .code = status.code(),
                                         .queue = queue_,
                                         .compute = compute_,
                                         .total = absl::Now() - opened_,
                                         .peer = peer});
    }
    Finish(ToGrpcStatus(status));
  }

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
    message_bytes_.store(static_cast<size_t>(input->request_bytes) + response_.ByteSizeLong(),
                         std::memory_order_release);
    live->Step(std::move(model), ToPagedStep(*input, settings_, /*cache=*/nullptr, output, lse),
               DeadlineOf(context_), [context = context_] { return context->IsCancelled(); });
  }

  void OnWriteDone(bool ok) override {
    // A step's messages over kKeptMessageBytes (a prefill: 4,032 tokens of an
    // attention-only Llama layer are 99 MB in and 66 MB out) are let go of once it is
    // answered, here, while the session waits for its next message. Kept, the
    // response's capacity would stay with the session, and the request's would be
    // freed by the next message's parse, on the path of the first decode step
    // (docs/performance.md, "Prefill messages let go of after their answer").
    if (message_bytes_.load(std::memory_order_acquire) > kKeptMessageBytes) {
      request_ = SessionRequest();
      response_ = SessionResponse();
    }
    session()->Written(ok);
  }

  void OnDone() override {
    manager_->store_.Close(session());
    delete this;
  }

 private:
  SessionManager* const manager_;
  grpc::CallbackServerContext* const context_;
  // Smaller messages keep their capacity for the next step's (no new pages).
  static constexpr size_t kKeptMessageBytes = size_t{16} << 20;

  SessionRequest request_;
  SessionResponse response_;
  // The current step's request and response, serialized. Stored by OnReadDone once
  // both are filled in and loaded by OnWriteDone, on gRPC threads that gRPC core
  // orders out of ThreadSanitizer's sight: the release and acquire make that order,
  // and the messages' writes before it, visible to it.
  std::atomic<size_t> message_bytes_{0};
  SessionSettings settings_;
  // The access log's figures, written in Write and read in End: both called by the
  // store under the session's lock.
  const absl::Time opened_;
  std::string model_name_;  // "" when it ended before its first step was answered
  int64_t model_version_ = 0;
  int64_t steps_ = 0, queries_ = 0, context_tokens_ = 0;
  absl::Duration queue_, compute_;
  SessionStore::Session* session() const { return session_.load(std::memory_order_acquire); }

  std::atomic<SessionStore::Session*> session_{nullptr};
};

grpc::ServerBidiReactor<SessionRequest, SessionResponse>* SessionManager::Open(
    grpc::CallbackServerContext* context) {
  return new Reactor(this, context);
}

}  // namespace mha::server

#include "server/service.h"

#include <atomic>
#include <chrono>
#include <deque>
#include <functional>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "base/status_macros.h"
#include "core/config.h"
#include "server/abbreviate.h"
#include "server/codec.h"
#include "server/grpc_status.h"

namespace mha::server {
namespace {

using attention::v1::AttendRequest;
using attention::v1::AttendResponse;

// One request's accounting, from receipt to answer (see service.h).
class Meter {
 public:
  explicit Meter(Metrics* metrics) : metrics_(metrics), received_(absl::Now()) {}

  // Validated and about to be submitted: in flight from now.
  void Accepted(const ValidatedRequest& request) {
    model_ = &metrics_->ForModel(request.model->name);
    tokens_ = request.inputs.batch * request.inputs.num_queries;
    model_->inflight().Increment();
  }

  // `requested_model` labels a request that was never accepted.
  void Answered(const absl::Status& status, const ModelRepository& models,
                const std::string& requested_model) {
    ModelMetrics* model = model_;
    if (model != nullptr) {
      model->inflight().Decrement();
    } else {
      absl::StatusOr<const Model*> found = models.Find(requested_model);
      model = &metrics_->ForModel(found.ok() ? (*found)->name : kUnknownModelLabel);
    }
    model->Answered(status.code(), absl::Now() - received_);
    if (status.ok()) model->tokens().Increment(static_cast<double>(tokens_));
  }

 private:
  Metrics* const metrics_;
  const absl::Time received_;
  ModelMetrics* model_ = nullptr;
  int64_t tokens_ = 0;
};

// Finds the model, then asks its queue before decoding: a request the queue would
// refuse now is refused before its tensors are read (under overload most are). So a
// malformed request that meets a full queue gets RESOURCE_EXHAUSTED (retry later,
// then INVALID_ARGUMENT); an unknown model gets NOT_FOUND. Submit checks again.
absl::StatusOr<ValidatedRequest> AdmitAndValidate(const AttendRequest& request,
                                                  const ModelRepository& models,
                                                  const Batcher& batcher) {
  MHA_ASSIGN_OR_RETURN(const Model* model, models.Find(request.model()));
  MHA_RETURN_IF_ERROR(batcher.Admit(model));
  return ValidateRequest(request, *model);
}

absl::Time DeadlineOf(const grpc::CallbackServerContext* context) {
  const auto deadline = context->deadline();
  if (deadline == std::chrono::system_clock::time_point::max()) return absl::InfiniteFuture();
  return absl::FromChrono(deadline);
}

// The work item of a validated request answered into `response` (sized here).
WorkItem MakeWorkItem(const ValidatedRequest& request, AttendResponse* response,
                      grpc::CallbackServerContext* context,
                      std::function<void(absl::Status)> answer) {
  const OutputViews views = PrepareResponse(request, response);
  return WorkItem{
      .model = request.model,
      .inputs = request.inputs,
      .output = views.output,
      .attention = views.attention,
      .deadline = DeadlineOf(context),
      .cancelled = [context] { return context->IsCancelled(); },
      .done =
          [response, answer = std::move(answer)](absl::Status status, const ComputeTiming& timing) {
            if (status.ok()) EncodeTiming(timing, response);
            answer(std::move(status));
          },
  };
}

// One AttendStream call. Owned by itself: deleted when gRPC is done with it
// (OnDone) and no worker still holds a reference (every queued item holds one).
class AttendStreamReactor final : public grpc::ServerBidiReactor<AttendRequest, AttendResponse> {
 public:
  AttendStreamReactor(grpc::CallbackServerContext* context, const ModelRepository* models,
                      Batcher* batcher, Metrics* metrics)
      : context_(context), models_(models), batcher_(batcher), metrics_(metrics) {
    absl::MutexLock lock(&mu_);
    reading_ = true;
    StartRead(&incoming_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // half-close by the client, or the call is over
      absl::MutexLock lock(&mu_);
      reading_ = false;
      read_done_ = true;
      Advance();
      return;
    }
    std::unique_ptr<Slot> owned;
    Slot* slot;
    {
      // Consecutive reads complete on different gRPC threads; the lock (held when
      // the next StartRead was issued) is what orders them for readers of the code
      // and for ThreadSanitizer, which cannot see gRPC core's hand-off. The first
      // read also reads members the constructor set on another thread, so nothing
      // here is touched before the lock.
      absl::MutexLock lock(&mu_);
      owned = std::make_unique<Slot>(metrics_);
      slot = owned.get();
      slot->request.Swap(&incoming_);
      slot->index = next_index_++;
    }
    slot->response.set_request_id(slot->request.request_id());
    absl::StatusOr<ValidatedRequest> validated =
        AdmitAndValidate(slot->request, *models_, *batcher_);
    {
      absl::MutexLock lock(&mu_);
      if (stop_ || finished_) {  // a late message on a stream that is ending
        reading_ = false;
        Advance();
        return;
      }
      // From here the stream cannot finish before this slot is done.
      slots_.push_back(std::move(owned));
    }
    absl::Status submitted = validated.status();
    if (validated.ok()) {
      Ref();
      slot->meter.Accepted(*validated);
      submitted = batcher_->Submit(
          MakeWorkItem(*validated, &slot->response, context_,
                       [this, slot](absl::Status status) { OnComputed(slot, std::move(status)); }));
      if (!submitted.ok()) Unref();
    }
    absl::MutexLock lock(&mu_);
    reading_ = false;
    if (!submitted.ok()) {
      Complete(slot, std::move(submitted));
      no_more_reads_ = true;
    }
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
    explicit Slot(Metrics* metrics) : meter(metrics) {}
    Meter meter;
    AttendRequest request;
    AttendResponse response;
    int64_t index = 0;
    bool done = false;
    absl::Status status;
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
    slot->meter.Answered(status, *models_, slot->request.model());
    if (!status.ok()) {
      slot->status =
          absl::Status(status.code(), absl::StrCat("request ", slot->index, " (request_id \"",
                                                   Abbreviate(slot->request.request_id()),
                                                   "\"): ", status.message()));
    }
  }

  // Starts whatever can happen next: a write of the oldest finished response, a
  // read, or Finish once nothing is left in flight.
  void Advance() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finished_) return;
    if (!stop_ && !writing_ && !slots_.empty() && slots_.front()->done) {
      Slot& front = *slots_.front();
      if (front.status.ok()) {
        writing_ = true;
        StartWrite(&front.response);
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
      Finish(ToGrpcStatus(final_status_));
      return;
    }
    if (read_done_) {
      if (slots_.empty() && !writing_) {
        finished_ = true;
        Finish(grpc::Status::OK);
      }
      return;
    }
    if (!reading_ && !no_more_reads_ && static_cast<int>(slots_.size()) < kMaxStreamInFlight) {
      reading_ = true;
      StartRead(&incoming_);
    }
  }

  void Ref() { refs_.fetch_add(1, std::memory_order_relaxed); }
  void Unref() {
    if (refs_.fetch_sub(1, std::memory_order_acq_rel) == 1) delete this;
  }

  grpc::CallbackServerContext* const context_;
  const ModelRepository* const models_;
  Batcher* const batcher_;
  Metrics* const metrics_;
  std::atomic<int> refs_{1};  // gRPC's, released in OnDone, plus one per queued item

  absl::Mutex mu_;
  AttendRequest incoming_ ABSL_GUARDED_BY(mu_);  // the read buffer (gRPC fills it)
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

}  // namespace

attention::v1::ModelInfo ToModelInfo(const Model& model) {
  const core::ModelConfig& c = model.config;
  attention::v1::ModelInfo info;
  info.set_name(model.name);
  info.set_num_hiddens(c.num_hiddens);
  info.set_num_heads(c.num_heads);
  info.set_head_size(c.head_size());
  info.set_query_size(c.query_size);
  info.set_key_size(c.key_size);
  info.set_value_size(c.value_size);
  info.set_bias(c.bias);
  info.set_precision(std::string(core::PrecisionName(c.precision)));
  info.set_supports_self_attention(c.SupportsSelfAttention());
  info.set_scoring(std::string(core::ScoringName(c.scoring)));
  info.set_additive_hidden(c.additive_hidden);
  attention::v1::ModelLimits* limits = info.mutable_limits();
  limits->set_max_batch_size(model.limits.max_batch_size);
  limits->set_max_sequence_length(model.limits.max_sequence_length);
  limits->set_max_request_bytes(model.limits.max_request_bytes);
  limits->set_max_attention_elements(model.limits.max_attention_elements);
  return info;
}

grpc::ServerUnaryReactor* AttentionServiceImpl::Attend(grpc::CallbackServerContext* context,
                                                       const AttendRequest* request,
                                                       AttendResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  response->set_request_id(request->request_id());
  auto meter = std::make_shared<Meter>(metrics_);
  absl::StatusOr<ValidatedRequest> validated = AdmitAndValidate(*request, *models_, *batcher_);
  if (!validated.ok()) {
    meter->Answered(validated.status(), *models_, request->model());
    reactor->Finish(ToGrpcStatus(validated.status()));
    return reactor;
  }
  meter->Accepted(*validated);
  absl::Status submitted = batcher_->Submit(
      MakeWorkItem(*validated, response, context, [this, reactor, request, meter](absl::Status s) {
        meter->Answered(s, *models_, request->model());
        reactor->Finish(ToGrpcStatus(s));
      }));
  if (!submitted.ok()) {
    meter->Answered(submitted, *models_, request->model());
    reactor->Finish(ToGrpcStatus(submitted));
  }
  return reactor;
}

grpc::ServerBidiReactor<AttendRequest, AttendResponse>* AttentionServiceImpl::AttendStream(
    grpc::CallbackServerContext* context) {
  return new AttendStreamReactor(context, models_, batcher_, metrics_);
}

grpc::ServerUnaryReactor* AttentionServiceImpl::GetModel(
    grpc::CallbackServerContext* context, const attention::v1::GetModelRequest* request,
    attention::v1::ModelInfo* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  absl::StatusOr<const Model*> model = models_->Find(request->model());
  if (model.ok()) *response = ToModelInfo(**model);
  reactor->Finish(ToGrpcStatus(model.status()));
  return reactor;
}

grpc::ServerUnaryReactor* AttentionServiceImpl::ListModels(
    grpc::CallbackServerContext* context, const attention::v1::ListModelsRequest* /*request*/,
    attention::v1::ListModelsResponse* response) {
  for (const Model* model : models_->models()) *response->add_models() = ToModelInfo(*model);
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

}  // namespace mha::server

#include "server/serving/submit.h"

#include <algorithm>
#include <memory>
#include <optional>
#include <utility>

#include "absl/synchronization/mutex.h"

namespace mha::server {
namespace {

// One request's accounting, from receipt to answer: mha_requests_total,
// mha_request_duration_seconds, mha_inflight_requests (accepted requests) and
// mha_tokens_total (OK answers). One per request.
class Meter {
 public:
  Meter(Metrics* metrics, const Call& call, const AccessLog* access_log)
      : metrics_(metrics), protocol_(call.protocol), received_(call.received) {
    if (access_log != nullptr && *access_log) {
      access_log_ = access_log;
      requested_ = std::string(call.model);
      if (call.peer) peer_ = call.peer();
    }
  }

  // Validated and about to be submitted: in flight from now.
  void Accepted(const ValidatedRequest& request) {
    model_ = &metrics_->ForModel(request.model->name);
    if (access_log_ != nullptr) {
      requested_ = request.model->name;  // the served name, copied: the model may go first
      version_ = request.model->version;
    }
    queries_ = request.inputs.num_queries;
    keys_ = request.inputs.self_attention() ? request.inputs.num_queries : request.inputs.num_keys;
    rows_ = request.inputs.batch;
    tokens_ = request.inputs.batch * request.inputs.num_queries;
    model_->inflight().Increment();
  }

  // Counts the answer once. A request never accepted is counted under the model
  // `requested` resolves to, or "_unknown" when it names none that is served.
  void Answered(const absl::Status& status, const ModelSource& models, absl::string_view requested,
                const ComputeTiming& timing = {}) {
    ModelMetrics* model = model_;
    if (model != nullptr) {
      model->inflight().Decrement();
    } else {
      absl::StatusOr<std::shared_ptr<const Model>> found = models.Find(requested, "");
      model = &metrics_->ForModel(found.ok() ? (*found)->name : kUnknownModelLabel);
    }
    const absl::Duration took = absl::Now() - received_;
    model->Answered(protocol_, status.code(), took, rows_);
    if (status.ok()) model->tokens().Increment(static_cast<double>(tokens_));
    if (access_log_ != nullptr) {
      (*access_log_)(AccessRecord{.protocol = protocol_,
                                  .model = requested_,
                                  .version = version_,
                                  .batch = rows_,
                                  .queries = queries_,
                                  .keys = keys_,
                                  .code = status.code(),
                                  .queue = timing.queue,
                                  .compute = timing.compute,
                                  .total = took,
                                  .peer = peer_});
    }
  }

 private:
  Metrics* metrics_;
  Protocol protocol_;
  absl::Time received_;
  ModelMetrics* model_ = nullptr;
  const AccessLog* access_log_ = nullptr;  // set when access is logged
  std::string requested_, peer_;           // the served model's name once accepted
  int64_t version_ = 0, queries_ = 0, keys_ = 0;
  int64_t rows_ = 0;
  int64_t tokens_ = 0;
};

}  // namespace

void RequestPath::Submit(const Call& call,
                         absl::FunctionRef<absl::StatusOr<Prepared>(const Model& model)> decode,
                         Answer answer) const {
  Meter meter(metrics_, call, &access_log_);
  auto refuse = [&](const absl::Status& status) {
    meter.Answered(status, *models_, call.model);
    answer(status, ComputeTiming{});
  };
  absl::StatusOr<std::shared_ptr<const Model>> model = models_->Find(call.model, call.version);
  if (!model.ok()) return refuse(model.status());
  if (absl::Status admitted = batcher_->Admit(model->get()); !admitted.ok()) {
    return refuse(admitted);
  }
  absl::StatusOr<Prepared> prepared = [&] {
    ScopedSharedMemory regions(shared_memory_);
    return decode(**model);
  }();
  if (!prepared.ok()) return refuse(prepared.status());
  meter.Accepted(prepared->request);
  absl::Status submitted = batcher_->Submit(WorkItem{
      .model = *std::move(model),
      .inputs = prepared->request.inputs,
      .output = prepared->outputs.output,
      .attention = prepared->outputs.attention,
      .lse = prepared->outputs.lse,
      .deadline = std::min(call.deadline, prepared->deadline),
      .cancelled = call.cancelled,
      .may_run_inline = call.run_inline,
      .done =
          [meter, models = models_, answer, finish = std::move(prepared->finish),
           cancelled = call.cancel_after_compute ? call.cancelled : nullptr](
              absl::Status status, const ComputeTiming& timing) mutable {
            if (status.ok() && finish) status = finish();
            if (status.ok() && cancelled && cancelled()) {
              status = absl::CancelledError(
                  "the client closed its connection before the answer; computed, not sent");
            }
            meter.Answered(status, *models, "", timing);
            answer(std::move(status), timing);
          },
  });
  if (!submitted.ok()) refuse(submitted);
}

void RequestPath::Refused(const Call& call, const absl::Status& status) const {
  Meter(metrics_, call, &access_log_).Answered(status, *models_, call.model);
}

Answer Completion::Callback() {
  return [this](absl::Status status, const ComputeTiming& /*timing*/) {
    absl::MutexLock lock(&mu_);
    status_ = std::move(status);
    done_ = true;
  };
}

absl::Status Completion::Wait() {
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(&done_));
  return status_;
}

absl::Status SubmitAndWait(Batcher& batcher, WorkItem item) {
  Completion completion;
  item.done = completion.Callback();
  if (absl::Status submitted = batcher.Submit(std::move(item)); !submitted.ok()) return submitted;
  return completion.Wait();
}

}  // namespace mha::server

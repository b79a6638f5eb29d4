#include "server/serving/meter.h"

#include <algorithm>
#include <utility>

namespace mha::server {

void Meter::Accepted(const ValidatedRequest& request) {
  model_ = &metrics_->ForModel(request.model->name);
  rows_ = request.inputs.batch;
  tokens_ = request.inputs.batch * request.inputs.num_queries;
  model_->inflight().Increment();
}

void Meter::Answered(const absl::Status& status, const ModelSource& models,
                     const std::string& requested_model) {
  ModelMetrics* model = model_;
  if (model != nullptr) {
    model->inflight().Decrement();
  } else {
    absl::StatusOr<std::shared_ptr<const Model>> found = models.Find(requested_model, "");
    model = &metrics_->ForModel(found.ok() ? (*found)->name : kUnknownModelLabel);
  }
  model->Answered(protocol_, status.code(), absl::Now() - received_, rows_);
  if (status.ok()) model->tokens().Increment(static_cast<double>(tokens_));
}

WorkItem MakeWorkItem(const Admitted& admitted, absl::Time deadline,
                      std::function<bool()> cancelled,
                      std::function<void(absl::Status, const ComputeTiming&)> done) {
  return WorkItem{
      .model = admitted.model,
      .inputs = admitted.request.inputs,
      .output = admitted.outputs.output,
      .attention = admitted.outputs.attention,
      .deadline = std::min(deadline, admitted.deadline),
      .cancelled = std::move(cancelled),
      .done = std::move(done),
  };
}

}  // namespace mha::server

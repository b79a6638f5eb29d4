// What every front (attention.v1, the Open Inference Protocol over gRPC and over
// HTTP) shares between decoding a request and answering it: its accounting
// (Meter), the request ready to submit (Admitted) and its work item.
//
// A front's handler: find the model, ask the batcher (Batcher::Admit), decode and
// validate (server/serving/request.h: Validate), size the response (OutputViews), then
// Submit(MakeWorkItem(...)); the work item's `done` encodes and answers.
#ifndef MHA_SERVER_SERVING_METER_H_
#define MHA_SERVER_SERVING_METER_H_

#include <cstdint>
#include <functional>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "server/serving/metrics.h"
#include "server/serving/model_source.h"
#include "server/serving/request.h"
#include "server/serving/work_item.h"

namespace mha::server {

// One request's accounting, from receipt to answer: mha_requests_total,
// mha_request_duration_seconds, mha_inflight_requests (accepted requests) and
// mha_tokens_total (OK answers). Not thread-safe: one per request.
class Meter {
 public:
  Meter(Metrics* metrics, Protocol protocol)
      : metrics_(metrics), protocol_(protocol), received_(absl::Now()) {}

  // Validated and about to be submitted: in flight from now.
  void Accepted(const ValidatedRequest& request);

  // Counts the answer once. `requested_model` labels a request that was never
  // accepted (the "_unknown" model when it names none that is served).
  void Answered(const absl::Status& status, const ModelSource& models,
                const std::string& requested_model);

 private:
  Metrics* const metrics_;
  const Protocol protocol_;
  const absl::Time received_;
  ModelMetrics* model_ = nullptr;
  int64_t rows_ = 0;
  int64_t tokens_ = 0;
};

// A request that passed admission and validation, with its response sized.
struct Admitted {
  std::shared_ptr<const Model> model;  // request.model, held until answered
  ValidatedRequest request;
  OutputViews outputs;
  // The front's own bound (a timeout parameter); the call's deadline also applies.
  absl::Time deadline = absl::InfiniteFuture();
};

// The work item of `admitted`: it expires at the earlier of `deadline` and the
// front's own, and `done` is called as the batcher's contract says.
WorkItem MakeWorkItem(const Admitted& admitted, absl::Time deadline,
                      std::function<bool()> cancelled,
                      std::function<void(absl::Status, const ComputeTiming&)> done);

}  // namespace mha::server

#endif  // MHA_SERVER_SERVING_METER_H_

// What every front (attention.v1 with its sessions, KServe over gRPC and HTTP) and
// the warm-up hand the scheduler: one request as core views, where its results go,
// and how to answer it. No protocol types: fronts decode into views
// (server/serving/request.h), the submit path makes the WorkItem
// (server/serving/submit.h), and fronts encode their answer from what it computed.
#ifndef MHA_SERVER_SERVING_WORK_ITEM_H_
#define MHA_SERVER_SERVING_WORK_ITEM_H_

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "core/attention.h"
#include "server/serving/model.h"

namespace mha::server {

// A computed request's timing.
struct ComputeTiming {
  absl::Duration queue;    // from Submit to the start of its forward call
  absl::Duration compute;  // its forward call, merged with others or alone
  int64_t batch_rows = 0;  // rows of that forward call
};

// One request. Everything the views point at (inputs, output, attention) is owned
// by the front and must stay alive until `done` is called.
struct WorkItem {
  // Held until the item is answered and destroyed: a model replaced or removed
  // meanwhile (server/models/model_repository.h) stays alive for it.
  std::shared_ptr<const Model> model;
  core::AttentionInputs inputs;  // (B, Q, d_q) queries etc., checked (server/serving/request.h)
  float* output = nullptr;       // (B, Q, p_o), written by the forward call
  float* attention = nullptr;    // (B, h, Q, K) weights, or nullptr when not asked for
  float* lse = nullptr;          // (B, h, Q) log-sum-exp, or nullptr; such an item runs alone
  absl::Time deadline = absl::InfiniteFuture();
  std::function<bool()> cancelled;  // optional; polled at batch formation
  bool may_run_inline = true;       // false: never on the submitting thread (batcher.h)
  // Called exactly once if Submit is OK, on a worker thread; `timing` is set when
  // the status is OK. Must not block for long.
  std::function<void(absl::Status, const ComputeTiming&)> done;
  absl::Time enqueued;  // set by Submit
  // A warm-up pass (server/app/server.h): admitted while the model is still warming up.
  bool warmup = false;
  // A session step (server/serving/session_store.h), owned by the session: computed with
  // core::MultiHeadAttention::ForwardPaged instead of Forward, merged only with
  // other steps, never padded. `inputs` then says only B = 1, Q = T and K = the
  // step's new keys, for the batcher's accounting; `output` is unused.
  const core::PagedStep* step = nullptr;

  int64_t rows() const { return inputs.batch; }
  // The sequence length the request pads a merged call to: max(Q, K).
  int64_t length() const { return std::max(inputs.num_queries, inputs.num_keys); }
};

}  // namespace mha::server

#endif  // MHA_SERVER_SERVING_WORK_ITEM_H_

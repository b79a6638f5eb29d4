// The one path from a front's request to its answer. Every front calls Submit
// (attention.v1 Attend and AttendStream, KServe ModelInfer and ModelStreamInfer
// over gRPC, KServe infer over HTTP); admission and accounting are written here
// once. Sessions do not come here (server/attention_v1/session.h says why).
//
//   path.Submit({.protocol = Protocol::kAttentionV1, .model = request.model(),
//                .version = request.model_version(), .deadline = DeadlineOf(context)},
//               [&](const Model& model) -> absl::StatusOr<Prepared> {
//                 ... decode and validate the request, size its response ...
//               },
//               [=](absl::Status status, const ComputeTiming& timing) { ... answer ... });
//
// Submit, in this order (the first failure is the answer):
//   1. finds the model (ModelSource::Find): NOT_FOUND naming the model or version
//   2. asks its queue (Batcher::Admit) before the request's tensors are read, so
//      that under overload most requests are refused unread: RESOURCE_EXHAUSTED
//      (retry later), UNAVAILABLE (warming up, shutting down). So a malformed
//      request that meets a full queue gets RESOURCE_EXHAUSTED, then
//      INVALID_ARGUMENT on retry
//   3. decodes and validates it (the front's `decode`, which ends with
//      server/serving/request.h's Validate) and sizes its response; while it runs,
//      CurrentSharedMemory() is the path's registry (server/serving/shared_memory.h),
//      so that a codec reads inputs from and sizes outputs into regions whatever the
//      front; the Prepared's `finish` (if any) runs after a successful compute
//   4. counts it in flight and queues it (Batcher::Submit, which checks the queue
//      again); it expires at the earlier of the call's deadline and the front's
//      own (Prepared::deadline), and is dropped if `cancelled` says so while queued
// `answer` is called exactly once: on the calling thread when the request is
// refused (or computed inline, server/serving/batcher.h), else on a compute
// worker; it must not block for long. The request is counted just before:
// mha_requests_total, mha_request_duration_seconds, mha_inflight_requests while
// accepted, and mha_tokens_total when OK (server/serving/metrics.h).
//
// Thread safety: thread-safe; the model source, batcher and metrics outlive it.
#ifndef MHA_SERVER_SERVING_SUBMIT_H_
#define MHA_SERVER_SERVING_SUBMIT_H_

#include <functional>
#include <string>
#include <utility>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/serving/access_log.h"
#include "server/serving/batcher.h"
#include "server/serving/metrics.h"
#include "server/serving/model_source.h"
#include "server/serving/request.h"
#include "server/serving/restricted_api.h"
#include "server/serving/shared_memory.h"
#include "server/serving/work_item.h"

namespace mha::server {

// What a front's decoder returns: the request validated, where its results go, and
// the front's own bound (a timeout parameter).
struct Prepared {
  ValidatedRequest request;
  OutputViews outputs;
  absl::Time deadline = absl::InfiniteFuture();
  // Optional: runs once the request computed OK, on the thread that answers, before
  // the answer; a failure becomes the answer (outputs into shared-memory regions,
  // server/serving/shared_memory.h, are written here).
  std::function<absl::Status()> finish;
};

// One call as its front received it.
struct Call {
  Protocol protocol = Protocol::kAttentionV1;
  absl::string_view model;                       // as the request names it
  absl::string_view version;                     // "" = the newest served
  absl::Time deadline = absl::InfiniteFuture();  // the transport's
  std::function<bool()> cancelled;               // optional; polled while queued
  absl::Time received = absl::Now();             // mha_request_duration_seconds from here
  std::function<std::string()> peer;             // optional; read when access is logged
  // false: never computed on the calling thread (Batcher's inline path); the HTTP
  // front's event-loop threads compute nothing.
  bool run_inline = true;
  // true: an answer computed after `cancelled` turned true is counted and answered
  // CANCELLED (the HTTP front: its client closed the connection, and gets nothing).
  bool cancel_after_compute = false;
};

// How a call ends: its status, and its timing when OK. Called exactly once.
using Answer = std::function<void(absl::Status, const ComputeTiming&)>;

class RequestPath {
 public:
  // `restricted` (optional, outliving the path) restricts API groups for every front.
  // `access_log` (optional) gets a record of every answer.
  // `shared_memory` (optional, outliving the path): the registered regions every
  // front's decode resolves (CurrentSharedMemory() while `decode` runs).
  RequestPath(const ModelSource* models, Batcher* batcher, Metrics* metrics,
              const RestrictedApis* restricted = nullptr, AccessLog access_log = nullptr,
              SharedMemoryRegistry* shared_memory = nullptr)
      : models_(models),
        batcher_(batcher),
        metrics_(metrics),
        restricted_(restricted),
        access_log_(std::move(access_log)),
        shared_memory_(shared_memory) {}

  // The system shared-memory registry; nullptr when the extension is off.
  SharedMemoryRegistry* shared_memory() const { return shared_memory_; }

  // Every front's first step for every call, of any group (server/serving/restricted_api.h):
  // OK, or PERMISSION_DENIED (counted) when the group is restricted and the call lacks its
  // key. `key_prefix` is a second spelling of the key the transport accepts (gRPC:
  // "triton-grpc-protocol-").
  absl::Status Allow(ApiGroup group, HeaderLookup header, absl::string_view key_prefix = "") const {
    return restricted_ == nullptr ? absl::OkStatus()
                                  : restricted_->Allow(group, header, key_prefix);
  }

  // Steps 1-4 above; `decode` runs on the calling thread, before Submit returns.
  void Submit(const Call& call,
              absl::FunctionRef<absl::StatusOr<Prepared>(const Model& model)> decode,
              Answer answer) const;

  // Counts a request its front refused before it could be submitted (an HTTP body
  // that does not parse), as Submit counts its own refusals.
  void Refused(const Call& call, const absl::Status& status) const;

 private:
  const ModelSource* const models_;
  Batcher* const batcher_;
  Metrics* const metrics_;
  const RestrictedApis* const restricted_;
  const AccessLog access_log_;
  SharedMemoryRegistry* const shared_memory_;
};

// An Answer to wait for, on a thread that may block: the HTTP front's (its
// handler answers on its own thread), warm-up's and tests'. Callback() is called
// once; Wait returns its status once it is called.
class Completion {
 public:
  Answer Callback();
  absl::Status Wait();

 private:
  absl::Mutex mu_;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
};

// Submits `item` and waits for its answer (Completion): for warm-up and tests,
// which have no front to answer to. A refusal is returned as is.
absl::Status SubmitAndWait(Batcher& batcher, WorkItem item);

}  // namespace mha::server

#endif  // MHA_SERVER_SERVING_SUBMIT_H_

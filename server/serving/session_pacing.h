// Session pacing for one model's queue: which sessions answer promptly, which the
// queued steps await after a session call, and until when (the batcher's
// "Gathering session steps", server/serving/batcher.h, says why).
//
// A session is known by its steps' core::PagedStep (WorkItem::step). A session
// whose step comes within `gather` of the answer to its previous step is prompt.
// When a session call ends, its prompt sessions are awaited until each queues its
// next step or ends; queued steps wait for them until GatherDeadline.
//
// Not thread-safe: the batcher holds one per model queue and calls it only under
// its lock.
#ifndef MHA_SERVER_SERVING_SESSION_PACING_H_
#define MHA_SERVER_SERVING_SESSION_PACING_H_

#include <algorithm>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/time/time.h"
#include "core/attention.h"
#include "server/serving/work_item.h"

namespace mha::server {

class SessionPacing {
 public:
  // A step of `session` queued at `now`: prompt when it came within `gather` of
  // the answer to the session's previous step; the session is no longer awaited.
  void Queued(const core::PagedStep* session, absl::Time now, absl::Duration gather) {
    if (const auto pace = sessions_.find(session); pace != sessions_.end()) {
      pace->second.prompt = now - pace->second.answered <= gather;
      pace->second.stepped = true;
    }
    std::erase(awaited_, session);
  }

  // `session`'s step is answered at `now`, by a session call that may still be
  // computing the others (core::MultiHeadAttention::ForwardPaged's step_done).
  void Answered(const core::PagedStep* session, absl::Time now) {
    Pace& pace = sessions_[session];
    pace.answered = now;
    pace.stepped = false;
  }

  // `session` sends no more steps.
  void Ended(const core::PagedStep* session) {
    sessions_.erase(session);
    std::erase(awaited_, session);
  }

  // A session call of `items` ended at `now`, its sessions answered (Answered)
  // during it or now. Computed, the prompt ones that have not queued their next step
  // since their answer are awaited; failed, none is (its sessions end).
  void CallEnded(const std::vector<WorkItem>& items, bool computed, absl::Time now) {
    awaited_.clear();
    awaited_since_ = now;
    if (!computed) return;
    for (const WorkItem& item : items) {
      const auto pace = sessions_.find(item.step);
      if (pace == sessions_.end()) continue;  // ended since its answer
      if (pace->second.prompt && !pace->second.stepped) awaited_.push_back(item.step);
    }
  }

  bool awaiting() const { return !awaited_.empty(); }
  size_t sessions() const { return sessions_.size(); }

  // Until when queued steps, the oldest queued at `oldest`, wait for the awaited
  // sessions: `gather` after the later of that and the last session call's end.
  absl::Time GatherDeadline(absl::Time oldest, absl::Duration gather) const {
    return std::max(oldest, awaited_since_) + gather;
  }

  // While exactly one session is awaited: until when an idle worker polls for its
  // step (`gather` after the last session call's end); else InfinitePast.
  absl::Time PollDeadline(absl::Duration gather) const {
    return awaited_.size() == 1 ? awaited_since_ + gather : absl::InfinitePast();
  }

 private:
  struct Pace {
    absl::Time answered;   // its last step's answer
    bool prompt = false;   // the step before that came within `gather` of its answer
    bool stepped = false;  // it has queued a step since that answer
  };
  // Sessions that have been answered; warm-up steps are not sessions.
  absl::flat_hash_map<const core::PagedStep*, Pace> sessions_;
  // The prompt sessions of the last session call, which have not queued their next
  // step since it ended (at awaited_since_).
  std::vector<const core::PagedStep*> awaited_;
  absl::Time awaited_since_;
};

}  // namespace mha::server

#endif  // MHA_SERVER_SERVING_SESSION_PACING_H_

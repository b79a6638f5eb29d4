// SessionPacing (server/serving/session_pacing.h) alone, on a clock of its
// arguments: a session that steps within session_gather of its answer is awaited
// after the next call; a late one, an ended one and those of a failed call are not;
// the gather and poll deadlines follow the call's end.
#include "server/serving/session_pacing.h"

#include <vector>

#include "gtest/gtest.h"

namespace mha::server {
namespace {

constexpr absl::Duration kGather = absl::Milliseconds(1);
const absl::Time kT0 = absl::FromUnixSeconds(1000);

std::vector<WorkItem> Steps(std::initializer_list<const core::PagedStep*> sessions) {
  std::vector<WorkItem> items;
  for (const core::PagedStep* s : sessions) items.push_back(WorkItem{.step = s});
  return items;
}

// A call of `items` that ends at `now` and answers them then, as the batcher does
// for steps not answered during the call.
void EndCall(SessionPacing& pacing, const std::vector<WorkItem>& items, bool computed,
             absl::Time now) {
  if (computed) {
    for (const WorkItem& item : items) pacing.Answered(item.step, now);
  }
  pacing.CallEnded(items, computed, now);
}

TEST(SessionPacingTest, APromptSessionIsAwaitedUntilItQueuesItsNextStep) {
  core::PagedStep a, b;
  SessionPacing pacing;
  pacing.Queued(&a, kT0, kGather);  // first steps: not prompt yet
  pacing.Queued(&b, kT0, kGather);
  EndCall(pacing, Steps({&a, &b}), /*computed=*/true, kT0 + absl::Microseconds(100));
  EXPECT_FALSE(pacing.awaiting());
  EXPECT_EQ(pacing.sessions(), 2u);
  // a answers within the gather, b after it.
  pacing.Queued(&a, kT0 + absl::Microseconds(300), kGather);
  pacing.Queued(&b, kT0 + absl::Milliseconds(5), kGather);
  const absl::Time end = kT0 + absl::Milliseconds(6);
  EndCall(pacing, Steps({&a, &b}), /*computed=*/true, end);
  EXPECT_TRUE(pacing.awaiting());  // a only
  EXPECT_EQ(pacing.PollDeadline(kGather), end + kGather);
  EXPECT_EQ(pacing.GatherDeadline(end - absl::Seconds(1), kGather), end + kGather);
  EXPECT_EQ(pacing.GatherDeadline(end + absl::Seconds(1), kGather),
            end + absl::Seconds(1) + kGather);
  pacing.Queued(&a, end + absl::Microseconds(50), kGather);
  EXPECT_FALSE(pacing.awaiting());
  EXPECT_EQ(pacing.PollDeadline(kGather), absl::InfinitePast());
}

TEST(SessionPacingTest, EndedSessionsAndFailedCallsAreNotAwaited) {
  core::PagedStep a, b;
  SessionPacing pacing;
  for (const core::PagedStep* s : {&a, &b}) pacing.Queued(s, kT0, kGather);
  EndCall(pacing, Steps({&a, &b}), true, kT0);
  for (const core::PagedStep* s : {&a, &b}) pacing.Queued(s, kT0 + absl::Microseconds(10), kGather);
  EndCall(pacing, Steps({&a, &b}), true, kT0 + absl::Microseconds(20));
  EXPECT_TRUE(pacing.awaiting());
  EXPECT_EQ(pacing.PollDeadline(kGather), absl::InfinitePast());  // two awaited: no poll
  pacing.Ended(&a);
  EXPECT_EQ(pacing.sessions(), 1u);
  EXPECT_EQ(pacing.PollDeadline(kGather), kT0 + absl::Microseconds(20) + kGather);
  pacing.Queued(&b, kT0 + absl::Microseconds(30), kGather);
  EndCall(pacing, Steps({&b}), /*computed=*/false, kT0 + absl::Microseconds(40));
  EXPECT_FALSE(pacing.awaiting());
}

// Steps answered while their call computes the others (an attention-only call): a
// session that has queued its next step by the call's end is not awaited; one
// answered during the call but not stepped since is; the gather counts from the end.
TEST(SessionPacingTest, StepsAnsweredDuringTheCallAreAwaitedOnlyUntilTheyStepAgain) {
  core::PagedStep a, b, c;
  SessionPacing pacing;
  for (const core::PagedStep* s : {&a, &b, &c}) pacing.Queued(s, kT0, kGather);
  EndCall(pacing, Steps({&a, &b, &c}), true, kT0);
  for (const core::PagedStep* s : {&a, &b, &c}) {
    pacing.Queued(s, kT0 + absl::Microseconds(10), kGather);  // all prompt now
  }
  // The next call answers a and b early; a steps again before the call ends.
  pacing.Answered(&a, kT0 + absl::Microseconds(100));
  pacing.Answered(&b, kT0 + absl::Microseconds(200));
  pacing.Queued(&a, kT0 + absl::Microseconds(300), kGather);
  const absl::Time end = kT0 + absl::Microseconds(900);
  pacing.Answered(&c, end);
  pacing.CallEnded(Steps({&a, &b, &c}), true, end);
  EXPECT_TRUE(pacing.awaiting());
  EXPECT_EQ(pacing.PollDeadline(kGather), absl::InfinitePast());  // b and c
  pacing.Queued(&c, end + absl::Microseconds(10), kGather);
  EXPECT_EQ(pacing.PollDeadline(kGather), end + kGather);  // b alone
  // b steps 1.2 ms after its answer: no longer prompt, and not awaited after the next call.
  pacing.Queued(&b, kT0 + absl::Microseconds(1400), kGather);
  EXPECT_FALSE(pacing.awaiting());
  for (const core::PagedStep* s : {&a, &b, &c}) pacing.Answered(s, end + absl::Milliseconds(2));
  pacing.CallEnded(Steps({&a, &b, &c}), true, end + absl::Milliseconds(2));
  EXPECT_TRUE(pacing.awaiting());
  pacing.Queued(&a, end + absl::Milliseconds(3), kGather);
  pacing.Queued(&c, end + absl::Milliseconds(3), kGather);
  EXPECT_FALSE(pacing.awaiting());  // b, late, was not awaited
  // A session that ends after its early answer is not awaited either.
  pacing.Answered(&a, end + absl::Milliseconds(4));
  pacing.Ended(&a);
  pacing.CallEnded(Steps({&a, &c}), true, end + absl::Milliseconds(5));
  EXPECT_FALSE(pacing.awaiting());
}

}  // namespace
}  // namespace mha::server

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

TEST(SessionPacingTest, APromptSessionIsAwaitedUntilItQueuesItsNextStep) {
  core::PagedStep a, b;
  SessionPacing pacing;
  pacing.Queued(&a, kT0, kGather);  // first steps: not prompt yet
  pacing.Queued(&b, kT0, kGather);
  pacing.CallEnded(Steps({&a, &b}), /*computed=*/true, kT0 + absl::Microseconds(100));
  EXPECT_FALSE(pacing.awaiting());
  EXPECT_EQ(pacing.sessions(), 2u);
  // a answers within the gather, b after it.
  pacing.Queued(&a, kT0 + absl::Microseconds(300), kGather);
  pacing.Queued(&b, kT0 + absl::Milliseconds(5), kGather);
  const absl::Time end = kT0 + absl::Milliseconds(6);
  pacing.CallEnded(Steps({&a, &b}), /*computed=*/true, end);
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
  pacing.CallEnded(Steps({&a, &b}), true, kT0);
  for (const core::PagedStep* s : {&a, &b}) pacing.Queued(s, kT0 + absl::Microseconds(10), kGather);
  pacing.CallEnded(Steps({&a, &b}), true, kT0 + absl::Microseconds(20));
  EXPECT_TRUE(pacing.awaiting());
  EXPECT_EQ(pacing.PollDeadline(kGather), absl::InfinitePast());  // two awaited: no poll
  pacing.Ended(&a);
  EXPECT_EQ(pacing.sessions(), 1u);
  EXPECT_EQ(pacing.PollDeadline(kGather), kT0 + absl::Microseconds(20) + kGather);
  pacing.Queued(&b, kT0 + absl::Microseconds(30), kGather);
  pacing.CallEnded(Steps({&b}), /*computed=*/false, kT0 + absl::Microseconds(40));
  EXPECT_FALSE(pacing.awaiting());
}

}  // namespace
}  // namespace mha::server

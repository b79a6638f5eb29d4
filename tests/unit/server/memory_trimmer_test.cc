// MemoryTrimmer (server/app/memory_trimmer.h): trims at its interval, stops at once,
// and a zero interval starts no thread.
#include "server/app/memory_trimmer.h"

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"

namespace mha::server {
namespace {

TEST(MemoryTrimmerTest, TrimsAtItsIntervalAndStopsAtOnce) {
  MemoryTrimmer trimmer(absl::Milliseconds(10));
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (trimmer.trims() < 3 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(5));
  EXPECT_GE(trimmer.trims(), 3);
  const absl::Time start = absl::Now();
  trimmer.Stop();
  EXPECT_LT(absl::Now() - start, absl::Seconds(1));  // not a whole interval's wait
  const int64_t stopped = trimmer.trims();
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_EQ(trimmer.trims(), stopped);
  trimmer.Stop();  // idempotent
}

TEST(MemoryTrimmerTest, ZeroIntervalNeverTrims) {
  MemoryTrimmer trimmer(absl::ZeroDuration());
  absl::SleepFor(absl::Milliseconds(30));
  EXPECT_EQ(trimmer.trims(), 0);
}

TEST(MemoryTrimmerTest, ALongIntervalStillStopsAtOnce) {
  const absl::Time start = absl::Now();
  {
    MemoryTrimmer trimmer(absl::Hours(1));
  }
  EXPECT_LT(absl::Now() - start, absl::Seconds(1));
}

}  // namespace
}  // namespace mha::server

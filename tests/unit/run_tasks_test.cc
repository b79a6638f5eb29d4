// internal::RunTasks, TaskRanges and RunPhases. RunTasks: every task runs exactly once, on a team
// shared as tasks come or, given costs, as one contiguous range of about equal cost per thread
// (the paged pass's decode steps keep a head on one core), whose tail another thread takes
// once it has run out of its own.
#include <omp.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <string_view>
#include <thread>
#include <vector>

#include "core/workspace.h"
#include "gtest/gtest.h"
#include "tests/unit/test_util.h"

namespace mha::core::internal {
namespace {

// Which thread ran each task of one RunTasks call; fails the test if a task ran
// other than once.
std::vector<int> Owners(int64_t tasks, int threads, Workspace& ws,
                        const std::vector<double>& costs) {
  std::vector<std::atomic<int>> runs(tasks);
  std::vector<int> owner(tasks, -1);
  const absl::Status s = RunTasks(
      tasks, threads, ws,
      [&](int64_t t, dnnl::stream&, TaskScratch&) {
        runs[t].fetch_add(1);
        owner[t] = omp_get_thread_num();
      },
      costs);
  EXPECT_TRUE(s.ok()) << s;
  for (int64_t t = 0; t < tasks; ++t) EXPECT_EQ(runs[t].load(), 1) << "task " << t;
  return owner;
}

// TaskRanges alone, one thread's calls at a time: each thread's range of about equal
// cost from its front, then the others' from their backs, every task once.
TEST(TaskRangesTest, EachThreadTakesItsRangeFromTheFrontThenTheOthersFromTheBack) {
  TaskRanges equal(std::vector<double>(12, 1.0), 2);
  EXPECT_EQ(equal.Next(1), 6);
  for (int64_t t = 0; t < 6; ++t) EXPECT_EQ(equal.Next(0), t);
  EXPECT_EQ(equal.Next(0), 11);  // thread 0 has run out: thread 1's last
  EXPECT_EQ(equal.Next(1), 7);
  EXPECT_EQ(equal.Next(0), 10);
  EXPECT_EQ(equal.Next(1), 8);
  EXPECT_EQ(equal.Next(1), 9);
  EXPECT_EQ(equal.Next(1), -1);
  EXPECT_EQ(equal.Next(0), -1);

  // One task as costly as the ten others: a range to itself.
  std::vector<double> uneven(11, 1.0);
  uneven[0] = 10.0;
  TaskRanges ranges(uneven, 2);
  EXPECT_EQ(ranges.Next(0), 0);
  EXPECT_EQ(ranges.Next(1), 1);
  EXPECT_EQ(ranges.Next(0), 10);

  // Ranges for 4 threads taken by one: all 12 tasks, its own first.
  TaskRanges four(std::vector<double>(12, 1.0), 4);
  std::vector<int64_t> order;
  for (int64_t t = four.Next(0); t >= 0; t = four.Next(0)) order.push_back(t);
  EXPECT_EQ(order, (std::vector<int64_t>{0, 1, 2, 5, 4, 3, 8, 7, 6, 11, 10, 9}));
}

// RunTasks with costs: each thread starts on its own range, and a thread held up
// (thread 1, whose first task waits until task 11 has run) has its range's tail
// taken by the other.
TEST(RunTasksTest, CostsGiveEachThreadItsRangeAndASlowThreadsTailToTheOther) {
  if (::mha::testing::TeamOfTwo() != 2) GTEST_SKIP() << "OpenMP gives one thread";
  Workspace ws;
  constexpr int64_t kTasks = 12;
  std::vector<std::atomic<int>> runs(kTasks);
  std::vector<int> owner(kTasks, -1);
  std::atomic<bool> last_ran{false};
  const absl::Status s = RunTasks(
      kTasks, 2, ws,
      [&](int64_t t, dnnl::stream&, TaskScratch&) {
        runs[t].fetch_add(1);
        owner[t] = omp_get_thread_num();
        if (t == 11) last_ran.store(true);
        if (t == 6) {
          for (int i = 0; i < 10000 && !last_ran.load(); ++i) {
            std::this_thread::sleep_for(std::chrono::milliseconds(1));
          }
        }
      },
      std::vector<double>(kTasks, 1.0));
  ASSERT_TRUE(s.ok()) << s;
  for (int64_t t = 0; t < kTasks; ++t) EXPECT_EQ(runs[t].load(), 1) << "task " << t;
  for (int64_t t = 0; t < 6; ++t) EXPECT_EQ(owner[t], 0) << "task " << t;
  EXPECT_EQ(owner[11], 0);
  EXPECT_TRUE(last_ran.load());
}

TEST(RunTasksTest, EveryTaskRunsOnceWithoutCostsOrWithZeroCosts) {
  Workspace ws;
  Owners(13, 2, ws, {});
  Owners(13, 2, ws, std::vector<double>(13, 0.0));
  Owners(1, 2, ws, {2.0});
  Owners(5, 1, ws, std::vector<double>(5, 1.0));
}

// RunPhases: every phase on every thread of the team, each after the phase before it
// has finished on all of them.
TEST(RunPhasesTest, EachPhaseRunsOnEveryThreadAfterThePreviousOne) {
  Workspace ws;
  constexpr int kMost = 8;
  std::vector<std::atomic<int>> first(kMost), second(kMost);
  std::atomic<int> team{0}, saw_all{0};
  const absl::Status s = RunPhases(2, ws,
                                   {[&](int me, int n, TaskScratch&) {
                                      team.store(n);
                                      first[me].fetch_add(1);
                                    },
                                    [&](int me, int n, TaskScratch&) {
                                      int done = 0;
                                      for (int i = 0; i < n; ++i) done += first[i].load();
                                      if (done == n) saw_all.fetch_add(1);
                                      second[me].fetch_add(1);
                                    }});
  ASSERT_TRUE(s.ok()) << s;
  ASSERT_GE(team.load(), 1);
  if (std::getenv("OMP_THREAD_LIMIT") == nullptr) {
    EXPECT_EQ(team.load(), 2);
  }
  EXPECT_EQ(saw_all.load(), team.load());  // no thread began phase 2 early
  for (int i = 0; i < team.load(); ++i) {
    EXPECT_EQ(first[i].load(), 1) << i;
    EXPECT_EQ(second[i].load(), 1) << i;
  }
}

TEST(RunPhasesTest, AFailedPhaseIsReturnedAndTheLaterOnesSkipped) {
  Workspace ws;
  std::atomic<int> later{0};
  const absl::Status s = RunPhases(2, ws,
                                   {[&](int me, int, TaskScratch&) {
                                      if (me == 0) throw std::runtime_error("phase one broke");
                                    },
                                    [&](int, int, TaskScratch&) { later.fetch_add(1); }});
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  EXPECT_NE(s.message().find("phase one broke"), std::string_view::npos) << s;
  EXPECT_EQ(later.load(), 0);
  // The team is whole again for the next call.
  EXPECT_TRUE(RunPhases(2, ws, {[&](int, int, TaskScratch&) {}}).ok());
}

}  // namespace
}  // namespace mha::core::internal

// internal::RunTasks and RunPhases. RunTasks: every task runs exactly once, on a team shared as
// tasks come or, given costs, as one contiguous range of about equal cost per thread, the same
// ranges call after call (the paged pass's decode steps keep a head on one core).
#include <omp.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <string_view>
#include <vector>

#include "core/workspace.h"
#include "gtest/gtest.h"

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

TEST(RunTasksTest, CostsGiveEachThreadOneRangeOfAboutEqualCostCallAfterCall) {
  Workspace ws;
  // The team OpenMP gives for two threads (one under OMP_THREAD_LIMIT=1).
  int team = 0;
#pragma omp parallel num_threads(2)
  {
#pragma omp single
    team = omp_get_num_threads();
  }
  const std::vector<double> equal(12, 1.0);
  const std::vector<int> first = Owners(12, 2, ws, equal);
  for (int64_t t = 1; t < 12; ++t) EXPECT_LE(first[t - 1], first[t]) << "ranges, task " << t;
  if (team == 2) {
    EXPECT_EQ(first[5], 0);
    EXPECT_EQ(first[6], 1);
  }
  for (int call = 0; call < 20; ++call) EXPECT_EQ(Owners(12, 2, ws, equal), first) << call;

  // One task as costly as the ten others: it has a thread to itself.
  std::vector<double> uneven(11, 1.0);
  uneven[0] = 10.0;
  const std::vector<int> owners = Owners(11, 2, ws, uneven);
  if (team == 2) {
    EXPECT_EQ(owners[0], 0);
    for (int64_t t = 1; t < 11; ++t) EXPECT_EQ(owners[t], 1) << "task " << t;
  }
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

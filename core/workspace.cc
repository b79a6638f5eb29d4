#include "core/workspace.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <exception>
#include <new>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"

namespace mha::core::internal {
namespace {

// Records the first failure of a parallel region.
class FirstError {
 public:
  void Set(absl::Status status) {
    absl::MutexLock lock(&mu_);
    if (status_.ok()) status_ = std::move(status);
    failed_.store(true, std::memory_order_relaxed);
  }
  bool failed() const { return failed_.load(std::memory_order_relaxed); }
  absl::Status status() const {
    absl::MutexLock lock(&mu_);
    return status_;
  }

 private:
  mutable absl::Mutex mu_;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  std::atomic<bool> failed_{false};
};

}  // namespace

int ThreadsForFlops(double flops, int num_threads, int cap, double per_thread) {
  // oneDNN splits a primitive's work for the threads it asks OpenMP for and assumes
  // it gets them all, so a call never asks for more than OMP_THREAD_LIMIT: the part
  // of the output planned for threads OpenMP refuses would silently be skipped.
  int max_threads =
      std::min(num_threads > 0 ? num_threads : omp_get_max_threads(), omp_get_thread_limit());
  if (cap > 0) max_threads = std::min(max_threads, cap);
  // Small calls run on fewer threads: a fork/join and a partition of a tiny GEMM cost
  // more than they save, and the cores are left to other callers.
  return static_cast<int>(std::clamp<double>(std::floor(flops / per_thread), 1.0, max_threads));
}

absl::Status StatusOfCurrentException(const char* where) {
  try {
    throw;
  } catch (const dnnl::error& e) {
    return absl::InternalError(
        absl::StrCat("oneDNN: ", e.what(), " (status ", static_cast<int>(e.status), ")"));
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(absl::StrCat("out of memory in ", where));
  } catch (const std::exception& e) {
    return absl::InternalError(e.what());
  } catch (...) {
    return absl::InternalError(absl::StrCat("unknown exception in ", where));
  }
}

std::unique_ptr<Workspace> WorkspacePool::Acquire() {
  absl::MutexLock lock(&mu_);
  if (free_.empty()) return std::make_unique<Workspace>();
  auto ws = std::move(free_.back());
  free_.pop_back();
  return ws;
}

void WorkspacePool::Release(std::unique_ptr<Workspace> ws) {
  absl::MutexLock lock(&mu_);
  free_.push_back(std::move(ws));
}

std::pair<int64_t, int64_t> CostRange(std::span<const double> costs, int me, int n) {
  // Thread i runs the tasks from the first whose costs before it reach i / n of the
  // total, up to thread i + 1's first.
  double total = 0;
  for (const double c : costs) total += c;
  const auto tasks = static_cast<int64_t>(costs.size());
  auto first = [&](int i) {
    if (i <= 0) return int64_t{0};
    if (i >= n) return tasks;
    const double at = total * i / n;
    double before = 0;
    for (int64_t t = 0; t < tasks; ++t) {
      if (before >= at) return t;
      before += costs[t];
    }
    return tasks;
  };
  return {first(me), first(me + 1)};
}

namespace {
uint64_t PackRange(uint64_t next, uint64_t end) { return next | end << 32; }
}  // namespace

TaskRanges::TaskRanges(std::span<const double> costs, int n)
    : ranges_(std::make_unique<std::atomic<uint64_t>[]>(n)), n_(n) {
  for (int i = 0; i < n; ++i) {
    const auto [first, last] = CostRange(costs, i, n);
    ranges_[i].store(PackRange(first, last), std::memory_order_relaxed);
  }
}

int64_t TaskRanges::Next(int me) {
  // The owner's front, then the others' backs, each claimed by moving its bound.
  for (int k = 0; k < n_; ++k) {
    std::atomic<uint64_t>& range = ranges_[(me + k) % n_];
    uint64_t bounds = range.load(std::memory_order_relaxed);
    while (true) {
      const uint64_t next = bounds & 0xffffffffu, end = bounds >> 32;
      if (next >= end) break;
      const bool front = k == 0;
      const uint64_t claimed = front ? PackRange(next + 1, end) : PackRange(next, end - 1);
      if (range.compare_exchange_weak(bounds, claimed, std::memory_order_relaxed)) {
        return static_cast<int64_t>(front ? next : end - 1);
      }
    }
  }
  return -1;
}

absl::Status RunPhases(
    int threads, Workspace& ws,
    std::initializer_list<absl::FunctionRef<void(int, int, TaskScratch&)>> phases) {
  if (ws.scratch.size() < static_cast<size_t>(threads)) ws.scratch.resize(threads);
  FirstError error;
#pragma omp parallel num_threads(threads)
  {
    const int me = omp_get_thread_num(), n = omp_get_num_threads();
    bool first = true;
    for (const auto& phase : phases) {
      if (!first) {
#pragma omp barrier
      }
      first = false;
      if (error.failed()) continue;
      try {
        phase(me, n, ws.scratch[me]);
      } catch (...) {
        error.Set(StatusOfCurrentException("a phase of a call"));
      }
    }
  }
  return error.status();
}

dnnl::stream& TaskScratch::Stream() {
  if (!stream) stream.emplace(CpuEngine());
  return *stream;
}

absl::Status RunTasks(int64_t tasks, int threads, Workspace& ws,
                      absl::FunctionRef<void(int64_t, dnnl::stream&, TaskScratch&)> task,
                      std::span<const double> costs) {
  // One thread runs every task itself. A team shares them out: run serially beside
  // multi-threaded primitives, each tiny block GEMM would fork a team of its own.
  const int team = static_cast<int>(std::min<int64_t>(threads, tasks));
  if (ws.scratch.size() < static_cast<size_t>(team)) ws.scratch.resize(team);
  FirstError error;
  auto run_task = [&](TaskScratch& scratch, int64_t t) {
    if (error.failed()) return;
    try {
      task(t, scratch.Stream(), scratch);
    } catch (...) {
      error.Set(StatusOfCurrentException("an attention task"));
    }
  };
  if (team > 1) {
    double total = 0;
    for (const double c : costs) total += c;
    // Else (no costs, or all 0) as they come.
    std::optional<TaskRanges> ranges;
    if (total > 0) ranges.emplace(costs, team);
#pragma omp parallel num_threads(team)
    {
      const int me = omp_get_thread_num();
      TaskScratch& scratch = ws.scratch[me];
      if (ranges) {
        for (int64_t t = ranges->Next(me); t >= 0; t = ranges->Next(me)) run_task(scratch, t);
      } else {
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < tasks; ++t) run_task(scratch, t);
      }
    }
  } else {
    // Block GEMMs run inline here, as they do inside a team (one task on many threads).
    omp_set_num_threads(1);
    for (int64_t t = 0; t < tasks; ++t) run_task(ws.scratch[0], t);
    omp_set_num_threads(threads);
  }
  return error.status();
}

}  // namespace mha::core::internal

// What every pass of the attention layer runs on: the buffers of one call (a
// Workspace, leased from a pool and kept between calls), the thread policy (how many
// OpenMP threads a call of a given size gets), a parallel task loop, and the one
// mapping of exceptions to absl::Status.
//
// Internal to core/: only core/*.cc include it.
#ifndef MHA_CORE_WORKSPACE_H_
#define MHA_CORE_WORKSPACE_H_

#include <omp.h>

#include <atomic>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "core/matmul.h"
#include "oneapi/dnnl/dnnl.hpp"

namespace mha::core::internal {

// A call gets one OpenMP thread per this many FLOPs, up to its cap (PyTorch's
// grain-size idea): below it, another thread's fork/join and its share of a GEMM
// partition cost more than the work it takes over.
inline constexpr double kFlopsPerThread = 16e6;

// A small self-attention call that runs as one OpenMP region (each thread projecting,
// laying out and attending its own heads, one barrier, then its share of W_o's
// columns: MultiHeadAttention::Impl::ForwardOneRegion) forks once instead of four
// times and keeps each thread's data in its own core's cache, so another thread pays
// off sooner: one per this many FLOPs, for calls under kOneRegionMaxFlops
// (docs/performance.md, "One region for a small call").
inline constexpr double kOneRegionFlopsPerThread = 4e6;
inline constexpr double kOneRegionMaxFlops = 2 * kFlopsPerThread;

// The threads a call of `flops` gets: one per `per_thread` FLOPs, at least one, at
// most `num_threads` (0: this thread's omp_get_max_threads()), `cap` (when > 0) and
// OMP_THREAD_LIMIT.
int ThreadsForFlops(double flops, int num_threads, int cap, double per_thread = kFlopsPerThread);

// Sets this thread's OpenMP thread count (which bounds oneDNN's regions too) for the
// scope of one call, and gives the caller its own back.
class ThreadScope {
 public:
  explicit ThreadScope(int threads) : caller_(omp_get_max_threads()) {
    omp_set_num_threads(threads);
  }
  ~ThreadScope() { omp_set_num_threads(caller_); }
  ThreadScope(const ThreadScope&) = delete;
  ThreadScope& operator=(const ThreadScope&) = delete;

 private:
  const int caller_;
};

// The status of the exception being handled: oneDNN's errors and others INTERNAL,
// std::bad_alloc RESOURCE_EXHAUSTED naming `where`. Call only inside a catch block.
absl::Status StatusOfCurrentException(const char* where);

// Runs f, turning whatever it throws into a status (StatusOfCurrentException): what
// each public entry point of the layer wraps itself in, since it never throws.
template <typename F>
absl::Status Guarded(const char* where, F&& f) {
  try {
    return f();
  } catch (...) {
    return StatusOfCurrentException(where);
  }
}

// One OpenMP thread's buffers in a parallel loop (RunTasks).
struct TaskScratch {
  std::vector<float> s;     // scores / f32 probabilities (query_block, key_block)
  std::vector<float> o;     // context accumulator (query_block, p)
  std::vector<uint16_t> p;  // bf16 probabilities
  Bindings bindings;        // oneDNN arguments and scratchpad
  std::optional<dnnl::stream> stream;

  // The thread's stream, made on first use.
  dnnl::stream& Stream();
};

// Buffers of one call, kept between calls: first-touching fresh pages is expensive
// (and on some VMs very expensive), so a call reuses the memory of an earlier one. A
// pool holds one workspace per concurrent call.
struct Workspace {
  std::vector<char> xq, xk, xv;          // bf16 copies of the inputs
  std::vector<char> prefix_k, prefix_v;  // key/value rows some query sees, gathered
  std::vector<char> proj, kv;            // projections, row-major
  std::vector<char> heads;               // Q, K, V head-major
  std::vector<char> blocked;             // full key blocks in the GEMMs' layouts
  std::vector<char> ctx;                 // concatenated heads, f32 (B*Q, p_o)
  std::vector<float> qa, kt;             // additive scoring's projections
  std::vector<TaskScratch> scratch;      // one per OpenMP thread
  // ForwardPaged: the steps' gathered inputs, their projections, the gathered
  // output, f32.
  std::vector<float> paged_in, paged_proj, paged_out;
  Bindings bindings;  // oneDNN arguments of the projections
  std::optional<dnnl::stream> stream;
};

// Grows (never shrinks) a buffer to at least n elements; contents are not preserved.
template <typename T>
void Grow(std::vector<T>& buf, size_t n) {
  if (buf.size() < n) {
    buf = std::vector<T>();
    buf.resize(n);
  }
}

class WorkspacePool {
 public:
  std::unique_ptr<Workspace> Acquire();
  void Release(std::unique_ptr<Workspace> ws);

 private:
  absl::Mutex mu_;
  std::vector<std::unique_ptr<Workspace>> free_ ABSL_GUARDED_BY(mu_);
};

// A workspace for the scope of one call.
class WorkspaceLease {
 public:
  explicit WorkspaceLease(WorkspacePool& pool) : pool_(pool), ws_(pool.Acquire()) {}
  ~WorkspaceLease() { pool_.Release(std::move(ws_)); }
  Workspace& operator*() { return *ws_; }

 private:
  WorkspacePool& pool_;
  std::unique_ptr<Workspace> ws_;
};

// Runs task(t, stream, scratch) for t < tasks, shared out over a team of up to
// `threads`, each thread with its own stream and scratch (ws.scratch); returns the
// first failure. Exceptions may not cross an OpenMP region, so each task's are caught
// and reported. Threads take tasks as they come, or, given `costs` (one per task),
// as TaskRanges: each its own contiguous range of tasks of about equal total cost,
// the same ranges for the same costs, so that calls in a row (a session's decode
// steps) give each task's data to the core that had it in the call before; a thread
// that finishes its range first takes over the tail of another's.
absl::Status RunTasks(int64_t tasks, int threads, Workspace& ws,
                      absl::FunctionRef<void(int64_t, dnnl::stream&, TaskScratch&)> task,
                      std::span<const double> costs = {});
// The tasks [first, last) that thread `me` of a team of n starts with by RunTasks'
// rule for costs (all > 0 in total).
std::pair<int64_t, int64_t> CostRange(std::span<const double> costs, int me, int n);

// Tasks shared out over n threads by their costs: thread i takes the tasks of its
// CostRange from the front; once that is empty, the last task left in another's.
// Threads that read memory at different rates (this VM's cores did, by 6-14% of a
// decode call's time) then end together, while each task stays where it ran the call
// before except at the tail (docs/performance.md, "The tail of a call shared").
// Every task is taken once, also by a team of fewer than n threads. Thread-safe.
class TaskRanges {
 public:
  TaskRanges(std::span<const double> costs, int n);
  // Thread me's next task; -1 when none is left.
  int64_t Next(int me);

 private:
  // Range i's next and end tasks, packed (next in the low 32 bits), so that its
  // owner (front) and the others (back) claim tasks by one compare-and-swap.
  std::unique_ptr<std::atomic<uint64_t>[]> ranges_;
  int n_;
};

// Runs every phase on each thread of one team of up to `threads`, as phase(me, n,
// ws.scratch[me]) with me < n the team's size, and a barrier between phases: one fork
// and join for a call of several dependent parallel steps (a decode step). Returns
// the first failure; the phases after it are skipped, the barriers still met.
absl::Status RunPhases(
    int threads, Workspace& ws,
    std::initializer_list<absl::FunctionRef<void(int, int, TaskScratch&)>> phases);

}  // namespace mha::core::internal

#endif  // MHA_CORE_WORKSPACE_H_

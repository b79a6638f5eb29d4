// Load modes for `bench`, shaped like Triton perf_analyzer's load managers: one
// LoadManager interface, one class per mode. ConcurrencyManager keeps a fixed number
// of requests in flight; RequestRateManager starts requests at a fixed rate
// (constant or Poisson intervals) whatever is in flight. Managers decide when to
// send; the calls themselves live in calls.h, measurement (windows, percentiles,
// stability) in stats.h, reporting in report.h.
//
//   Recorder recorder;
//   auto load = ConcurrencyManager::Create(target, 8, &recorder).value();  // 8 in flight
//   absl::SleepFor(absl::Seconds(2));
//   std::vector<Sample> window = recorder.Take();
//   load->Stop();  // stop sending, wait for calls in flight
//
// Failures back off: after n failed requests in a row (codes not in
// LoadTarget::allowed_errors), a closed loop sends again on a failed slot only
// BackoffDelay(n) later (1 ms, doubling, at most 100 ms) and an open loop delays its
// next request as long, so that a dead server is not hammered by a tight loop.
#ifndef MHA_CLIENT_LOAD_LOAD_MANAGER_H_
#define MHA_CLIENT_LOAD_LOAD_MANAGER_H_

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "client/load/calls.h"

namespace mha::client {

// Collects samples from gRPC's threads. Thread-safe.
class Recorder {
 public:
  void Add(const Sample& sample);
  std::vector<Sample> Take();  // the samples since the last Take
  int64_t completed() const;   // every sample ever added
  // Every failed sample ever added, by code name ("UNAVAILABLE" -> 3).
  std::map<std::string, int64_t> errors() const;

 private:
  mutable std::mutex mu_;
  std::vector<Sample> samples_;
  int64_t completed_ = 0;
  std::map<std::string, int64_t> errors_;
};

// How long to wait before sending again after `consecutive_failures` failed
// requests in a row: 0 for none, then 1 ms doubling to at most 100 ms.
std::chrono::nanoseconds BackoffDelay(int64_t consecutive_failures);

struct LoadTarget {
  CallTarget calls;  // what each request is, where it goes, its deadline
  // True: the load starts with a warm-up that max_requests does not count, ended by
  // LoadManager::EndWarmup.
  bool warmup = false;
  // Requests that finish after the warm-up, at most (0 = no limit): sending stops
  // once the requests in flight when the warm-up ended and those sent since reach
  // it (more only when more than max_requests were in flight then).
  int64_t max_requests = 0;
  // Codes a run expects (refusals such as RESOURCE_EXHAUSTED): they neither back
  // off nor count toward max_errors.
  std::set<grpc::StatusCode> allowed_errors;
  // Stop sending after this many failed requests of other codes (0 = no limit).
  int64_t max_errors = 0;
  // Streams that carry a fixed-rate stream load, or HTTP connections that carry a
  // fixed-rate HTTP load.
  int rate_streams = 4;
};

// A load mode: sends from creation until Stop and records every finished request.
// Thread-safe.
class LoadManager : public CallObserver {
 public:
  ~LoadManager() override = default;
  LoadManager(const LoadManager&) = delete;
  LoadManager& operator=(const LoadManager&) = delete;

  // Stops sending and waits for every call in flight to finish (each is bounded by
  // its deadline). Idempotent; every final manager calls it on destruction.
  void Stop();
  // Ends a LoadTarget::warmup: drops the samples recorded so far (they are not
  // measured) and starts counting max_requests.
  void EndWarmup();
  int64_t sent() const { return sent_.load(); }  // every request, warm-up included
  // True once max_requests have been sent (or were in flight) since the warm-up.
  bool exhausted() const;
  // True once max_errors requests have failed with codes not allowed.
  bool failing() const;

  void OnSample(int slot, const Sample& sample) final;
  void OnStreamDone(absl::Span<const Sample> unanswered) final;

 protected:
  LoadManager(const LoadTarget& target, Recorder* recorder);

  // Opens the calls, with `lanes` streams for a stream load or connections for an
  // HTTP load (CallSender). Once, before sending.
  void OpenCalls(int lanes);
  // Takes up to `count` requests to send at once; how many it took.
  int AcquireNow(int count);
  // Waits until `when`, then takes one request to send; false once stopping or
  // max_requests are sent.
  bool AcquireAt(std::chrono::steady_clock::time_point when);
  // Sends a request taken by AcquireNow or AcquireAt (or a refill) on `slot`.
  void Issue(int slot);

  // True when a finished request is replaced at once on its slot (closed loop).
  virtual bool RefillsFinishedSlots() const = 0;
  // Stops the mode's own sending (a scheduler thread); Stop calls it first.
  virtual void StopSending() {}
  // BackoffDelay of the failures in a row so far.
  std::chrono::nanoseconds Backoff() const;

 private:
  using Clock = std::chrono::steady_clock;

  // Counts one more request in flight; false when stopping, max_requests are sent
  // or max_errors have failed.
  bool AcquireLocked();
  bool ExhaustedLocked() const;
  bool FailingLocked() const;
  // Records a finished request, counting it for backoff and max_errors.
  void RecordLocked(const Sample& sample);
  // Sends again on `slot` at `when` (retry_thread_, started on first use).
  void RetryLocked(int slot, Clock::time_point when);
  void SendRetries();

  Recorder* const recorder_;
  const LoadTarget target_;
  std::atomic<int64_t> sent_{0};
  std::unique_ptr<CallSender> calls_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  bool warming_up_ = false;
  int64_t budget_used_ = 0;  // max_requests' count since the warm-up
  int64_t in_flight_ = 0;
  int open_streams_ = 0;
  int64_t failures_in_a_row_ = 0, failures_ = 0;            // of codes not allowed
  std::vector<std::pair<Clock::time_point, int>> retries_;  // (when, slot), backing off
  std::thread retry_thread_;
};

// Closed loop: `concurrency` requests in flight, each finished request starts the
// next on its slot. A stream load opens one stream per slot, an HTTP load one
// connection per slot.
class ConcurrencyManager final : public LoadManager {
 public:
  // INVALID_ARGUMENT for concurrency < 1 or an incomplete target.
  static absl::StatusOr<std::unique_ptr<ConcurrencyManager>> Create(const LoadTarget& target,
                                                                    int concurrency,
                                                                    Recorder* recorder);
  ~ConcurrencyManager() override { Stop(); }

 private:
  using LoadManager::LoadManager;
  bool RefillsFinishedSlots() const override { return true; }
};

// When a fixed-rate load sends: intervals of exactly 1 / rate, or exponential ones
// with mean 1 / rate (a Poisson process) drawn from `seed`, so a seed repeats its
// schedule. Not thread-safe.
//
//   RequestSchedule schedule(4, /*poisson=*/false, 0);
//   schedule.NextInterval();  // 250 ms, every time
class RequestSchedule {
 public:
  RequestSchedule(double rate, bool poisson, uint64_t seed);
  std::chrono::steady_clock::duration NextInterval();

 private:
  const double rate_;
  const bool poisson_;
  std::mt19937_64 engine_;
  std::exponential_distribution<double> gap_;
};

// Open loop: requests start on a RequestSchedule from a thread of their own,
// whatever is in flight. A stream load spreads them over `rate_streams` streams, an
// HTTP load over `rate_streams` connections (a request waits for its connection,
// and its latency counts from its scheduled start).
class RequestRateManager final : public LoadManager {
 public:
  // INVALID_ARGUMENT for rate <= 0, a stream or HTTP load with rate_streams < 1, or
  // an incomplete target.
  static absl::StatusOr<std::unique_ptr<RequestRateManager>> Create(const LoadTarget& target,
                                                                    double rate, bool poisson,
                                                                    uint64_t seed,
                                                                    Recorder* recorder);
  ~RequestRateManager() override { Stop(); }

 private:
  using LoadManager::LoadManager;
  bool RefillsFinishedSlots() const override { return false; }
  void StopSending() override;
  void SendOnSchedule(RequestSchedule schedule);

  std::thread scheduler_;
};

}  // namespace mha::client

#endif  // MHA_CLIENT_LOAD_LOAD_MANAGER_H_

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
#ifndef MHA_CLIENT_LOAD_H_
#define MHA_CLIENT_LOAD_H_

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "client/calls.h"

namespace mha::client {

// Collects samples from gRPC's threads. Thread-safe.
class Recorder {
 public:
  void Add(const Sample& sample);
  std::vector<Sample> Take();  // the samples since the last Take
  int64_t completed() const;   // every sample ever added

 private:
  mutable std::mutex mu_;
  std::vector<Sample> samples_;
  int64_t completed_ = 0;
};

struct LoadTarget {
  CallTarget calls;          // what each request is, where it goes, its deadline
  int64_t max_requests = 0;  // stop sending after this many (0 = no limit)
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
  int64_t sent() const { return sent_.load(); }
  // True once max_requests calls have been sent.
  bool exhausted() const { return max_requests_ > 0 && sent_.load() >= max_requests_; }

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

 private:
  // Counts one more request in flight; false when stopping or max_requests are sent.
  bool AcquireLocked();

  Recorder* const recorder_;
  const LoadTarget target_;
  const int64_t max_requests_;
  std::atomic<int64_t> sent_{0};
  std::unique_ptr<CallSender> calls_;

  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  int64_t in_flight_ = 0;
  int open_streams_ = 0;
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

#endif  // MHA_CLIENT_LOAD_H_

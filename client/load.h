// Load generation for `bench`, shaped like Triton perf_analyzer's load managers: a
// fixed number of requests in flight (concurrency) or a fixed rate of request starts
// (constant or Poisson intervals), over unary Attend, AttendStream or
// grpc.health.v1.Health/Check. Generators send and record samples; measurement
// (windows, percentiles, stability) lives in stats.h, reporting in report.h.
//
//   Recorder recorder;
//   auto load = StartConcurrency(target, 8, &recorder).value();  // 8 calls in flight
//   absl::SleepFor(absl::Seconds(2));
//   std::vector<Sample> window = recorder.Take();
//   load->Stop();  // stop sending, wait for calls in flight
//
// Every call carries a deadline: unary calls LoadTarget::timeout, streams
// LoadTarget::stream_deadline (each request on a stream is bounded by the stream).
#ifndef MHA_CLIENT_LOAD_H_
#define MHA_CLIENT_LOAD_H_

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "proto/attention.pb.h"

namespace mha::client {

enum class Rpc { kAttend, kHealth };
enum class Mode { kUnary, kStream };

// One finished request as the client saw it.
struct Sample {
  int64_t end_ns = 0;      // steady clock
  int64_t latency_ns = 0;  // from the send (stream: queued for writing) to the response
  grpc::StatusCode code = grpc::StatusCode::OK;
  // AttendResponse.timing of a successful Attend; 0 otherwise.
  int64_t queue_us = 0, compute_us = 0, batch_rows = 0;
};

int64_t SteadyNowNs();

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
  // Calls are spread over these channels (one HTTP/2 connection each, or a
  // round_robin channel over several servers).
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  const attention::v1::AttendRequest* request = nullptr;  // outlives the generator
  Rpc rpc = Rpc::kAttend;
  Mode mode = Mode::kUnary;                            // kStream only for kAttend
  absl::Duration timeout = absl::Seconds(10);          // unary deadline
  absl::Duration stream_deadline = absl::Seconds(60);  // a stream's whole life
  int64_t max_requests = 0;  // stop sending after this many (0 = no limit)
  int rate_streams = 4;      // streams that carry a fixed-rate stream load
};

// Sends until Stop. Thread-safe.
class LoadGenerator {
 public:
  virtual ~LoadGenerator() = default;
  // Stops sending and waits for every call in flight to finish (each is bounded by
  // its deadline). Idempotent.
  virtual void Stop() = 0;
  int64_t sent() const { return sent_.load(); }
  // True once max_requests calls have been sent.
  bool exhausted() const { return max_requests_ > 0 && sent_.load() >= max_requests_; }

 protected:
  explicit LoadGenerator(int64_t max_requests) : max_requests_(max_requests) {}
  // Counts one more request against max_requests; false when none is left.
  bool Acquire();
  void Release() { sent_.fetch_sub(1); }  // a request acquired but never sent

 private:
  const int64_t max_requests_;
  std::atomic<int64_t> sent_{0};
};

// `concurrency` requests in flight: each finished request starts the next.
absl::StatusOr<std::unique_ptr<LoadGenerator>> StartConcurrency(const LoadTarget& target,
                                                                int concurrency,
                                                                Recorder* recorder);

// Requests start at `rate` per second, at constant intervals or with exponential
// (Poisson process) intervals drawn from `seed`, whatever is in flight.
absl::StatusOr<std::unique_ptr<LoadGenerator>> StartRate(const LoadTarget& target, double rate,
                                                         bool poisson, uint64_t seed,
                                                         Recorder* recorder);

}  // namespace mha::client

#endif  // MHA_CLIENT_LOAD_H_

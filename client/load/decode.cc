#include "client/load/decode.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <deque>
#include <iterator>
#include <limits>
#include <mutex>
#include <system_error>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "base/splitmix64.h"
#include "client/load/calls.h"
#include "client/sdk/call_group.h"
#include "client/sdk/channel.h"
#include "client/sdk/connection.h"
#include "client/sdk/request.h"
#include "client/sdk/status.h"
#include "proto/attention.grpc.pb.h"

namespace mha::client {
namespace {

using attention::v1::AttendRequest;
using attention::v1::AttendResponse;
using attention::v1::AttentionService;
using attention::v1::ModelInfo;
using attention::v1::SessionRequest;
using attention::v1::SessionResponse;
using attention::v1::Tensor;
using attention::v1::Timing;

// Upper bounds of the context buckets; one more bucket holds what lies above.
constexpr int64_t kBucketBounds[] = {64, 128, 256, 512, 1024, 2048, 4096};
constexpr size_t kBuckets = std::size(kBucketBounds) + 1;

size_t BucketOf(int64_t context) {
  const int64_t* bound =
      std::lower_bound(std::begin(kBucketBounds), std::end(kBucketBounds), context);
  return static_cast<size_t>(bound - std::begin(kBucketBounds));
}

// One decode step as the client saw it.
struct DecodeStep {
  int64_t context = 0;  // keys cached after the step
  Sample sample;
};

// What one session measured; the decode phase from its first send to its last
// response.
// Sums of output values and of their magnitudes.
struct OutputSums {
  double sum = 0, abs_sum = 0;
};

struct SessionResult {
  Sample prefill;
  std::vector<DecodeStep> steps;
  int64_t decode_start_ns = 0, decode_end_ns = 0;
  OutputSums output;
};

// What the sessions of a run share: where they send, the prefill barrier, the
// calls in flight and the first failure. Thread-safe.
class Shared {
 public:
  Shared(const DecodeOptions& options, const std::shared_ptr<grpc::Channel>& channel,
         const ModelInfo& model)
      : options_(options), model_(model), channel_(channel), not_prefilled_(options.sessions) {}

  const DecodeOptions& options() const { return options_; }
  const ModelInfo& model() const { return model_; }
  const std::shared_ptr<grpc::Channel>& channel() const { return channel_; }
  // Every call in flight joins it, so that a failure cancels it: a session blocked
  // on a response must not hold the run until its deadline.
  CallGroup& calls() { return calls_; }

  // Every stateless session's thread calls this once, prefilled or failed, and
  // returns when all have (SessionDriver keeps the same barrier in its loop):
  // the decode phase starts for all at once, so that no decode step shares the
  // server with another session's prefill and the phase's wall time is the
  // decode's. A server that holds some sessions back until others end would keep
  // the barrier shut: after waiting --timeout the run fails (DEADLINE_EXCEEDED).
  void PrefillDone(int64_t session) {
    std::unique_lock<std::mutex> lock(mu_);
    if (--not_prefilled_ == 0) prefilled_.notify_all();
    const auto opened = [&] { return not_prefilled_ <= 0 || failed(); };
    if (prefilled_.wait_for(lock, absl::ToChronoNanoseconds(options_.timeout), opened)) return;
    FailLocked(absl::DeadlineExceededError(absl::StrCat(
        "decode: session ", session, " prefilled, but ", not_prefilled_, " of ", options_.sessions,
        " sessions had not --timeout (", absl::FormatDuration(options_.timeout),
        ") later: does the server run ", options_.sessions, " sessions at once?")));
  }
  // For `sessions` that never started: lets the started ones past the barrier.
  void Abandon(int64_t sessions) {
    std::lock_guard<std::mutex> lock(mu_);
    not_prefilled_ -= sessions;
    prefilled_.notify_all();
  }

  // Keeps the first failure (the later ones are usually its consequences: calls it
  // cancelled) and cancels every call in flight.
  void Fail(const absl::Status& status) {
    std::lock_guard<std::mutex> lock(mu_);
    FailLocked(status);
  }
  // Sessions stop at their next step once one has failed.
  bool failed() const { return failed_.load(std::memory_order_relaxed); }
  absl::Status status() const {
    std::lock_guard<std::mutex> lock(mu_);
    return first_failure_;
  }

 private:
  void FailLocked(const absl::Status& status) {
    if (first_failure_.ok()) first_failure_ = status;
    if (failed_.exchange(true, std::memory_order_relaxed)) return;
    calls_.Cancel();
    prefilled_.notify_all();
  }

  const DecodeOptions& options_;
  const ModelInfo& model_;
  const std::shared_ptr<grpc::Channel> channel_;
  CallGroup calls_;
  std::atomic<bool> failed_{false};
  mutable std::mutex mu_;
  std::condition_variable prefilled_;
  int64_t not_prefilled_;  // guarded by mu_, as is first_failure_
  absl::Status first_failure_;
};

// Session s's tokens (1, P + N, d_q).
Tensor SessionTokens(const DecodeOptions& options, int64_t session, int64_t d) {
  SplitMix64 inputs(options.seed + static_cast<uint64_t>(session));
  Tensor tokens;
  FillSigned(inputs, {1, options.prefill + options.decode_tokens, d}, &tokens);
  return tokens;
}

// An attention-only model takes its tokens' q, k and v already projected: k and v
// (1, P + N, G * d_h) each, drawn after the queries from the same generator's
// continuation (seed + s, offset).
Tensor SessionKeys(const DecodeOptions& options, int64_t session, int64_t d, uint64_t which) {
  SplitMix64 inputs((options.seed + static_cast<uint64_t>(session)) ^ (which << 56));
  Tensor tokens;
  FillSigned(inputs, {1, options.prefill + options.decode_tokens, d}, &tokens);
  return tokens;
}

// Rows [first, first + count) of `tokens` as a (1, count, d) tensor.
void CopyRows(const Tensor& tokens, int64_t first, int64_t count, Tensor* out) {
  const int64_t d = tokens.shape(2);
  out->Clear();
  out->add_shape(1);
  out->add_shape(count);
  out->add_shape(d);
  const float* begin = tokens.data().data() + first * d;
  out->mutable_data()->Add(begin, begin + count * d);
}

// Appends row `row` of `tokens` to `out` (1, K, d), making it (1, K + 1, d).
void AppendRow(const Tensor& tokens, int64_t row, Tensor* out) {
  const int64_t d = tokens.shape(2);
  out->set_shape(1, out->shape(1) + 1);
  const float* begin = tokens.data().data() + row * d;
  out->mutable_data()->Add(begin, begin + d);
}

Sample TimedSample(int64_t start_ns, const Timing& timing) {
  Sample sample;
  sample.end_ns = SteadyNowNs();
  sample.latency_ns = sample.end_ns - start_ns;
  sample.queue_us = timing.queue_us();
  sample.compute_us = timing.compute_us();
  sample.batch_rows = timing.batch_rows();
  return sample;
}

// INTERNAL unless `output` is (1, tokens, p_o) with its values in `data` (the
// server answers in the encoding of the request's queries: data); adds them to
// `sums`.
absl::Status CheckOutput(const Tensor& output, int64_t tokens, int64_t p_o, OutputSums* sums) {
  const bool shape_ok = output.shape_size() == 3 && output.shape(0) == 1 &&
                        output.shape(1) == tokens && output.shape(2) == p_o;
  if (!shape_ok || output.data_size() != tokens * p_o) {
    return absl::InternalError(
        absl::StrFormat("the server's output has shape %s and %d data values, expected (1, %d, %d)",
                        ShapeString(output), output.data_size(), tokens, p_o));
  }
  for (float v : output.data()) {
    sums->sum += v;
    sums->abs_sum += std::abs(v);
  }
  return absl::OkStatus();
}

// `status` with the call, the session and the step in front of its message (a
// message that starts with the call already, as the SDK's errors do, keeps it once);
// the code is kept.
absl::Status InStep(const absl::Status& status, absl::string_view call, int64_t session,
                    absl::string_view step) {
  absl::string_view message = status.message();
  absl::ConsumePrefix(&message, absl::StrCat(call, ": "));
  return absl::Status(status.code(), absl::StrCat(call, ": session ", session, ", ", step, ": ",
                                                  message.empty() ? "(no message)" : message));
}

std::string PrefillName(int64_t tokens) { return absl::StrCat("prefill of ", tokens, " tokens"); }
// Decode steps count from 1, as the server counts a session's steps after its
// prefill (step 0).
std::string DecodeStepName(int64_t n, int64_t steps, int64_t context) {
  return absl::StrCat("decode step ", n + 1, " of ", steps, " (context ", context, ")");
}

// The sessions over AttendSession (SELF, causal: the prefill, then one token a
// step), every stream driven by the calling thread over one completion queue.
// A thread per session, blocked in a synchronous stream, cost the client about
// 50 us of CPU a token at 16 sessions, most of it thread wake-ups, on cores the
// benchmarks share with the server (docs/performance.md, "Sessions").
//
// Each stream has one operation in flight at a time (start, write, read, writes
// done, the read that must find no further response, finish), and its Session is
// that operation's tag. Every stream is finished (Finish called once, its status
// read) before Run returns; a failed step fails the run (Shared::Fail keeps the
// first failure and cancels every stream still in flight).
class SessionDriver {
 public:
  SessionDriver(Shared& shared, std::vector<SessionResult>& results)
      : shared_(shared), stub_(AttentionService::NewStub(shared.channel())), results_(results) {}

  void Run() {
    const DecodeOptions& o = shared_.options();
    for (int64_t s = 0; s < o.sessions; ++s) {
      auto session = std::make_unique<Session>();
      session->index = s;
      session->result = &results_[static_cast<size_t>(s)];
      waiting_.push_back(session.get());
      sessions_.push_back(std::move(session));
    }
    StartWaiting();
    while (unfinished_ > 0) {
      void* tag = nullptr;
      bool ok = false;
      // At the prefill barrier, the run fails after --timeout without another
      // session's prefill answered.
      const bool waiting = prefilled_ > 0 && !decoding_ && !shared_.failed();
      const auto next = queue_.AsyncNext(
          &tag, &ok, absl::ToChronoTime(waiting ? barrier_deadline_ : absl::InfiniteFuture()));
      if (next == grpc::CompletionQueue::TIMEOUT) {
        Fail(absl::DeadlineExceededError(absl::StrCat(
            "decode: ", prefilled_, " of ", o.sessions, " sessions prefilled, but no other had ",
            "prefilled --timeout (", absl::FormatDuration(o.timeout),
            ") after the last: does the server run ", o.sessions, " sessions at once?")));
        continue;
      }
      if (next != grpc::CompletionQueue::GOT_EVENT) break;  // shut down: cannot happen here
      Advance(*static_cast<Session*>(tag), ok);
    }
    queue_.Shutdown();
    void* tag = nullptr;
    bool ok = false;
    while (queue_.Next(&tag, &ok)) {
    }
  }

 private:
  enum class Op { kStart, kWrite, kRead, kWritesDone, kReadExtra, kFinish, kIdle };

  struct Session {
    int64_t index = 0;
    SessionResult* result = nullptr;
    // The decode steps' rows, made with the prefill's (which go into its request):
    // (1, N, d_q), and an attention-only model's (1, N, d_k), (1, N, d_v).
    Tensor tokens;
    Tensor keys, values;
    grpc::ClientContext context;
    std::unique_ptr<grpc::ClientAsyncReaderWriter<SessionRequest, SessionResponse>> stream;
    Op op = Op::kIdle;
    SessionRequest request;
    SessionResponse response;
    grpc::Status status;
    int64_t step = -1;  // -1: the prefill; n: decode step n
    int64_t start_ns = 0;
    std::string if_ok;  // the error when the stream ends OK where it should not
  };

  static constexpr absl::string_view kCall = "AttendSession";

  std::string StepName(const Session& session) const {
    const DecodeOptions& o = shared_.options();
    if (session.step < 0) return PrefillName(o.prefill);
    if (session.step >= o.decode_tokens) return "end of the session";
    return DecodeStepName(session.step, o.decode_tokens, o.prefill + session.step + 1);
  }

  void Advance(Session& session, bool ok) {
    switch (session.op) {
      case Op::kStart:
        if (!ok) return Finish(session, "the server ended the session without answering the step");
        return SendPrefill(session);
      case Op::kWrite:
        if (!ok) return Finish(session, "the server ended the session without answering the step");
        session.op = Op::kRead;
        return session.stream->Read(&session.response, &session);
      case Op::kRead:
        if (!ok) return Finish(session, "the server ended the session without answering the step");
        return Answered(session);
      case Op::kWritesDone:
        session.op = Op::kReadExtra;
        return session.stream->Read(&session.response, &session);
      case Op::kReadExtra:
        if (ok) {
          session.context.TryCancel();
          Fail(InStep(absl::InternalError("the server sent a response no step asked for"), kCall,
                      session.index, StepName(session)));
        }
        return Finish(session, "");
      case Op::kFinish:
        return Finished(session);
      case Op::kIdle:
        return;
    }
  }

  // Opens waiting sessions' streams (each then sends its prefill) while fewer than
  // kPrefillWindow are between their start and their prefill's answer. A session's
  // stream opens only when its turn comes, so the server never holds it idle.
  void StartWaiting() {
    const DecodeOptions& o = shared_.options();
    while (!waiting_.empty() && prefills_in_flight_ < kPrefillWindow && !shared_.failed()) {
      Session& session = *waiting_.front();
      waiting_.pop_front();
      // The stream is one call carrying N + 1 steps: --timeout for each.
      SetTimeout(&session.context, o.timeout * (o.decode_tokens + 1));
      shared_.calls().Track(&session.context);
      session.stream = stub_->PrepareAsyncAttendSession(&session.context, &queue_);
      session.op = Op::kStart;
      ++prefills_in_flight_;
      session.stream->StartCall(&session);
    }
  }

  // The session's tokens are made here: the prefill's rows go into its request, and
  // only the decode steps' rows are kept.
  void SendPrefill(Session& session) {
    const DecodeOptions& o = shared_.options();
    SessionRequest& request = session.request;
    request.set_model(o.model);
    request.set_model_version(o.model_version);
    request.set_causal(true);
    auto split = [&](const Tensor& all, Tensor* prefill_rows, Tensor* decode_rows) {
      CopyRows(all, 0, o.prefill, prefill_rows);
      CopyRows(all, o.prefill, o.decode_tokens, decode_rows);
    };
    split(SessionTokens(o, session.index, shared_.model().query_size()), request.mutable_queries(),
          &session.tokens);
    if (IsWorker(shared_.model())) {  // CROSS, causal: each step brings its q, k, v
      request.set_kind(attention::v1::CROSS);
      split(SessionKeys(o, session.index, shared_.model().key_size(), 1), request.mutable_keys(),
            &session.keys);
      split(SessionKeys(o, session.index, shared_.model().value_size(), 2),
            request.mutable_values(), &session.values);
    } else {
      request.set_kind(attention::v1::SELF);
    }
    Send(session);
  }

  // Decode step session.step: one token.
  void SendStep(Session& session) {
    CopyRows(session.tokens, session.step, 1, session.request.mutable_queries());
    if (IsWorker(shared_.model())) {
      CopyRows(session.keys, session.step, 1, session.request.mutable_keys());
      CopyRows(session.values, session.step, 1, session.request.mutable_values());
    }
    Send(session);
  }

  void Send(Session& session) {
    session.op = Op::kWrite;
    session.start_ns = SteadyNowNs();
    session.stream->Write(session.request, &session);
  }

  // A step's response: `context` keys cached after it, an output row per new token.
  void Answered(Session& session) {
    const DecodeOptions& o = shared_.options();
    const Sample sample = TimedSample(session.start_ns, session.response.timing());
    const bool prefill = session.step < 0;
    const int64_t context = o.prefill + session.step + 1;
    const int64_t new_tokens = prefill ? o.prefill : 1;
    OutputSums unused_sums;
    absl::Status checked =
        session.response.context_tokens() == context
            ? CheckOutput(session.response.output(), new_tokens, shared_.model().num_hiddens(),
                          prefill ? &unused_sums : &session.result->output)
            : absl::InternalError(absl::StrCat("the server reports context_tokens ",
                                               session.response.context_tokens(), ", expected ",
                                               context));
    if (!checked.ok()) {
      Fail(InStep(checked, kCall, session.index, StepName(session)));
      return Finish(session, "");
    }
    if (prefill) {
      session.result->prefill = sample;
      session.op = Op::kIdle;
      // Options are the first message's: later ones carry only their tokens. The
      // prefill's request and response are let go of, not cleared (which keeps their
      // capacity: about 170 MB a session at 4,032 tokens of an attention-only layer).
      session.request = SessionRequest();
      session.response = SessionResponse();
      --prefills_in_flight_;
      ++prefilled_;
      barrier_deadline_ = absl::Now() + o.timeout;
      if (prefilled_ == o.sessions) return StartDecoding();
      StartWaiting();
      return;
    }
    session.result->steps.push_back({context, sample});
    Next(session);
  }

  // Every session prefilled: the decode phase starts for all at once, so that no
  // decode step shares the server with another session's prefill.
  void StartDecoding() {
    decoding_ = true;
    for (auto& session : sessions_) {
      if (session->op != Op::kIdle) continue;
      session->result->decode_start_ns = SteadyNowNs();
      Next(*session);
    }
  }

  // The session's next decode step, or its half-close after the last.
  void Next(Session& session) {
    const DecodeOptions& o = shared_.options();
    ++session.step;
    if (shared_.failed()) return Finish(session, "");
    if (session.step < o.decode_tokens) return SendStep(session);
    session.result->decode_end_ns = SteadyNowNs();
    session.op = Op::kWritesDone;
    session.stream->WritesDone(&session);
  }

  void Finish(Session& session, absl::string_view if_ok) {
    session.if_ok = std::string(if_ok);
    session.op = Op::kFinish;
    session.stream->Finish(&session.status, &session);
  }

  void Finished(Session& session) {
    session.op = Op::kIdle;
    session.stream.reset();
    --unfinished_;
    shared_.calls().Untrack(&session.context);
    absl::Status status = FromGrpcStatus(session.status);
    if (status.ok() && !session.if_ok.empty()) status = absl::InternalError(session.if_ok);
    if (!status.ok()) Fail(InStep(status, kCall, session.index, StepName(session)));
  }

  // Fails the run (the first failure is kept) and ends the sessions that wait at
  // the prefill barrier; those with an operation in flight end when it does, and
  // those whose turn to start had not come never start.
  void Fail(const absl::Status& status) {
    shared_.Fail(status);
    unfinished_ -= static_cast<int64_t>(waiting_.size());
    waiting_.clear();
    for (auto& session : sessions_) {
      if (session->op == Op::kIdle && session->stream != nullptr) {
        session->context.TryCancel();
        Finish(*session, "");
      }
    }
  }

  Shared& shared_;
  std::unique_ptr<AttentionService::Stub> stub_;
  std::vector<SessionResult>& results_;
  grpc::CompletionQueue queue_;
  std::vector<std::unique_ptr<Session>> sessions_;
  int64_t unfinished_ = static_cast<int64_t>(results_.size());
  int64_t prefilled_ = 0;
  absl::Time barrier_deadline_;  // --timeout after the last prefill answered
  bool decoding_ = false;
  // Sessions between their stream's start and their prefill's answer, at most. Each
  // prefill holds its request on the client (and on the server until it runs) and
  // then its response: 99 MB and 66 MB for 4,032 tokens of an attention-only Llama
  // layer. With all of them in flight, 64 such sessions needed 17.7 GB of client
  // memory; the decode phase, which starts once every session has prefilled, is the
  // same either way.
  static constexpr int64_t kPrefillWindow = 4;
  int64_t prefills_in_flight_ = 0;
  std::deque<Session*> waiting_;  // not started yet, in order
};

// The same session through unary Attend: the prefill as causal self-attention, then
// each step's token attending to every token so far (itself included) sent as keys
// and values.
void StatelessSession(Shared& shared, int64_t s, SessionResult& result) {
  const DecodeOptions& o = shared.options();
  const int64_t p_o = shared.model().num_hiddens();
  const Tensor tokens = SessionTokens(o, s, shared.model().query_size());
  const bool worker = IsWorker(shared.model());
  // Self-attention reads the tokens as keys and values; a worker has its own.
  const Tensor keys = worker ? SessionKeys(o, s, shared.model().key_size(), 1) : tokens;
  const Tensor values = worker ? SessionKeys(o, s, shared.model().value_size(), 2) : tokens;
  constexpr absl::string_view kCall = "Attend";
  // The SDK's unary Attend, on the run's channel; a failure elsewhere cancels it.
  std::unique_ptr<Connection> connection =
      Connection::OverChannel(Protocol::kAttention, shared.channel(), o.timeout)
          .value();  // cannot fail over gRPC
  connection->set_call_group(&shared.calls());

  auto call = [&](const AttendRequest& request, int64_t new_tokens,
                  OutputSums* sums) -> absl::StatusOr<Sample> {
    const int64_t start_ns = SteadyNowNs();
    MHA_ASSIGN_OR_RETURN(const AttendResponse response, connection->Attend(request));
    const Sample sample = TimedSample(start_ns, response.timing());
    MHA_RETURN_IF_ERROR(CheckOutput(response.output(), new_tokens, p_o, sums));
    return sample;
  };

  AttendRequest request;
  request.set_model(o.model);
  request.set_model_version(o.model_version);
  request.set_causal(true);
  CopyRows(tokens, 0, o.prefill, request.mutable_queries());
  if (worker) {
    CopyRows(keys, 0, o.prefill, request.mutable_keys());
    CopyRows(values, 0, o.prefill, request.mutable_values());
  }
  OutputSums unused_sums;
  absl::StatusOr<Sample> prefill = call(request, o.prefill, &unused_sums);
  if (prefill.ok()) {
    result.prefill = *prefill;
  } else {
    shared.Fail(InStep(prefill.status(), kCall, s, PrefillName(o.prefill)));
  }
  shared.PrefillDone(s);
  if (shared.failed()) return;

  // Keys and values grow by a row a step; causal would leave the single query
  // (position 0) only key 0.
  request.set_causal(false);
  CopyRows(keys, 0, o.prefill, request.mutable_keys());
  CopyRows(values, 0, o.prefill, request.mutable_values());
  result.decode_start_ns = SteadyNowNs();
  for (int64_t n = 0; n < o.decode_tokens && !shared.failed(); ++n) {
    const int64_t row = o.prefill + n, context = row + 1;
    CopyRows(tokens, row, 1, request.mutable_queries());
    AppendRow(keys, row, request.mutable_keys());
    AppendRow(values, row, request.mutable_values());
    absl::StatusOr<Sample> sample = call(request, 1, &result.output);
    if (!sample.ok()) {
      shared.Fail(InStep(sample.status(), kCall, s, DecodeStepName(n, o.decode_tokens, context)));
      return;
    }
    result.steps.push_back({context, *sample});
  }
  result.decode_end_ns = SteadyNowNs();
}

std::string BucketLabel(size_t bucket) {
  return bucket < std::size(kBucketBounds) ? absl::StrCat("<=", kBucketBounds[bucket])
                                           : absl::StrCat(">", kBucketBounds[bucket - 1]);
}

// The report's numbers from every session's results (all of them succeeded).
void Aggregate(const std::vector<SessionResult>& results, DecodeReport& report) {
  Window prefill, decode;
  std::vector<Window> buckets(kBuckets);
  int64_t start_ns = std::numeric_limits<int64_t>::max(), end_ns = 0;
  for (const SessionResult& r : results) {
    prefill.samples.push_back(r.prefill);
    for (const DecodeStep& step : r.steps) {
      decode.samples.push_back(step.sample);
      buckets[BucketOf(step.context)].samples.push_back(step.sample);
    }
    start_ns = std::min(start_ns, r.decode_start_ns);
    end_ns = std::max(end_ns, r.decode_end_ns);
    report.output_sum += r.output.sum;
    report.output_abs_sum += r.output.abs_sum;
  }
  // A decode step is one token: tokens/s are Summarize's responses per second.
  decode.duration_ns = std::max<int64_t>(end_ns - start_ns, 0);
  report.prefill = Summarize(absl::MakeConstSpan(&prefill, 1), 0);
  report.decode = Summarize(absl::MakeConstSpan(&decode, 1), 1);
  report.decode_tokens = report.decode.ok;
  report.decode_tokens_per_s = report.decode.tokens_per_s;
  for (size_t b = 0; b < kBuckets; ++b) {
    if (buckets[b].samples.empty()) continue;
    report.buckets.push_back({.max_context = b < std::size(kBucketBounds) ? kBucketBounds[b] : 0,
                              .label = BucketLabel(b),
                              .stats = Summarize(absl::MakeConstSpan(&buckets[b], 1), 0)});
  }
}

}  // namespace

bool IsWorker(const ModelInfo& model) { return model.projections() == "none"; }

absl::Status CheckDecodeOptions(const DecodeOptions& options) {
  MHA_RETURN_IF_ERROR(CheckAtLeast("sessions", options.sessions, 1));
  if (options.sessions > kMaxDecodeSessions) {
    return UsageError(absl::StrCat("--sessions: at most ", kMaxDecodeSessions,
                                   " (--stateless runs a thread each), got ", options.sessions));
  }
  MHA_RETURN_IF_ERROR(CheckAtLeast("prefill", options.prefill, 1));
  MHA_RETURN_IF_ERROR(CheckAtLeast("decode_tokens", options.decode_tokens, 1));
  return CheckPositive("timeout", options.timeout);
}

absl::StatusOr<DecodeReport> RunDecode(const DecodeOptions& options,
                                       const std::shared_ptr<grpc::Channel>& channel,
                                       const ModelInfo& model) {
  MHA_RETURN_IF_ERROR(CheckDecodeOptions(options));
  if (channel == nullptr) return absl::InvalidArgumentError("decode: no channel");
  if (!model.supports_self_attention() && !IsWorker(model)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model ", model.name(), " has d_q ", model.query_size(), ", d_k ", model.key_size(),
        ", d_v ", model.value_size(), " and cannot self-attend: decode needs d_k = d_v = d_q"));
  }
  Shared shared(options, channel, model);
  std::vector<SessionResult> results(static_cast<size_t>(options.sessions));
  if (!options.stateless) {
    SessionDriver(shared, results).Run();
  } else {
    std::vector<std::jthread> threads;
    threads.reserve(results.size());
    for (int64_t s = 0; s < options.sessions; ++s) {
      try {
        threads.emplace_back([&shared, &results, s] {
          StatelessSession(shared, s, results[static_cast<size_t>(s)]);
        });
      } catch (const std::system_error& e) {  // out of threads: stop those started
        shared.Fail(absl::ResourceExhaustedError(
            absl::StrCat("decode: cannot start session ", s, "'s thread: ", e.what())));
        shared.Abandon(options.sessions - s);
        break;
      }
    }
  }  // joins
  if (absl::Status status = shared.status(); !status.ok()) {
    if (status.code() == absl::StatusCode::kUnimplemented && !options.stateless) {
      return absl::Status(status.code(),
                          absl::StrCat(status.message(),
                                       "; does the server implement AttendSession? --stateless "
                                       "runs the same load through Attend"));
    }
    return status;
  }
  DecodeReport report;
  report.options = options;
  report.model = model;
  report.calls =
      options.stateless ? options.sessions * (1 + options.decode_tokens) : options.sessions;
  Aggregate(results, report);
  // The K/V cache a decode step reads: every cached token's key and value, G heads.
  const double element = model.kv_cache_precision() == "bf16" ? 2.0 : 4.0;
  const double per_token = static_cast<double>(model.key_size() + model.value_size()) * element;
  if (IsWorker(model)) {
    double bytes = 0;
    for (const SessionResult& r : results) {
      for (const DecodeStep& step : r.steps) bytes += static_cast<double>(step.context) * per_token;
    }
    report.cache_bytes_read = bytes;
    report.cache_bytes_per_step =
        report.decode.ok > 0 ? bytes / static_cast<double>(report.decode.ok) : 0;
    report.cache_gb_per_s =
        report.decode.duration_s > 0 ? bytes / report.decode.duration_s / 1e9 : 0;
  }
  return report;
}

}  // namespace mha::client

// AttendSession on the real server process over loopback: sessions fed in any
// chunking equal stateless Attend on the whole sequence; cross-attention sessions;
// interleaved sessions; the cache budget, token limit and idle timeout, each ending
// only its own stream; bad steps; SIGTERM with sessions open.
#include <signal.h>
#include <sys/wait.h>

#include <cmath>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/integration/client_util.h"
#include "tests/integration/metrics_scrape.h"
#include "tests/integration/server_process.h"

namespace mha::testing {
namespace {

using attention::v1::SessionRequest;
using attention::v1::SessionResponse;

// Server steps (paged, plain-loop attention) against a stateless Attend of the same
// f32 layer (oneDNN's GEMMs): the same sums in different orders.
constexpr float kTolerance = 1e-5f;

// (1, n, d) of uniform values in [-1, 1).
std::vector<float> Random(int64_t n, int64_t d, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> v(static_cast<size_t>(n * d));
  for (float& x : v) x = dist(rng);
  return v;
}

std::vector<float> StatelessCausal(AttentionService::Stub& stub, const std::string& model,
                                   const std::vector<float>& x, int64_t n, int64_t d) {
  AttendRequest request;
  request.set_model(model);
  *request.mutable_queries() = Rows(x, d, 0, n);
  request.set_causal(true);
  AttendResponse response;
  const grpc::Status status = Attend(stub, request, &response);
  EXPECT_TRUE(status.ok()) << status.error_message();
  return {response.output().data().begin(), response.output().data().end()};
}

class SessionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    repository_.Write("toy/config.pbtxt", "num_hiddens: 100 num_heads: 5 seeded { seed: 0 }");
    repository_.Write("toy_bias/config.pbtxt",
                      "num_hiddens: 100 num_heads: 5 bias: true seeded { seed: 2 }");
    repository_.Write("bert/config.pbtxt",
                      "num_hiddens: 768 num_heads: 12 bias: true seeded { seed: 1 }");
    repository_.Write("bert_nobias/config.pbtxt",
                      "num_hiddens: 768 num_heads: 12 seeded { seed: 4 }");
    repository_.Write("cross/config.pbtxt",
                      "num_hiddens: 8 num_heads: 2 query_size: 4 key_size: 6 value_size: 3 "
                      "bias: true seeded { seed: 3 }");
    repository_.Write("short/config.pbtxt",
                      "num_hiddens: 100 num_heads: 5 seeded { seed: 0 } "
                      "limits { max_session_tokens: 40 }");
  }
  void Start(std::vector<std::string> args = {}) {
    args.insert(args.begin(),
                {"--port=0", "--default_warmup=false", "--model_repository=" + repository_.path()});
    auto server = ServerProcess::Start(args);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    stub_ = Connect(server_->target());
  }
  void TearDown() override {
    if (server_ == nullptr) return;
    stub_.reset();
    server_->Signal(SIGTERM);
    const std::optional<int> status = server_->WaitForExit(absl::Seconds(30));
    ASSERT_TRUE(status.has_value()) << "server did not exit";
    EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0) << server_->log();
  }
  // -1 when /metrics cannot be read or lacks the series.
  double Metric(const std::string& series) {
    const absl::StatusOr<std::string> text = ScrapeMetrics(server_->metrics_port());
    if (!text.ok()) return -1;
    return FindMetric(*text, series).value_or(-1);
  }

  TempDir repository_;
  std::unique_ptr<ServerProcess> server_;
  std::unique_ptr<AttentionService::Stub> stub_;
};

TEST_F(SessionTest, AnyChunkingEqualsStatelessCausalAttend) {
  Start();
  for (const auto& [model, d] : std::vector<std::pair<std::string, int64_t>>{
           {"toy", 100}, {"toy_bias", 100}, {"bert", 768}, {"bert_nobias", 768}}) {
    const int64_t n = 70;  // over two 32-token blocks
    const std::vector<float> x = Random(n, d, 17);
    const std::vector<float> want = StatelessCausal(*stub_, model, x, n, d);
    ASSERT_EQ(static_cast<int64_t>(want.size()), n * (d == 100 ? 100 : 768));
    for (const std::vector<int64_t>& chunks :
         {std::vector<int64_t>(n, 1), std::vector<int64_t>{n}, std::vector<int64_t>{33, 1, 36},
          std::vector<int64_t>{5, 27, 32, 6}}) {
      Session session(*stub_, model, /*causal=*/true);
      std::vector<float> got;
      int64_t at = 0;
      for (int64_t t : chunks) {
        std::optional<SessionResponse> r = session.SelfStep(x, d, at, t);
        ASSERT_TRUE(r.has_value()) << model << ": " << session.status().error_message();
        at += t;
        EXPECT_EQ(r->context_tokens(), at);
        ASSERT_EQ(r->output().shape(1), t);
        got.insert(got.end(), r->output().data().begin(), r->output().data().end());
      }
      EXPECT_LE(MaxAbsDiff(got, want), kTolerance) << model << " in " << chunks.size() << " chunks";
      EXPECT_TRUE(session.Close().ok());
    }
  }
}

// Issue 34: a grouped-query rotary model (h 8, G 2, rope theta 500000) served through
// attention.v1. Its sessions in any chunking equal one stateless causal Attend on the
// whole sequence; its cache holds G heads per token (2 G d_h 4 bytes, compared at
// whole 32-token blocks); ListModels gives the resolved fields; CROSS is refused
// naming `kind`.
TEST_F(SessionTest, GroupedRotarySessionsEqualStatelessAttend) {
  repository_.Write("gqa/config.pbtxt",
                    "num_hiddens: 64 num_heads: 8 num_kv_heads: 2 bias: true "
                    "rope { theta: 500000 } seeded { seed: 5 }");
  repository_.Write("gqa_bf16_cache/config.pbtxt",
                    "num_hiddens: 64 num_heads: 8 num_kv_heads: 2 bias: true "
                    "rope { theta: 500000 } seeded { seed: 5 } kv_cache_precision: \"bf16\"");
  Start();
  const int64_t n = 64, d = 64;  // two whole blocks
  const std::vector<float> x = Random(n, d, 23);
  const std::vector<float> want = StatelessCausal(*stub_, "gqa", x, n, d);
  ASSERT_EQ(static_cast<int64_t>(want.size()), n * d);
  for (const std::vector<int64_t>& chunks :
       {std::vector<int64_t>(n, 1), std::vector<int64_t>{n}, std::vector<int64_t>{5, 27, 32}}) {
    Session session(*stub_, "gqa", /*causal=*/true);
    std::vector<float> got;
    int64_t at = 0;
    for (int64_t t : chunks) {
      std::optional<SessionResponse> r = session.SelfStep(x, d, at, t);
      ASSERT_TRUE(r.has_value()) << session.status().error_message();
      at += t;
      got.insert(got.end(), r->output().data().begin(), r->output().data().end());
    }
    EXPECT_LE(MaxAbsDiff(got, want), kTolerance) << chunks.size() << " chunks";
    EXPECT_EQ(Metric("mha_session_cache_bytes"), n * 2 * 2 * 8 * 4);  // 2 G d_h f32 per token
    EXPECT_TRUE(session.Close().ok());
  }
  {
    // The same layer with a bf16 cache: 2 G d_h 2 bytes per token, and the f32
    // answer within a relative Frobenius error of 1e-2 (the bound).
    Session session(*stub_, "gqa_bf16_cache", /*causal=*/true);
    std::optional<SessionResponse> r = session.SelfStep(x, d, 0, n);
    ASSERT_TRUE(r.has_value()) << session.status().error_message();
    EXPECT_EQ(Metric("mha_session_cache_bytes"), n * 2 * 2 * 8 * 2);
    double err = 0, norm = 0;
    for (int64_t i = 0; i < n * d; ++i) {
      const double e = r->output().data(static_cast<int>(i)) - want[i];
      err += e * e;
      norm += static_cast<double>(want[i]) * want[i];
    }
    EXPECT_GT(err, 0.0);  // the cache really is bf16
    EXPECT_LE(std::sqrt(err / norm), 1e-2);
    EXPECT_TRUE(session.Close().ok());
  }
  grpc::ClientContext context;
  attention::v1::ListModelsResponse models;
  ASSERT_TRUE(stub_->ListModels(&context, {}, &models).ok());
  bool found = false;
  for (const attention::v1::ModelInfo& m : models.models()) {
    if (m.name() != "gqa") continue;
    found = true;
    EXPECT_EQ(m.num_kv_heads(), 2);
    EXPECT_EQ(m.rope_theta(), 500000);
    EXPECT_EQ(m.rotary_dim(), 8);
    EXPECT_FALSE(m.rope_interleaved());
    EXPECT_EQ(m.projections(), "full");
    EXPECT_EQ(m.kv_cache_precision(), "f32");
  }
  EXPECT_TRUE(found);
  Session cross(*stub_, "gqa", /*causal=*/false, attention::v1::CROSS);
  SessionRequest step;
  *step.mutable_queries() = Rows(x, d, 0, 1);
  *step.mutable_keys() = Rows(x, d, 0, 1);
  *step.mutable_values() = Rows(x, d, 0, 1);
  EXPECT_FALSE(cross.Step(step).has_value());
  const grpc::Status refused = cross.status();  // Finish: once
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StrContains(refused.error_message(), "kind")) << refused.error_message();
}

TEST_F(SessionTest, CrossSessionEqualsAttendOnTheKeysSoFar) {
  Start();
  Session session(*stub_, "cross", /*causal=*/false, attention::v1::CROSS);
  std::vector<float> keys, values;
  uint64_t seed = 1;
  for (int64_t tk : {7, 0, 40, 2}) {
    const std::vector<float> k = Random(tk, 6, seed++), v = Random(tk, 3, seed++);
    keys.insert(keys.end(), k.begin(), k.end());
    values.insert(values.end(), v.begin(), v.end());
    SessionRequest step;
    if (tk > 0) {
      *step.mutable_keys() = Rows(k, 6, 0, tk);
      *step.mutable_values() = Rows(v, 3, 0, tk);
    }
    // The second step sends no keys; the first only appends.
    const int64_t tq = tk == 7 ? 0 : 3;
    const std::vector<float> q = Random(tq, 4, seed++);
    if (tq > 0) *step.mutable_queries() = Rows(q, 4, 0, tq);
    std::optional<SessionResponse> r = session.Step(step);
    ASSERT_TRUE(r.has_value()) << session.status().error_message();
    const int64_t all = static_cast<int64_t>(keys.size()) / 6;
    EXPECT_EQ(r->context_tokens(), all);
    ASSERT_EQ(r->output().shape(1), tq);
    if (tq == 0) continue;
    AttendRequest request;
    request.set_model("cross");
    *request.mutable_queries() = Rows(q, 4, 0, tq);
    *request.mutable_keys() = Rows(keys, 6, 0, all);
    *request.mutable_values() = Rows(values, 3, 0, all);
    AttendResponse want;
    ASSERT_TRUE(Attend(*stub_, request, &want).ok());
    EXPECT_LE(MaxAbsDiff(r->output().data(), want.output().data()), kTolerance)
        << "after " << all << " keys";
  }
  EXPECT_TRUE(session.Close().ok());
}

// Four sessions decode at once, from four threads: steps of different sessions
// are batched together, and each still equals its own stateless answer.
TEST_F(SessionTest, InterleavedSessionsStayApart) {
  Start();
  constexpr int kSessions = 4;
  constexpr int64_t kPrefix = 20, kDecode = 24, kD = 768;
  std::vector<std::vector<float>> inputs, got(kSessions);
  for (int i = 0; i < kSessions; ++i) inputs.push_back(Random(kPrefix + kDecode, kD, 100 + i));
  std::vector<std::thread> threads;
  std::vector<std::string> errors(kSessions);
  for (int i = 0; i < kSessions; ++i) {
    threads.emplace_back([&, i] {
      auto stub = Connect(server_->target());
      Session session(*stub, "bert", /*causal=*/true);
      std::optional<SessionResponse> r = session.SelfStep(inputs[i], kD, 0, kPrefix);
      for (int64_t t = 0; r.has_value(); ++t) {
        got[i].insert(got[i].end(), r->output().data().begin(), r->output().data().end());
        if (t == kDecode) break;
        r = session.SelfStep(inputs[i], kD, kPrefix + t, 1);
      }
      if (!r.has_value()) errors[i] = session.status().error_message();
      if (!session.Close().ok()) errors[i] += " close failed";
    });
  }
  for (auto& t : threads) t.join();
  for (int i = 0; i < kSessions; ++i) {
    EXPECT_EQ(errors[i], "") << "session " << i;
    const std::vector<float> want =
        StatelessCausal(*stub_, "bert", inputs[i], kPrefix + kDecode, kD);
    EXPECT_LE(MaxAbsDiff(got[i], want), kTolerance) << "session " << i;
  }
  // Steps ran merged at least once (mean rows per forward call above 1).
  const double calls = Metric("mha_batch_size_count{model=\"bert\"}");
  const double rows = Metric("mha_batch_size_sum{model=\"bert\"}");
  EXPECT_GT(rows, calls) << "no two steps ever shared a forward call";
}

// Each limit ends only the stream that meets it, naming the limit.
TEST_F(SessionTest, LimitsEndOnlyTheirOwnSession) {
  // Toy blocks are 2 x 5 heads x 32 tokens x 20 floats = 25,600 bytes: 5 blocks.
  // Sessions take them in chunks of 1, 1, 2, ... blocks (core/kv_cache.h).
  Start({"--session_cache_bytes=128000", "--session_idle_timeout=1s"});
  const std::vector<float> x = Random(200, 100, 5);
  Session a(*stub_, "toy", true);
  ASSERT_TRUE(a.SelfStep(x, 100, 0, 64).has_value());  // 2 blocks
  EXPECT_EQ(Metric("mha_session_cache_bytes"), 2 * 25600);

  Session b(*stub_, "toy", true);
  ASSERT_TRUE(b.SelfStep(x, 100, 0, 40).has_value());    // blocks 3 and 4
  EXPECT_FALSE(b.SelfStep(x, 100, 40, 60).has_value());  // needs a 5th and a 6th
  grpc::Status status = b.status();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_TRUE(absl::StrContains(status.error_message(), "--session_cache_bytes"))
      << status.error_message();
  EXPECT_TRUE(absl::StartsWith(status.error_message(), "step 1: ")) << status.error_message();
  EXPECT_EQ(Metric("mha_session_cache_bytes"), 2 * 25600);  // b's went back

  Session c(*stub_, "short", true);  // max_session_tokens 40
  ASSERT_TRUE(c.SelfStep(x, 100, 0, 32).has_value());
  EXPECT_FALSE(c.SelfStep(x, 100, 32, 9).has_value());
  status = c.status();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_TRUE(absl::StrContains(status.error_message(), "max_session_tokens 40"))
      << status.error_message();

  // a, still stepping every 200 ms, outlives d, which goes idle past 1 s.
  Session d(*stub_, "toy", true);
  ASSERT_TRUE(d.SelfStep(x, 100, 0, 1).has_value());
  for (int64_t t = 64; t < 72; ++t) {  // a's third block: a chunk of 2
    ASSERT_TRUE(a.SelfStep(x, 100, t, 1).has_value()) << a.status().error_message();
    absl::SleepFor(absl::Milliseconds(200));
  }
  EXPECT_FALSE(d.SelfStep(x, 100, 1, 1).has_value());
  status = d.status();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_TRUE(absl::StrContains(status.error_message(), "--session_idle_timeout"))
      << status.error_message();
  EXPECT_TRUE(a.Close().ok());
  EXPECT_EQ(Metric("mha_session_ends_total{reason=\"cache_budget\"}"), 1);
  EXPECT_EQ(Metric("mha_session_ends_total{reason=\"token_limit\"}"), 1);
  EXPECT_EQ(Metric("mha_session_ends_total{reason=\"idle_timeout\"}"), 1);
  EXPECT_EQ(Metric("mha_sessions_active"), 0);
  EXPECT_EQ(Metric("mha_session_cache_bytes"), 0);
  EXPECT_EQ(Metric("mha_session_cached_tokens"), 0);
}

TEST_F(SessionTest, BadStepsEndTheStreamNamingTheField) {
  Start();
  const std::vector<float> x = Random(4, 100, 6);
  struct Case {
    std::string name;
    std::function<void(SessionRequest&)> second;  // the second message
    std::string field;
  };
  const std::vector<Case> cases = {
      {"model later", [](SessionRequest& r) { r.set_model("toy"); }, "model:"},
      {"keys in SELF", [&](SessionRequest& r) { *r.mutable_keys() = Rows(x, 100, 0, 1); }, "keys:"},
      {"no queries", [](SessionRequest& r) { r.clear_queries(); }, "queries:"},
      {"wrong width", [&](SessionRequest& r) { *r.mutable_queries() = Rows(x, 50, 0, 1); },
       "queries:"},
      {"nan", [](SessionRequest& r) { r.mutable_queries()->set_data(3, NAN); }, "queries:"},
  };
  for (const Case& c : cases) {
    Session session(*stub_, "toy", true);
    ASSERT_TRUE(session.SelfStep(x, 100, 0, 2).has_value());
    SessionRequest second;
    *second.mutable_queries() = Rows(x, 100, 2, 1);
    c.second(second);
    EXPECT_FALSE(session.Step(second).has_value()) << c.name;
    const grpc::Status status = session.status();
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << c.name;
    EXPECT_TRUE(absl::StartsWith(status.error_message(), "step 1: " + c.field))
        << c.name << ": " << status.error_message();
  }
  Session unknown(*stub_, "nope", true);
  EXPECT_FALSE(unknown.SelfStep(x, 100, 0, 1).has_value());
  EXPECT_EQ(unknown.status().error_code(), grpc::StatusCode::NOT_FOUND);
  // The server still serves, and every session's cache went back.
  Session fine(*stub_, "toy", true);
  EXPECT_TRUE(fine.SelfStep(x, 100, 0, 4).has_value());
  EXPECT_TRUE(fine.Close().ok());
  EXPECT_EQ(Metric("mha_session_cache_bytes"), 0);
}

// A bert session's prefill of x's 512 rows, with SIGTERM sent once the server
// holds it (its blocks are reserved as it is submitted, so the cache's bytes pass
// `cached_before`): the step is computing then, or, on a fast machine, answered.
std::optional<SessionResponse> PrefillThroughSigterm(ServerProcess& server, Session& busy,
                                                     const std::vector<float>& x,
                                                     const std::function<double()>& cached_bytes,
                                                     double cached_before) {
  std::optional<SessionResponse> answer;
  std::thread prefill([&] { answer = busy.SelfStep(x, 768, 0, 512); });
  for (int i = 0; i < 3000 && cached_bytes() <= cached_before; ++i) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  server.Signal(SIGTERM);
  prefill.join();
  return answer;
}

// SIGTERM: a session waiting for its next message ends at once, one computing
// gets its step's answer first; both end UNAVAILABLE and the server exits 0.
TEST_F(SessionTest, SigtermEndsEverySessionCleanly) {
  Start({"--compute_workers=1", "--drain_timeout=120s"});
  const std::vector<float> x = Random(513, 768, 7);
  Session idle(*stub_, "toy", true);
  ASSERT_TRUE(idle.SelfStep(Random(2, 100, 8), 100, 0, 2).has_value());
  auto stub = Connect(server_->target());
  Session busy(*stub, "bert", true);
  const std::optional<SessionResponse> answer = PrefillThroughSigterm(
      *server_, busy, x, [&] { return Metric("mha_session_cache_bytes"); }, 25600);
  EXPECT_TRUE(answer.has_value()) << busy.status().error_message();
  if (answer.has_value()) {
    EXPECT_EQ(answer->context_tokens(), 512);
    EXPECT_FALSE(busy.SelfStep(x, 768, 512, 1).has_value());
    EXPECT_EQ(busy.status().error_code(), grpc::StatusCode::UNAVAILABLE);
  }
  EXPECT_FALSE(idle.SelfStep(Random(2, 100, 8), 100, 0, 1).has_value());
  const grpc::Status status = idle.status();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_TRUE(absl::StrContains(status.error_message(), "shutting down")) << status.error_message();
  // TearDown waits for the exit and checks it is 0.
}

// A session answered at shutdown whose client sends nothing more ends about a
// second after its answer (the grace that lets the client read it), UNAVAILABLE.
TEST_F(SessionTest, AnAnsweredSessionThatSendsNothingEndsAfterTheShutdownGrace) {
  Start({"--compute_workers=1", "--drain_timeout=120s"});
  Session busy(*stub_, "bert", true);
  const std::optional<SessionResponse> answer = PrefillThroughSigterm(
      *server_, busy, Random(512, 768, 9), [&] { return Metric("mha_session_cache_bytes"); }, 0);
  ASSERT_TRUE(answer.has_value()) << busy.status().error_message();
  const absl::Time answered = absl::Now();
  const grpc::Status status = busy.AwaitEnd();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE) << status.error_message();
  // Kept open for the grace (1 s from the server's write), not --drain_timeout.
  EXPECT_GE(absl::Now() - answered, absl::Milliseconds(500));
  EXPECT_LT(absl::Now() - answered, absl::Seconds(30));
}

}  // namespace
}  // namespace mha::testing

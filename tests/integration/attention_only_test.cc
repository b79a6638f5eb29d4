// The attention-only worker (issue 35) on the real server over loopback: a model with
// projections NONE takes pre-projected q, k, v and answers the heads' contexts and,
// with return_lse, each head's log-sum-exp, in Attend and in CROSS causal sessions;
// a session's partial result merged with a stateless Attend over other keys equals
// one Attend over all of them; the new fields' errors name them.
#include <signal.h>
#include <sys/wait.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
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
#include "tests/integration/server_process.h"

namespace mha::testing {
namespace {

using attention::v1::SessionRequest;
using attention::v1::SessionResponse;

// The server's f32 kernels against the double loop below.
constexpr double kReferenceTolerance = 1e-4;
// The lse merge of two of the server's answers against a third (issue 35: 1e-5).
constexpr double kMergeTolerance = 1e-5;

constexpr int64_t kHeads = 8, kKvHeads = 2, kHeadSize = 16;
constexpr int64_t kE = kHeads * kHeadSize, kEkv = kKvHeads * kHeadSize;

std::vector<float> Random(int64_t n, uint64_t seed, float scale = 1.0f) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> dist(-scale, scale);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = dist(rng);
  return v;
}

Tensor Shaped(const std::vector<float>& x, std::vector<int64_t> shape) {
  Tensor t;
  for (int64_t s : shape) t.add_shape(s);
  t.mutable_data()->Add(x.begin(), x.end());
  return t;
}

// A CROSS session step of tokens [at, at + t) of q (rows of kE), k and v (rows of
// kEkv), return_lse set in the session's first step (at 0).
SessionRequest CrossStep(const std::vector<float>& q, const std::vector<float>& k,
                         const std::vector<float>& v, int64_t at, int64_t t) {
  auto rows = [&](const std::vector<float>& x, int64_t width) {
    return Shaped(std::vector<float>(x.begin() + at * width, x.begin() + (at + t) * width),
                  {1, t, width});
  };
  SessionRequest step;
  if (at == 0) step.set_return_lse(true);
  *step.mutable_queries() = rows(q, kE);
  *step.mutable_keys() = rows(k, kEkv);
  *step.mutable_values() = rows(v, kEkv);
  return step;
}

// One batch row: query t of head i sees keys j < limit[t] of key/value head
// i / (h / G); lse = log sum exp(q.k / sqrt(d)), context = softmax . v; no key: -inf, 0.
void Reference(const std::vector<float>& q, const std::vector<float>& k,
               const std::vector<float>& v, int64_t Q, int64_t K, const std::vector<int64_t>& limit,
               std::vector<double>& out, std::vector<double>& lse) {
  out.assign(Q * kE, 0.0);
  lse.assign(kHeads * Q, -std::numeric_limits<double>::infinity());
  for (int64_t t = 0; t < Q; ++t) {
    for (int64_t i = 0; i < kHeads; ++i) {
      const int64_t g = i / (kHeads / kKvHeads), n = limit.empty() ? K : limit[t];
      if (n == 0) continue;
      std::vector<double> s(n);
      double m = -std::numeric_limits<double>::infinity();
      for (int64_t j = 0; j < n; ++j) {
        double dot = 0;
        for (int64_t x = 0; x < kHeadSize; ++x) {
          dot +=
              static_cast<double>(q[t * kE + i * kHeadSize + x]) * k[j * kEkv + g * kHeadSize + x];
        }
        s[j] = dot / std::sqrt(static_cast<double>(kHeadSize));
        m = std::max(m, s[j]);
      }
      double sum = 0;
      for (double x : s) sum += std::exp(x - m);
      lse[i * Q + t] = m + std::log(sum);
      for (int64_t j = 0; j < n; ++j) {
        const double a = std::exp(s[j] - m) / sum;
        for (int64_t x = 0; x < kHeadSize; ++x) {
          out[t * kE + i * kHeadSize + x] += a * v[j * kEkv + g * kHeadSize + x];
        }
      }
    }
  }
}

template <typename A, typename B>
double Diff(const A& a, const B& b) {
  EXPECT_EQ(static_cast<size_t>(a.size()), static_cast<size_t>(b.size()));
  double worst = 0;
  for (int i = 0; i < static_cast<int>(a.size()) && i < static_cast<int>(b.size()); ++i) {
    const double x = a[i], y = b[i];
    if (std::isinf(x) || std::isinf(y) || std::isnan(x) || std::isnan(y)) {
      if (x != y) return std::numeric_limits<double>::infinity();
      continue;
    }
    worst = std::max(worst, std::abs(x - y));
  }
  return worst;
}

class AttentionOnlyTest : public ::testing::Test {
 protected:
  void SetUp() override {
    repository_.Write("worker/config.pbtxt",
                      absl::StrCat("num_hiddens: ", kE, " num_heads: ", kHeads,
                                   " num_kv_heads: ", kKvHeads, " projections: NONE"));
    repository_.Write("worker_bf16_cache/config.pbtxt",
                      absl::StrCat("num_hiddens: ", kE, " num_heads: ", kHeads, " num_kv_heads: ",
                                   kKvHeads, " projections: NONE kv_cache_precision: \"bf16\""));
    repository_.Write("full/config.pbtxt", "num_hiddens: 100 num_heads: 5 seeded { seed: 0 }");
  }
  void Start(const std::vector<std::string>& flags = {}) {
    std::vector<std::string> args = {"--port=0", "--default_warmup=false",
                                     "--model_repository=" + repository_.path()};
    args.insert(args.end(), flags.begin(), flags.end());
    auto server = ServerProcess::Start(args);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    stub_ = Connect(server_->target());
  }
  void Stop() {
    if (server_ == nullptr) return;
    stub_.reset();
    server_->Signal(SIGTERM);
    const std::optional<int> status = server_->WaitForExit(absl::Seconds(30));
    ASSERT_TRUE(status.has_value()) << "server did not exit";
    EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0) << server_->log();
    server_.reset();
  }
  void TearDown() override { Stop(); }
  AttendRequest Request(const std::vector<float>& q, const std::vector<float>& k,
                        const std::vector<float>& v, int64_t Q, int64_t K) {
    AttendRequest r;
    r.set_model("worker");
    *r.mutable_queries() = Shaped(q, {1, Q, kE});
    *r.mutable_keys() = Shaped(k, {1, K, kEkv});
    *r.mutable_values() = Shaped(v, {1, K, kEkv});
    r.set_return_lse(true);
    return r;
  }

  TempDir repository_;
  std::unique_ptr<ServerProcess> server_;
  std::unique_ptr<AttentionService::Stub> stub_;
};

TEST_F(AttentionOnlyTest, AttendReturnsContextsAndLseOfThePreProjectedHeads) {
  Start();
  const int64_t Q = 4, K = 23;
  const auto q = Random(Q * kE, 1), k = Random(K * kEkv, 2), v = Random(K * kEkv, 3);
  for (bool raw : {false, true}) {
    AttendRequest request = Request(q, k, v, Q, K);
    // Query 1 sees no key (lse -inf, context 0), the others 5, 23, 17.
    const std::vector<int64_t> limits = {5, 0, 23, 17};
    for (int64_t n : limits) request.add_valid_lens(static_cast<int32_t>(n));
    if (raw) {  // the raw encoding answers raw, -inf included
      for (Tensor* t :
           {request.mutable_queries(), request.mutable_keys(), request.mutable_values()}) {
        const std::vector<float> data(t->data().begin(), t->data().end());
        t->clear_data();
        t->set_raw(
            std::string(reinterpret_cast<const char*>(data.data()), data.size() * sizeof(float)));
      }
    }
    AttendResponse response;
    const grpc::Status status = Attend(*stub_, request, &response);
    ASSERT_TRUE(status.ok()) << status.error_message();
    auto values = [raw](const Tensor& t) {
      if (!raw) return std::vector<float>(t.data().begin(), t.data().end());
      std::vector<float> out(t.raw().size() / sizeof(float));
      std::memcpy(out.data(), t.raw().data(), t.raw().size());
      return out;
    };
    ASSERT_EQ(response.output().shape_size(), 3);
    EXPECT_EQ(response.output().shape(2), kE);
    ASSERT_EQ(response.lse().shape_size(), 3);
    EXPECT_EQ(response.lse().shape(0), 1);
    EXPECT_EQ(response.lse().shape(1), kHeads);
    EXPECT_EQ(response.lse().shape(2), Q);
    std::vector<double> want, want_lse;
    Reference(q, k, v, Q, K, limits, want, want_lse);
    EXPECT_LE(Diff(values(response.output()), want), kReferenceTolerance) << "raw " << raw;
    EXPECT_LE(Diff(values(response.lse()), want_lse), kReferenceTolerance) << "raw " << raw;
    EXPECT_EQ(values(response.lse())[0 * Q + 1], -std::numeric_limits<float>::infinity());
  }
  // Without return_lse there is no lse tensor.
  AttendRequest plain = Request(q, k, v, Q, K);
  plain.set_return_lse(false);
  AttendResponse response;
  ASSERT_TRUE(Attend(*stub_, plain, &response).ok());
  EXPECT_FALSE(response.has_lse());
}

TEST_F(AttentionOnlyTest, GetModelDescribesTheWorker) {
  Start();
  grpc::ClientContext context;
  attention::v1::GetModelRequest get;
  get.set_model("worker");
  attention::v1::ModelInfo info;
  ASSERT_TRUE(stub_->GetModel(&context, get, &info).ok());
  EXPECT_EQ(info.projections(), "none");
  EXPECT_EQ(info.query_size(), kE);
  EXPECT_EQ(info.key_size(), kEkv);
  EXPECT_EQ(info.value_size(), kEkv);
  EXPECT_EQ(info.num_kv_heads(), kKvHeads);
  EXPECT_FALSE(info.supports_self_attention());
}

// The disaggregated decode: the session holds the old tokens; the recent ones go to
// a stateless Attend; merged by lse they equal one Attend over every key.
TEST_F(AttentionOnlyTest, SessionPartialMergedWithStatelessAttendEqualsFullAttention) {
  Start();
  for (const std::string model : {"worker", "worker_bf16_cache"}) {
    const int64_t n = 150, recent = 30;
    const auto k = Random((n + recent) * kEkv, 10, 2.0f), v = Random((n + recent) * kEkv, 11);
    const auto q_prefix = Random(n * kE, 12);
    Session session(*stub_, model, /*causal=*/true, attention::v1::CROSS);
    // The prefix in two steps, then a decode step of one token whose lse is read.
    std::optional<SessionResponse> last;
    int64_t at = 0;
    for (int64_t t : {int64_t{100}, n - 1 - 100, int64_t{1}}) {
      last = session.Step(CrossStep(q_prefix, k, v, at, t));
      ASSERT_TRUE(last.has_value()) << session.status().error_message();
      ASSERT_EQ(last->lse().shape_size(), 3);
      EXPECT_EQ(last->lse().shape(1), kHeads);
      EXPECT_EQ(last->lse().shape(2), t);
      at += t;
    }
    EXPECT_EQ(last->context_tokens(), n);
    const std::vector<float> q(q_prefix.end() - kE, q_prefix.end());
    const std::vector<float> k_recent(k.begin() + n * kEkv, k.end());
    const std::vector<float> v_recent(v.begin() + n * kEkv, v.end());
    AttendResponse other, all;
    ASSERT_TRUE(Attend(*stub_, Request(q, k_recent, v_recent, 1, recent), &other).ok());
    ASSERT_TRUE(Attend(*stub_, Request(q, k, v, 1, n + recent), &all).ok());
    // The merge: m = max(l1, l2), w_i = exp(l_i - m), c = sum w_i c_i / sum w_i.
    std::vector<double> merged(kE), merged_lse(kHeads);
    for (int64_t i = 0; i < kHeads; ++i) {
      const double l1 = last->lse().data(i), l2 = other.lse().data(i), m = std::max(l1, l2);
      const double w1 = std::exp(l1 - m), w2 = std::exp(l2 - m);
      merged_lse[i] = m + std::log(w1 + w2);
      for (int64_t x = 0; x < kHeadSize; ++x) {
        const int64_t c = i * kHeadSize + x;
        merged[c] = (w1 * last->output().data(c) + w2 * other.output().data(c)) / (w1 + w2);
      }
    }
    if (model == "worker") {  // f32 cache: the same sums
      EXPECT_LE(Diff(all.output().data(), merged), kMergeTolerance);
      EXPECT_LE(Diff(all.lse().data(), merged_lse), kMergeTolerance);
    } else {  // bf16 cache: the session read rounded keys and values (2^-9 relative)
      EXPECT_LE(Diff(all.output().data(), merged), 2e-2);
      EXPECT_LE(Diff(all.lse().data(), merged_lse), 2e-2);
    }
    EXPECT_GT(Diff(all.output().data(), last->output().data()), 1e-3);
    EXPECT_TRUE(session.Close().ok());
  }
}

// Sessions decoding together, their steps answered when their call has ended (the
// default) and as each ends (--session_answers=step_end): every decode step's
// contexts and lse equal the reference over the session's keys so far, and the
// sessions' steps shared calls.
TEST_F(AttentionOnlyTest, SessionsDecodingTogetherMatchTheReferenceEitherWayOfAnswering) {
  constexpr int kSessions = 3;
  constexpr int64_t kPrefill = 40, kSteps = 12, kTokens = kPrefill + kSteps;
  std::vector<std::vector<float>> q, k, v;
  for (int s = 0; s < kSessions; ++s) {
    q.push_back(Random(kTokens * kE, 100 + s));
    k.push_back(Random(kTokens * kEkv, 200 + s, 2.0f));
    v.push_back(Random(kTokens * kEkv, 300 + s));
  }
  for (const std::string answers : {"call_end", "step_end"}) {
    SCOPED_TRACE(answers);
    Start({"--session_answers=" + answers});
    std::vector<std::vector<SessionResponse>> responses(kSessions);
    std::vector<std::string> errors(kSessions);
    std::vector<std::thread> threads;
    for (int s = 0; s < kSessions; ++s) {
      threads.emplace_back([&, s] {
        Session session(*stub_, "worker", /*causal=*/true, attention::v1::CROSS);
        for (int64_t at = 0; at < kTokens;) {
          const int64_t t = at == 0 ? kPrefill : 1;
          std::optional<SessionResponse> response =
              session.Step(CrossStep(q[s], k[s], v[s], at, t));
          if (!response.has_value()) {
            errors[s] = session.status().error_message();
            return;
          }
          responses[s].push_back(*std::move(response));
          at += t;
        }
        if (const grpc::Status closed = session.Close(); !closed.ok()) {
          errors[s] = closed.error_message();
        }
      });
    }
    for (std::thread& thread : threads) thread.join();
    int64_t most_rows = 0;
    for (int s = 0; s < kSessions; ++s) {
      SCOPED_TRACE(s);
      ASSERT_EQ(errors[s], "");
      ASSERT_EQ(responses[s].size(), static_cast<size_t>(kSteps + 1));
      for (int64_t i = 0; i < kSteps; ++i) {
        const SessionResponse& r = responses[s][i + 1];
        const int64_t n = kPrefill + i + 1;  // keys the step's query sees, its own included
        EXPECT_EQ(r.context_tokens(), n);
        std::vector<double> out, lse;
        Reference(std::vector<float>(q[s].begin() + (n - 1) * kE, q[s].begin() + n * kE), k[s],
                  v[s], 1, n, {}, out, lse);
        EXPECT_LE(Diff(r.output().data(), out), kReferenceTolerance) << "step " << i;
        EXPECT_LE(Diff(r.lse().data(), lse), kReferenceTolerance) << "step " << i;
        most_rows = std::max(most_rows, r.timing().batch_rows());
      }
    }
    EXPECT_GE(most_rows, 2) << "the sessions' steps never shared a call";
    Stop();
  }
}

TEST_F(AttentionOnlyTest, NewFieldsAreRefusedNamingThem) {
  Start();
  // return_lse on a FULL model: Attend and a session's first message.
  AttendRequest full = ToyRequest();
  full.set_model("full");
  full.set_return_lse(true);
  AttendResponse response;
  grpc::Status status = Attend(*stub_, full, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StartsWith(status.error_message(), "return_lse:")) << status.error_message();
  {
    Session session(*stub_, "full", true);
    SessionRequest first;
    first.set_return_lse(true);
    *first.mutable_queries() = Shaped(Random(100, 4), {1, 1, 100});
    EXPECT_FALSE(session.Step(first).has_value());
    const grpc::Status ended = session.status();  // Finish: once
    EXPECT_EQ(ended.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_TRUE(absl::StrContains(ended.error_message(), "return_lse:")) << ended.error_message();
  }
  // The worker: keys required; sessions CROSS with causal true.
  AttendRequest self;
  self.set_model("worker");
  *self.mutable_queries() = Shaped(Random(kE, 5), {1, 1, kE});
  status = Attend(*stub_, self, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StrContains(status.error_message(), "keys")) << status.error_message();
  const struct {
    attention::v1::SessionKind kind;
    bool causal;
    const char* field;
  } sessions[] = {{attention::v1::SELF, true, "kind:"}, {attention::v1::CROSS, false, "causal:"}};
  for (const auto& c : sessions) {
    Session session(*stub_, "worker", c.causal, c.kind);
    SessionRequest first;
    *first.mutable_queries() = Shaped(Random(kE, 6), {1, 1, kE});
    *first.mutable_keys() = Shaped(Random(kEkv, 7), {1, 1, kEkv});
    *first.mutable_values() = Shaped(Random(kEkv, 8), {1, 1, kEkv});
    EXPECT_FALSE(session.Step(first).has_value()) << c.field;
    const grpc::Status ended = session.status();  // Finish: once
    EXPECT_EQ(ended.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << c.field;
    EXPECT_TRUE(absl::StrContains(ended.error_message(), c.field)) << ended.error_message();
  }
}

// Hostile requests to the worker: wrong widths, missing or non-finite tensors, a
// causal step with unequal keys, return_lse sent after the first message (ignored:
// the first fixes a session's settings); each refusal names its field and the server
// keeps serving.
TEST_F(AttentionOnlyTest, HostileRequestsAreRefusedNamingTheField) {
  Start();
  const int64_t K = 5;
  const auto q = Random(kE, 20), k = Random(K * kEkv, 21), v = Random(K * kEkv, 22);
  struct Case {
    const char* name;
    std::function<void(AttendRequest&)> spoil;
    const char* field;
  };
  const std::vector<Case> cases = {
      {"keys as wide as the queries",
       [&](AttendRequest& r) {
         *r.mutable_keys() = Shaped(Random(K * kE, 23), {1, K, kE});
       },
       "keys:"},
      {"no values", [](AttendRequest& r) { r.clear_values(); }, "values"},
      {"nan key", [](AttendRequest& r) { r.mutable_keys()->set_data(7, NAN); }, "keys:"},
      {"inf query",
       [](AttendRequest& r) {
         r.mutable_queries()->set_data(0, std::numeric_limits<float>::infinity());
       },
       "queries:"},
      {"head_mask of G entries",
       [](AttendRequest& r) {
         for (int i = 0; i < kKvHeads; ++i) r.add_head_mask(1.0f);
       },
       "head_mask"},
      {"valid_lens over K", [](AttendRequest& r) { r.add_valid_lens(K + 1); }, "valid_lens"},
  };
  for (const Case& c : cases) {
    AttendRequest request = Request(q, k, v, 1, K);
    c.spoil(request);
    AttendResponse response;
    const grpc::Status status = Attend(*stub_, request, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << c.name;
    EXPECT_TRUE(absl::StrContains(status.error_message(), c.field))
        << c.name << ": " << status.error_message();
  }
  // A causal step whose keys are not one per query.
  {
    Session session(*stub_, "worker", /*causal=*/true, attention::v1::CROSS);
    SessionRequest first;
    *first.mutable_queries() = Shaped(Random(2 * kE, 24), {1, 2, kE});
    *first.mutable_keys() = Shaped(Random(kEkv, 25), {1, 1, kEkv});
    *first.mutable_values() = Shaped(Random(kEkv, 26), {1, 1, kEkv});
    EXPECT_FALSE(session.Step(first).has_value());
    const grpc::Status ended = session.status();
    EXPECT_EQ(ended.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_TRUE(absl::StrContains(ended.error_message(), "keys:")) << ended.error_message();
  }
  // return_lse after the first message changes nothing.
  {
    Session session(*stub_, "worker", /*causal=*/true, attention::v1::CROSS);
    for (int i = 0; i < 2; ++i) {
      SessionRequest step;
      step.set_return_lse(i == 1);
      *step.mutable_queries() = Shaped(Random(kE, 27 + i), {1, 1, kE});
      *step.mutable_keys() = Shaped(Random(kEkv, 29 + i), {1, 1, kEkv});
      *step.mutable_values() = Shaped(Random(kEkv, 31 + i), {1, 1, kEkv});
      const std::optional<SessionResponse> r = session.Step(step);
      ASSERT_TRUE(r.has_value()) << session.status().error_message();
      EXPECT_FALSE(r->has_lse()) << "step " << i;
    }
    EXPECT_TRUE(session.Close().ok());
  }
  AttendResponse fine;
  EXPECT_TRUE(Attend(*stub_, Request(q, k, v, 1, K), &fine).ok());
}

// Load errors: a weights file beside a NONE model's config, and a size that is not
// the heads' (each names its field).
TEST(AttentionOnlyStartupTest, BadWorkerModelsFailStartNamingTheField) {
  const struct {
    const char* config;
    bool weights_file;
    const char* field;
  } cases[] = {
      {"num_hiddens: 64 num_heads: 8 projections: NONE", true, "projections"},
      {"num_hiddens: 64 num_heads: 8 projections: NONE seeded { seed: 1 }", false, "projections"},
      {"num_hiddens: 64 num_heads: 8 projections: NONE rope {}", false, "projections"},
      {"num_hiddens: 64 num_heads: 8 num_kv_heads: 2 projections: NONE key_size: 64", false,
       "key_size"},
      {"num_hiddens: 64 num_heads: 8 projections: NONE query_size: 32", false, "query_size"},
      {"num_hiddens: 64 num_heads: 8 projections: NONE value_size: 8", false, "value_size"},
  };
  for (const auto& c : cases) {
    TempDir repository;
    repository.Write("w/config.pbtxt", c.config);
    if (c.weights_file) repository.Write("w/weights.safetensors", "not read");
    const RunResult run = RunServer({"--port=0", "--model_repository=" + repository.path()});
    EXPECT_NE(run.exit_code, 0) << c.config;
    EXPECT_TRUE(absl::StrContains(run.err, absl::StrCat(c.field, ":"))) << c.config << "\n"
                                                                        << run.err;
  }
}

// deploy/models_llm's workers load, warm up with their explicit passes, and answer a
// decode-shaped call with lse.
TEST(AttentionOnlyDeployTest, LlamaWorkersLoadAndAnswer) {
  TempDir repository;
  const struct {
    const char* name;
    int64_t kv_heads;
  } models[] = {{"llama_attention_only", 8}, {"llama_attention_only_g32", 32}};
  for (const auto& m : models) {
    const std::string text =
        ReadFile(absl::StrCat(MHA_SOURCE_DIR, "/deploy/models_llm/", m.name, "/config.pbtxt"));
    ASSERT_FALSE(text.empty()) << m.name;
    repository.Write(absl::StrCat(m.name, "/config.pbtxt"), text);
  }
  auto server = ServerProcess::Start({"--port=0", "--model_repository=" + repository.path()},
                                     absl::Seconds(120));
  ASSERT_TRUE(server.ok()) << server.status();
  auto stub = Connect((*server)->target());
  for (const auto& m : models) {
    grpc::ClientContext context;
    attention::v1::GetModelRequest get;
    get.set_model(m.name);
    attention::v1::ModelInfo info;
    ASSERT_TRUE(stub->GetModel(&context, get, &info).ok()) << m.name;
    EXPECT_EQ(info.num_heads(), 32);
    EXPECT_EQ(info.head_size(), 128);
    EXPECT_EQ(info.num_kv_heads(), m.kv_heads);
    EXPECT_EQ(info.projections(), "none");
    EXPECT_EQ(info.key_size(), m.kv_heads * 128);
    const int64_t K = 40;
    AttendRequest request;
    request.set_model(m.name);
    *request.mutable_queries() = Shaped(Random(4096, 1), {1, 1, 4096});
    *request.mutable_keys() = Shaped(Random(K * m.kv_heads * 128, 2), {1, K, m.kv_heads * 128});
    *request.mutable_values() = Shaped(Random(K * m.kv_heads * 128, 3), {1, K, m.kv_heads * 128});
    request.set_return_lse(true);
    AttendResponse response;
    const grpc::Status status = Attend(*stub, request, &response);
    ASSERT_TRUE(status.ok()) << m.name << ": " << status.error_message();
    EXPECT_EQ(response.output().data_size(), 4096);
    ASSERT_EQ(response.lse().data_size(), 32);
    for (float l : response.lse().data()) EXPECT_TRUE(std::isfinite(l)) << m.name;
  }
  stub.reset();
  (*server)->Signal(SIGTERM);
  const std::optional<int> exited = (*server)->WaitForExit(absl::Seconds(30));
  ASSERT_TRUE(exited.has_value());
  EXPECT_TRUE(WIFEXITED(*exited) && WEXITSTATUS(*exited) == 0) << (*server)->log();
}

}  // namespace
}  // namespace mha::testing

// Model lifecycle on the real server process: SIGHUP reloads, explicit load and
// unload over gRPC, and a broken new version that keeps the old one serving.
// (tests/e2e/reload_test.py adds traffic: a bench at concurrency 8 across reloads.)
#include <signal.h>
#include <sys/wait.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/safetensors.h"
#include "core/weights.h"
#include "gtest/gtest.h"
#include "proto/inference/grpc_service.grpc.pb.h"
#include "tests/integration/client_util.h"
#include "tests/integration/server_process.h"

namespace mha::testing {
namespace {

using ::inference::GRPCInferenceService;

std::string ToyConfig(int seed) {
  return absl::StrCat("num_hiddens: 100 num_heads: 5 seeded { seed: ", seed, " }");
}

// The toy model's weights from `seed`, as d2l names them.
std::string ToyWeights(uint64_t seed) {
  const core::Weights w = core::SeededWeights(core::ModelConfig{}, seed);
  return core::SerializeSafetensors({core::F32Tensor("W_q.weight", {100, 100}, w.w_q),
                                     core::F32Tensor("W_k.weight", {100, 100}, w.w_k),
                                     core::F32Tensor("W_v.weight", {100, 100}, w.w_v),
                                     core::F32Tensor("W_o.weight", {100, 100}, w.w_o)});
}

class ReloadTest : public ::testing::Test {
 protected:
  void Start(std::vector<std::string> args) {
    args.insert(args.begin(), {"--port=0", "--model_repository=" + repository_.path()});
    auto server = ServerProcess::Start(args);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    stub_ = Connect(server_->target());
    inference_ = GRPCInferenceService::NewStub(Channel(server_->target()));
  }
  void TearDown() override {
    if (server_ == nullptr) return;
    stub_.reset();
    inference_.reset();
    server_->Signal(SIGTERM);
    const std::optional<int> status = server_->WaitForExit(absl::Seconds(30));
    ASSERT_TRUE(status.has_value()) << "server did not exit";
    EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0) << server_->log();
  }

  // SIGHUP, then waits for the n-th "reload done" line of the log; returns it.
  std::string Reload() {
    ++reloads_;
    server_->Signal(SIGHUP);
    const absl::Time deadline = absl::Now() + absl::Seconds(60);
    while (absl::Now() < deadline) {
      const std::string log = server_->log();
      size_t at = 0;
      int seen = 0;
      std::string line;
      while ((at = log.find("repository: reload done", at)) != std::string::npos) {
        ++seen;
        line = log.substr(at, log.find('\n', at) - at);
        ++at;
      }
      if (seen >= reloads_) return line;
      absl::SleepFor(absl::Milliseconds(20));
    }
    ADD_FAILURE() << "no reload line in time:\n" << server_->log();
    return "";
  }

  // The model's answer to the toy request, or the call's error.
  absl::StatusOr<std::vector<float>> Answer(const std::string& model,
                                            const std::string& version = "") {
    AttendRequest request = ToyRequest();
    request.set_model(model);
    request.set_model_version(version);
    AttendResponse response;
    const grpc::Status status = Attend(*stub_, request, &response);
    if (!status.ok()) {
      return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                          status.error_message());
    }
    return std::vector<float>(response.output().data().begin(), response.output().data().end());
  }

  inference::RepositoryIndexResponse Index() {
    grpc::ClientContext context;
    SetTimeout(&context, std::chrono::seconds(10));
    inference::RepositoryIndexResponse index;
    EXPECT_TRUE(inference_->RepositoryIndex(&context, {}, &index).ok());
    return index;
  }

  grpc::Status Control(bool load, const std::string& model) {
    grpc::ClientContext context;
    SetTimeout(&context, std::chrono::seconds(60));
    if (load) {
      inference::RepositoryModelLoadRequest request;
      request.set_model_name(model);
      inference::RepositoryModelLoadResponse response;
      return inference_->RepositoryModelLoad(&context, request, &response);
    }
    inference::RepositoryModelUnloadRequest request;
    request.set_model_name(model);
    inference::RepositoryModelUnloadResponse response;
    return inference_->RepositoryModelUnload(&context, request, &response);
  }

  TempDir repository_;
  std::unique_ptr<ServerProcess> server_;
  std::unique_ptr<AttentionService::Stub> stub_;
  std::unique_ptr<GRPCInferenceService::Stub> inference_;
  int reloads_ = 0;
};

TEST_F(ReloadTest, SighupSwapsChangedModelsLoadsNewOnesAndUnloadsRemovedOnes) {
  repository_.Write("a/config.pbtxt", ToyConfig(1));
  repository_.Write("b/config.pbtxt", ToyConfig(2));
  Start({});
  const std::vector<float> old_a = Answer("a").value();
  ASSERT_TRUE(Answer("b").ok());

  repository_.Write("a/config.pbtxt", ToyConfig(7));
  repository_.Write("c/config.pbtxt", ToyConfig(7));
  std::filesystem::remove_all(std::filesystem::path(repository_.path()) / "b");
  EXPECT_EQ(Reload(), "repository: reload done (loaded 2, unloaded 1, failed 0)");
  // A reload with the same default passes runs all but the last (the largest batch:
  // the shared workspaces are grown); a new model runs all four.
  EXPECT_TRUE(absl::StrContains(server_->log(),
                                "model a: reloaded, version(s) 1, weights seeded "
                                "(seed 7), warm-up 3 pass(es)"))
      << server_->log();
  EXPECT_TRUE(absl::StrContains(server_->log(),
                                "model c: loaded, version(s) 1, weights seeded "
                                "(seed 7), warm-up 4 pass(es)"))
      << server_->log();

  const std::vector<float> new_a = Answer("a").value();
  EXPECT_EQ(new_a, Answer("c").value());  // the same seed, so the same weights
  EXPECT_NE(new_a, old_a);
  const absl::Status b = Answer("b").status();
  EXPECT_EQ(b.code(), absl::StatusCode::kNotFound) << b;
  EXPECT_TRUE(absl::StrContains(b.message(), "unknown model \"b\"; served: a, c")) << b;

  grpc::health::v1::HealthCheckResponse health;
  ASSERT_TRUE(CheckHealth(server_->target(), "c", &health).ok());
  EXPECT_EQ(health.status(), grpc::health::v1::HealthCheckResponse::SERVING);
  ASSERT_TRUE(CheckHealth(server_->target(), "b", &health).ok());
  EXPECT_EQ(health.status(), grpc::health::v1::HealthCheckResponse::NOT_SERVING);

  const inference::RepositoryIndexResponse index = Index();
  ASSERT_EQ(index.models_size(), 2) << index.DebugString();
  EXPECT_EQ(index.models(0).name(), "a");
  EXPECT_EQ(index.models(1).name(), "c");
  EXPECT_EQ(index.models(1).state(), "READY");

  // Nothing changed: nothing reloads.
  EXPECT_EQ(Reload(), "repository: reload done (loaded 0, unloaded 0, failed 0)");
}

// A session keeps the model version it started with: after a reload swapped the
// model, its steps still equal the old weights' stateless answers, and a session
// opened after the reload gets the new ones.
TEST_F(ReloadTest, SessionsKeepTheirVersionAcrossAReload) {
  repository_.Write("a/config.pbtxt", ToyConfig(1));
  Start({});
  const Tensor tokens = MakeTensor({1, 6, 100});
  auto step = [](grpc::ClientReaderWriter<attention::v1::SessionRequest,
                                          attention::v1::SessionResponse>& stream,
                 const Tensor& all, int64_t from, int64_t count, bool first) {
    attention::v1::SessionRequest request;
    if (first) {
      request.set_model("a");
      request.set_causal(true);
    }
    Tensor* q = request.mutable_queries();
    for (int64_t d : {int64_t{1}, count, int64_t{100}}) q->add_shape(d);
    q->mutable_data()->Add(all.data().begin() + from * 100,
                           all.data().begin() + (from + count) * 100);
    attention::v1::SessionResponse response;
    EXPECT_TRUE(stream.Write(request) && stream.Read(&response));
    return std::vector<float>(response.output().data().begin(), response.output().data().end());
  };
  // The stateless answer of the model now served: causal self-attention on all 6.
  auto stateless = [&] {
    AttendRequest request;
    request.set_model("a");
    *request.mutable_queries() = tokens;
    request.set_causal(true);
    AttendResponse response;
    EXPECT_TRUE(Attend(*stub_, request, &response).ok());
    return std::vector<float>(response.output().data().end() - 100, response.output().data().end());
  };
  const std::vector<float> old_last = stateless();

  grpc::ClientContext old_context;
  auto old_session = stub_->AttendSession(&old_context);
  step(*old_session, tokens, 0, 5, /*first=*/true);
  repository_.Write("a/config.pbtxt", ToyConfig(7));
  EXPECT_EQ(Reload(), "repository: reload done (loaded 1, unloaded 0, failed 0)");
  const std::vector<float> new_last = stateless();
  ASSERT_GT(MaxAbsDiff(old_last, new_last), 1e-3f) << "the reload changed nothing";

  EXPECT_LE(MaxAbsDiff(step(*old_session, tokens, 5, 1, false), old_last), 1e-5f);
  grpc::ClientContext new_context;
  auto new_session = stub_->AttendSession(&new_context);
  step(*new_session, tokens, 0, 5, /*first=*/true);
  EXPECT_LE(MaxAbsDiff(step(*new_session, tokens, 5, 1, false), new_last), 1e-5f);
  for (auto* session : {old_session.get(), new_session.get()}) {
    session->WritesDone();
    EXPECT_TRUE(session->Finish().ok());
  }
}

TEST_F(ReloadTest, BrokenNewFilesKeepThePreviousVersionServing) {
  repository_.Write("a/config.pbtxt", ToyConfig(1));
  Start({});
  const std::vector<float> before = Answer("a").value();

  repository_.Write("a/config.pbtxt", "num_hiddens: 100 num_heads: 5 file: \"w.safetensors\"");
  const std::string weights = repository_.Write("a/w.safetensors", "truncated");
  repository_.Write("n/config.pbtxt", "num_hiddens: 100 num_heads: 7 seeded { seed: 1 }");
  EXPECT_EQ(Reload(), "repository: reload done (loaded 0, unloaded 0, failed 2)");
  EXPECT_EQ(Answer("a").value(), before);
  EXPECT_EQ(Answer("n").status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(absl::StrContains(server_->log(),
                                "model a: load failed, the previous version "
                                "keeps serving: model a (" +
                                    weights + ")"))
      << server_->log();

  const inference::RepositoryIndexResponse index = Index();
  ASSERT_EQ(index.models_size(), 2) << index.DebugString();
  EXPECT_EQ(index.models(0).state(), "READY");  // the previous version serves
  EXPECT_TRUE(absl::StrContains(index.models(0).reason(), weights)) << index.DebugString();
  EXPECT_EQ(index.models(1).name(), "n");
  EXPECT_EQ(index.models(1).state(), "UNAVAILABLE");
  EXPECT_TRUE(absl::StrContains(index.models(1).reason(), "num_heads")) << index.DebugString();

  // Unchanged broken files are not tried again; fixed ones load.
  EXPECT_EQ(Reload(), "repository: reload done (loaded 0, unloaded 0, failed 0)");
  repository_.Write("a/config.pbtxt", ToyConfig(1));
  EXPECT_EQ(Reload(), "repository: reload done (loaded 1, unloaded 0, failed 0)");
  EXPECT_EQ(Answer("a").value(), before);
  EXPECT_EQ(Index().models(0).reason(), "");
}

// Listing trouble is not an empty repository: a dangling link is skipped, and a
// repository that cannot be listed at all (here: moved away) unloads nothing.
TEST_F(ReloadTest, AnUnreadableRepositoryChangesNothing) {
  repository_.Write("a/config.pbtxt", ToyConfig(1));
  repository_.Write("b/config.pbtxt", ToyConfig(2));
  Start({});
  const std::filesystem::path root(repository_.path());
  std::filesystem::create_symlink(root / "no_such_folder", root / "0_dangling");
  EXPECT_EQ(Reload(), "repository: reload done (loaded 0, unloaded 0, failed 0)");
  ASSERT_TRUE(Answer("a").ok());
  ASSERT_TRUE(Answer("b").ok());

  const std::filesystem::path away = root.string() + ".away";
  std::filesystem::rename(root, away);
  server_->Signal(SIGHUP);
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (!absl::StrContains(server_->log(), "nothing changed") && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  std::filesystem::rename(away, root);
  EXPECT_TRUE(absl::StrContains(server_->log(), "cannot list the directory")) << server_->log();
  EXPECT_TRUE(Answer("a").ok());
  EXPECT_TRUE(Answer("b").ok());
  EXPECT_EQ(Index().models_size(), 2);
}

TEST_F(ReloadTest, ExplicitModeLoadsAndUnloadsOnRequestOnly) {
  repository_.Write("a/config.pbtxt", ToyConfig(1));
  repository_.Write("b/config.pbtxt", ToyConfig(2));
  Start({"--model_control=explicit", "--load_models=a"});
  ASSERT_TRUE(Answer("a").ok());
  EXPECT_EQ(Answer("b").status().code(), absl::StatusCode::kNotFound);
  const inference::RepositoryIndexResponse index = Index();
  ASSERT_EQ(index.models_size(), 2);
  EXPECT_EQ(index.models(1).state(), "UNAVAILABLE");
  EXPECT_EQ(index.models(1).reason(), "not loaded");

  ASSERT_TRUE(Control(true, "b").ok());
  ASSERT_TRUE(Answer("b").ok());
  ASSERT_TRUE(Control(false, "a").ok());
  EXPECT_EQ(Answer("a").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(Control(false, "a").error_code(), grpc::StatusCode::NOT_FOUND);

  // SIGHUP re-reads only the loaded models: b's change loads, a stays unloaded.
  repository_.Write("b/config.pbtxt", ToyConfig(1));
  EXPECT_EQ(Reload(), "repository: reload done (loaded 1, unloaded 0, failed 0)");
  EXPECT_EQ(Answer("a").status().code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(Control(true, "a").ok());
  EXPECT_EQ(Answer("a").value(), Answer("b").value());  // b now has a's seed

  // Bad requests name the field; a name with no folder is NOT_FOUND.
  const grpc::Status outside = Control(true, "../a");
  EXPECT_EQ(outside.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StrContains(outside.error_message(), "model_name: \"../a\""))
      << outside.error_message();
  const grpc::Status missing = Control(true, "z");
  EXPECT_EQ(missing.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_TRUE(absl::StrContains(missing.error_message(), "no folder \"z\" in the model repository"))
      << missing.error_message();
  grpc::ClientContext context;
  inference::RepositoryModelLoadRequest with_parameters;
  with_parameters.set_model_name("a");
  (*with_parameters.mutable_parameters())["config"].set_string_param("{}");
  inference::RepositoryModelLoadResponse response;
  const grpc::Status parameters =
      inference_->RepositoryModelLoad(&context, with_parameters, &response);
  EXPECT_EQ(parameters.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StartsWith(parameters.error_message(), "parameters.config: not supported"))
      << parameters.error_message();
}

TEST_F(ReloadTest, LoadAndUnloadNeedExplicitMode) {
  repository_.Write("a/config.pbtxt", ToyConfig(1));
  Start({"--model_control=poll"});
  const grpc::Status load = Control(true, "a");
  EXPECT_EQ(load.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_TRUE(absl::StrContains(load.error_message(), "--model_control=explicit"))
      << load.error_message();
  EXPECT_EQ(Control(false, "a").error_code(), grpc::StatusCode::PERMISSION_DENIED);
  ASSERT_TRUE(Answer("a").ok());
}

TEST_F(ReloadTest, VersionFoldersServeByPolicyAndByRequest) {
  repository_.Write("m/config.pbtxt",
                    "num_hiddens: 100 num_heads: 5 version_policy { latest { num_versions: 2 } }");
  for (int v : {1, 2, 3})
    repository_.Write(absl::StrCat("m/", v, "/weights.safetensors"), ToyWeights(10 + v));
  Start({});
  const core::ModelConfig toy;
  const auto expect = [&](const std::string& version, uint64_t seed) {
    const absl::StatusOr<std::vector<float>> answer = Answer("m", version);
    ASSERT_TRUE(answer.ok()) << version << ": " << answer.status();
    EXPECT_LE(MaxAbsDiff(*answer, CoreForward(toy, seed, ToyRequest()).output), 1e-5f) << version;
  };
  expect("", 13);  // the newest
  expect("3", 13);
  expect("2", 12);
  const absl::Status old = Answer("m", "1").status();
  EXPECT_EQ(old.code(), absl::StatusCode::kNotFound) << old;
  EXPECT_TRUE(absl::StrContains(old.message(), "model_version: model m serves version(s) 2, 3"))
      << old;
  inference::RepositoryIndexResponse index = Index();
  ASSERT_EQ(index.models_size(), 2) << index.DebugString();
  EXPECT_EQ(index.models(0).version(), "2");
  EXPECT_EQ(index.models(1).version(), "3");

  repository_.Write(
      "m/config.pbtxt",
      "num_hiddens: 100 num_heads: 5 version_policy { specific { versions: [1, 3] } }");
  EXPECT_EQ(Reload(), "repository: reload done (loaded 1, unloaded 0, failed 0)");
  expect("1", 11);
  expect("", 13);
  EXPECT_EQ(Answer("m", "2").status().code(), absl::StatusCode::kNotFound);

  // The default policy serves the newest folder only; a new folder is a change.
  repository_.Write("m/config.pbtxt", "num_hiddens: 100 num_heads: 5");
  repository_.Write("m/4/weights.safetensors", ToyWeights(14));
  EXPECT_EQ(Reload(), "repository: reload done (loaded 1, unloaded 0, failed 0)");
  expect("", 14);
  EXPECT_EQ(Answer("m", "3").status().code(), absl::StatusCode::kNotFound);
  index = Index();
  ASSERT_EQ(index.models_size(), 1) << index.DebugString();
  EXPECT_EQ(index.models(0).version(), "4");
}

TEST(ReloadFlagsTest, BadModelControlFlagsFailStartNamingTheFlag) {
  const RunResult mode = RunServer({"--port=0", "--model_control=sometimes"});
  EXPECT_NE(mode.exit_code, 0);
  EXPECT_TRUE(absl::StrContains(mode.err, "--model_control: expected none, poll or explicit"))
      << mode.err;
  const RunResult poll = RunServer({"--port=0", "--model_control=poll"});
  EXPECT_NE(poll.exit_code, 0);
  EXPECT_TRUE(absl::StrContains(poll.err,
                                "--model_control: poll and explicit need a "
                                "model_repository"))
      << poll.err;
  const RunResult load = RunServer({"--port=0", "--load_models=a"});
  EXPECT_NE(load.exit_code, 0);
  EXPECT_TRUE(absl::StrContains(load.err, "--load_models: needs model_control explicit"))
      << load.err;
}

}  // namespace
}  // namespace mha::testing

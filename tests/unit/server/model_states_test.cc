// ModelStates (server/models/model_states.h): every move it allows and refuses,
// and the readiness and index answers of each state, as the fronts give them.
#include "server/models/model_states.h"

#include <vector>

#include "absl/strings/match.h"
#include "gtest/gtest.h"

namespace mha::server {
namespace {

Model Version(const char* name, int64_t version = 1) {
  Model model;
  model.name = name;
  model.version = version;
  return model;
}

constexpr ModelState kAll[] = {ModelState::kLoading, ModelState::kWarming, ModelState::kReady,
                               ModelState::kUnloading, ModelState::kFailed};

// Moves a new version of `states` along `path`, each move expected to pass.
void Walk(ModelStates& states, const Model& model, std::vector<ModelState> path) {
  for (ModelState to : path) {
    ASSERT_TRUE(states.Move(model, to, "bad weights").ok()) << ModelStateName(to);
  }
}

TEST(ModelStatesTest, EveryMoveDrawnIsAllowedAndNoOther) {
  // The allowed moves, from each state reached by a walk from a new version.
  const std::vector<std::pair<std::vector<ModelState>, std::vector<ModelState>>> cases = {
      {{ModelState::kLoading}, {ModelState::kWarming, ModelState::kFailed}},
      {{ModelState::kLoading, ModelState::kWarming}, {ModelState::kReady, ModelState::kFailed}},
      {{ModelState::kLoading, ModelState::kWarming, ModelState::kReady}, {ModelState::kUnloading}},
      {{ModelState::kLoading, ModelState::kWarming, ModelState::kReady, ModelState::kUnloading},
       {}},
      {{ModelState::kLoading, ModelState::kFailed}, {}},
  };
  for (const auto& [path, allowed] : cases) {
    for (ModelState to : kAll) {
      ModelStates states;
      const Model model = Version("m");
      Walk(states, model, path);
      const bool ok = std::find(allowed.begin(), allowed.end(), to) != allowed.end();
      const absl::Status moved = states.Move(model, to);
      EXPECT_EQ(moved.ok(), ok) << ModelStateName(path.back()) << " -> " << ModelStateName(to);
      if (!ok) {
        EXPECT_EQ(moved.code(), absl::StatusCode::kFailedPrecondition);
        EXPECT_TRUE(absl::StrContains(moved.message(), absl::StrCat("cannot move from ",
                                                                    ModelStateName(path.back()))))
            << moved;
      }
    }
  }
}

TEST(ModelStatesTest, ANewVersionStartsLoadingAndOnlyEndedOnesAreForgotten) {
  ModelStates states;
  const Model model = Version("m");
  EXPECT_EQ(states.Move(model, ModelState::kWarming).code(), absl::StatusCode::kFailedPrecondition);
  Walk(states, model, {ModelState::kLoading, ModelState::kWarming, ModelState::kReady});
  EXPECT_EQ(states.Forget(model).code(), absl::StatusCode::kFailedPrecondition);  // still ready
  Walk(states, model, {ModelState::kUnloading});
  EXPECT_TRUE(states.Forget(model).ok());
  EXPECT_TRUE(absl::StrContains(states.Readiness(model).message(), "is not served"));
  const Model failed = Version("f");
  Walk(states, failed, {ModelState::kLoading, ModelState::kFailed});
  EXPECT_TRUE(states.Forget(failed).ok());
  EXPECT_TRUE(states.Move(failed, ModelState::kLoading).ok());  // a retry is a new load
}

TEST(ModelStatesTest, ReadinessAndIndexAnswerEachState) {
  struct Case {
    std::vector<ModelState> path;
    absl::StatusCode code;
    const char* message;  // contained in the readiness message and the index's reason
    const char* wire;
  };
  const std::vector<Case> cases = {
      {{ModelState::kLoading}, absl::StatusCode::kUnavailable, "model m is loading", "LOADING"},
      {{ModelState::kLoading, ModelState::kWarming}, absl::StatusCode::kUnavailable,
       "model m is warming up", "UNAVAILABLE"},
      {{ModelState::kLoading, ModelState::kWarming, ModelState::kReady}, absl::StatusCode::kOk, "",
       "READY"},
      {{ModelState::kLoading, ModelState::kWarming, ModelState::kReady, ModelState::kUnloading},
       absl::StatusCode::kUnavailable, "model m is unloading", "UNLOADING"},
      {{ModelState::kLoading, ModelState::kWarming, ModelState::kFailed},
       absl::StatusCode::kUnavailable, "model m failed to load: bad weights", "UNAVAILABLE"},
      {{}, absl::StatusCode::kUnavailable, "model m is not served", "UNAVAILABLE"},
  };
  for (const Case& c : cases) {
    ModelStates states;
    const Model model = Version("m");
    Walk(states, model, c.path);
    const absl::Status readiness = states.Readiness(model);
    EXPECT_EQ(readiness.code(), c.code) << readiness;
    EXPECT_EQ(readiness.message(), c.message);
    const ModelStates::IndexEntry entry = states.Index(model);
    EXPECT_EQ(entry.state, c.wire) << c.message;
    EXPECT_EQ(entry.reason, c.message);
  }
}

TEST(ModelStatesTest, ShuttingDownMakesEveryAnswerUnavailable) {
  ModelStates states;
  const Model model = Version("m");
  Walk(states, model, {ModelState::kLoading, ModelState::kWarming, ModelState::kReady});
  ASSERT_TRUE(states.Readiness(model).ok());
  states.ShuttingDown();
  EXPECT_EQ(states.Readiness(model).message(), "the server is shutting down");
  EXPECT_EQ(states.Index(model).state, "UNAVAILABLE");
}

TEST(ModelStatesTest, VersionsOfOneModelHaveTheirOwnStates) {
  ModelStates states;
  const Model v1 = Version("m", 1), v2 = Version("m", 2);
  Walk(states, v1, {ModelState::kLoading, ModelState::kWarming, ModelState::kReady});
  Walk(states, v2, {ModelState::kLoading, ModelState::kWarming});
  EXPECT_TRUE(states.Readiness(v1).ok());
  EXPECT_EQ(states.Index(v2).reason, "model m is warming up");
}

}  // namespace
}  // namespace mha::server

// attention_client against the real attention_server on loopback: every verb runs
// as the binary users run, and its results are checked against the in-process core
// (same seeded or file weights), the PNG's pixels and the server's own counters.
#include <cairo.h>

#include <algorithm>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "base/splitmix64.h"
#include "client/heatmap/heatmap.h"
#include "client/sdk/kserve.h"
#include "client/sdk/request.h"
#include "client/sdk/tensor_io.h"
#include "core/attention.h"
#include "core/safetensors.h"
#include "core/weights.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/integration/client_util.h"
#include "tests/integration/metrics_scrape.h"
#include "tests/integration/net_util.h"
#include "tests/integration/server_process.h"

namespace mha::testing {
namespace {

using nlohmann::json;

using ClientRun = RunResult;

// Runs attention_client with `args` to completion (killed after `timeout`).
ClientRun RunClient(const std::vector<std::string>& args,
                    absl::Duration timeout = absl::Seconds(90)) {
  return RunProgram(MHA_CLIENT_PATH, args, timeout);
}

std::string Describe(const ClientRun& run) {
  return absl::StrCat("exit ", run.exit_code, "\nstdout:\n", run.out, "\nstderr:\n", run.err);
}

// The server's embedded model: the toy layer with SeededWeights(config, 0).
const core::ModelConfig kToy;

// The tensors of a .safetensors file as an AttendRequest (what infer recorded).
AttendRequest RequestFromFile(const core::SafetensorsFile& file) {
  AttendRequest request;
  auto fill = [&](const char* name, Tensor* tensor) {
    const core::TensorView view = file.Get(name).value();
    for (int64_t d : view.shape) tensor->add_shape(d);
    const absl::StatusOr<std::vector<float>> values = view.ToFloat(name);
    ASSERT_TRUE(values.ok()) << values.status();
    for (float v : *values) tensor->add_data(v);
  };
  fill("queries", request.mutable_queries());
  if (file.tensors().count("keys")) {
    fill("keys", request.mutable_keys());
    fill("values", request.mutable_values());
  }
  if (file.tensors().count("valid_lens")) {
    const core::TensorView lens = file.Get("valid_lens").value();
    EXPECT_EQ(lens.dtype, core::DType::kI32);
    for (int64_t i = 0; i < lens.num_elements(); ++i) {
      int32_t len;
      std::memcpy(&len, lens.data + i * 4, 4);
      request.add_valid_lens(len);
    }
  }
  return request;
}

class ClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto server = ServerProcess::Start({"--port=0"});
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
  }
  std::string TargetFlag() const { return "--target=" + server_->target(); }
  std::string Path(const std::string& name) const { return dir_.path() + "/" + name; }

  TempDir dir_;
  std::unique_ptr<ServerProcess> server_;
};

// mha_requests_total summed over every model and code (defined with the bench tests).
int64_t RequestsTotal(const ServerProcess& server);

TEST(ClientHelpTest, ListsEveryFlagWithItsDefault) {
  const ClientRun run = RunClient({"--help"});
  EXPECT_EQ(run.exit_code, 0) << Describe(run);
  const std::string help = run.out + run.err;
  // Flags and defaults, not where they are defined.
  EXPECT_FALSE(absl::StrContains(help, "main.cc")) << help;
  EXPECT_FALSE(absl::StrContains(help, MHA_SOURCE_DIR)) << help;
  for (const char* flag : {"--protocol",
                           "--target",
                           "--targets",
                           "--tls",
                           "--tls_ca",
                           "--tls_cert",
                           "--tls_key",
                           "--tls_server_name",
                           "--timeout",
                           "--max_message_size",
                           "--model",
                           "--batch",
                           "--num_queries",
                           "--num_keys",
                           "--valid_lens",
                           "--causal",
                           "--seed",
                           "--input",
                           "--output",
                           "--return_attention",
                           "--concurrency",
                           "--request_rate",
                           "--request_distribution",
                           "--mode",
                           "--streams",
                           "--rpc",
                           "--channels",
                           "--warmup",
                           "--window",
                           "--stable_windows",
                           "--stability",
                           "--max_windows",
                           "--duration",
                           "--max_requests",
                           "--allow_errors",
                           "--max_errors",
                           "--json",
                           "--csv",
                           "--progress",
                           "--batch_index",
                           "--cell_size",
                           "--columns",
                           "--scale",
                           "--check",
                           "--prune",
                           "--service"}) {
    EXPECT_TRUE(absl::StrContains(help, absl::StrCat(flag, " ("))) << flag << "\n" << help;
  }
  EXPECT_TRUE(absl::StrContains(help, "default: \"127.0.0.1:50051\"")) << help;
  EXPECT_TRUE(absl::StrContains(help, "default: 268435456")) << help;  // 256 MiB
  for (const char* verb : {"infer", "bench", "heatmap", "heads", "health"}) {
    EXPECT_TRUE(absl::StrContains(help, verb)) << verb;
  }
  EXPECT_FALSE(absl::StrContains(help, "--flagfile")) << "absl's own flags are not listed";
}

TEST(ClientUsageTest, UnknownVerbIsAUsageError) {
  const ClientRun run = RunClient({"frobnicate"});
  EXPECT_EQ(run.exit_code, 2) << Describe(run);
  EXPECT_TRUE(absl::StrContains(run.err, "got 'frobnicate'")) << run.err;
}

// `run` exited 2 with one line on stderr that starts with `expected`.
void ExpectUsageError(const ClientRun& run, const std::string& expected) {
  EXPECT_EQ(run.exit_code, 2) << Describe(run);
  EXPECT_TRUE(absl::StartsWith(run.err, expected)) << run.err;
  EXPECT_EQ(std::count(run.err.begin(), run.err.end(), '\n'), 1) << run.err;
}

// Found before any call (nothing listens on the default target): exit 2, one line
// naming the flag, no gRPC code.
TEST(ClientUsageTest, UsageErrorsExitTwoNamingTheFlag) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"infer", "--batch=0"}, "error: --batch: must be >= 1, got 0"},
      {{"infer", "--batch=8", "--valid_lens=3,2"},
       "error: --valid_lens: 2 entries (3,2) for batch 8: give B = 8 or B*Q = 32 entries"},
      {{"infer", "--num_keys=0", "--valid_lens=1,2,3"},
       "error: --valid_lens: 3 entries (1,2,3) for batch 2: give B = 2 or B*Q = 8 entries"},
      // A flag another verb reads is refused rather than ignored.
      {{"infer", "--duration=5s"}, "error: --duration: infer does not read it (bench only)"},
      {{"decode", "--batch=4"},
       "error: --batch: decode does not read it (infer, bench, heatmap, heads only)"},
      {{"health", "--json=h.json"},
       "error: --json: health does not read it (bench, heatmap, heads, decode only)"},
      {{"bench", "--nocheck"}, "error: --check: bench does not read it (decode only)"},
      {{"heatmap", "--scale=cubic"}, "error: --scale: expected linear, log or row, got cubic"},
      {{"infer", "--batch=two"}, "error: --batch: expected an integer, got 'two'"},
      {{"bench", "--duration=5"},
       "error: --duration: expected a duration with a unit (5s, 500ms, 2m, 1h30m), got '5'"},
      {{"infer", "--timeout", "10"}, "error: --timeout: expected a duration with a unit"},
      {{"infer", "--timeout=0s"}, "error: --timeout: must be > 0, got 0"},
      {{"bench", "--concurency=4"}, "error: --concurency: unknown flag (--help lists every flag)"},
      {{"infer", "extra"}, "error: unexpected argument 'extra' after the verb infer"},
      {{"bench", "--allow_errors=QUEUE_FULL"},
       "error: --allow_errors: unknown code \"QUEUE_FULL\""},
      {{"bench", "--warmup=2s", "--duration=2s"},
       "error: --duration: must be longer than --warmup (2s) to measure, got 2s"},
      {{"bench", "--max_errors=-1"}, "error: --max_errors: must be >= 0, got -1"},
      {{"bench", "--channels=0"}, "error: --channels: must be >= 1, got 0"},
      {{"bench", "--concurrency=0"}, "error: --concurrency: bad start"},
      {{"infer", "--output=out.txt"}, "error: --output: expected a .npy or .safetensors file"},
      {{"infer", "--tls_cert=client.pem"}, "error: --tls_cert and --tls_key go together"},
      {{"infer", "--targets=localhost"}, "error: --targets: expected host:port, got localhost"},
      {{"decode", "--sessions=0"}, "error: --sessions: must be >= 1, got 0"},
      {{"decode", "--sessions=5000"},
       "error: --sessions: at most 4096 (--stateless runs a thread each), got 5000"},
      {{"decode", "--prefill=0"}, "error: --prefill: must be >= 1, got 0"},
      {{"decode", "--decode_tokens=0"}, "error: --decode_tokens: must be >= 1, got 0"},
  };
  for (const auto& [args, expected] : cases) {
    SCOPED_TRACE(absl::StrJoin(args, " "));
    ExpectUsageError(RunClient(args), expected);
  }
}

TEST(ClientUsageTest, TheServerRejectsPositionalArgumentsAndNamesDurationUnits) {
  RunResult run = RunServer({"--port=0", "--metrics_port=-1", "models"});
  ExpectUsageError(run, "error: unexpected argument 'models': attention_server takes flags only");
  run = RunServer({"--port=0", "--metrics_port=-1", "--drain_timeout=30"});
  ExpectUsageError(run, "error: --drain_timeout: expected a duration with a unit");
}

// CMakeLists.txt's project(mha_serve VERSION x.y.z).
std::string ProjectVersion() {
  const std::string cmake = ReadFile(std::string(MHA_SOURCE_DIR) + "/CMakeLists.txt");
  const size_t at = cmake.find("project(mha_serve VERSION ");
  if (at == std::string::npos) return "";
  const size_t start = at + std::strlen("project(mha_serve VERSION ");
  return cmake.substr(start, cmake.find_first_of(" )", start) - start);
}

// --version on every program a user runs: the two binaries print the project's
// version and this build's type; the Python CLI and exporter the version and
// "(python)". Each exits 0 with one line on stdout.
TEST(VersionTest, EveryProgramPrintsTheProjectVersion) {
  const std::string version = ProjectVersion();
  ASSERT_FALSE(version.empty()) << "no project VERSION in CMakeLists.txt";
  const std::string python_path = std::string("PYTHONPATH=") + MHA_SOURCE_DIR + "/client/python";
  struct Case {
    std::string binary;
    std::vector<std::string> args;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {MHA_CLIENT_PATH,
       {"--version"},
       absl::StrCat("attention_client ", version, " (", MHA_BUILD_TYPE, ")\n")},
      {MHA_SERVER_PATH,
       {"--version"},
       absl::StrCat("attention_server ", version, " (", MHA_BUILD_TYPE, ")\n")},
      {"/usr/bin/env",
       {python_path, MHA_PYTHON, "-m", "mha_serve", "--version"},
       absl::StrCat("mha-serve-client ", version, " (python)\n")},
      {"/usr/bin/env",
       {python_path, MHA_PYTHON, "-m", "mha_serve.export", "--version"},
       absl::StrCat("mha_serve.export ", version, " (python)\n")},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(absl::StrCat(c.binary, " ", absl::StrJoin(c.args, " ")));
    const RunResult run = RunProgram(c.binary, c.args, absl::Seconds(60));
    EXPECT_EQ(run.exit_code, 0) << Describe(run);
    EXPECT_EQ(run.out, c.expected) << Describe(run);
    EXPECT_FALSE(absl::StrContains(run.out + run.err, "NDEBUG")) << Describe(run);
  }
  // The build type is this build's own: never absl's "Debug build" on a release.
  EXPECT_FALSE(std::string(MHA_BUILD_TYPE).empty());
}

TEST(VersionTest, TheServersHelpExitsZeroWithoutSourcePaths) {
  const RunResult run = RunServer({"--help"});
  EXPECT_EQ(run.exit_code, 0) << Describe(run);
  EXPECT_TRUE(absl::StrContains(run.out, "--port (")) << run.out;
  EXPECT_FALSE(absl::StrContains(run.out + run.err, "main.cc")) << run.out;
  EXPECT_FALSE(absl::StrContains(run.out + run.err, "--flagfile")) << run.out;
}

TEST_F(ClientTest, InferDefaultRequestMatchesTheCore) {
  const ClientRun run = RunClient({"infer", TargetFlag(), "--output=" + Path("run.safetensors")});
  ASSERT_EQ(run.exit_code, 0) << Describe(run);
  EXPECT_TRUE(absl::StrContains(run.out, "output shape: (2, 4, 100)")) << run.out;
  EXPECT_TRUE(absl::StrContains(run.out, "valid_lens [3, 2]")) << run.out;
  EXPECT_TRUE(absl::StrContains(run.out, "ms round trip")) << run.out;

  // The file records what was sent; the core on those inputs must give the output.
  auto file = core::SafetensorsFile::Open(Path("run.safetensors"));
  ASSERT_TRUE(file.ok()) << file.status();
  const AttendRequest request = RequestFromFile(**file);
  ASSERT_EQ(request.queries().shape_size(), 3);
  EXPECT_EQ(request.keys().shape(1), 6);
  EXPECT_EQ(request.valid_lens_size(), 2);
  float lo = 1, hi = -1;
  for (float v : request.queries().data()) lo = std::min(lo, v), hi = std::max(hi, v);
  EXPECT_GE(lo, -1.0f);
  EXPECT_LT(hi, 1.0f);
  EXPECT_GT(hi - lo, 1.5f) << "random inputs should cover [-1, 1)";

  const CoreResult expected = CoreForward(kToy, 0, request);
  const std::vector<float> got = (*file)->Get("output")->ToFloat("output").value();
  ASSERT_EQ(got.size(), 2u * 4 * 100);
  EXPECT_LE(MaxAbsDiff(got, expected.output), 1e-5f);

  // Another seed, other inputs, another output.
  const ClientRun other =
      RunClient({"infer", TargetFlag(), "--seed=5", "--output=" + Path("other.npy")});
  ASSERT_EQ(other.exit_code, 0) << Describe(other);
  auto other_output = client::ReadNpy(Path("other.npy"));
  ASSERT_TRUE(other_output.ok()) << other_output.status();
  EXPECT_GT(
      MaxAbsDiff(std::vector<float>(other_output->values.begin(), other_output->values.end()), got),
      1e-3f);
}

// The lines "[b, q, :4] = ..." of a program's output.
std::vector<std::string> RowLines(const std::string& out) {
  std::vector<std::string> rows;
  for (absl::string_view line : absl::StrSplit(out, '\n')) {
    if (absl::StartsWith(line, "[")) rows.emplace_back(line);
  }
  return rows;
}

// The README shows the two side by side: the same inputs (SplitMix64 from seed 0)
// and weights give the same printed rows.
TEST_F(ClientTest, InferPrintsTheToyExamplesRows) {
  const RunResult toy = RunProgram(MHA_TOY_EXAMPLE_PATH, {}, absl::Seconds(60));
  ASSERT_EQ(toy.exit_code, 0) << toy.err;
  const ClientRun run = RunClient({"infer", TargetFlag()});
  ASSERT_EQ(run.exit_code, 0) << Describe(run);
  const std::vector<std::string> rows = RowLines(run.out);
  ASSERT_EQ(rows.size(), 8u) << run.out;
  EXPECT_EQ(rows[0].substr(0, 13), "[0, 0, :4] = ") << run.out;
  EXPECT_EQ(rows, RowLines(toy.out)) << "infer:\n" << run.out << "\nmha_toy_example:\n" << toy.out;
  EXPECT_TRUE(absl::StrContains(toy.out, "output shape: (2, 4, 100)")) << toy.out;
}

TEST_F(ClientTest, InferFromNpyFilesMatchesTheCore) {
  // Cross-attention with its own shapes, and self-attention from one file.
  AttendRequest cross;
  *cross.mutable_queries() = MakeTensor({3, 5, 100}, 0.3f);
  *cross.mutable_keys() = MakeTensor({3, 7, 100}, 1.1f);
  *cross.mutable_values() = MakeTensor({3, 7, 100}, 2.7f);
  for (int len : {7, 1, 4}) cross.add_valid_lens(len);
  std::vector<std::string> files;
  for (const auto& [name, tensor] :
       {std::pair{"q", &cross.queries()}, {"k", &cross.keys()}, {"v", &cross.values()}}) {
    files.push_back(Path(absl::StrCat(name, ".npy")));
    ASSERT_TRUE(client::WriteNpy(files.back(), {tensor->shape().begin(), tensor->shape().end()},
                                 tensor->data())
                    .ok());
  }
  ClientRun run = RunClient({"infer", TargetFlag(), "--input=" + absl::StrJoin(files, ","),
                             "--valid_lens=7,1,4", "--output=" + Path("cross.npy")});
  ASSERT_EQ(run.exit_code, 0) << Describe(run);
  EXPECT_TRUE(absl::StrContains(run.out, "output shape: (3, 5, 100)")) << run.out;
  auto output = client::ReadNpy(Path("cross.npy"));
  ASSERT_TRUE(output.ok()) << output.status();
  EXPECT_EQ(output->shape, (std::vector<int64_t>{3, 5, 100}));
  EXPECT_LE(MaxAbsDiff(std::vector<float>(output->values.begin(), output->values.end()),
                       CoreForward(kToy, 0, cross).output),
            1e-5f);

  AttendRequest self;
  *self.mutable_queries() = cross.queries();
  self.set_causal(true);
  run = RunClient({"infer", TargetFlag(), "--input=" + files[0], "--valid_lens=none", "--causal",
                   "--output=" + Path("self.npy")});
  ASSERT_EQ(run.exit_code, 0) << Describe(run);
  EXPECT_TRUE(absl::StrContains(run.out, "(self-attention)")) << run.out;
  output = client::ReadNpy(Path("self.npy"));
  ASSERT_TRUE(output.ok()) << output.status();
  EXPECT_LE(MaxAbsDiff(std::vector<float>(output->values.begin(), output->values.end()),
                       CoreForward(kToy, 0, self).output),
            1e-5f);
}

// Without --valid_lens only the toy request itself (B 2, Q 4, K 6, no --input) gets
// the toy lengths 3,2; other sizes and files send none, and the server's answer is
// the core's for what was sent.
TEST_F(ClientTest, TheToyValidLensAreTheToyRequestsOnly) {
  struct Case {
    std::vector<std::string> flags;
    std::string request_line;
  };
  const std::vector<Case> cases = {
      {{}, "request: queries (2, 4, 100), keys (2, 6, 100), values (2, 6, 100), valid_lens [3, 2]"},
      {{"--batch=8"},
       "request: queries (8, 4, 100), keys (8, 6, 100), values (8, 6, 100), valid_lens []"},
      {{"--num_keys=2"},
       "request: queries (2, 4, 100), keys (2, 2, 100), values (2, 2, 100), valid_lens []"},
      {{"--num_queries=3", "--num_keys=0"},
       "request: queries (2, 3, 100) (self-attention), valid_lens []"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(absl::StrJoin(c.flags, " "));
    std::vector<std::string> args = {"infer", TargetFlag(), "--output=" + Path("run.safetensors")};
    args.insert(args.end(), c.flags.begin(), c.flags.end());
    const ClientRun run = RunClient(args);
    ASSERT_EQ(run.exit_code, 0) << Describe(run);
    EXPECT_TRUE(absl::StrContains(run.out, c.request_line + "\n")) << run.out;
    auto file = core::SafetensorsFile::Open(Path("run.safetensors"));
    ASSERT_TRUE(file.ok()) << file.status();
    const AttendRequest sent = RequestFromFile(**file);
    EXPECT_LE(MaxAbsDiff((*file)->Get("output")->ToFloat("output").value(),
                         CoreForward(kToy, 0, sent).output),
              1e-5f);
  }
  // A .npy input of another batch size: no lengths unless given.
  AttendRequest three;
  *three.mutable_queries() = MakeTensor({3, 5, 100}, 0.3f);
  ASSERT_TRUE(client::WriteNpy(Path("q.npy"), {3, 5, 100}, three.queries().data()).ok());
  const ClientRun run = RunClient({"infer", TargetFlag(), "--input=" + Path("q.npy")});
  ASSERT_EQ(run.exit_code, 0) << Describe(run);
  EXPECT_TRUE(absl::StrContains(run.out, "(self-attention), valid_lens []\n")) << run.out;
}

// Lengths that fit neither B nor B*Q of the --input files are the user's to fix: a
// usage error (exit 2) naming the flag or the file, and no request sent.
TEST_F(ClientTest, InputFilesWithTheWrongValidLensCountAreUsageErrors) {
  const AttendRequest toy = ToyRequest();
  std::vector<client::SafetensorsEntry> entries = {
      client::F32Entry("queries", {2, 4, 100}, toy.queries().data()),
      client::F32Entry("keys", {2, 6, 100}, toy.keys().data()),
      client::F32Entry("values", {2, 6, 100}, toy.values().data()),
      client::I32Entry("valid_lens", {3}, std::vector<int32_t>{1, 2, 3})};
  ASSERT_TRUE(client::WriteSafetensors(Path("io.safetensors"), entries).ok());
  ASSERT_TRUE(client::WriteNpy(Path("q.npy"), {3, 5, 100}, MakeTensor({3, 5, 100}).data()).ok());
  const int64_t before = RequestsTotal(*server_);
  ExpectUsageError(RunClient({"infer", TargetFlag(), "--input=" + Path("io.safetensors")}),
                   "error: --input: " + Path("io.safetensors") +
                       ": its valid_lens has 3 entries for queries (2, 4, 100): expected B = 2 "
                       "or B*Q = 8");
  ExpectUsageError(
      RunClient({"infer", TargetFlag(), "--input=" + Path("q.npy"), "--valid_lens=3,2"}),
      "error: --valid_lens: 2 entries (3,2) for batch 3: give B = 3 or B*Q = 15 entries, or "
      "--valid_lens=none (B and Q from --input)");
  ExpectUsageError(RunClient({"bench", TargetFlag(), "--input=" + Path("io.safetensors")}),
                   "error: --input: ");
  EXPECT_EQ(RequestsTotal(*server_), before) << "a usage error sent a request";
}

// infer --input=FILE.safetensors with an "output" tensor (the exporter's
// io.safetensors): the server's output against it, as a max abs difference.
TEST_F(ClientTest, InferComparesWithTheOutputStoredInTheInputFile) {
  AttendRequest request;
  *request.mutable_queries() = MakeTensor({3, 5, 100}, 0.3f);
  *request.mutable_keys() = MakeTensor({3, 7, 100}, 1.1f);
  *request.mutable_values() = MakeTensor({3, 7, 100}, 2.7f);
  for (int len : {7, 1, 4}) request.add_valid_lens(len);
  std::vector<float> expected = CoreForward(kToy, 0, request).output;
  auto write = [&](const std::string& name, const std::vector<float>& output,
                   std::vector<int64_t> output_shape) {
    const std::vector<int32_t> lens(request.valid_lens().begin(), request.valid_lens().end());
    ASSERT_TRUE(client::WriteSafetensors(
                    Path(name), {client::F32Entry("queries", {3, 5, 100}, request.queries().data()),
                                 client::F32Entry("keys", {3, 7, 100}, request.keys().data()),
                                 client::F32Entry("values", {3, 7, 100}, request.values().data()),
                                 client::I32Entry("valid_lens", {3}, lens),
                                 client::F32Entry("output", output_shape, output)})
                    .ok());
  };
  // The printed difference, parsed.
  auto difference = [](const std::string& out) {
    const size_t at = out.find("max abs difference ");
    return at == std::string::npos
               ? -1.0
               : std::strtod(out.c_str() + at + std::strlen("max abs difference "), nullptr);
  };

  write("same.safetensors", expected, {3, 5, 100});
  ClientRun run = RunClient({"infer", TargetFlag(), "--input=" + Path("same.safetensors")});
  ASSERT_EQ(run.exit_code, 0) << Describe(run);
  EXPECT_TRUE(absl::StrContains(
      run.out, "stored output (" + Path("same.safetensors") + "): max abs difference "))
      << run.out;
  EXPECT_TRUE(absl::StrContains(run.out, " over 1500 values\n")) << run.out;
  EXPECT_GE(difference(run.out), 0.0) << run.out;
  EXPECT_LE(difference(run.out), 1e-5) << run.out;

  // One value off by 0.25: the difference says so (and infer still succeeds).
  std::vector<float> off = expected;
  off[737] += 0.25f;
  write("off.safetensors", off, {3, 5, 100});
  run = RunClient({"infer", TargetFlag(), "--input=" + Path("off.safetensors")});
  ASSERT_EQ(run.exit_code, 0) << Describe(run);
  EXPECT_NEAR(difference(run.out), 0.25, 1e-4) << run.out;

  // A stored output of another shape is not this request's: an error naming the file.
  write("other.safetensors", std::vector<float>(expected.begin(), expected.begin() + 1000),
        {2, 5, 100});
  run = RunClient({"infer", TargetFlag(), "--input=" + Path("other.safetensors")});
  EXPECT_EQ(run.exit_code, 1) << Describe(run);
  EXPECT_TRUE(absl::StartsWith(run.err, "error: INVALID_ARGUMENT: " + Path("other.safetensors") +
                                            ": the stored output has shape (2, 5, 100), the "
                                            "server's (3, 5, 100)"))
      << run.err;

  // A file infer wrote itself holds its output: the same request again compares to ~0.
  run = RunClient({"infer", TargetFlag(), "--output=" + Path("run.safetensors")});
  ASSERT_EQ(run.exit_code, 0) << Describe(run);
  run = RunClient({"infer", TargetFlag(), "--input=" + Path("run.safetensors")});
  ASSERT_EQ(run.exit_code, 0) << Describe(run);
  EXPECT_TRUE(absl::StrContains(run.out, "valid_lens [3, 2]")) << run.out;
  EXPECT_LE(difference(run.out), 1e-5) << run.out;
  EXPECT_GE(difference(run.out), 0.0) << run.out;
}

TEST_F(ClientTest, ErrorsAreOneLineWithTheCodeName) {
  const RawServer silent("");
  struct Case {
    std::vector<std::string> args;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {{"--valid_lens=3,9"},
       "error: INVALID_ARGUMENT: Attend: valid_lens[1]: expected 0 <= valid_len <= K = 6, got 9"},
      {{"--model=nope"}, "error: NOT_FOUND: GetModel: model: unknown model \"nope\""},
      // A listener that never answers: the deadline always passes first.
      {{"--target=127.0.0.1:" + std::to_string(silent.port()), "--timeout=300ms"},
       "error: DEADLINE_EXCEEDED: "},
      {{"--target=127.0.0.1:1", "--timeout=5s"}, "error: UNAVAILABLE: "},
      {{"--input=" + Path("absent.npy")}, "error: INVALID_ARGUMENT: "},
  };
  for (const Case& c : cases) {
    std::vector<std::string> args = {"infer", TargetFlag()};
    args.insert(args.end(), c.args.begin(), c.args.end());
    const ClientRun run = RunClient(args);
    EXPECT_EQ(run.exit_code, 1) << Describe(run);
    EXPECT_TRUE(absl::StartsWith(run.err, c.expected)) << run.err;
    EXPECT_EQ(std::count(run.err.begin(), run.err.end(), '\n'), 1) << run.err;
  }
}

TEST_F(ClientTest, MessageSizeErrorsNameMaxMessageSize) {
  // The toy request (12.8 kB) over a 5000-byte limit is refused before it is sent.
  ClientRun run = RunClient({"infer", TargetFlag(), "--max_message_size=5000"});
  EXPECT_EQ(run.exit_code, 1) << Describe(run);
  EXPECT_TRUE(absl::StartsWith(run.err,
                               "error: RESOURCE_EXHAUSTED: Attend: Sent message larger "
                               "than max ("))
      << run.err;
  EXPECT_TRUE(absl::EndsWith(run.err, "(the client's limit, --max_message_size=5000: raise it)\n"))
      << run.err;
  // An 80 kB request whose answer (output and attention weights) is 1.8 MB.
  run = RunClient({"infer", TargetFlag(), "--max_message_size=200000", "--num_queries=200",
                   "--num_keys=0", "--valid_lens=none", "--return_attention"});
  EXPECT_EQ(run.exit_code, 1) << Describe(run);
  EXPECT_TRUE(absl::StartsWith(run.err,
                               "error: RESOURCE_EXHAUSTED: Attend: Received message "
                               "larger than max ("))
      << run.err;
  EXPECT_TRUE(
      absl::EndsWith(run.err, "(the client's limit, --max_message_size=200000: raise it)\n"))
      << run.err;
}

// decode's sessions draw their tokens as the client documents (client/load/decode.h):
// session s's P + N tokens from SplitMix64(seed + s). The core's causal forward over
// all of them, rows P .. P + N - 1 summed over every session, is what the decode
// steps' outputs must add up to, with or without the server's cache.
struct DecodeSum {
  double sum = 0;
  double sum_abs = 0;
};
DecodeSum ExpectedDecodeSum(int64_t sessions, int64_t prefill, int64_t steps) {
  DecodeSum expected;
  for (int64_t s = 0; s < sessions; ++s) {
    SplitMix64 inputs(static_cast<uint64_t>(s));
    AttendRequest request;
    client::FillSigned(inputs, {1, prefill + steps, kToy.query_size}, request.mutable_queries());
    request.set_causal(true);
    const CoreResult core = CoreForward(kToy, 0, request);
    for (size_t i = static_cast<size_t>(prefill * kToy.num_hiddens); i < core.output.size(); ++i) {
      expected.sum += core.output[i];
      expected.sum_abs += std::abs(core.output[i]);
    }
  }
  return expected;
}

// Six sessions: more than the driver's four prefills in flight, so two wait their turn.
TEST_F(ClientTest, DecodeSessionsAddUpToTheCoreWithAndWithoutTheCache) {
  constexpr int64_t kSessions = 6, kPrefill = 5, kSteps = 7;
  const DecodeSum expected = ExpectedDecodeSum(kSessions, kPrefill, kSteps);
  ASSERT_GT(expected.sum_abs, 1.0);
  for (const bool stateless : {false, true}) {
    SCOPED_TRACE(stateless ? "--stateless" : "sessions");
    std::vector<std::string> args = {"decode",
                                     TargetFlag(),
                                     absl::StrCat("--sessions=", kSessions),
                                     absl::StrCat("--prefill=", kPrefill),
                                     absl::StrCat("--decode_tokens=", kSteps),
                                     "--json=" + Path("decode.json")};
    if (stateless) args.push_back("--stateless");
    const ClientRun run = RunClient(args);
    ASSERT_EQ(run.exit_code, 0) << Describe(run);
    EXPECT_TRUE(absl::StrContains(run.out, "decode: 42 tokens in ")) << run.out;
    EXPECT_TRUE(absl::StrContains(
        run.out, stateless ? "calls: 48 Attend\n" : "calls: 6 AttendSession stream(s), 48 steps\n"))
        << run.out;

    const json report = json::parse(ReadFile(Path("decode.json")));
    EXPECT_EQ(report["call"], stateless ? "Attend" : "AttendSession");
    EXPECT_EQ(report["stateless"], stateless);
    EXPECT_EQ(report["calls"], stateless ? kSessions * (1 + kSteps) : kSessions);
    EXPECT_EQ(report["prefill_steps"]["count"], kSessions);
    EXPECT_EQ(report["decode"]["tokens"], kSessions * kSteps);
    EXPECT_GT(report["decode"]["tokens_per_s"].get<double>(), 0);
    // Contexts 6 .. 12 after each step: every step in the first bucket.
    ASSERT_EQ(report["decode_buckets"].size(), 1u) << report.dump(2);
    EXPECT_EQ(report["decode_buckets"][0]["label"], "<=64");
    EXPECT_EQ(report["decode_buckets"][0]["count"], kSessions * kSteps);
    const double p50 = report["decode_buckets"][0]["latency_us"]["p50"];
    EXPECT_GT(p50, 0);
    EXPECT_LE(p50, report["decode_buckets"][0]["latency_us"]["max"].get<double>());
    EXPECT_GE(report["decode_buckets"][0]["server"]["compute_us"].get<double>(), 0);
    // f32 sums of 2,100 values, each within 1e-5 of the core's.
    EXPECT_NEAR(report["output_sum"].get<double>(), expected.sum, 1e-5 * expected.sum_abs)
        << "expected " << expected.sum;
  }
}

// An attention-only model (issue 35): decode sends random pre-projected q, k, v as
// client/load/decode.h documents them; the steps' outputs add up to the core's causal
// forward over the same tensors, and the cache bytes a step reads are printed.
TEST(ClientWorkerTest, DecodeOnAnAttentionOnlyModelReportsCacheBytes) {
  constexpr int64_t kSessions = 6, kPrefill = 9, kSteps = 6;  // two wait to prefill
  core::ModelConfig c{
      .num_hiddens = 64, .num_heads = 8, .query_size = 64, .key_size = 16, .value_size = 16};
  c.num_kv_heads = 2;
  c.projections = core::Projections::kNone;
  TempDir repository;
  repository.Write("w/config.pbtxt",
                   "num_hiddens: 64 num_heads: 8 num_kv_heads: 2 projections: NONE");
  auto server = ServerProcess::Start(
      {"--port=0", "--default_warmup=false", "--model_repository=" + repository.path()});
  ASSERT_TRUE(server.ok()) << server.status();
  // The core's answer on the documented tokens.
  auto mha = core::MultiHeadAttention::Create(c, core::Weights{}).value();
  double sum = 0, sum_abs = 0;
  const int64_t n = kPrefill + kSteps;
  for (int64_t s = 0; s < kSessions; ++s) {
    Tensor q, k, v;
    SplitMix64 qs(static_cast<uint64_t>(s));
    SplitMix64 ks(static_cast<uint64_t>(s) ^ (uint64_t{1} << 56));
    SplitMix64 vs(static_cast<uint64_t>(s) ^ (uint64_t{2} << 56));
    client::FillSigned(qs, {1, n, 64}, &q);
    client::FillSigned(ks, {1, n, 16}, &k);
    client::FillSigned(vs, {1, n, 16}, &v);
    std::vector<float> out(n * 64);
    const core::AttentionInputs in{.batch = 1,
                                   .num_queries = n,
                                   .num_keys = n,
                                   .queries = q.data().data(),
                                   .keys = k.data().data(),
                                   .values = v.data().data(),
                                   .causal = true};
    ASSERT_TRUE(mha->Forward(in, out.data()).ok());
    for (size_t i = kPrefill * 64; i < out.size(); ++i) {
      sum += out[i];
      sum_abs += std::abs(out[i]);
    }
  }
  // Contexts kPrefill + 1 .. n, each token's key and value 2 x 16 floats.
  const double bytes_per_step = (kPrefill + 1 + n) / 2.0 * 2 * 16 * 4;
  for (const bool stateless : {false, true}) {
    SCOPED_TRACE(stateless ? "--stateless" : "sessions");
    TempDir out;
    std::vector<std::string> args = {"decode",
                                     "--target=" + (*server)->target(),
                                     absl::StrCat("--sessions=", kSessions),
                                     absl::StrCat("--prefill=", kPrefill),
                                     absl::StrCat("--decode_tokens=", kSteps),
                                     "--json=" + out.path() + "/d.json"};
    if (stateless) args.push_back("--stateless");
    const ClientRun run = RunClient(args);
    ASSERT_EQ(run.exit_code, 0) << Describe(run);
    EXPECT_TRUE(absl::StrContains(
        run.out, absl::StrFormat("cache read: %.0f bytes per decode step on average (f32 cache)",
                                 bytes_per_step)))
        << run.out;
    EXPECT_TRUE(absl::StrContains(run.out, " GB/s over the decode phase")) << run.out;
    if (!stateless) {
      EXPECT_TRUE(absl::StrContains(
          run.out, "(AttendSession, CROSS causal: each step sends its q, k and v)"))
          << run.out;
    }
    const json report = json::parse(ReadFile(out.path() + "/d.json"));
    EXPECT_DOUBLE_EQ(report["cache_bytes_per_step"].get<double>(), bytes_per_step);
    EXPECT_GT(report["cache_gb_per_s"].get<double>(), 0);
    EXPECT_NEAR(report["output_sum"].get<double>(), sum, 1e-5 * sum_abs) << "expected " << sum;
  }
  (*server)->Signal(SIGTERM);
  EXPECT_TRUE((*server)->WaitForExit(absl::Seconds(30)).has_value());
}

// --check runs the stateless equivalent on the same tokens: both sums are the
// core's, they match within the stated tolerance, and the speed-up is printed.
TEST_F(ClientTest, DecodeCheckComparesSessionsWithTheStatelessRun) {
  constexpr int64_t kSessions = 2, kPrefill = 4, kSteps = 6;
  const DecodeSum expected = ExpectedDecodeSum(kSessions, kPrefill, kSteps);
  for (const bool stateless : {false, true}) {
    SCOPED_TRACE(stateless ? "--stateless --check" : "--check");
    std::vector<std::string> args = {"decode",
                                     TargetFlag(),
                                     absl::StrCat("--sessions=", kSessions),
                                     absl::StrCat("--prefill=", kPrefill),
                                     absl::StrCat("--decode_tokens=", kSteps),
                                     "--check",
                                     "--json=" + Path("decode.json")};
    if (stateless) args.push_back("--stateless");
    const ClientRun run = RunClient(args);
    ASSERT_EQ(run.exit_code, 0) << Describe(run);
    // Both runs' tables, then the verdict naming the tolerance and the speed-up.
    EXPECT_TRUE(absl::StrContains(run.out, "calls: 14 Attend\n")) << run.out;
    EXPECT_TRUE(absl::StrContains(run.out, "calls: 2 AttendSession stream(s), 14 steps\n"))
        << run.out;
    EXPECT_TRUE(absl::StrContains(run.out, "check: output sums ")) << run.out;
    EXPECT_TRUE(absl::StrContains(run.out, "(stateless Attend): match, |difference| ")) << run.out;
    EXPECT_TRUE(absl::StrContains(run.out,
                                  " x the sum of |output|); AttendSession decode "
                                  "tokens/s "))
        << run.out;
    EXPECT_TRUE(absl::StrContains(run.out, "x stateless Attend's\n")) << run.out;

    const json check = json::parse(ReadFile(Path("decode.json")))["check"];
    ASSERT_TRUE(check.is_object()) << check.dump();
    EXPECT_EQ(check["match"], true);
    EXPECT_DOUBLE_EQ(check["relative_tolerance"].get<double>(), 1e-5);
    EXPECT_NEAR(check["tolerance"].get<double>(), 1e-5 * expected.sum_abs, 1e-7 * expected.sum_abs);
    EXPECT_NEAR(check["session_output_sum"].get<double>(), expected.sum, 1e-5 * expected.sum_abs);
    EXPECT_NEAR(check["stateless_output_sum"].get<double>(), expected.sum, 1e-5 * expected.sum_abs);
    EXPECT_GT(check["speedup"].get<double>(), 0);
  }
}

TEST(ClientDecodeTest, AStepOverTheTokenLimitFailsTheRunNamingSessionAndStep) {
  TempDir repository;
  repository.Write("short/config.pbtxt",
                   "num_hiddens: 8 num_heads: 2 seeded { seed: 1 } "
                   "limits { max_sequence_length: 8 }");
  repository.Write("cross/config.pbtxt",
                   "num_hiddens: 8 num_heads: 2 query_size: 4 key_size: 6 value_size: 3 "
                   "seeded { seed: 1 }");
  auto server = ServerProcess::Start({"--port=0", "--model_repository=" + repository.path()});
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string target = "--target=" + (*server)->target();

  // Contexts 6, 7, 8, then 9: the fourth decode step is over the limit of 8.
  ClientRun run = RunClient(
      {"decode", target, "--model=short", "--sessions=2", "--prefill=5", "--decode_tokens=6"});
  EXPECT_EQ(run.exit_code, 1) << Describe(run);
  EXPECT_TRUE(absl::StartsWith(run.err, "error: RESOURCE_EXHAUSTED: AttendSession: session "))
      << run.err;
  EXPECT_TRUE(absl::StrContains(run.err, ", decode step 4 of 6 (context 9): ")) << run.err;
  EXPECT_TRUE(absl::StrContains(run.err, "max_sequence_length 8")) << run.err;
  EXPECT_EQ(std::count(run.err.begin(), run.err.end(), '\n'), 1) << run.err;
  EXPECT_FALSE(absl::StrContains(run.out, "tokens/s")) << "no table after a failure\n" << run.out;

  // Within the limit the same model decodes.
  run = RunClient(
      {"decode", target, "--model=short", "--sessions=2", "--prefill=5", "--decode_tokens=3"});
  EXPECT_EQ(run.exit_code, 0) << Describe(run);

  // A model that cannot self-attend is refused before any session opens.
  run = RunClient({"decode", target, "--model=cross"});
  EXPECT_EQ(run.exit_code, 1) << Describe(run);
  EXPECT_TRUE(absl::StartsWith(run.err,
                               "error: INVALID_ARGUMENT: model cross has d_q 4, d_k 6, d_v 3 and "
                               "cannot self-attend"))
      << run.err;
}

TEST(ClientModelTest, SeveralModelsAndNoModelFlagSuggestsTheServedNames) {
  TempDir repository;
  for (const char* name : {"small", "tiny"}) {
    repository.Write(absl::StrCat(name, "/config.pbtxt"),
                     "num_hiddens: 8 num_heads: 2 seeded { seed: 1 }");
  }
  auto server = ServerProcess::Start({"--port=0", "--model_repository=" + repository.path()});
  ASSERT_TRUE(server.ok()) << server.status();
  const ClientRun run = RunClient({"infer", "--target=" + (*server)->target()});
  EXPECT_EQ(run.exit_code, 1) << Describe(run);
  EXPECT_TRUE(absl::StartsWith(run.err, "error: INVALID_ARGUMENT: GetModel: model: required"))
      << run.err;
  EXPECT_TRUE(absl::EndsWith(run.err, "; give --model=small or --model=tiny\n")) << run.err;
}

// kserve and http pick the model as attention.v1 does: the only one served, or a
// usage hint naming every model.
TEST(ClientModelTest, KserveAndHttpTakeTheOnlyModelOrSuggestTheNames) {
  TempDir one;
  one.Write("tiny/config.pbtxt", "num_hiddens: 8 num_heads: 2 seeded { seed: 1 }");
  auto server =
      ServerProcess::Start({"--port=0", "--http_port=0", "--model_repository=" + one.path()});
  ASSERT_TRUE(server.ok()) << server.status();
  for (const char* protocol : {"kserve", "http"}) {
    SCOPED_TRACE(protocol);
    const std::string target =
        std::string(protocol) == "http" ? (*server)->http_target() : (*server)->target();
    const ClientRun run =
        RunClient({"infer", absl::StrCat("--protocol=", protocol), "--target=" + target});
    ASSERT_EQ(run.exit_code, 0) << Describe(run);
    EXPECT_TRUE(absl::StrContains(run.out, "model tiny: p_o 8")) << run.out;
    EXPECT_TRUE(absl::StrContains(run.out, "output shape: (2, 4, 8)")) << run.out;
  }

  TempDir several;
  for (const char* name : {"small", "tiny"}) {
    several.Write(absl::StrCat(name, "/config.pbtxt"),
                  "num_hiddens: 8 num_heads: 2 seeded { seed: 1 }");
  }
  server =
      ServerProcess::Start({"--port=0", "--http_port=0", "--model_repository=" + several.path()});
  ASSERT_TRUE(server.ok()) << server.status();
  const std::pair<const char*, std::string> cases[] = {
      {"kserve", "error: INVALID_ARGUMENT: RepositoryIndex: model: required"},
      {"http", "error: INVALID_ARGUMENT: POST /v2/repository/index: model: required"}};
  for (const auto& [protocol, expected] : cases) {
    SCOPED_TRACE(protocol);
    const std::string target =
        std::string(protocol) == "http" ? (*server)->http_target() : (*server)->target();
    ClientRun run =
        RunClient({"infer", absl::StrCat("--protocol=", protocol), "--target=" + target});
    EXPECT_EQ(run.exit_code, 1) << Describe(run);
    EXPECT_TRUE(absl::StartsWith(run.err, expected)) << run.err;
    EXPECT_TRUE(absl::EndsWith(run.err, "; give --model=small or --model=tiny\n")) << run.err;
    run = RunClient(
        {"infer", absl::StrCat("--protocol=", protocol), "--target=" + target, "--model=small"});
    EXPECT_EQ(run.exit_code, 0) << Describe(run);
    EXPECT_TRUE(absl::StrContains(run.out, "model small: p_o 8")) << run.out;
  }
}

// --target is used as given with --protocol=http, even when it equals the gRPC default.
TEST(ClientUsageTest, HttpTargetIsNeverRewritten) {
  const ClientRun run =
      RunClient({"infer", "--protocol=http", "--target=127.0.0.1:50051", "--timeout=5s"});
  EXPECT_EQ(run.exit_code, 1) << Describe(run);
  EXPECT_TRUE(absl::StrContains(run.err, "127.0.0.1:50051")) << run.err;
  EXPECT_FALSE(absl::StrContains(run.err, ":8000")) << run.err;
}

TEST_F(ClientTest, HealthChecksTheServerAndEveryModel) {
  ClientRun run = RunClient({"health", TargetFlag()});
  ASSERT_EQ(run.exit_code, 0) << Describe(run);
  EXPECT_TRUE(absl::StrContains(run.out, "server: SERVING")) << run.out;
  EXPECT_TRUE(absl::StrContains(run.out, "model default: SERVING")) << run.out;

  run = RunClient({"health", TargetFlag(), "--service=nope"});
  EXPECT_EQ(run.exit_code, 1) << Describe(run);
  EXPECT_TRUE(absl::StartsWith(run.err, "error: NOT_FOUND: Health/Check model nope")) << run.err;
}

// Short steps: a fraction of a second of warm-up and windows, bounded by --duration.
std::vector<std::string> QuickBench(const std::string& target_flag) {
  return {"bench",         target_flag,       "--warmup=200ms",  "--window=500ms",
          "--duration=3s", "--max_windows=4", "--progress=false"};
}

json ReadJson(const std::string& path) {
  json parsed = json::parse(ReadFile(path), nullptr, /*allow_exceptions=*/false);
  EXPECT_FALSE(parsed.is_discarded()) << path;
  return parsed;
}

// mha_requests_total summed over every model and code: every Attend and every
// AttendStream message the server answered.
int64_t RequestsTotal(const ServerProcess& server) {
  const absl::StatusOr<std::string> text = ScrapeMetrics(server.metrics_port());
  EXPECT_TRUE(text.ok()) << text.status() << "\nserver stderr:\n" << server.log();
  if (!text.ok()) return -1;
  double total = 0;
  for (absl::string_view line : absl::StrSplit(*text, '\n')) {
    if (!absl::ConsumePrefix(&line, "mha_requests_total{")) continue;
    const size_t space = line.rfind(' ');
    total += std::strtod(std::string(line.substr(space + 1)).c_str(), nullptr);
  }
  return static_cast<int64_t>(total);
}

// The server's count once it reaches `expected` (it is bumped as each answer is
// sent, so it may trail the client's last response by a moment), or after 5 s.
int64_t SettledRequestsTotal(const ServerProcess& server, int64_t expected) {
  int64_t total = RequestsTotal(server);
  for (int i = 0; i < 50 && total < expected; ++i) {
    absl::SleepFor(absl::Milliseconds(100));
    total = RequestsTotal(server);
  }
  return total;
}

void ExpectSaneStep(const json& step, const std::string& rpc) {
  SCOPED_TRACE(step.dump());
  EXPECT_EQ(step["rpc"], rpc);
  EXPECT_GT(step["ok"].get<int64_t>(), 0);
  EXPECT_TRUE(step["errors"].empty());
  EXPECT_GT(step["requests_per_s"].get<double>(), 0);
  const json& l = step["latency_us"];
  EXPECT_GT(l["p50"].get<double>(), 0);
  EXPECT_LE(l["p50"].get<double>(), l["p90"].get<double>());
  EXPECT_LE(l["p90"].get<double>(), l["p95"].get<double>());
  EXPECT_LE(l["p95"].get<double>(), l["p99"].get<double>());
  EXPECT_LE(l["p99"].get<double>(), l["max"].get<double>());
  EXPECT_GE(step["sent"].get<int64_t>(), step["ok"].get<int64_t>());
  EXPECT_GE(step["windows"].get<int>(), 1);
  EXPECT_LE(step["windows"].get<int>(), 4);
}

TEST_F(ClientTest, BenchSweepsConcurrencyAndWritesJsonAndCsv) {
  std::vector<std::string> args = QuickBench(TargetFlag());
  args.insert(args.end(), {"--concurrency=1:4:x2", "--json=" + Path("bench.json"),
                           "--csv=" + Path("bench.csv")});
  const ClientRun run = RunClient(args);
  ASSERT_EQ(run.exit_code, 0) << Describe(run);
  for (const char* row : {"concurrency 1 ", "concurrency 2 ", "concurrency 4 "}) {
    EXPECT_TRUE(absl::StrContains(run.out, row)) << run.out;
  }
  const json report = ReadJson(Path("bench.json"));
  ASSERT_EQ(report["steps"].size(), 3u) << report.dump();
  int64_t sent = 1;  // the pre-flight request
  for (size_t i = 0; i < 3; ++i) {
    const json& step = report["steps"][i];
    ExpectSaneStep(step, "attend");
    EXPECT_EQ(step["concurrency"], 1 << i);
    // Tokens are B * Q = 8 per request.
    EXPECT_NEAR(step["tokens_per_s"].get<double>(), 8 * step["requests_per_s"].get<double>(),
                1e-6 * step["tokens_per_s"].get<double>());
    // Server timing comes from the responses: B = 2 rows per request at least.
    EXPECT_GE(step["server"]["batch_rows"].get<double>(), 2.0);
    EXPECT_GT(step["server"]["compute_us"].get<double>(), 0);
    sent += step["sent"].get<int64_t>();
  }
  EXPECT_EQ(report["attend_requests"].get<int64_t>(), sent);
  EXPECT_EQ(report["request"]["tokens"], 8);
  EXPECT_EQ(report["model"]["name"], "default");

  const std::vector<std::string> csv =
      absl::StrSplit(ReadFile(Path("bench.csv")), '\n', absl::SkipEmpty());
  ASSERT_EQ(csv.size(), 4u);
  EXPECT_TRUE(absl::StartsWith(csv[0], "rpc,mode,concurrency,request_rate,requests_per_s"));
  EXPECT_TRUE(absl::StartsWith(csv[3], "attend,unary,4,")) << csv[3];
}

// --max_requests counts measured requests only: without a warm-up every request
// sent; with one, those sent after it (and in flight as it ends), however many the
// warm-up sent.
TEST_F(ClientTest, BenchMaxRequestsBoundsTheMeasuredRequests) {
  for (const std::string warmup : {"0s", "500ms"}) {
    SCOPED_TRACE("--warmup=" + warmup);
    std::vector<std::string> args = QuickBench(TargetFlag());
    // Windows long enough that the 40 requests finish in the last 3 even on a busy
    // machine (the step ends as soon as they have); later flags override QuickBench's.
    args.insert(args.end(), {"--concurrency=3", "--warmup=" + warmup, "--max_requests=40",
                             "--window=5s", "--duration=30s", "--json=" + Path("bench.json")});
    const ClientRun run = RunClient(args);
    ASSERT_EQ(run.exit_code, 0) << Describe(run);
    const json report = ReadJson(Path("bench.json"));
    ASSERT_EQ(report["steps"].size(), 1u);
    const json& step = report["steps"][0];
    EXPECT_EQ(step["end_reason"], "max_requests") << step.dump();
    EXPECT_EQ(step["measured"], 40) << step.dump();
    EXPECT_EQ(step["requests"], 40) << step.dump();
    EXPECT_EQ(step["ok"], 40) << step.dump();
    const int64_t sent = step["sent"];
    EXPECT_EQ(report["attend_requests"], sent + 1);  // and the pre-flight request
    if (warmup == "0s") {
      EXPECT_EQ(sent, 40);
    } else {
      EXPECT_GT(sent, 40) << "the warm-up sent requests too";
    }
  }
}

// The server killed in the middle of the decode phase: the run ends at once with
// the first failure, UNAVAILABLE naming a session and its step, and prints no
// table. Every stream was finished for the client to exit on its own.
TEST(ClientDecodeTest, AServerThatDiesEndsTheRunNamingSessionAndStep) {
  TempDir repository;
  repository.Write("long/config.pbtxt",
                   "num_hiddens: 16 num_heads: 2 seeded { seed: 1 } "
                   "limits { max_sequence_length: 1000000 }");
  auto server = ServerProcess::Start({"--port=0", "--model_repository=" + repository.path()});
  ASSERT_TRUE(server.ok()) << server.status();
  // The kill comes once the server holds more than the 4 prefills' 16 tokens: the
  // decode phase is under way (however slow the build, as under ThreadSanitizer).
  absl::Time killed;
  std::thread killer([&] {
    const absl::Time give_up = absl::Now() + absl::Seconds(60);
    while (absl::Now() < give_up) {
      const absl::StatusOr<std::string> text = ScrapeMetrics((*server)->metrics_port());
      if (text.ok() && MetricValue(*text, "mha_session_cached_tokens") > 16) break;
      absl::SleepFor(absl::Milliseconds(20));
    }
    killed = absl::Now();
    (*server)->Signal(SIGKILL);
  });
  const ClientRun run =
      RunClient({"decode", "--target=" + (*server)->target(), "--model=long", "--sessions=4",
                 "--prefill=4", "--decode_tokens=1000000", "--timeout=60s"});
  const absl::Time ended = absl::Now();
  killer.join();
  const absl::Duration elapsed = ended - killed;
  (*server)->WaitForExit(absl::Seconds(10));
  EXPECT_EQ(run.exit_code, 1) << Describe(run);
  EXPECT_TRUE(absl::StartsWith(run.err, "error: UNAVAILABLE: AttendSession: session ")) << run.err;
  EXPECT_TRUE(absl::StrContains(run.err, ", decode step ")) << run.err;
  EXPECT_EQ(std::count(run.err.begin(), run.err.end(), '\n'), 1) << run.err;
  EXPECT_FALSE(absl::StrContains(run.out, "tokens/s")) << run.out;
  EXPECT_LT(elapsed, absl::Seconds(10)) << "the run outlived its server by " << elapsed;
}

// Requests that outlast every window (a 512-wide model, 8 x 512 tokens, against
// 10 ms windows): the step measured nothing, and bench says so and fails.
TEST(ClientBenchTest, AStepThatMeasuredNothingFailsTheRun) {
  TempDir repository;
  repository.Write("wide/config.pbtxt", "num_hiddens: 512 num_heads: 8 seeded { seed: 1 }");
  auto server = ServerProcess::Start({"--port=0", "--model_repository=" + repository.path()});
  ASSERT_TRUE(server.ok()) << server.status();
  const ClientRun run =
      RunClient({"bench", "--target=" + (*server)->target(), "--model=wide", "--batch=8",
                 "--num_queries=512", "--num_keys=0", "--valid_lens=none", "--warmup=0s",
                 "--window=10ms", "--max_windows=2", "--stable_windows=2", "--progress=false"});
  EXPECT_EQ(run.exit_code, 1) << Describe(run);
  EXPECT_TRUE(absl::StartsWith(run.err,
                               "error: FAILED_PRECONDITION: bench: attend concurrency 1: measured "
                               "nothing: no request finished in its last 2 window(s) of 10ms"))
      << run.err;
}

// Bench (concurrency 2, 500 ms windows, `flags`) against a server of its own that
// is killed 1.5 s into the run: its exit, how long it took and its --json report.
struct DeadServerRun {
  ClientRun run;
  absl::Duration elapsed;
  json report;
};
DeadServerRun BenchUntilTheServerDies(const std::vector<std::string>& flags) {
  DeadServerRun result;
  auto server = ServerProcess::Start({"--port=0"});
  EXPECT_TRUE(server.ok()) << server.status();
  if (!server.ok()) return result;
  TempDir dir;
  std::vector<std::string> args = {"bench",
                                   "--target=" + (*server)->target(),
                                   "--concurrency=2",
                                   "--warmup=200ms",
                                   "--window=500ms",
                                   "--max_windows=100",
                                   "--stable_windows=100",
                                   "--progress=false",
                                   "--json=" + dir.path() + "/bench.json"};
  args.insert(args.end(), flags.begin(), flags.end());
  std::thread killer([&] {
    absl::SleepFor(absl::Milliseconds(1500));
    (*server)->Signal(SIGKILL);
  });
  const absl::Time start = absl::Now();
  result.run = RunClient(args);
  result.elapsed = absl::Now() - start;
  killer.join();
  (*server)->WaitForExit(absl::Seconds(10));
  result.report = ReadJson(dir.path() + "/bench.json");
  EXPECT_EQ(result.run.exit_code, 1) << Describe(result.run);
  EXPECT_TRUE(absl::StartsWith(result.run.err, "error: UNAVAILABLE: bench: attend concurrency "))
      << result.run.err;
  return result;
}

TEST(ClientBenchTest, FailuresBackOffWhenTheServerDies) {
  // No --max_errors: the step runs its 4 s out, failing from 1.5 s on.
  const DeadServerRun dead = BenchUntilTheServerDies({"--duration=4s", "--max_errors=0"});
  EXPECT_LT(dead.elapsed, absl::Seconds(10));
  const json& step = dead.report["steps"][0];
  EXPECT_GT(step["ok"].get<int64_t>(), 0) << step.dump();
  // About 2.5 s dead at concurrency 2: 1, 2, 4, ... ms then 100 ms between attempts,
  // some 60 of them; a tight loop makes tens of thousands.
  const int64_t failed = step["all_errors"].value("UNAVAILABLE", int64_t{0});
  EXPECT_GT(failed, 0) << step.dump();
  EXPECT_LT(failed, 200) << step.dump();
  EXPECT_EQ(step["all_errors"].size(), 1u) << step.dump();
  // One count: the table's row, its last line and the error line agree.
  const std::string count = absl::StrCat("UNAVAILABLE=", failed);
  EXPECT_TRUE(absl::StrContains(dead.run.out, " " + count + " ")) << dead.run.out;
  EXPECT_TRUE(absl::StrContains(dead.run.out, absl::StrCat("; failed: ", failed, "\n")))
      << dead.run.out;
  EXPECT_TRUE(absl::StrContains(
      dead.run.err, absl::StrCat(": ", failed, " failed request(s) (", count, ") not allowed")))
      << dead.run.err;
}

TEST(ClientBenchTest, MaxErrorsEndsTheRunEarly) {
  // The default --max_errors=10 ends a 60 s step soon after the server dies, and the
  // sweep's second step is not run.
  const DeadServerRun dead = BenchUntilTheServerDies({"--duration=60s", "--concurrency=1:2"});
  EXPECT_TRUE(absl::StrContains(dead.run.err, "--max_errors=10 ended the step and the run"))
      << dead.run.err;
  EXPECT_LT(dead.elapsed, absl::Seconds(15));
  ASSERT_EQ(dead.report["steps"].size(), 1u) << dead.report.dump();
  const json& step = dead.report["steps"][0];
  EXPECT_EQ(step["end_reason"], "max_errors") << step.dump();
  EXPECT_EQ(step["all_errors"].value("UNAVAILABLE", int64_t{0}), 10) << step.dump();
  EXPECT_TRUE(absl::StrContains(dead.run.out, " UNAVAILABLE=10 ")) << dead.run.out;
  EXPECT_TRUE(absl::StrContains(dead.run.out, "; failed: 10\n")) << dead.run.out;
  EXPECT_TRUE(absl::StrContains(dead.run.err, ": 10 failed request(s) (UNAVAILABLE=10)"))
      << dead.run.err;
}

// A server that refuses whatever would wait behind other work (--max_queue_wait_us=1):
// eight requests in flight draw RESOURCE_EXHAUSTED, which fails the run unless
// --allow_errors expects it.
TEST(ClientBenchTest, ExitStatusFollowsAllowErrors) {
  auto server = ServerProcess::Start({"--port=0", "--max_queue_wait_us=1"});
  ASSERT_TRUE(server.ok()) << server.status();
  TempDir dir;
  const std::vector<std::string> bench = {"bench",
                                          "--target=" + (*server)->target(),
                                          "--concurrency=8",
                                          "--warmup=200ms",
                                          "--window=500ms",
                                          "--duration=2s",
                                          "--max_windows=3",
                                          "--progress=false",
                                          "--json=" + dir.path() + "/bench.json"};
  ClientRun run = RunClient(bench);
  EXPECT_EQ(run.exit_code, 1) << Describe(run);
  EXPECT_TRUE(absl::StartsWith(run.err, "error: RESOURCE_EXHAUSTED: bench: attend concurrency 8: "))
      << run.err;
  EXPECT_TRUE(absl::StrContains(run.err, "not allowed by --allow_errors")) << run.err;

  std::vector<std::string> allowed = bench;
  allowed.push_back("--allow_errors=RESOURCE_EXHAUSTED,DEADLINE_EXCEEDED");
  run = RunClient(allowed);
  EXPECT_EQ(run.exit_code, 0) << Describe(run);
  const json step = ReadJson(dir.path() + "/bench.json")["steps"][0];
  EXPECT_GT(step["all_errors"].value("RESOURCE_EXHAUSTED", int64_t{0}), 0) << step.dump();
  EXPECT_GT(step["ok"].get<int64_t>(), 0) << step.dump();
}

TEST_F(ClientTest, BenchStreamsAtFixedConcurrencyAndRate) {
  std::vector<std::string> args = QuickBench(TargetFlag());
  args.insert(args.end(), {"--mode=stream", "--concurrency=2", "--json=" + Path("c.json")});
  ClientRun run = RunClient(args);
  ASSERT_EQ(run.exit_code, 0) << Describe(run);
  json report = ReadJson(Path("c.json"));
  EXPECT_EQ(report["mode"], "stream");
  ExpectSaneStep(report["steps"][0], "attend");

  // Open loop: Poisson arrivals at 20/s over 2 streams; the achieved rate follows.
  args = QuickBench(TargetFlag());
  args.insert(args.end(),
              {"--mode=stream", "--request_rate=20", "--request_distribution=poisson",
               "--streams=2", "--window=1s", "--duration=4s", "--json=" + Path("r.json")});
  run = RunClient(args);
  ASSERT_EQ(run.exit_code, 0) << Describe(run);
  report = ReadJson(Path("r.json"));
  EXPECT_EQ(report["load"], "request_rate");
  EXPECT_EQ(report["distribution"], "poisson");
  const json& step = report["steps"][0];
  ExpectSaneStep(step, "attend");
  EXPECT_EQ(step["request_rate"], 20.0);
  // A Poisson count over 1-3 s windows (mean 20-60) stays well inside 8..40 per
  // second unless the schedule is broken (e.g. closed-loop or bursting).
  EXPECT_GT(step["requests_per_s"].get<double>(), 8) << step.dump();
  EXPECT_LT(step["requests_per_s"].get<double>(), 40) << step.dump();
}

TEST_F(ClientTest, BenchHealthRpcIsMeasuredBesideAttend) {
  std::vector<std::string> args = QuickBench(TargetFlag());
  args.insert(args.end(), {"--rpc=health", "--concurrency=2", "--json=" + Path("h.json")});
  const ClientRun run = RunClient(args);
  ASSERT_EQ(run.exit_code, 0) << Describe(run);
  EXPECT_TRUE(absl::StrContains(run.out, "Attend / Health p50 latency")) << run.out;
  const json report = ReadJson(Path("h.json"));
  ASSERT_EQ(report["steps"].size(), 2u);
  ExpectSaneStep(report["steps"][0], "health");
  ExpectSaneStep(report["steps"][1], "attend");
  EXPECT_GT(report["health_requests"].get<int64_t>(), 0);
  // Health/Check is not an Attend request: the server counted exactly the Attend calls.
  const int64_t attend = report["attend_requests"];
  EXPECT_EQ(SettledRequestsTotal(*server_, attend), attend);
  ASSERT_EQ(report["health_ratios"].size(), 1u);
  const json& ratio = report["health_ratios"][0];
  const double p50_ratio = ratio["attend_over_health_p50"].get<double>();
  EXPECT_NEAR(p50_ratio,
              report["steps"][1]["latency_us"]["p50"].get<double>() /
                  report["steps"][0]["latency_us"]["p50"].get<double>(),
              1e-9 * p50_ratio);
  EXPECT_GT(p50_ratio, 0);
}

TEST_F(ClientTest, BenchCountEqualsTheServersRequestsTotal) {
  ASSERT_GT(server_->metrics_port(), 0);
  for (const char* mode : {"--mode=unary", "--mode=stream"}) {
    SCOPED_TRACE(mode);
    const int64_t before = RequestsTotal(*server_);
    std::vector<std::string> args = QuickBench(TargetFlag());
    args.insert(args.end(), {mode, "--concurrency=1:4:x2", "--json=" + Path("bench.json")});
    const ClientRun run = RunClient(args);
    ASSERT_EQ(run.exit_code, 0) << Describe(run);
    const json report = ReadJson(Path("bench.json"));
    const int64_t sent = report["attend_requests"];
    EXPECT_GT(sent, 10);
    EXPECT_EQ(SettledRequestsTotal(*server_, before + sent) - before, sent);
  }
}

TEST(ClientTargetsTest, RoundRobinSpreadsLoadOverEveryServer) {
  auto first = ServerProcess::Start({"--port=0"});
  auto second = ServerProcess::Start({"--port=0"});
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_TRUE(second.ok()) << second.status();
  TempDir dir;
  const ClientRun run = RunClient(
      {"bench",
       "--targets=" + (*first)->target() + ",localhost:" + std::to_string((*second)->port()),
       "--concurrency=4", "--warmup=200ms", "--window=500ms", "--duration=3s", "--max_windows=4",
       "--progress=false", "--json=" + dir.path() + "/bench.json"});
  ASSERT_EQ(run.exit_code, 0) << Describe(run);
  const json report = ReadJson(dir.path() + "/bench.json");
  ExpectSaneStep(report["steps"][0], "attend");
  const int64_t sent = report["attend_requests"];
  const int64_t on_first = SettledRequestsTotal(**first, 1);
  const int64_t on_second = SettledRequestsTotal(**second, sent - on_first);
  EXPECT_EQ(on_first + on_second, sent);
  // round_robin alternates per call: neither server sits idle.
  EXPECT_GT(on_first, sent / 4) << on_first << " of " << sent;
  EXPECT_GT(on_second, sent / 4) << on_second << " of " << sent;
}

// The pixel at the centre of cell (q, k) of a head's map.
uint32_t CellPixel(cairo_surface_t* png, const json& layout, int head, int64_t q, int64_t k) {
  const int cell = layout["cell_size"];
  const int x = layout["heads"][head]["x"].get<int>() + static_cast<int>(k) * cell + cell / 2;
  const int y = layout["heads"][head]["y"].get<int>() + static_cast<int>(q) * cell + cell / 2;
  const unsigned char* data = cairo_image_surface_get_data(png);
  uint32_t pixel;
  std::memcpy(&pixel, data + y * cairo_image_surface_get_stride(png) + x * 4, 4);
  return pixel & 0xffffff;  // RGB of ARGB32 / RGB24
}

// The attention weights (B, h, Q, K) of `request` (flags) as `infer
// --return_attention --output=FILE` records them, checked against the core's (the
// file records no --causal: `causal` says whether the flags have it).
std::vector<float> RecordedWeights(const std::vector<std::string>& request, const std::string& path,
                                   bool causal = false) {
  std::vector<std::string> infer = {"infer", "--return_attention", "--output=" + path};
  infer.insert(infer.end(), request.begin(), request.end());
  const ClientRun run = RunClient(infer);
  EXPECT_EQ(run.exit_code, 0) << Describe(run);
  auto file = core::SafetensorsFile::Open(path);
  EXPECT_TRUE(file.ok()) << file.status();
  if (!file.ok()) return {};
  const std::vector<float> weights = (*file)->Get("attention")->ToFloat("attention").value();
  AttendRequest recorded = RequestFromFile(**file);
  recorded.set_return_attention(true);
  recorded.set_causal(causal);
  EXPECT_LE(MaxAbsDiff(weights, CoreForward(kToy, 0, recorded).attention), 1e-5f);
  return weights;
}

// `pixel` is viridis' colour at `t`, to 1 in each channel.
void ExpectViridis(uint32_t pixel, double t, const std::string& where) {
  uint8_t rgb[3];
  client::Viridis(t, rgb);
  EXPECT_NEAR((pixel >> 16) & 0xff, rgb[0], 1) << where;
  EXPECT_NEAR((pixel >> 8) & 0xff, rgb[1], 1) << where;
  EXPECT_NEAR(pixel & 0xff, rgb[2], 1) << where;
}

TEST_F(ClientTest, HeatmapDrawsEveryHeadWithMaskedKeysBlank) {
  // The same request twice: once recorded with its weights, once drawn.
  const std::vector<std::string> request = {TargetFlag(), "--num_queries=5", "--num_keys=7",
                                            "--valid_lens=4,6", "--seed=3"};
  const std::vector<float> weights = RecordedWeights(request, Path("run.safetensors"));
  ASSERT_EQ(weights.size(), 2u * 5 * 5 * 7);  // (B, h, Q, K)

  for (int b : {0, 1}) {
    SCOPED_TRACE(absl::StrCat("batch row ", b));
    const int valid_len = b == 0 ? 4 : 6;
    std::vector<std::string> heatmap = {"heatmap", "--batch_index=" + std::to_string(b),
                                        "--output=" + Path("map.png"),
                                        "--json=" + Path("map.json")};
    heatmap.insert(heatmap.end(), request.begin(), request.end());
    const ClientRun run = RunClient(heatmap);
    ASSERT_EQ(run.exit_code, 0) << Describe(run);
    const json layout = ReadJson(Path("map.json"));
    cairo_surface_t* png = cairo_image_surface_create_from_png(Path("map.png").c_str());
    ASSERT_EQ(cairo_surface_status(png), CAIRO_STATUS_SUCCESS);
    const int width = cairo_image_surface_get_width(png);
    const int height = cairo_image_surface_get_height(png);
    EXPECT_EQ(width, layout["width"].get<int>());
    EXPECT_EQ(height, layout["height"].get<int>());
    ASSERT_EQ(layout["heads"].size(), 5u);
    const int cell = layout["cell_size"];
    EXPECT_GE(cell, 4);
    // Five maps of 7 x 5 cells in a 3 x 2 grid, with room for axes and a colour bar.
    EXPECT_GE(width, 3 * 7 * cell);
    EXPECT_GE(height, 2 * 5 * cell);
    EXPECT_LE(width, 4000);
    EXPECT_LE(height, 4000);

    float max_weight = 0;
    for (int h = 0; h < 5; ++h) {
      for (int q = 0; q < 5; ++q) {
        for (int k = 0; k < valid_len; ++k) {
          max_weight = std::max(max_weight, weights[((b * 5 + h) * 5 + q) * 7 + k]);
        }
      }
    }
    EXPECT_NEAR(layout["max_weight"].get<float>(), max_weight, 1e-6f);
    cairo_surface_flush(png);
    for (int h = 0; h < 5; ++h) {
      for (int q = 0; q < 5; ++q) {
        for (int k = 0; k < 7; ++k) {
          const uint32_t pixel = CellPixel(png, layout, h, q, k);
          if (k >= valid_len) {
            EXPECT_EQ(pixel, 0xffffffu)
                << "masked cell not blank: head " << h << " (" << q << ", " << k << ")";
            continue;
          }
          // Unmasked: the viridis colour of this weight on the 0..max scale.
          ExpectViridis(pixel, weights[((b * 5 + h) * 5 + q) * 7 + k] / max_weight,
                        absl::StrCat("head ", h, " (", q, ", ", k, ")"));
          EXPECT_NE(pixel, 0xffffffu);
        }
      }
    }
    // The colour bar runs from viridis' yellow (top) to its purple (bottom).
    const json& bar = layout["colour_bar"];
    const unsigned char* data = cairo_image_surface_get_data(png);
    const int stride = cairo_image_surface_get_stride(png);
    auto bar_pixel = [&](int y) {
      uint32_t p;
      std::memcpy(&p, data + y * stride + (bar["x"].get<int>() + 5) * 4, 4);
      return p & 0xffffff;
    };
    EXPECT_GT((bar_pixel(bar["y"].get<int>() + 1) >> 8) & 0xff, 200u);  // green of yellow
    EXPECT_LT((bar_pixel(bar["y"].get<int>() + bar["height"].get<int>() - 2) >> 8) & 0xff, 40u);
    cairo_surface_destroy(png);
  }
}

// A causal map on --scale=row and --scale=log: every unmasked cell has the colour
// of its weight on that scale (row: over its row's largest, so each row's largest is
// the top colour; log: log10 between the smallest positive weight and the largest),
// and the masked (future) keys stay blank.
TEST_F(ClientTest, HeatmapScalesRowAndLogKeepACausalMapReadable) {
  constexpr int kQ = 6, kHeads = 5;
  const std::vector<std::string> request = {
      TargetFlag(),   "--batch=1", absl::StrCat("--num_queries=", kQ),
      "--num_keys=0", "--causal",  "--seed=4"};
  const std::vector<float> weights =
      RecordedWeights(request, Path("run.safetensors"), /*causal=*/true);
  ASSERT_EQ(weights.size(), static_cast<size_t>(kHeads * kQ * kQ));  // (1, h, Q, K)
  auto weight = [&](int h, int q, int k) { return weights[(h * kQ + q) * kQ + k]; };
  float max_weight = 0, min_positive = 1;
  for (int h = 0; h < kHeads; ++h) {
    for (int q = 0; q < kQ; ++q) {
      for (int k = 0; k <= q; ++k) {
        max_weight = std::max(max_weight, weight(h, q, k));
        if (weight(h, q, k) > 0) min_positive = std::min(min_positive, weight(h, q, k));
      }
    }
  }
  EXPECT_FLOAT_EQ(max_weight, 1.0f) << "row 0 of a causal map has one weight, 1";

  for (const std::string scale : {"row", "log"}) {
    SCOPED_TRACE("--scale=" + scale);
    std::vector<std::string> heatmap = {
        "heatmap", "--scale=" + scale, "--output=" + Path("map.png"), "--json=" + Path("map.json")};
    heatmap.insert(heatmap.end(), request.begin(), request.end());
    const ClientRun run = RunClient(heatmap);
    ASSERT_EQ(run.exit_code, 0) << Describe(run);
    EXPECT_TRUE(absl::StrContains(
        run.out, scale == "row" ? "each query row scaled 0 .. its largest weight" : "log scale "))
        << run.out;
    const json layout = ReadJson(Path("map.json"));
    EXPECT_EQ(layout["scale"], scale);
    if (scale == "log") {
      EXPECT_NEAR(layout["min_weight"].get<float>(), min_positive, 1e-6f * min_positive);
    }
    cairo_surface_t* png = cairo_image_surface_create_from_png(Path("map.png").c_str());
    ASSERT_EQ(cairo_surface_status(png), CAIRO_STATUS_SUCCESS);
    cairo_surface_flush(png);
    for (int h = 0; h < kHeads; ++h) {
      for (int q = 0; q < kQ; ++q) {
        float row_max = 0;
        for (int k = 0; k <= q; ++k) row_max = std::max(row_max, weight(h, q, k));
        for (int k = 0; k < kQ; ++k) {
          const uint32_t pixel = CellPixel(png, layout, h, q, k);
          if (k > q) {
            EXPECT_EQ(pixel, 0xffffffu)
                << "future key not blank: head " << h << " (" << q << ", " << k << ")";
            continue;
          }
          const double t = scale == "row" ? weight(h, q, k) / row_max
                                          : std::log(weight(h, q, k) / min_positive) /
                                                std::log(max_weight / min_positive);
          ExpectViridis(pixel, t, absl::StrCat("head ", h, " (", q, ", ", k, ")"));
          if (scale == "row" && weight(h, q, k) == row_max) {
            EXPECT_EQ(pixel, 0xfde725u) << "a row's largest weight is the top colour";
          }
        }
      }
    }
    cairo_surface_destroy(png);
  }
}

// A model folder whose safetensors weights (d2l naming) have head `zeroed`'s W_o
// columns set to zero: that head contributes nothing to the output.
const core::ModelConfig kSmall{.num_hiddens = 48,
                               .num_heads = 4,
                               .query_size = 20,
                               .key_size = 20,
                               .value_size = 20,
                               .bias = true};

core::Weights WriteZeroedHeadModel(const TempDir& dir, int64_t zeroed) {
  core::Weights weights = core::SeededWeights(kSmall, 11);
  const int64_t n = kSmall.num_hiddens, p = kSmall.head_size();
  for (int64_t row = 0; row < n; ++row) {
    for (int64_t col = zeroed * p; col < (zeroed + 1) * p; ++col) {
      weights.w_o[static_cast<size_t>(row * n + col)] = 0;
    }
  }
  dir.Write("zeroed/config.pbtxt",
            "num_hiddens: 48 num_heads: 4 query_size: 20 key_size: 20 value_size: 20 bias: true\n");
  dir.Write("zeroed/weights.safetensors",
            core::SerializeSafetensors({core::F32Tensor("W_q.weight", {n, 20}, weights.w_q),
                                        core::F32Tensor("W_k.weight", {n, 20}, weights.w_k),
                                        core::F32Tensor("W_v.weight", {n, 20}, weights.w_v),
                                        core::F32Tensor("W_o.weight", {n, n}, weights.w_o),
                                        core::F32Tensor("W_q.bias", {n}, weights.b_q),
                                        core::F32Tensor("W_k.bias", {n}, weights.b_k),
                                        core::F32Tensor("W_v.bias", {n}, weights.b_v),
                                        core::F32Tensor("W_o.bias", {n}, weights.b_o)}));
  return weights;
}

// ||y(without `dropped`) - y|| / ||y|| by the in-process core.
double CoreRelativeChange(const core::MultiHeadAttention& mha, const AttendRequest& request,
                          const std::vector<int64_t>& dropped) {
  const Tensor& q = request.queries();
  std::vector<float> mask(static_cast<size_t>(kSmall.num_heads), 1.0f);
  for (int64_t h : dropped) mask[static_cast<size_t>(h)] = 0;
  core::AttentionInputs in{
      .batch = q.shape(0),
      .num_queries = q.shape(1),
      .num_keys = request.keys().shape(1),
      .queries = q.data().data(),
      .keys = request.keys().data().data(),
      .values = request.values().data().data(),
      .valid_lens = {request.valid_lens().data(), static_cast<size_t>(request.valid_lens_size())},
  };
  const size_t size = static_cast<size_t>(in.batch * in.num_queries * kSmall.num_hiddens);
  std::vector<float> full(size), masked(size);
  EXPECT_TRUE(mha.Forward(in, full.data()).ok());
  in.head_mask = mask;
  EXPECT_TRUE(mha.Forward(in, masked.data()).ok());
  double diff = 0, norm = 0;
  for (size_t i = 0; i < size; ++i) {
    diff += (masked[i] - full[i]) * static_cast<double>(masked[i] - full[i]);
    norm += full[i] * static_cast<double>(full[i]);
  }
  return std::sqrt(diff / norm);
}

TEST(ClientHeadsTest, RanksAZeroedHeadLastAndMatchesTheCore) {
  TempDir repository;
  constexpr int64_t kZeroed = 1;
  const core::Weights weights = WriteZeroedHeadModel(repository, kZeroed);
  auto mha = core::MultiHeadAttention::Create(kSmall, weights);
  ASSERT_TRUE(mha.ok()) << mha.status();
  auto server = ServerProcess::Start({"--port=0", "--model_repository=" + repository.path()});
  ASSERT_TRUE(server.ok()) << server.status();

  // Inputs from a file, so the test knows them: B 3, Q 6, K 9, valid_lens [9, 5, 1].
  AttendRequest request;
  *request.mutable_queries() = MakeTensor({3, 6, 20}, 0.5f);
  *request.mutable_keys() = MakeTensor({3, 9, 20}, 1.5f);
  *request.mutable_values() = MakeTensor({3, 9, 20}, 2.5f);
  const std::vector<int32_t> lens = {9, 5, 1};
  for (int32_t len : lens) request.add_valid_lens(len);
  TempDir dir;
  const std::string inputs = dir.Write(
      "inputs.safetensors",
      core::SerializeSafetensors(
          {core::F32Tensor("queries", {3, 6, 20},
                           {request.queries().data().begin(), request.queries().data().end()}),
           core::F32Tensor("keys", {3, 9, 20},
                           {request.keys().data().begin(), request.keys().data().end()}),
           core::F32Tensor("values", {3, 9, 20},
                           {request.values().data().begin(), request.values().data().end()}),
           core::NamedTensor{"valid_lens",
                             core::DType::kI32,
                             {3},
                             std::string(reinterpret_cast<const char*>(lens.data()), 12)}}));

  const ClientRun run =
      RunClient({"heads", "--target=" + (*server)->target(), "--model=zeroed", "--prune=2",
                 "--input=" + inputs, "--json=" + dir.path() + "/heads.json"});
  ASSERT_EQ(run.exit_code, 0) << Describe(run);
  EXPECT_TRUE(absl::StrContains(run.out, "rank  head")) << run.out;
  const json report = ReadJson(dir.path() + "/heads.json");
  ASSERT_EQ(report["ranking"].size(), 4u) << report.dump();
  EXPECT_EQ(report["ranking"][3], kZeroed) << report.dump();
  EXPECT_LT(report["heads"][kZeroed]["relative_change"].get<double>(), 1e-6);
  for (int64_t h = 0; h < 4; ++h) {
    const double change = report["heads"][h]["relative_change"];
    EXPECT_NEAR(change, CoreRelativeChange(**mha, request, {h}), 1e-5) << "head " << h;
    if (h != kZeroed) {
      EXPECT_GT(change, 1e-3) << "head " << h;
    }
  }
  // Ranked by change, most important first.
  for (size_t r = 1; r < 4; ++r) {
    EXPECT_GE(report["heads"][report["ranking"][r - 1].get<int>()]["relative_change"].get<double>(),
              report["heads"][report["ranking"][r].get<int>()]["relative_change"].get<double>());
  }
  // --prune=2 drops the two least important heads together.
  const json& prune = report["prune"];
  const std::vector<int64_t> pruned = {report["ranking"][2], report["ranking"][3]};
  EXPECT_EQ(prune["heads"], json(pruned));
  EXPECT_NEAR(prune["relative_change"].get<double>(), CoreRelativeChange(**mha, request, pruned),
              1e-5);
  (*server)->Signal(SIGTERM);
  EXPECT_TRUE((*server)->WaitForExit(absl::Seconds(15)).has_value());
}

// Certificates made by openssl for this test (MakeTestCertificates).
TEST(ClientTlsTest, InferOverMutualTls) {
  TempDir certs;
  const absl::Status made = MakeTestCertificates(certs.path());
  ASSERT_TRUE(made.ok()) << made;
  auto file = [&](const char* name) { return certs.path() + "/" + name; };
  auto server = ServerProcess::Start({"--port=0", "--tls_cert=" + file("server.pem"),
                                      "--tls_key=" + file("server.key"),
                                      "--tls_client_ca=" + file("ca.pem")});
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string target = "--target=" + (*server)->target();

  ClientRun run =
      RunClient({"infer", target, "--tls_ca=" + file("ca.pem"), "--tls_cert=" + file("client.pem"),
                 "--tls_key=" + file("client.key")});
  EXPECT_EQ(run.exit_code, 0) << Describe(run);
  EXPECT_TRUE(absl::StrContains(run.out, "output shape: (2, 4, 100)")) << run.out;
  // The name checked can be overridden (the certificate also names localhost).
  run = RunClient({"health", target, "--tls_ca=" + file("ca.pem"), "--tls_server_name=localhost",
                   "--tls_cert=" + file("client.pem"), "--tls_key=" + file("client.key")});
  EXPECT_EQ(run.exit_code, 0) << Describe(run);

  // No client certificate, or plaintext: refused, one line with the code and a hint.
  for (const auto& [flags, hint] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"--tls_ca=" + file("ca.pem")},
            "(the server may require a client certificate (mutual TLS): give --tls_cert and "
            "--tls_key)"},
           {{}, "(the server may speak TLS, this client plaintext: give --tls or --tls_ca)"}}) {
    std::vector<std::string> args = {"infer", target, "--timeout=5s"};
    args.insert(args.end(), flags.begin(), flags.end());
    run = RunClient(args);
    EXPECT_EQ(run.exit_code, 1) << Describe(run);
    EXPECT_TRUE(absl::StartsWith(run.err, "error: UNAVAILABLE: ")) << run.err;
    EXPECT_TRUE(absl::EndsWith(run.err, hint + "\n")) << run.err;
  }
  run = RunClient({"infer", target, "--tls_cert=" + file("client.pem")});
  ExpectUsageError(run, "error: --tls_cert and --tls_key go together");
}

// --protocol=http speaks HTTPS with the same --tls flags as gRPC: server verified
// against --tls_ca, and a client certificate when the server asks for one.
TEST(ClientTlsTest, HttpOverTlsAndMutualTls) {
  TempDir certs;
  const absl::Status made = MakeTestCertificates(certs.path());
  ASSERT_TRUE(made.ok()) << made;
  auto file = [&](const char* name) { return certs.path() + "/" + name; };
  auto tls = ServerProcess::Start({"--port=0", "--http_port=0", "--tls_cert=" + file("server.pem"),
                                   "--tls_key=" + file("server.key")});
  ASSERT_TRUE(tls.ok()) << tls.status();
  const std::string target = "--target=" + (*tls)->http_target();
  ClientRun run = RunClient({"infer", "--protocol=http", target, "--tls_ca=" + file("ca.pem")});
  EXPECT_EQ(run.exit_code, 0) << Describe(run);
  EXPECT_TRUE(absl::StrContains(run.out, "output shape: (2, 4, 100)")) << run.out;
  // Plain HTTP to an HTTPS server, and HTTPS without the server's CA: refused.
  for (const std::vector<std::string>& flags :
       {std::vector<std::string>{}, std::vector<std::string>{"--tls"}}) {
    std::vector<std::string> args = {"infer", "--protocol=http", target, "--timeout=5s"};
    args.insert(args.end(), flags.begin(), flags.end());
    run = RunClient(args);
    EXPECT_EQ(run.exit_code, 1) << Describe(run);
    EXPECT_TRUE(absl::StartsWith(run.err, "error: ")) << run.err;
  }

  auto mutual = ServerProcess::Start(
      {"--port=0", "--http_port=0", "--tls_cert=" + file("server.pem"),
       "--tls_key=" + file("server.key"), "--tls_client_ca=" + file("ca.pem")});
  ASSERT_TRUE(mutual.ok()) << mutual.status();
  const std::string mutual_target = "--target=" + (*mutual)->http_target();
  // bench's load connections (one per slot) speak HTTPS too.
  std::vector<std::string> bench = QuickBench(mutual_target);
  bench.insert(bench.end(),
               {"--protocol=http", "--tls_ca=" + file("ca.pem"), "--tls_cert=" + file("client.pem"),
                "--tls_key=" + file("client.key"), "--concurrency=2"});
  run = RunClient(bench);
  EXPECT_EQ(run.exit_code, 0) << Describe(run);
  EXPECT_TRUE(absl::StrContains(run.out, "POST infer")) << run.out;
  run = RunClient({"infer", "--protocol=http", mutual_target, "--tls_ca=" + file("ca.pem"),
                   "--tls_cert=" + file("client.pem"), "--tls_key=" + file("client.key")});
  EXPECT_EQ(run.exit_code, 0) << Describe(run);
  EXPECT_TRUE(absl::StrContains(run.out, "output shape: (2, 4, 100)")) << run.out;
  // Without a client certificate the handshake fails.
  run = RunClient(
      {"infer", "--protocol=http", mutual_target, "--tls_ca=" + file("ca.pem"), "--timeout=5s"});
  EXPECT_EQ(run.exit_code, 1) << Describe(run);
  EXPECT_TRUE(absl::StartsWith(run.err, "error: UNAVAILABLE: ")) << run.err;
}

// The last line of `text` (gRPC may log the handshake failure before the client's error).
std::string LastLine(const std::string& text) {
  const std::vector<std::string> lines = absl::StrSplit(text, '\n', absl::SkipEmpty());
  return lines.empty() ? "" : lines.back();
}

TEST(ClientTlsTest, AMismatchedTlsSettingGetsAHint) {
  TempDir certs;
  const absl::Status made = MakeTestCertificates(certs.path());
  ASSERT_TRUE(made.ok()) << made;
  auto file = [&](const char* name) { return certs.path() + "/" + name; };
  auto tls = ServerProcess::Start(
      {"--port=0", "--tls_cert=" + file("server.pem"), "--tls_key=" + file("server.key")});
  auto plain = ServerProcess::Start({"--port=0"});
  ASSERT_TRUE(tls.ok()) << tls.status();
  ASSERT_TRUE(plain.ok()) << plain.status();

  // Plaintext client, TLS server: gRPC says "Socket closed".
  ClientRun run = RunClient({"infer", "--target=" + (*tls)->target(), "--timeout=5s"});
  EXPECT_EQ(run.exit_code, 1) << Describe(run);
  EXPECT_TRUE(absl::StartsWith(LastLine(run.err), "error: UNAVAILABLE: GetModel: ")) << run.err;
  EXPECT_TRUE(absl::EndsWith(LastLine(run.err),
                             "(the server may speak TLS, this client plaintext: give --tls or "
                             "--tls_ca)"))
      << run.err;
  // TLS client, plaintext server.
  run = RunClient(
      {"health", "--target=" + (*plain)->target(), "--tls_ca=" + file("ca.pem"), "--timeout=5s"});
  EXPECT_EQ(run.exit_code, 1) << Describe(run);
  EXPECT_TRUE(absl::EndsWith(LastLine(run.err),
                             "(the server may speak plaintext, this client TLS: drop the --tls "
                             "flags)"))
      << run.err;
  // TLS on both sides, but the server's CA not given: the system roots do not trust it.
  run = RunClient({"infer", "--target=" + (*tls)->target(), "--tls", "--timeout=5s"});
  EXPECT_EQ(run.exit_code, 1) << Describe(run);
  EXPECT_TRUE(absl::EndsWith(LastLine(run.err),
                             "(the client does not trust the server's certificate: give its CA "
                             "with --tls_ca)"))
      << run.err;
}

// --- The Open Inference Protocol: the same requests as attention.v1, over gRPC
// (kserve) and HTTP (http), must give the same answers.

TEST(KServeTranslationTest, HttpBodyIsTheJsonHeaderThenEveryInputsBytes) {
  AttendRequest request = ToyRequest();
  request.set_causal(true);
  request.set_return_attention(true);
  const inference::ModelInferRequest infer = client::ToModelInferRequest(request);
  EXPECT_EQ(infer.model_name(), "default");
  EXPECT_EQ(infer.id(), "toy");
  ASSERT_EQ(infer.inputs_size(), 4);
  ASSERT_EQ(infer.raw_input_contents_size(), 4);
  EXPECT_EQ(infer.inputs(3).name(), "valid_lens");
  EXPECT_EQ(infer.inputs(3).datatype(), "INT32");
  EXPECT_EQ(infer.raw_input_contents(0).size(), 2u * 4 * 100 * 4);
  EXPECT_TRUE(infer.parameters().at("causal").bool_param());

  const client::HttpRequest http = client::ToHttpRequest(infer);
  EXPECT_EQ(http.path, "/v2/models/default/infer");
  const json header = json::parse(http.body.substr(0, static_cast<size_t>(http.header_length)));
  EXPECT_EQ(header["id"], "toy");
  EXPECT_EQ(header["parameters"]["causal"], true);
  EXPECT_EQ(header["parameters"]["binary_data_output"], true);
  ASSERT_EQ(header["inputs"].size(), 4u);
  EXPECT_EQ(header["inputs"][0]["name"], "queries");
  EXPECT_EQ(header["inputs"][0]["shape"], json::array({2, 4, 100}));
  EXPECT_EQ(header["inputs"][0]["parameters"]["binary_data_size"], 3200);
  EXPECT_EQ(header["inputs"][3]["shape"], json::array({2}));
  EXPECT_EQ(header["outputs"][1]["name"], "attention");
  EXPECT_EQ(header["outputs"][1]["parameters"]["binary_data"], true);
  // The binary part: queries, keys, values, valid_lens, in that order.
  const std::string binary = http.body.substr(static_cast<size_t>(http.header_length));
  ASSERT_EQ(binary.size(), (800u + 1200 + 1200) * 4 + 2 * 4);
  float first_key;
  std::memcpy(&first_key, binary.data() + 800 * 4, 4);
  EXPECT_EQ(first_key, request.keys().data(0));
  int32_t lens[2];
  std::memcpy(lens, binary.data() + binary.size() - 8, 8);
  EXPECT_EQ(lens[0], 3);
  EXPECT_EQ(lens[1], 2);

  // Per-query lengths travel as (B, Q).
  request.clear_valid_lens();
  for (int i = 0; i < 8; ++i) request.add_valid_lens(i % 4 + 1);
  const inference::ModelInferRequest per_query = client::ToModelInferRequest(request);
  EXPECT_EQ(
      std::vector<int64_t>(per_query.inputs(3).shape().begin(), per_query.inputs(3).shape().end()),
      (std::vector<int64_t>{2, 4}));
}

TEST(KServeTranslationTest, HttpResponsesBecomeAttendResponsesOrCanonicalErrors) {
  const std::vector<float> values = {0.5f, -1.25f, 3.0f, 4.0f, 5.0f, 6.0f};
  const std::string header =
      R"({"model_name":"default","id":"r7","outputs":[{"name":"output","datatype":"FP32",)"
      R"("shape":[1,2,3],"parameters":{"binary_data_size":24}}]})";
  const std::string body =
      header + std::string(reinterpret_cast<const char*>(values.data()), values.size() * 4);
  auto parsed = client::ParseHttpInferResponse(200, static_cast<int64_t>(header.size()), body);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  auto attend = client::ToAttendResponse(*parsed);
  ASSERT_TRUE(attend.ok()) << attend.status();
  EXPECT_EQ(attend->request_id(), "r7");
  EXPECT_EQ(std::vector<int64_t>(attend->output().shape().begin(), attend->output().shape().end()),
            (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(std::vector<float>(attend->output().data().begin(), attend->output().data().end()),
            values);
  EXPECT_FALSE(attend->has_timing());

  // A byte short, or one too many: refused, not misread.
  EXPECT_EQ(client::ParseHttpInferResponse(200, static_cast<int64_t>(header.size()),
                                           body.substr(0, body.size() - 1))
                .status()
                .code(),
            absl::StatusCode::kInternal);
  EXPECT_EQ(
      client::ParseHttpInferResponse(200, static_cast<int64_t>(header.size()), body + "x").status(),
      absl::InternalError("HTTP response: body: 1 binary bytes past the last output's"));

  const std::vector<std::pair<int, absl::StatusCode>> statuses = {
      {400, absl::StatusCode::kInvalidArgument},   {404, absl::StatusCode::kNotFound},
      {429, absl::StatusCode::kResourceExhausted}, {500, absl::StatusCode::kInternal},
      {501, absl::StatusCode::kUnimplemented},     {503, absl::StatusCode::kUnavailable},
      {504, absl::StatusCode::kDeadlineExceeded},  {418, absl::StatusCode::kUnknown}};
  for (const auto& [status, code] : statuses) {
    const absl::Status error =
        client::ParseHttpInferResponse(status, std::nullopt, R"({"error":"no such model"})")
            .status();
    EXPECT_EQ(error.code(), code) << status;
    EXPECT_EQ(error.message(), absl::StrCat("no such model (HTTP ", status, ")"));
  }
}

class ClientProtocolTest : public ClientTest {
 protected:
  void SetUp() override {
    auto server = ServerProcess::Start({"--port=0", "--http_port=0"});
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    ASSERT_GT(server_->http_port(), 0);
  }
  // --protocol and --target for `protocol`.
  std::vector<std::string> Flags(const std::string& protocol) const {
    return {"--protocol=" + protocol,
            "--target=" + (protocol == "http" ? server_->http_target() : server_->target())};
  }
};

const char* const kProtocols[] = {"attention", "kserve", "http"};

// infer's printed lines but the model line (metadata has no bias or precision) and
// the timing.
std::string ComparableLines(const std::string& out) {
  std::vector<std::string> kept;
  for (absl::string_view line : absl::StrSplit(out, '\n', absl::SkipEmpty())) {
    if (absl::StartsWith(line, "model ") || absl::StartsWith(line, "time: ") ||
        absl::StartsWith(line, "wrote ")) {
      continue;
    }
    kept.emplace_back(line);
  }
  return absl::StrJoin(kept, "\n");
}

TEST_F(ClientProtocolTest, InferPrintsTheSameOutputOverEveryProtocol) {
  // Cross-attention with per-row lengths; self-attention, causal, with per-query
  // lengths and the attention weights.
  const std::vector<std::vector<std::string>> requests = {
      {"--seed=3"},
      {"--num_keys=0", "--causal", "--valid_lens=4,3,2,1,1,2,3,4", "--return_attention"}};
  for (size_t r = 0; r < requests.size(); ++r) {
    SCOPED_TRACE(absl::StrJoin(requests[r], " "));
    std::string expected_out, expected_file;
    for (const char* protocol : kProtocols) {
      SCOPED_TRACE(protocol);
      const std::string file = Path(absl::StrCat(protocol, r, ".safetensors"));
      std::vector<std::string> args = {"infer", "--output=" + file};
      for (const std::string& flag : Flags(protocol)) args.push_back(flag);
      args.insert(args.end(), requests[r].begin(), requests[r].end());
      const ClientRun run = RunClient(args);
      ASSERT_EQ(run.exit_code, 0) << Describe(run);
      EXPECT_TRUE(absl::StrContains(run.out, "model default: p_o 100, h ")) << run.out;
      EXPECT_TRUE(absl::StrContains(run.out, "output shape: (2, 4, 100)")) << run.out;
      // The file holds the inputs sent and every output: byte for byte the same.
      const std::string bytes = ReadFile(file);
      ASSERT_FALSE(bytes.empty());
      if (expected_out.empty()) {
        expected_out = ComparableLines(run.out);
        expected_file = bytes;
        if (r == 1) {
          EXPECT_TRUE(absl::StrContains(run.out, "attention shape: (2, 5, 4, 4)")) << run.out;
        }
        continue;
      }
      EXPECT_EQ(ComparableLines(run.out), expected_out);
      EXPECT_TRUE(bytes == expected_file) << "outputs differ from --protocol=attention's";
    }
  }
}

// --model_version reaches the server over every protocol: the embedded model is
// version 1; version 2 is NOT_FOUND naming model_version.
TEST_F(ClientProtocolTest, ModelVersionReachesTheServerOverEveryProtocol) {
  for (const char* protocol : kProtocols) {
    SCOPED_TRACE(protocol);
    std::vector<std::string> args = {"infer", "--model_version=1"};
    for (const std::string& flag : Flags(protocol)) args.push_back(flag);
    const ClientRun one = RunClient(args);
    EXPECT_EQ(one.exit_code, 0) << Describe(one);
    args[1] = "--model_version=2";
    const ClientRun two = RunClient(args);
    EXPECT_EQ(two.exit_code, 1) << Describe(two);
    EXPECT_TRUE(absl::StrContains(two.err, "NOT_FOUND")) << two.err;
    EXPECT_TRUE(absl::StrContains(two.err, "model_version: model default serves version(s) 1"))
        << two.err;
  }
}

TEST_F(ClientProtocolTest, BenchCompletesRequestsOverEveryProtocol) {
  struct Case {
    std::string protocol;
    std::vector<std::string> flags;
    std::vector<std::string> rpcs;
    std::vector<std::string> calls;  // the table's rpc column: the call each step sent
  };
  const std::vector<Case> cases = {
      {"attention", {}, {"attend"}, {"Attend"}},
      {"attention", {"--mode=stream"}, {"attend"}, {"AttendStream"}},
      {"kserve", {}, {"attend"}, {"ModelInfer"}},
      {"kserve", {"--mode=stream"}, {"attend"}, {"ModelStreamInfer"}},
      {"kserve", {"--rpc=health"}, {"health", "attend"}, {"ServerReady", "ModelInfer"}},
      {"http", {}, {"attend"}, {"POST infer"}},
      {"http", {"--rpc=health"}, {"health", "attend"}, {"GET ready", "POST infer"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(absl::StrCat(c.protocol, " ", absl::StrJoin(c.flags, " ")));
    std::vector<std::string> args = QuickBench("");
    args.erase(args.begin() + 1);  // QuickBench's target flag
    for (const std::string& flag : Flags(c.protocol)) args.push_back(flag);
    args.insert(args.end(), c.flags.begin(), c.flags.end());
    args.insert(args.end(), {"--concurrency=2", "--json=" + Path("bench.json")});
    const ClientRun run = RunClient(args);
    ASSERT_EQ(run.exit_code, 0) << Describe(run);
    EXPECT_TRUE(absl::StartsWith(run.out, "protocol " + c.protocol + " (")) << run.out;
    const json report = ReadJson(Path("bench.json"));
    EXPECT_EQ(report["protocol"], c.protocol);
    ASSERT_EQ(report["steps"].size(), c.rpcs.size()) << report.dump();
    for (size_t i = 0; i < c.rpcs.size(); ++i) ExpectSaneStep(report["steps"][i], c.rpcs[i]);
    // The table's rows (after the header lines) name the call, as does its last line.
    const std::vector<std::string> lines = absl::StrSplit(run.out, '\n', absl::SkipEmpty());
    ASSERT_GE(lines.size(), 3 + c.calls.size()) << run.out;
    for (size_t i = 0; i < c.calls.size(); ++i) {
      EXPECT_TRUE(absl::StartsWith(lines[2 + i],
                                   absl::StrFormat("%-17s %-16s ", "concurrency 2", c.calls[i])))
          << lines[2 + i];
    }
    const std::string sent = absl::StrCat(
        "requests sent: ", report["attend_requests"].get<int64_t>(), " ", c.calls.back());
    EXPECT_TRUE(absl::StrContains(run.out, sent)) << run.out;
  }
}

TEST_F(ClientProtocolTest, ErrorsCarryTheCanonicalCodeOverEveryProtocol) {
  struct Case {
    std::string protocol;
    std::vector<std::string> args;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {"http", {"infer", "--model=nope"}, "error: NOT_FOUND: GET /v2/models/nope: "},
      {"http", {"bench", "--model=nope"}, "error: NOT_FOUND: GET /v2/models/nope: "},
      {"kserve", {"infer", "--model=nope"}, "error: NOT_FOUND: ModelMetadata: "},
      {"http",
       {"infer", "--valid_lens=3,9"},
       "error: INVALID_ARGUMENT: POST /v2/models/default/infer: "},
      {"kserve", {"infer", "--valid_lens=3,9"}, "error: INVALID_ARGUMENT: ModelInfer: "},
  };
  for (const Case& c : cases) {
    std::vector<std::string> args = c.args;
    for (const std::string& flag : Flags(c.protocol)) args.push_back(flag);
    const ClientRun run = RunClient(args);
    EXPECT_EQ(run.exit_code, 1) << Describe(run);
    EXPECT_TRUE(absl::StartsWith(run.err, c.expected)) << run.err;
    EXPECT_EQ(std::count(run.err.begin(), run.err.end(), '\n'), 1) << run.err;
  }
}

TEST(ClientUsageTest, ProtocolsOtherThanAttentionOnlyForInferAndBench) {
  const std::vector<std::vector<std::string>> usage_errors = {
      {"heatmap", "--protocol=kserve"},
      {"heads", "--protocol=http"},
      {"health", "--protocol=kserve"},
      {"infer", "--protocol=grpc"},
      {"bench", "--protocol=http", "--mode=stream"},
      {"infer", "--protocol=http", "--tls_server_name=localhost"},
      {"bench", "--protocol=http", "--targets=127.0.0.1:1,127.0.0.1:2"},
  };
  for (const std::vector<std::string>& args : usage_errors) {
    const ClientRun run = RunClient(args);
    EXPECT_EQ(run.exit_code, 2) << Describe(run);
    EXPECT_TRUE(absl::StartsWith(run.err, "error: --protocol")) << run.err;
    EXPECT_EQ(std::count(run.err.begin(), run.err.end(), '\n'), 1) << run.err;
  }
}

}  // namespace
}  // namespace mha::testing

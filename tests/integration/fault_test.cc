// Faults: connections killed mid-stream, SIGTERM under load with every request
// accounted for, and model repositories with one broken model.
#include <signal.h>
#include <sys/wait.h>

#include <atomic>
#include <map>
#include <thread>

#include "gtest/gtest.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "core/safetensors.h"
#include "core/weights.h"
#include "tests/integration/client_util.h"
#include "tests/integration/net_util.h"
#include "tests/integration/server_process.h"

namespace mha::testing {
namespace {

using grpc::StatusCode;

#ifdef MHA_SANITIZED
constexpr int64_t kRssBudgetKib = 1024 * 1024;
#else
constexpr int64_t kRssBudgetKib = 384 * 1024;
#endif

// The client's connection is reset (RST, as when a client process dies) while a
// stream has requests queued and computing and unary calls are in flight; 20
// times. The server frees everything: a normal request succeeds, RSS and open
// descriptors return, and it still drains and exits 0 on SIGTERM.
TEST(FaultTest, ConnectionsKilledMidStream) {
  auto started = ServerProcess::Start({"--port=0", "--compute_threads=2", "--drain_timeout=20s"});
  ASSERT_TRUE(started.ok()) << started.status();
  ServerProcess& server = **started;
  auto direct = Connect(server.target());
  AttendResponse response;
  ASSERT_TRUE(Attend(*direct, ToyRequest(), &response).ok());
  const int64_t baseline = ResidentKib(server.pid());
  const int fds_before = OpenFds(server.pid());

  AttendRequest heavy;  // ~10 ms of compute each
  *heavy.mutable_queries() = MakeTensor({4, 256, 100});
  constexpr int kRounds = 20;
  int answered_before_cut = 0;
  for (int round = 0; round < kRounds; ++round) {
    TcpProxy proxy(server.port());
    auto channel = Channel("127.0.0.1:" + std::to_string(proxy.port()),
                           grpc::InsecureChannelCredentials(), "", true);
    auto stub = AttentionService::NewStub(channel);
    grpc::ClientContext context;
    SetTimeout(&context, std::chrono::seconds(60));
    auto stream = stub->AttendStream(&context);
    for (int i = 0; i < 32; ++i) {
      ASSERT_TRUE(stream->Write(heavy)) << "round " << round << "\n" << server.log();
    }
    if (stream->Read(&response)) ++answered_before_cut;  // compute is under way
    // Unary calls in flight on the same connection.
    grpc::CompletionQueue cq;
    struct Call {
      grpc::ClientContext context;
      AttendResponse response;
      grpc::Status status;
      std::unique_ptr<grpc::ClientAsyncResponseReader<AttendResponse>> reader;
    } calls[8];
    for (Call& call : calls) {
      SetTimeout(&call.context, std::chrono::seconds(60));
      call.reader = stub->AsyncAttend(&call.context, heavy, &cq);
      call.reader->Finish(&call.response, &call.status, &call);
    }
    proxy.CutAll();
    // The client sees the connection die: the stream and every call end
    // UNAVAILABLE (or were answered just before the cut).
    while (stream->Read(&response)) {
    }
    const grpc::Status status = stream->Finish();
    EXPECT_EQ(status.error_code(), StatusCode::UNAVAILABLE) << status.error_message();
    for (int i = 0; i < 8; ++i) {
      void* tag;
      bool ok;
      ASSERT_TRUE(cq.Next(&tag, &ok));
      const grpc::Status& s = static_cast<Call*>(tag)->status;
      EXPECT_TRUE(s.ok() || s.error_code() == StatusCode::UNAVAILABLE) << s.error_message();
    }
  }
  EXPECT_EQ(answered_before_cut, kRounds);
  ASSERT_TRUE(Attend(*direct, ToyRequest(), &response).ok());
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (OpenFds(server.pid()) > fds_before + 2 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_LE(OpenFds(server.pid()), fds_before + 2);
  EXPECT_LE(ResidentKib(server.pid()) - baseline, kRssBudgetKib);
  std::printf("RSS baseline %lld KiB, after %d cuts %lld KiB\n",
              static_cast<long long>(baseline), kRounds,
              static_cast<long long>(ResidentKib(server.pid())));

  direct.reset();
  server.Signal(SIGTERM);
  const std::optional<int> exit = server.WaitForExit(absl::Seconds(30));
  ASSERT_TRUE(exit.has_value()) << "server did not exit";
  EXPECT_TRUE(WIFEXITED(*exit) && WEXITSTATUS(*exit) == 0) << server.log();
}

// SIGTERM under unary and streaming load. Every request a client sent is
// accounted for: OK, or an explicit refusal (UNAVAILABLE, CANCELLED from gRPC for a
// call caught in the instant shutdown began, RESOURCE_EXHAUSTED for a full queue).
// None times out (lost), a stream that was accepted gets every answer, and the
// server exits 0.
TEST(FaultTest, SigtermUnderLoadLosesNoAcceptedRequest) {
  auto started = ServerProcess::Start({"--port=0", "--compute_threads=2", "--drain_timeout=20s"});
  ASSERT_TRUE(started.ok()) << started.status();
  ServerProcess& server = **started;
  std::atomic<bool> stop{false};
  absl::Mutex mu;
  int64_t sent = 0, ok = 0;
  std::map<int, int64_t> refused;  // by code
  std::vector<std::string> lost;
  auto own = [&] { return Channel(server.target(), grpc::InsecureChannelCredentials(), "", true); };

  std::vector<std::thread> clients;
  for (int t = 0; t < 4; ++t) {
    clients.emplace_back([&] {
      auto stub = AttentionService::NewStub(own());
      while (!stop) {
        AttendResponse reply;
        const grpc::Status status = Attend(*stub, ToyRequest(), &reply, std::chrono::seconds(30));
        absl::MutexLock lock(&mu);
        ++sent;
        if (status.ok()) {
          ++ok;
        } else if (status.error_code() == StatusCode::UNAVAILABLE ||
                   status.error_code() == StatusCode::CANCELLED ||
                   status.error_code() == StatusCode::RESOURCE_EXHAUSTED) {
          ++refused[status.error_code()];
        } else {
          lost.push_back(absl::StrCat("unary: code ", status.error_code(), " ",
                                      status.error_message()));
        }
      }
    });
  }
  // Streams: one writer and one reader each; writes stop at `stop`, then
  // WritesDone. An accepted stream must answer every request it took.
  //
  // Their channels do not send BDP probe pings. gRPC's client (1.51) sends one when
  // data arrives; when it goes out after the server, drained, has closed the
  // connection, the server's kernel answers it with a reset, and the client's
  // transport then fails the stream UNAVAILABLE ("Broken pipe", "Connection reset by
  // peer"), dropping answers and the OK status it had already received but its reader
  // had not yet taken. A slow reader (ThreadSanitizer's, or a 10 ms sleep per read)
  // loses the race; a packet capture shows the server wrote every answer, the OK
  // trailers and its FIN first (docs/reliability.md, "A drain and a slow reader").
  auto stream_channel = [&] {
    return Channel(server.target(), grpc::InsecureChannelCredentials(), "", true,
                   /*bdp_probe=*/false);
  };
  struct StreamTally {
    int64_t written = 0, answered = 0;
    grpc::Status status;
  };
  std::vector<StreamTally> tallies(2);
  for (int t = 0; t < 2; ++t) {
    clients.emplace_back([&, t] {
      auto stub = AttentionService::NewStub(stream_channel());
      grpc::ClientContext context;
      SetTimeout(&context, std::chrono::seconds(60));
      auto stream = stub->AttendStream(&context);
      std::thread reader([&] {
        AttendResponse response;
        while (stream->Read(&response)) ++tallies[t].answered;
      });
      while (!stop && stream->Write(ToyRequest())) {
        ++tallies[t].written;
        absl::SleepFor(absl::Milliseconds(2));
      }
      stream->WritesDone();
      reader.join();
      tallies[t].status = stream->Finish();
    });
  }
  bool loaded;
  {
    absl::MutexLock lock(&mu);
    loaded = mu.AwaitWithTimeout(absl::Condition(+[](int64_t* n) { return *n >= 200; }, &ok),
                                 absl::Seconds(120));
  }
  if (!loaded) {
    stop = true;
    for (std::thread& client : clients) client.join();
    FAIL() << "fewer than 200 requests answered in 120 s\n" << server.log();
  }
  server.Signal(SIGTERM);
  absl::SleepFor(absl::Seconds(1));  // load goes on into the drain
  stop = true;
  for (std::thread& client : clients) client.join();
  const std::optional<int> exit = server.WaitForExit(absl::Seconds(30));
  ASSERT_TRUE(exit.has_value()) << "server did not exit";
  EXPECT_TRUE(WIFEXITED(*exit) && WEXITSTATUS(*exit) == 0) << server.log();

  int64_t refused_total = 0;
  for (const auto& [code, n] : refused) refused_total += n;
  std::printf("unary: sent %lld = OK %lld + refused %lld (UNAVAILABLE %lld, CANCELLED %lld, "
              "RESOURCE_EXHAUSTED %lld) + lost %zu\n",
              static_cast<long long>(sent), static_cast<long long>(ok),
              static_cast<long long>(refused_total),
              static_cast<long long>(refused[StatusCode::UNAVAILABLE]),
              static_cast<long long>(refused[StatusCode::CANCELLED]),
              static_cast<long long>(refused[StatusCode::RESOURCE_EXHAUSTED]), lost.size());
  EXPECT_TRUE(lost.empty()) << lost.front();
  EXPECT_EQ(sent, ok + refused_total);
  EXPECT_GT(refused[StatusCode::UNAVAILABLE] + refused[StatusCode::CANCELLED], 0)
      << "the load did not reach past the listener closing";
  for (const StreamTally& tally : tallies) {
    std::printf("stream: written %lld, answered %lld, status %d\n",
                static_cast<long long>(tally.written), static_cast<long long>(tally.answered),
                tally.status.error_code());
    EXPECT_TRUE(tally.status.ok()) << tally.status.error_message();
    EXPECT_EQ(tally.answered, tally.written);
  }
}

// A repository with good models and one broken one refuses to start: exit 1,
// never "listening on", and a message naming the broken model and its file.
struct BrokenModel {
  std::string name;
  std::string config;        // bad/config.pbtxt ("" = no config file)
  std::string weights;       // bad/weights.safetensors ("" = none)
  std::string file;          // the file the message must name (relative to bad/)
  std::string message;       // substring of the message
};
void PrintTo(const BrokenModel& b, std::ostream* os) { *os << b.name; }

class BrokenRepositoryTest : public ::testing::TestWithParam<BrokenModel> {};

TEST_P(BrokenRepositoryTest, RefusesStartNamingModelAndFile) {
  const BrokenModel& b = GetParam();
  TempDir repository;
  repository.Write("aa_good/config.pbtxt", "num_hiddens: 8 num_heads: 2 seeded { seed: 0 }");
  repository.Write("zz_good/config.pbtxt", "num_hiddens: 8 num_heads: 2 seeded { seed: 1 }");
  if (!b.config.empty()) repository.Write("bad/config.pbtxt", b.config);
  if (!b.weights.empty()) repository.Write("bad/weights.safetensors", b.weights);
  if (b.config.empty()) repository.Write("bad/README", "no config here");
  const absl::Time start = absl::Now();
  const RunResult run = RunServer({"--port=0", "--model_repository=" + repository.path()});
  EXPECT_EQ(run.exit_code, 1) << run.err;
  EXPECT_FALSE(absl::StrContains(run.out, "listening on")) << run.out;
  EXPECT_TRUE(absl::StrContains(run.err, "error: model bad (" + repository.path() + "/bad/" +
                                             b.file + ")"))
      << run.err;
  EXPECT_TRUE(absl::StrContains(run.err, b.message)) << run.err;
  EXPECT_LT(absl::Now() - start, absl::Seconds(20));
}

std::string D2lWeights(int64_t p, int64_t d, bool truncate = false, bool wrong_shape = false,
                       bool int_dtype = false) {
  const core::ModelConfig c{.num_hiddens = p, .num_heads = 2, .query_size = d, .key_size = d,
                            .value_size = d};
  const core::Weights w = core::SeededWeights(c, 0);
  std::vector<core::NamedTensor> tensors = {
      core::F32Tensor("W_q.weight", {p, wrong_shape ? d + 1 : d},
                      wrong_shape ? std::vector<float>(p * (d + 1), 0.0f) : w.w_q),
      core::F32Tensor("W_k.weight", {p, d}, w.w_k), core::F32Tensor("W_v.weight", {p, d}, w.w_v),
      core::F32Tensor("W_o.weight", {p, p}, w.w_o)};
  if (int_dtype) tensors[3].dtype = core::DType::kI32;
  std::string bytes = core::SerializeSafetensors(tensors);
  if (truncate) bytes.resize(bytes.size() - 17);
  return bytes;
}

const BrokenModel kBrokenModels[] = {
    {"HeadsDoNotDivide", "num_hiddens: 8 num_heads: 3 seeded { seed: 0 }", "", "config.pbtxt",
     "num_hiddens: must be divisible by num_heads"},
    {"MissingSize", "num_heads: 2 seeded { seed: 0 }", "", "config.pbtxt", "num_hiddens"},
    {"SyntaxError", "num_hiddens: 8\nnum_heads: two\n", "", "config.pbtxt", "line 2"},
    {"UnknownPrecision", "num_hiddens: 8 num_heads: 2 precision: \"f8\" seeded { seed: 0 }", "",
     "config.pbtxt", "precision"},
    {"NegativeLimit",
     "num_hiddens: 8 num_heads: 2 seeded { seed: 0 } limits { max_batch_size: -1 }", "",
     "config.pbtxt", "limits.max_batch_size"},
    {"NameDiffersFromDirectory", "name: \"other\" num_hiddens: 8 num_heads: 2 seeded { seed: 0 }",
     "", "config.pbtxt", "differs from the directory name"},
    {"NoConfigFile", "", "", "config.pbtxt", "cannot read the file"},
    {"MissingWeightsFile", "num_hiddens: 8 num_heads: 2", "", "weights.safetensors",
     "cannot open"},
    {"TruncatedWeights", "num_hiddens: 8 num_heads: 2", D2lWeights(8, 8, true),
     "weights.safetensors", "out of range"},
    {"MisShapedTensor", "num_hiddens: 8 num_heads: 2", D2lWeights(8, 8, false, true),
     "weights.safetensors", "W_q.weight"},
    {"IntegerTensor", "num_hiddens: 8 num_heads: 2", D2lWeights(8, 8, false, false, true),
     "weights.safetensors", "W_o.weight"},
    {"GarbageWeights", "num_hiddens: 8 num_heads: 2", std::string(64, '\x7f'),
     "weights.safetensors", "header length"},
    {"WeightsForOtherSizes", "num_hiddens: 8 num_heads: 2", D2lWeights(4, 4),
     "weights.safetensors", "W_q.weight"},
};

INSTANTIATE_TEST_SUITE_P(Models, BrokenRepositoryTest, ::testing::ValuesIn(kBrokenModels),
                         [](const ::testing::TestParamInfo<BrokenModel>& info) {
                           return info.param.name;
                         });

}  // namespace
}  // namespace mha::testing

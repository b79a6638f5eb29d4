// Runs the real attention_server binary as a child process for tests.
//
//   auto server = ServerProcess::Start({"--port=0"}).value();
//   auto channel = grpc::CreateChannel(server->target(), ...);
//   server->Signal(SIGTERM);
//   std::optional<int> status = server->WaitForExit(absl::Seconds(15));
//
// Not thread-safe; one owner.
#ifndef MHA_TESTS_INTEGRATION_SERVER_PROCESS_H_
#define MHA_TESTS_INTEGRATION_SERVER_PROCESS_H_

#include <sys/types.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "tests/temp_dir.h"

namespace mha::testing {

// The binary under test, from the MHA_SERVER_PATH compile definition.
std::string ServerPath();

class ServerProcess {
 public:
  // Starts the server with `args` (plus --metrics_port=0 and --http_port=-1
  // unless `args` set them) and waits (up to `timeout`) for the "listening on HOST:PORT" line on
  // its stdout, and for "http on HOST:PORT" too when `args` set --http_port >= 0. If the process
  // exits first, FAILED_PRECONDITION carrying the exit status and the server's stderr.
  // `address_line` "warming up on " returns as soon as the port answers health, before
  // the models' warm-up has run.
  static absl::StatusOr<std::unique_ptr<ServerProcess>> Start(
      const std::vector<std::string>& args, absl::Duration timeout = absl::Seconds(30),
      absl::string_view address_line = "listening on ");
  // Starts the server with `args` as they are (no test defaults added) and waits for
  // its "listening on", "http on" and "metrics on" lines: the flags' own defaults.
  static absl::StatusOr<std::unique_ptr<ServerProcess>> StartExactly(
      const std::vector<std::string>& args, absl::Duration timeout = absl::Seconds(30));
  ~ServerProcess();  // SIGKILL and reap if still running

  int port() const { return port_; }
  std::string target() const { return "127.0.0.1:" + std::to_string(port_); }
  int metrics_port() const { return metrics_port_; }  // 0 when metrics are off
  int http_port() const { return http_port_; }        // 0 without --http_port
  std::string http_target() const { return "127.0.0.1:" + std::to_string(http_port_); }
  pid_t pid() const { return pid_; }

  void Signal(int signal);
  // The waitpid status once the process has exited, nullopt on timeout.
  std::optional<int> WaitForExit(absl::Duration timeout);
  std::string log() const;  // stderr so far

 private:
  ServerProcess() = default;
  static absl::StatusOr<std::unique_ptr<ServerProcess>> Launch(const std::vector<std::string>& argv,
                                                               bool wants_http, bool wants_metrics,
                                                               absl::Duration timeout,
                                                               absl::string_view address_line);
  pid_t pid_ = -1;
  int port_ = 0;
  int metrics_port_ = 0;
  int http_port_ = 0;
  bool exited_ = false;
  std::unique_ptr<TempDir> dir_;
};

// Runs a program to completion (killed after `timeout`): the server for start-up
// failures and --help, the client for its verbs.
struct RunResult {
  int exit_code = -1;  // -1: killed by a signal or timed out
  std::string out, err;
};
RunResult RunProgram(const std::string& binary, const std::vector<std::string>& args,
                     absl::Duration timeout);
RunResult RunServer(const std::vector<std::string>& args,
                    absl::Duration timeout = absl::Seconds(30));

// A file's whole contents ("" if it cannot be read).
std::string ReadFile(const std::string& path);

// Writes, with openssl, a CA (ca.pem), a server certificate for localhost and
// 127.0.0.1 (server.pem, server.key) and a client certificate (client.pem,
// client.key), all signed by the CA, into `dir`. INTERNAL with openssl's log.
absl::Status MakeTestCertificates(const std::string& dir);

}  // namespace mha::testing

#endif  // MHA_TESTS_INTEGRATION_SERVER_PROCESS_H_

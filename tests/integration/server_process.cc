#include "tests/integration/server_process.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace mha::testing {
namespace {

// fork + exec of `binary` with stdout to `stdout_fd` and stderr to `stderr_path`.
pid_t Spawn(const std::string& binary, const std::vector<std::string>& args, int stdout_fd,
            const std::string& stderr_path) {
  std::vector<std::string> argv_strings = {binary};
  argv_strings.insert(argv_strings.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (std::string& s : argv_strings) argv.push_back(s.data());
  argv.push_back(nullptr);
  const pid_t pid = fork();
  if (pid == 0) {
    const int err = open(stderr_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(stdout_fd, STDOUT_FILENO);
    dup2(err, STDERR_FILENO);
    execv(argv[0], argv.data());
    _exit(127);
  }
  return pid;
}

// Waits for `pid` to exit without polling loops: a pidfd becomes readable on exit.
std::optional<int> WaitPid(pid_t pid, absl::Duration timeout) {
  const int pidfd = static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
  if (pidfd >= 0) {
    pollfd p{.fd = pidfd, .events = POLLIN, .revents = 0};
    const int ready = poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(timeout)));
    close(pidfd);
    if (ready <= 0) return std::nullopt;
  }
  int status = 0;
  if (waitpid(pid, &status, 0) != pid) return std::nullopt;
  return status;
}

}  // namespace

std::string ServerPath() { return MHA_SERVER_PATH; }

absl::StatusOr<std::unique_ptr<ServerProcess>> ServerProcess::StartExactly(
    const std::vector<std::string>& args, absl::Duration timeout) {
  return Launch(args, /*wants_http=*/true, /*wants_metrics=*/true, timeout, "listening on ");
}

absl::StatusOr<std::unique_ptr<ServerProcess>> ServerProcess::Start(
    const std::vector<std::string>& args, absl::Duration timeout, absl::string_view address_line) {
  // Metrics on a free port too, unless the test chose one.
  std::vector<std::string> argv = args;
  if (std::none_of(args.begin(), args.end(), [](const std::string& arg) {
        return absl::StartsWith(arg, "--metrics_port");
      })) {
    argv.push_back("--metrics_port=0");
  }
  // The HTTP front off unless asked for: servers of parallel tests share no port.
  if (std::none_of(args.begin(), args.end(),
                   [](const std::string& arg) { return absl::StartsWith(arg, "--http_port"); })) {
    argv.push_back("--http_port=-1");
  }
  const bool wants_http = std::any_of(args.begin(), args.end(), [](const std::string& arg) {
    int port = -1;
    return absl::StartsWith(arg, "--http_port=") &&
           absl::SimpleAtoi(arg.substr(arg.find('=') + 1), &port) && port >= 0;
  });
  return Launch(argv, wants_http, /*wants_metrics=*/false, timeout, address_line);
}

absl::StatusOr<std::unique_ptr<ServerProcess>> ServerProcess::Launch(
    const std::vector<std::string>& argv, bool wants_http, bool wants_metrics,
    absl::Duration timeout, absl::string_view address_line) {
  std::unique_ptr<ServerProcess> server(new ServerProcess());
  server->dir_ = std::make_unique<TempDir>();
  int out[2];
  if (pipe2(out, O_CLOEXEC) != 0) return absl::InternalError("pipe failed");
  server->pid_ = Spawn(ServerPath(), argv, out[1], server->dir_->path() + "/stderr.log");
  close(out[1]);

  // "metrics on HOST:PORT" (when metrics are on), "listening on HOST:PORT" and
  // "http on HOST:PORT" (when asked for), in any order.
  const absl::Time deadline = absl::Now() + timeout;
  std::string stdout_text;
  while (true) {
    size_t line_end;
    while ((line_end = stdout_text.find('\n')) != std::string::npos) {
      const std::string line = stdout_text.substr(0, line_end);
      stdout_text.erase(0, line_end + 1);
      const bool listening = absl::StartsWith(line, address_line);
      const bool http = absl::StartsWith(line, "http on ");
      if (!listening && !http && !absl::StartsWith(line, "metrics on ")) continue;
      int* port = listening ? &server->port_ : http ? &server->http_port_ : &server->metrics_port_;
      if (!absl::SimpleAtoi(line.substr(line.rfind(':') + 1), port)) {
        close(out[0]);
        return absl::InternalError(absl::StrCat("bad address line: ", line));
      }
      if (server->port_ > 0 && (!wants_http || server->http_port_ > 0) &&
          (!wants_metrics || server->metrics_port_ > 0)) {
        close(out[0]);
        return server;
      }
    }
    pollfd p{.fd = out[0], .events = POLLIN, .revents = 0};
    const int64_t left_ms = absl::ToInt64Milliseconds(deadline - absl::Now());
    const int ready = left_ms > 0 ? poll(&p, 1, static_cast<int>(left_ms)) : 0;
    if (ready < 0 && errno == EINTR) continue;
    char buffer[256];
    const ssize_t n = ready > 0 ? read(out[0], buffer, sizeof(buffer)) : 0;
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {  // exited (EOF) or timed out
      close(out[0]);
      std::optional<int> status = server->WaitForExit(absl::Seconds(ready > 0 ? 10 : 0));
      return absl::FailedPreconditionError(
          absl::StrCat("server did not start: ",
                       status ? absl::StrCat("exit status ", WEXITSTATUS(*status)) : "timed out",
                       "; stdout: ", stdout_text, "; stderr: ", server->log()));
    }
    stdout_text.append(buffer, static_cast<size_t>(n));
  }
}

ServerProcess::~ServerProcess() {
  if (pid_ <= 0 || exited_) return;
  // A server that died under the test (a sanitizer report ends it with exit 66)
  // shows up to the test only as UNAVAILABLE; its stderr names the cause.
  int status = 0;
  const bool died = waitpid(pid_, &status, WNOHANG) == pid_;
  if (died || ::testing::Test::HasFailure()) {
    std::fprintf(stderr, "--- attention_server (pid %d) %s; its stderr:\n%s--- end\n", pid_,
                 died ? absl::StrCat("exited during the test, wait status ", status).c_str()
                      : "was running when the test failed",
                 log().c_str());
  }
  if (died) return;
  kill(pid_, SIGKILL);
  WaitPid(pid_, absl::Seconds(10));
}

void ServerProcess::Signal(int signal) { kill(pid_, signal); }

std::optional<int> ServerProcess::WaitForExit(absl::Duration timeout) {
  if (exited_) return std::nullopt;
  std::optional<int> status = WaitPid(pid_, timeout);
  exited_ = status.has_value();
  return status;
}

std::string ServerProcess::log() const { return ReadFile(dir_->path() + "/stderr.log"); }

std::string ReadFile(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  std::stringstream text;
  text << file.rdbuf();
  return text.str();
}

absl::Status MakeTestCertificates(const std::string& dir) {
  std::ofstream(dir + "/make_certs.sh") << R"(set -e
EC="-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes"
openssl req -x509 $EC -keyout ca.key -out ca.pem -days 2 -subj /CN=mha-test-ca
openssl req $EC -keyout server.key -out server.csr -subj /CN=localhost
printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\n' > server.ext
openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial \
  -out server.pem -days 2 -extfile server.ext
openssl req $EC -keyout client.key -out client.csr -subj /CN=mha-test-client
openssl x509 -req -in client.csr -CA ca.pem -CAkey ca.key -CAcreateserial \
  -out client.pem -days 2
)";
  const std::string command = absl::StrCat("cd '", dir, "' && sh make_certs.sh > openssl.log 2>&1");
  if (std::system(command.c_str()) != 0) {
    return absl::InternalError(absl::StrCat("openssl failed: ", ReadFile(dir + "/openssl.log")));
  }
  return absl::OkStatus();
}

RunResult RunServer(const std::vector<std::string>& args, absl::Duration timeout) {
  std::vector<std::string> argv = args;
  // The HTTP front off unless asked for: no test relies on port 8000 being free.
  if (std::none_of(args.begin(), args.end(),
                   [](const std::string& arg) { return absl::StartsWith(arg, "--http_port"); })) {
    argv.push_back("--http_port=-1");
  }
  return RunProgram(ServerPath(), argv, timeout);
}

RunResult RunProgram(const std::string& binary, const std::vector<std::string>& args,
                     absl::Duration timeout) {
  TempDir dir;
  const std::string out_path = dir.path() + "/stdout.log";
  const int out = open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  const pid_t pid = Spawn(binary, args, out, dir.path() + "/stderr.log");
  close(out);
  RunResult result;
  std::optional<int> status = WaitPid(pid, timeout);
  if (!status) {
    kill(pid, SIGKILL);
    WaitPid(pid, absl::Seconds(10));
  } else if (WIFEXITED(*status)) {
    result.exit_code = WEXITSTATUS(*status);
  }
  result.out = ReadFile(out_path);
  result.err = ReadFile(dir.path() + "/stderr.log");
  return result;
}

}  // namespace mha::testing

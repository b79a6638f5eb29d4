// Process and socket helpers for the hostile-input and fault tests: a server's
// resident memory and open descriptors from /proc, raw TCP connections to send
// bytes gRPC would never send, and a loopback TCP proxy that can cut every
// connection (RST) or stop reading from the server (a client that never reads).
//
// Not thread-safe unless a method says so; loopback only.
#ifndef MHA_TESTS_INTEGRATION_NET_UTIL_H_
#define MHA_TESTS_INTEGRATION_NET_UTIL_H_

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace mha::testing {

// VmRSS / VmHWM of `pid` in KiB (from /proc/PID/status); -1 if unreadable.
int64_t ResidentKib(pid_t pid);
int64_t PeakResidentKib(pid_t pid);
// Entries of /proc/PID/fd; -1 if unreadable.
int OpenFds(pid_t pid);

// A blocking TCP connection to 127.0.0.1:port (fd -1 if the connect failed).
class RawConnection {
 public:
  explicit RawConnection(int port);
  ~RawConnection();
  RawConnection(const RawConnection&) = delete;
  RawConnection& operator=(const RawConnection&) = delete;

  bool ok() const { return fd_ >= 0; }
  bool Send(const std::string& bytes);
  // Reads what arrives until `timeout` passes or the peer closes; `closed` tells
  // which.
  std::string ReadFor(absl::Duration timeout, bool* closed);

 private:
  int fd_ = -1;
};

// A one-connection TCP listener on 127.0.0.1 that answers whatever arrives first
// with `reply` and then closes; with an empty `reply` it never even accepts, so a
// client's connection is established by the kernel and then nothing ever answers.
class RawServer {
 public:
  explicit RawServer(std::string reply);
  ~RawServer();
  RawServer(const RawServer&) = delete;
  RawServer& operator=(const RawServer&) = delete;

  int port() const { return port_; }

 private:
  int fd_ = -1;
  int port_ = 0;
  std::thread thread_;
};

// HTTP/2 pieces for hand-made gRPC requests (RFC 7540, HPACK literals without
// Huffman coding, RFC 7541 6.2.2).
std::string Http2Preface();  // client preface + an empty SETTINGS frame
std::string Http2Frame(uint8_t type, uint8_t flags, uint32_t stream, const std::string& payload);
// HEADERS (END_HEADERS) for a plaintext gRPC call of `path` on `stream`.
std::string GrpcHeaders(uint32_t stream, const std::string& path);
// A gRPC length-prefixed message: flag byte, 4-byte big-endian length, bytes.
std::string GrpcMessage(const std::string& message, uint32_t declared_length,
                        uint8_t compressed = 0);
struct Http2FrameHeader {
  uint32_t length;
  uint8_t type;  // 0 DATA, 1 HEADERS, 3 RST_STREAM, 4 SETTINGS, 6 PING, 7 GOAWAY, 8 WINDOW_UPDATE
  uint8_t flags;
  uint32_t stream;
};
// The frame headers in a server's byte stream (after the first byte of a frame).
std::vector<Http2FrameHeader> ParseHttp2Frames(const std::string& bytes);

// Forwards 127.0.0.1:port() to 127.0.0.1:upstream_port, one thread per direction
// per connection.
//   TcpProxy proxy(server.port());
//   auto channel = Channel("127.0.0.1:" + std::to_string(proxy.port()));
//   proxy.PauseDownstream(true);  // the client stops reading: the server's writes stall
//   proxy.CutAll();               // every connection is reset (RST) both ways
class TcpProxy {
 public:
  explicit TcpProxy(int upstream_port);
  ~TcpProxy();  // CutAll() and join

  int port() const { return port_; }
  // Thread-safe.
  void PauseDownstream(bool paused);
  void CutAll();
  int connections() const;

 private:
  struct Link {
    int client = -1, server = -1;
    std::atomic<bool> cut{false};
    std::thread up, down;
  };
  void AcceptLoop();
  void Pump(Link* link, bool downstream);

  int upstream_port_;
  int listen_fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stopping_{false};
  std::atomic<bool> paused_{false};
  std::thread acceptor_;
  mutable absl::Mutex mu_;
  std::vector<std::unique_ptr<Link>> links_ ABSL_GUARDED_BY(mu_);
};

}  // namespace mha::testing

#endif  // MHA_TESTS_INTEGRATION_NET_UTIL_H_

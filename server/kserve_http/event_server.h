// An event-driven HTTP/1.1 server on libevent: a few event-loop threads serve every
// connection, so an idle or slow connection, and a request whose answer is being
// computed, hold no thread. The KServe front (http_front.h) routes its requests.
//
// Why libevent's bufferevents with our own framing (http1.h), and not evhttp,
// Boost.Beast or libmicrohttpd: docs/service.md, "The HTTP engine".
//
// A connection, on its loop thread:
//   - reads a request head within Options::header_timeout of its first byte (a
//     deadline on the whole head, not an idle timer), else 408 and close;
//   - framing and limits as http1.h: a refusal is answered with {"error": ...}, then
//     the connection is closed (after a short lingering read, so that the client
//     sees the answer rather than a reset);
//   - answers "100 Continue" to Expect: 100-continue once the head is accepted (a
//     body over the limit is refused with 413 before any of it is read);
//   - decodes a gzip or deflate body (Content-Encoding) with the same limit on the
//     decoded bytes (413 past it), 415 for another coding;
//   - hands the request to the handler and reads nothing more until it is answered
//     (pipelined requests wait in the socket's buffer, bounded, and are answered in
//     order), but still sees the client close: HttpResponder::ClientGone;
//   - between requests, closes after Options::idle_timeout without a byte; while a
//     body is read, the same bound applies between reads (408).
// Connections beyond Options::max_connections are answered 503 and closed (plain
// HTTP; with TLS they are closed). Start raises the soft RLIMIT_NOFILE to the hard.
// The handler runs on a loop thread and must not block: it answers at once, or
// later from any thread. Responses go out in the order of their requests; a
// response body of application/json is compressed when the request's
// Accept-Encoding asks for gzip or deflate (on the thread that answers).
//
// Thread safety: Start and Stop from one thread; HttpResponder from any thread.
#ifndef MHA_SERVER_KSERVE_HTTP_EVENT_SERVER_H_
#define MHA_SERVER_KSERVE_HTTP_EVENT_SERVER_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace mha::server {

struct HttpRequest {
  std::string method;  // as sent; HEAD is answered as GET without the body
  std::string path;    // the target before '?', not decoded
  std::vector<std::pair<std::string, std::string>> headers;
  std::string body;  // Content-Encoding undone
  std::string peer;  // "address:port"
  bool loopback_peer = false;

  // The first header of that name (case-insensitive).
  std::optional<absl::string_view> Header(absl::string_view name) const;
};

struct HttpResponse {
  int status = 200;
  std::string content_type = "application/json";
  std::vector<std::pair<std::string, std::string>> headers;  // beyond the framing ones
  std::string body;
  // Sent after `body`, never compressed; a large part is handed to the socket by
  // reference (binary tensor outputs, not copied into `body`).
  std::vector<std::string> tail;
};

namespace http_internal {
struct Connection;
}

// Answers one request, once, from any thread; a copy shares the answer.
class HttpResponder {
 public:
  explicit HttpResponder(std::shared_ptr<http_internal::Connection> connection);
  void Send(HttpResponse response) const;
  // The client closed the connection (or the server dropped it) before the answer.
  bool ClientGone() const;

 private:
  std::shared_ptr<http_internal::Connection> connection_;
};

class EventHttpServer {
 public:
  struct Options {
    std::string host = "127.0.0.1";
    int32_t port = 8000;  // 0 = pick a free port
    int loops = 1;        // event-loop threads
    int64_t max_body_bytes = int64_t{64} << 20;
    int64_t max_head_bytes = int64_t{64} << 10;
    absl::Duration header_timeout = absl::Seconds(10);
    absl::Duration idle_timeout = absl::Seconds(60);
    int64_t max_connections = 10000;
    // Stop waits this long for requests being computed to be answered.
    absl::Duration drain_timeout = absl::Seconds(30);
    // PEM paths: cert + key serve HTTPS; client_ca also requires client certificates.
    std::string tls_cert, tls_key, tls_client_ca;
  };
  using Handler = std::function<void(HttpRequest request, HttpResponder responder)>;

  // Binds (UNAVAILABLE "HOST:PORT (--http_port)" when the port is in use; no
  // SO_REUSEPORT) and serves; INVALID_ARGUMENT when the TLS files do not load.
  static absl::StatusOr<std::unique_ptr<EventHttpServer>> Start(const Options& options,
                                                                Handler handler);
  ~EventHttpServer();  // Stop()

  // Stops accepting; closes idle connections; waits (up to drain_timeout) for the
  // requests being computed to be answered, each with Connection: close; joins.
  void Stop();

  int port() const { return port_; }
  int64_t open_connections() const;

  struct Impl;

 private:
  EventHttpServer() = default;
  std::unique_ptr<Impl> impl_;
  int port_ = 0;
};

}  // namespace mha::server

#endif  // MHA_SERVER_KSERVE_HTTP_EVENT_SERVER_H_

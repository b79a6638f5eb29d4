#include "client/sdk/http.h"

#include <fcntl.h>
#include <httplib.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <optional>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "base/status_macros.h"
#include "client/sdk/http1_response.h"
#include "client/sdk/status.h"

namespace mha::client {
namespace {

constexpr char kHeaderLength[] = "Inference-Header-Content-Length";

// A transport failure (no HTTP response) after `elapsed` of a `timeout`.
absl::Status TransportError(httplib::Error error, absl::Duration elapsed, absl::Duration timeout,
                            const HttpEndpoint& endpoint) {
  const std::string what =
      absl::StrFormat("HTTP %s error with %s after %.1f ms", httplib::to_string(error),
                      HttpTargetString(endpoint), absl::ToDoubleMilliseconds(elapsed));
  const bool slow = elapsed >= timeout * 0.99;
  if (error == httplib::Error::ConnectionTimeout ||
      (slow && (error == httplib::Error::Read || error == httplib::Error::Write))) {
    return absl::DeadlineExceededError(what);
  }
  return absl::UnavailableError(what);
}

absl::Status Prefixed(absl::string_view method, absl::string_view path, const absl::Status& s) {
  return absl::Status(s.code(), absl::StrCat(method, " ", path, ": ", s.message()));
}

void SetTimeout(httplib::Client& client, absl::Duration timeout) {
  const int64_t us = std::max<int64_t>(1, absl::ToInt64Microseconds(timeout));
  const time_t sec = static_cast<time_t>(us / 1000000);
  const time_t usec = static_cast<time_t>(us % 1000000);
  client.set_connection_timeout(sec, usec);
  client.set_read_timeout(sec, usec);
  client.set_write_timeout(sec, usec);
}

}  // namespace

absl::StatusOr<HttpEndpoint> ParseHttpTarget(absl::string_view target) {
  auto bad = [&] {
    return UsageError(absl::StrCat(
        "--target: expected HOST[:PORT] of the HTTP server with --protocol=http, got \"", target,
        "\""));
  };
  HttpEndpoint endpoint;
  absl::string_view port;
  if (absl::ConsumePrefix(&target, "[")) {
    const size_t close = target.find(']');
    if (close == absl::string_view::npos) return bad();
    endpoint.host = std::string(target.substr(0, close));
    absl::string_view rest = target.substr(close + 1);
    if (!rest.empty() && !absl::ConsumePrefix(&rest, ":")) return bad();
    port = rest;
  } else {
    const size_t colon = target.rfind(':');
    if (colon != absl::string_view::npos && target.find(':') != colon) return bad();
    endpoint.host = std::string(target.substr(0, colon));
    if (colon != absl::string_view::npos) port = target.substr(colon + 1);
  }
  if (endpoint.host.empty() || endpoint.host.find('/') != std::string::npos) return bad();
  if (!port.empty() &&
      (!absl::SimpleAtoi(port, &endpoint.port) || endpoint.port < 1 || endpoint.port > 65535)) {
    return bad();
  }
  return endpoint;
}

std::string HttpTargetString(const HttpEndpoint& endpoint) {
  const bool v6 = endpoint.host.find(':') != std::string::npos;
  return absl::StrCat(v6 ? "[" : "", endpoint.host, v6 ? "]" : "", ":", endpoint.port);
}

namespace {

std::unique_ptr<httplib::Client> MakeClient(const HttpEndpoint& endpoint) {
  // The scheme-less constructor makes a plain client; an https:// base URL makes an
  // SSL one that takes the client certificate files.
  const bool v6 = endpoint.host.find(':') != std::string::npos;
  auto client = std::make_unique<httplib::Client>(
      absl::StrCat("https://", v6 ? "[" : "", endpoint.host, v6 ? "]" : "", ":", endpoint.port),
      endpoint.tls_cert, endpoint.tls_key);
  client->enable_server_certificate_verification(true);
  if (!endpoint.tls_ca.empty()) client->set_ca_cert_path(endpoint.tls_ca);
  client->set_keep_alive(true);
  client->set_tcp_nodelay(true);
  // Bodies are tensors: no compression either way.
  client->set_default_headers({{"Accept-Encoding", "identity"}});
  return client;
}

// What a call needs of a response, from either transport.
struct Reply {
  int status = 0;
  std::optional<std::string> header_length;  // Inference-Header-Content-Length
  std::string body;
};

struct Call {
  absl::string_view method, path, content_type, body;
  std::optional<int64_t> header_length;  // sent as Inference-Header-Content-Length
};

absl::StatusOr<Reply> ExchangeTls(httplib::Client& client, const Call& call,
                                  const HttpEndpoint& endpoint, absl::Duration timeout) {
  const absl::Time start = absl::Now();
  httplib::Headers headers;
  if (call.header_length) headers.emplace(kHeaderLength, absl::StrCat(*call.header_length));
  const httplib::Result result =
      call.method == "GET" ? client.Get(std::string(call.path), headers)
                           : client.Post(std::string(call.path), headers, call.body.data(),
                                         call.body.size(), std::string(call.content_type));
  if (!result) return TransportError(result.error(), absl::Now() - start, timeout, endpoint);
  Reply reply{.status = result->status, .body = std::move(result->body)};
  if (result->has_header(kHeaderLength))
    reply.header_length = result->get_header_value(kHeaderLength);
  return reply;
}

// errno as words.
std::string ErrnoText(int error) {
  char text[128];
  return strerror_r(error, text, sizeof(text));
}

}  // namespace

// One keep-alive TCP connection written and read with blocking calls whose timeouts
// are the socket's (SO_SNDTIMEO, SO_RCVTIMEO: each read or write, as cpp-httplib's);
// connecting is bounded by the same timeout. A request is one sendmsg of the head and
// body; a response is read into a buffer kept from call to call.
class PlainHttpTransport {
 public:
  PlainHttpTransport(const HttpEndpoint& endpoint, absl::Duration timeout)
      : endpoint_(endpoint), timeout_(timeout), host_(HttpTargetString(endpoint)) {}
  ~PlainHttpTransport() { Close(); }

  absl::StatusOr<Reply> Exchange(const Call& call) {
    const absl::Time start = absl::Now();
    std::string head = absl::StrCat(call.method, " ", call.path, " HTTP/1.1\r\nHost: ", host_,
                                    "\r\nAccept-Encoding: identity\r\n");
    if (call.method != "GET") {
      absl::StrAppend(&head, "Content-Type: ", call.content_type,
                      "\r\nContent-Length: ", call.body.size(), "\r\n");
    }
    if (call.header_length)
      absl::StrAppend(&head, kHeaderLength, ": ", *call.header_length, "\r\n");
    head += "\r\n";
    while (true) {
      const bool reused = fd_ >= 0;
      if (!reused) {
        absl::Status connected = Connect(start);
        if (!connected.ok()) return connected;
      }
      bool answered = false;
      const absl::Status sent = Send(head, call.body, start);
      absl::StatusOr<Reply> reply = sent.ok() ? Receive(call.method == "HEAD", start, &answered)
                                              : absl::StatusOr<Reply>(sent);
      if (reply.ok() && keep_alive_) return reply;
      Close();
      // A kept-alive connection the server closed meanwhile: once more on a new one.
      const bool stale = reused && !answered && !reply.ok() &&
                         reply.status().code() == absl::StatusCode::kUnavailable;
      if (!stale) return reply;
    }
  }

 private:
  absl::Status Failure(absl::string_view what, int error, absl::Time start) const {
    const std::string text =
        absl::StrFormat("HTTP %s error with %s after %.1f ms: %s", what, host_,
                        absl::ToDoubleMilliseconds(absl::Now() - start), ErrnoText(error));
    if (error == EAGAIN || error == EWOULDBLOCK || error == ETIMEDOUT) {
      return absl::DeadlineExceededError(text);
    }
    return absl::UnavailableError(text);
  }

  absl::Status Connect(absl::Time start) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* found = nullptr;
    const int resolved =
        getaddrinfo(endpoint_.host.c_str(), absl::StrCat(endpoint_.port).c_str(), &hints, &found);
    if (resolved != 0) {
      return absl::UnavailableError(
          absl::StrFormat("HTTP connection error with %s: %s", host_, gai_strerror(resolved)));
    }
    absl::Status status =
        absl::UnavailableError(absl::StrCat("HTTP connection error with ", host_));
    for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
      status = ConnectTo(a, start);
      if (status.ok()) break;
    }
    freeaddrinfo(found);
    return status;
  }

  absl::Status ConnectTo(const addrinfo* address, absl::Time start) {
    const int fd = socket(address->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) return Failure("connection", errno, start);
    int error = 0;
    if (connect(fd, address->ai_addr, address->ai_addrlen) != 0) {
      error = errno;
      if (error == EINPROGRESS) {
        pollfd p{.fd = fd, .events = POLLOUT, .revents = 0};
        const int64_t ms = std::max<int64_t>(1, absl::ToInt64Milliseconds(timeout_));
        const int ready = poll(&p, 1, static_cast<int>(std::min<int64_t>(ms, 1 << 30)));
        socklen_t size = sizeof(error);
        if (ready == 0) {
          error = ETIMEDOUT;
        } else if (ready < 0 || getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &size) != 0) {
          error = errno;
        }
      }
    }
    if (error != 0) {
      close(fd);
      return Failure("connection", error, start);
    }
    const int one = 1;
    const int64_t us = std::max<int64_t>(1, absl::ToInt64Microseconds(timeout_));
    const timeval t{.tv_sec = static_cast<time_t>(us / 1000000),
                    .tv_usec = static_cast<suseconds_t>(us % 1000000)};
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &t, sizeof(t));
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &t, sizeof(t));
    fd_ = fd;
    return absl::OkStatus();
  }

  void Close() {
    if (fd_ >= 0) close(fd_);
    fd_ = -1;
  }

  absl::Status Send(absl::string_view head, absl::string_view body, absl::Time start) {
    iovec parts[2] = {{const_cast<char*>(head.data()), head.size()},
                      {const_cast<char*>(body.data()), body.size()}};
    iovec* next = parts;
    int count = body.empty() ? 1 : 2;
    while (count > 0) {
      msghdr message{};
      message.msg_iov = next;
      message.msg_iovlen = static_cast<size_t>(count);
      const ssize_t sent = sendmsg(fd_, &message, MSG_NOSIGNAL);
      if (sent < 0) {
        if (errno == EINTR) continue;
        return Failure("write", errno, start);
      }
      // Past what went out.
      size_t left = static_cast<size_t>(sent);
      while (count > 0 && left >= next->iov_len) {
        left -= next->iov_len;
        ++next;
        --count;
      }
      if (count > 0) {
        next->iov_base = static_cast<char*>(next->iov_base) + left;
        next->iov_len -= left;
      }
    }
    return absl::OkStatus();
  }

  absl::StatusOr<Reply> Receive(bool head_request, absl::Time start, bool* answered) {
    parser_.Reset(head_request);
    if (buffer_.empty()) buffer_.resize(64 * 1024);
    http1::ResponseParser::Event event = http1::ResponseParser::Event::kNeedMore;
    while (event == http1::ResponseParser::Event::kNeedMore) {
      const ssize_t got = recv(fd_, buffer_.data(), buffer_.size(), 0);
      if (got < 0) {
        if (errno == EINTR) continue;
        return Failure("read", errno, start);
      }
      if (got == 0) {
        event = parser_.Finish();
        // Closed early: the connection broke, the response was not malformed.
        if (event == http1::ResponseParser::Event::kError) {
          return absl::UnavailableError(
              absl::StrFormat("HTTP read error with %s after %.1f ms: %s", host_,
                              absl::ToDoubleMilliseconds(absl::Now() - start),
                              absl::StripPrefix(parser_.error().message(), "HTTP response: ")));
        }
        break;
      }
      *answered = true;
      size_t used = 0;
      event = parser_.Feed(absl::string_view(buffer_.data(), static_cast<size_t>(got)), &used);
      // Bytes past the response were not asked for: this connection is done with.
      keep_alive_ = used == static_cast<size_t>(got);
    }
    if (event == http1::ResponseParser::Event::kError) return parser_.error();
    keep_alive_ = keep_alive_ && parser_.keep_alive();
    Reply reply{.status = parser_.status(), .body = std::move(parser_.body())};
    if (std::optional<absl::string_view> length = parser_.Find(kHeaderLength)) {
      reply.header_length = std::string(*length);
    }
    return reply;
  }

  const HttpEndpoint endpoint_;
  const absl::Duration timeout_;
  const std::string host_;  // the Host field, and the target in messages
  int fd_ = -1;
  bool keep_alive_ = false;
  http1::ResponseParser parser_;
  std::string buffer_;
};

namespace {

absl::StatusOr<Reply> Exchange(httplib::Client* tls, PlainHttpTransport* plain, const Call& call,
                               const HttpEndpoint& endpoint, absl::Duration timeout) {
  absl::StatusOr<Reply> reply =
      tls != nullptr ? ExchangeTls(*tls, call, endpoint, timeout) : plain->Exchange(call);
  if (!reply.ok()) return Prefixed(call.method, call.path, reply.status());
  return reply;
}

}  // namespace

HttpConnection::HttpConnection(const HttpEndpoint& endpoint, absl::Duration timeout)
    : endpoint_(endpoint), timeout_(timeout) {
  if (endpoint.tls) {
    client_ = MakeClient(endpoint);
    SetTimeout(*client_, timeout);
  } else {
    plain_ = std::make_unique<PlainHttpTransport>(endpoint, timeout);
  }
}

HttpConnection::~HttpConnection() = default;

absl::StatusOr<inference::ModelInferResponse> HttpConnection::Infer(const HttpRequest& request) {
  MHA_ASSIGN_OR_RETURN(Reply reply, Exchange(client_.get(), plain_.get(),
                                             {.method = "POST",
                                              .path = request.path,
                                              .content_type = "application/octet-stream",
                                              .body = request.body,
                                              .header_length = request.header_length},
                                             endpoint_, timeout_));
  std::optional<int64_t> header_length;
  if (reply.header_length) {
    int64_t length = 0;
    if (!absl::SimpleAtoi(*reply.header_length, &length)) {
      return Prefixed("POST", request.path,
                      absl::InternalError(absl::StrCat("HTTP response: bad ", kHeaderLength, " \"",
                                                       *reply.header_length, "\"")));
    }
    header_length = length;
  }
  auto response = ParseHttpInferResponse(reply.status, header_length, reply.body);
  if (!response.ok()) return Prefixed("POST", request.path, response.status());
  return response;
}

absl::StatusOr<inference::ModelMetadataResponse> HttpConnection::ModelMetadata(
    const std::string& model) {
  const std::string path = ModelPath(model, "");
  MHA_ASSIGN_OR_RETURN(Reply reply, Exchange(client_.get(), plain_.get(),
                                             {.method = "GET", .path = path}, endpoint_, timeout_));
  if (reply.status != 200) return Prefixed("GET", path, HttpError(reply.status, reply.body));
  auto metadata = ParseHttpModelMetadata(reply.body);
  if (!metadata.ok()) return Prefixed("GET", path, metadata.status());
  return metadata;
}

absl::StatusOr<std::vector<std::string>> HttpConnection::ReadyModels() {
  constexpr char kPath[] = "/v2/repository/index";
  MHA_ASSIGN_OR_RETURN(Reply reply, Exchange(client_.get(), plain_.get(),
                                             {.method = "POST",
                                              .path = kPath,
                                              .content_type = "application/json",
                                              .body = R"({"ready": true})"},
                                             endpoint_, timeout_));
  if (reply.status != 200) return Prefixed("POST", kPath, HttpError(reply.status, reply.body));
  auto names = ParseHttpIndexNames(reply.body);
  if (!names.ok()) return Prefixed("POST", kPath, names.status());
  return names;
}

absl::Status HttpConnection::Ready() {
  constexpr char kPath[] = "/v2/health/ready";
  MHA_ASSIGN_OR_RETURN(
      Reply reply,
      Exchange(client_.get(), plain_.get(), {.method = "GET", .path = kPath}, endpoint_, timeout_));
  if (reply.status != 200) return Prefixed("GET", kPath, HttpError(reply.status, reply.body));
  return absl::OkStatus();
}

}  // namespace mha::client

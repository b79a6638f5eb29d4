#include "server/kserve_http/event_server.h"

#include <arpa/inet.h>
#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/bufferevent_ssl.h>
#include <event2/event.h>
#include <event2/listener.h>
#include <event2/thread.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <sys/ioctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>
#include <zlib.h>

#include <cerrno>
#include <cstring>
#include <ctime>
#include <map>
#include <thread>

#include "absl/base/call_once.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "server/kserve_http/http1.h"
#include "server/kserve_http/http_codec.h"

namespace mha::server {

std::optional<absl::string_view> HttpRequest::Header(absl::string_view name) const {
  return http1::FindHeader(headers, name);
}

namespace {

// A connection stops reading once this much of a following (pipelined) request is
// buffered while the current one is being answered.
constexpr size_t kPipelineBuffer = size_t{1} << 20;
// A refused connection is read (and the bytes dropped) this long before it closes.
constexpr timeval kLinger = {2, 0};

timeval TimevalOf(absl::Duration d) { return absl::ToTimeval(d); }

const char* Reason(int status) {
  switch (status) {
    case 100: return "Continue";
    case 200: return "OK";
    case 400: return "Bad Request";
    case 403: return "Forbidden";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 408: return "Request Timeout";
    case 409: return "Conflict";
    case 413: return "Content Too Large";
    case 415: return "Unsupported Media Type";
    case 417: return "Expectation Failed";
    case 429: return "Too Many Requests";
    case 431: return "Request Header Fields Too Large";
    case 500: return "Internal Server Error";
    case 501: return "Not Implemented";
    case 503: return "Service Unavailable";
    case 504: return "Gateway Timeout";
    case 505: return "HTTP Version Not Supported";
    default: return "Status";
  }
}

// gzip (windowBits 31), zlib (15) or raw deflate (-15).
absl::StatusOr<std::string> Inflate(absl::string_view in, int window_bits, int64_t limit) {
  z_stream z{};
  if (inflateInit2(&z, window_bits) != Z_OK) return absl::InternalError("inflateInit2");
  // Reserved once (address space, touched only as written): growing by doubling
  // would hold the old and the new copy, twice the limit, at the end.
  std::string out;
  out.reserve(static_cast<size_t>(limit) + (size_t{64} << 10));
  z.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(in.data()));
  z.avail_in = static_cast<uInt>(in.size());
  int rc = Z_OK;
  while (rc != Z_STREAM_END) {
    const size_t chunk = size_t{64} << 10;
    const size_t used = out.size();
    out.resize(used + chunk);
    z.next_out = reinterpret_cast<Bytef*>(out.data() + used);
    z.avail_out = static_cast<uInt>(chunk);
    rc = inflate(&z, Z_NO_FLUSH);
    out.resize(used + chunk - z.avail_out);
    if (static_cast<int64_t>(out.size()) > limit) {
      inflateEnd(&z);
      return absl::ResourceExhaustedError(absl::StrCat(
          "request body: over the limit of ", limit, " bytes once decoded (Content-Encoding)"));
    }
    if (rc == Z_STREAM_END) break;
    if (rc != Z_OK && !(rc == Z_BUF_ERROR && z.avail_out == 0)) {
      inflateEnd(&z);
      return absl::InvalidArgumentError("Content-Encoding: the body does not decode");
    }
    if (z.avail_in == 0 && z.avail_out != 0) {
      inflateEnd(&z);
      return absl::InvalidArgumentError("Content-Encoding: the body ends before its stream does");
    }
  }
  inflateEnd(&z);
  return out;
}

// Appends `bytes` to `out`: copied when small, else handed over by reference (freed
// once written).
void AddToBuffer(evbuffer* out, std::string bytes) {
  if (bytes.empty()) return;
  if (bytes.size() < 16384) {
    evbuffer_add(out, bytes.data(), bytes.size());
    return;
  }
  auto* held = new std::string(std::move(bytes));
  evbuffer_add_reference(
      out, held->data(), held->size(),
      [](const void*, size_t, void* arg) { delete static_cast<std::string*>(arg); }, held);
}

std::string Deflate(absl::string_view in, int window_bits) {
  z_stream z{};
  if (deflateInit2(&z, Z_DEFAULT_COMPRESSION, Z_DEFLATED, window_bits, 8,
                   Z_DEFAULT_STRATEGY) != Z_OK) {
    return {};
  }
  std::string out(deflateBound(&z, in.size()), '\0');
  z.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(in.data()));
  z.avail_in = static_cast<uInt>(in.size());
  z.next_out = reinterpret_cast<Bytef*>(out.data());
  z.avail_out = static_cast<uInt>(out.size());
  const int rc = deflate(&z, Z_FINISH);
  out.resize(out.size() - z.avail_out);
  deflateEnd(&z);
  return rc == Z_STREAM_END ? out : std::string();
}

// "gzip", "deflate" or "" from an Accept-Encoding value.
std::string PickCoding(absl::string_view accept) {
  std::string pick;
  for (absl::string_view item : absl::StrSplit(accept, ',')) {
    std::vector<absl::string_view> parts = absl::StrSplit(item, ';');
    const absl::string_view coding = absl::StripAsciiWhitespace(parts[0]);
    bool zero = false;
    for (size_t i = 1; i < parts.size(); ++i) {
      absl::string_view p = absl::StripAsciiWhitespace(parts[i]);
      double q = 1;
      if (absl::ConsumePrefix(&p, "q=") && absl::SimpleAtod(p, &q) && q <= 0) zero = true;
    }
    if (zero) continue;
    if (absl::EqualsIgnoreCase(coding, "gzip")) return "gzip";
    if (absl::EqualsIgnoreCase(coding, "deflate")) pick = "deflate";
  }
  return pick;
}

}  // namespace

namespace http_internal {

struct Loop;

struct Connection : std::enable_shared_from_this<Connection> {
  Connection(std::shared_ptr<Loop> l, const http1::Limits& limits) : loop(std::move(l)), parser(limits) {}
  ~Connection();

  std::shared_ptr<Loop> loop;
  bufferevent* bev = nullptr;
  event* deadline = nullptr;  // the request head's
  event* idle = nullptr;      // between requests, and between body reads
  event* linger = nullptr;
  std::string peer;
  bool loopback = false;
  http1::RequestParser parser;
  bool busy = false;             // a request is with the handler
  bool close_after_write = false;
  bool closed = false;
  bool head_request = false;     // the request being answered is a HEAD
  bool keep_alive_10 = false;    // HTTP/1.0 keep-alive: say so in the answer
  std::atomic<bool> gone{false};
  std::string accept_coding;  // the request being answered: "gzip", "deflate" or ""
};

struct Loop : std::enable_shared_from_this<Loop> {
  ~Loop() {
    if (inbox != nullptr) event_free(inbox);
    if (base != nullptr) event_base_free(base);
  }
  event_base* base = nullptr;
  event* inbox = nullptr;
  std::thread thread;
  std::thread::id id;
  EventHttpServer::Impl* server = nullptr;
  absl::Mutex mu;
  std::vector<std::function<void()>> posted ABSL_GUARDED_BY(mu);
  bool stopped ABSL_GUARDED_BY(mu) = false;
  std::map<Connection*, std::shared_ptr<Connection>> connections;  // loop thread only
  time_t date_second = 0;
  std::string date;  // "Date: ...\r\n" for date_second

  // Runs `fn` on the loop thread; false (and `fn` dropped) once the loop stopped.
  bool Post(std::function<void()> fn) {
    {
      absl::MutexLock lock(&mu);
      if (stopped) return false;
      posted.push_back(std::move(fn));
    }
    event_active(inbox, EV_READ, 0);
    return true;
  }
  const std::string& Date() {
    const time_t now = time(nullptr);
    if (now != date_second) {
      date_second = now;
      tm t{};
      gmtime_r(&now, &t);
      char buf[64];
      strftime(buf, sizeof(buf), "Date: %a, %d %b %Y %H:%M:%S GMT\r\n", &t);
      date = buf;
    }
    return date;
  }
};

Connection::~Connection() {
  if (bev != nullptr) bufferevent_free(bev);
  for (event* e : {deadline, idle, linger}) {
    if (e != nullptr) event_free(e);
  }
}

}  // namespace http_internal

using http_internal::Connection;
using http_internal::Loop;

struct EventHttpServer::Impl {
  Options options;
  Handler handler;
  http1::Limits limits;
  SSL_CTX* tls = nullptr;
  std::vector<std::shared_ptr<Loop>> loops;
  evconnlistener* listener = nullptr;
  event* listener_pause = nullptr;
  std::atomic<int64_t> open{0};
  std::atomic<bool> stopping{false};
  uint64_t next_loop = 0;  // loop 0's thread
  absl::Notification go;   // the loops start once every thread id is known

  ~Impl() {
    if (tls != nullptr) SSL_CTX_free(tls);
  }

  // --- on a connection's loop thread ---
  void Open(const std::shared_ptr<Loop>& loop, int fd, std::string peer, bool loopback);
  void Close(Connection* c);
  void ProcessInput(Connection* c);
  // Reads what the socket holds of a Content-Length body straight into the parser.
  void ReadBodyDirectly(Connection* c);
  void Dispatch(Connection* c);
  void Refuse(Connection* c, int status, absl::string_view message);
  void Write(Connection* c, HttpResponse response);
  void ArmIdle(Connection* c);
  // The answer is written: the connection reads its next request.
  void Ready(Connection* c);

  static void OnRead(bufferevent* bev, void* arg);
  static void OnWrite(bufferevent* bev, void* arg);
  static void OnEvent(bufferevent* bev, short what, void* arg);
  static void OnDeadline(evutil_socket_t, short, void* arg);
  static void OnIdle(evutil_socket_t, short, void* arg);
  static void OnLinger(evutil_socket_t, short, void* arg);
  static void OnLingerRead(bufferevent* bev, void* arg);
  static void OnAccept(evconnlistener*, evutil_socket_t fd, sockaddr* addr, int len, void* arg);
  static void OnAcceptError(evconnlistener*, void* arg);
};

namespace {

void RunPosted(evutil_socket_t, short, void* arg) {
  auto* loop = static_cast<Loop*>(arg);
  std::vector<std::function<void()>> work;
  {
    absl::MutexLock lock(&loop->mu);
    work.swap(loop->posted);
  }
  for (auto& fn : work) fn();
}

std::string PeerOf(const sockaddr* addr, bool* loopback) {
  char host[INET6_ADDRSTRLEN] = "?";
  int port = 0;
  *loopback = false;
  if (addr->sa_family == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(addr);
    inet_ntop(AF_INET, &in->sin_addr, host, sizeof(host));
    port = ntohs(in->sin_port);
    *loopback = (ntohl(in->sin_addr.s_addr) >> 24) == 127;
    return absl::StrCat(host, ":", port);
  }
  if (addr->sa_family == AF_INET6) {
    const auto* in6 = reinterpret_cast<const sockaddr_in6*>(addr);
    inet_ntop(AF_INET6, &in6->sin6_addr, host, sizeof(host));
    port = ntohs(in6->sin6_port);
    *loopback = IN6_IS_ADDR_LOOPBACK(&in6->sin6_addr) ||
                (IN6_IS_ADDR_V4MAPPED(&in6->sin6_addr) && in6->sin6_addr.s6_addr[12] == 127);
    return absl::StrCat("[", host, "]:", port);
  }
  return "unknown";
}

void RaiseFileLimit() {
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) == 0 && limit.rlim_cur < limit.rlim_max) {
    limit.rlim_cur = limit.rlim_max;
    setrlimit(RLIMIT_NOFILE, &limit);
  }
}

absl::Status TlsError(absl::string_view what) {
  char buf[256] = "";
  ERR_error_string_n(ERR_get_error(), buf, sizeof(buf));
  return absl::InvalidArgumentError(absl::StrCat(
      "http_port: cannot serve HTTPS with --tls_cert/--tls_key (or --tls_client_ca): ", what,
      ": ", buf));
}

absl::StatusOr<SSL_CTX*> MakeTls(const EventHttpServer::Options& o) {
  SSL_CTX* ctx = SSL_CTX_new(TLS_server_method());
  if (ctx == nullptr) return TlsError("SSL_CTX_new");
  auto fail = [ctx](absl::string_view what) {
    absl::Status s = TlsError(what);
    SSL_CTX_free(ctx);
    return s;
  };
  SSL_CTX_set_min_proto_version(ctx, TLS1_2_VERSION);
  if (SSL_CTX_use_certificate_chain_file(ctx, o.tls_cert.c_str()) != 1) return fail(o.tls_cert);
  if (SSL_CTX_use_PrivateKey_file(ctx, o.tls_key.c_str(), SSL_FILETYPE_PEM) != 1 ||
      SSL_CTX_check_private_key(ctx) != 1) {
    return fail(o.tls_key);
  }
  if (!o.tls_client_ca.empty()) {
    if (SSL_CTX_load_verify_locations(ctx, o.tls_client_ca.c_str(), nullptr) != 1) {
      return fail(o.tls_client_ca);
    }
    STACK_OF(X509_NAME)* names = SSL_load_client_CA_file(o.tls_client_ca.c_str());
    if (names != nullptr) SSL_CTX_set_client_CA_list(ctx, names);
    SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT, nullptr);
  }
  return ctx;
}

// A listening socket on host:port, SO_REUSEADDR only; -1 when it cannot bind.
int Listen(const std::string& host, int32_t port, int* bound_port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  if (getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &found) != 0) {
    return -1;
  }
  int fd = -1;
  for (addrinfo* a = found; a != nullptr && fd < 0; a = a->ai_next) {
    fd = socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    int yes = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
    if (bind(fd, a->ai_addr, a->ai_addrlen) != 0 || listen(fd, SOMAXCONN) != 0) {
      close(fd);
      fd = -1;
    }
  }
  freeaddrinfo(found);
  if (fd < 0) return -1;
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  *bound_port = addr.ss_family == AF_INET6
                    ? ntohs(reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port)
                    : ntohs(reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
  return fd;
}

}  // namespace

// --- HttpResponder ---

HttpResponder::HttpResponder(std::shared_ptr<http_internal::Connection> connection)
    : connection_(std::move(connection)) {}

bool HttpResponder::ClientGone() const { return connection_->gone.load(std::memory_order_acquire); }

void HttpResponder::Send(HttpResponse response) const {
  Connection* c = connection_.get();
  if (!c->accept_coding.empty() && response.content_type == "application/json" &&
      response.body.size() >= 1024) {
    const bool gzip = c->accept_coding == "gzip";
    std::string packed = Deflate(response.body, gzip ? 15 + 16 : 15);
    if (!packed.empty()) {
      response.body = std::move(packed);
      response.headers.emplace_back("Content-Encoding", c->accept_coding);
    }
  }
  Loop* loop = c->loop.get();
  if (std::this_thread::get_id() == loop->id) {
    loop->server->Write(c, std::move(response));
    return;
  }
  loop->Post([connection = connection_, response = std::move(response)]() mutable {
    Connection* conn = connection.get();
    conn->loop->server->Write(conn, std::move(response));
    if (!conn->closed && !conn->busy) conn->loop->server->ProcessInput(conn);
  });
}

// --- the connection's life, on its loop thread ---

void EventHttpServer::Impl::Open(const std::shared_ptr<Loop>& loop, int fd, std::string peer,
                                 bool loopback) {
  bufferevent* bev = nullptr;
  if (tls != nullptr) {
    SSL* ssl = SSL_new(tls);
    bev = bufferevent_openssl_socket_new(loop->base, fd, ssl, BUFFEREVENT_SSL_ACCEPTING,
                                         BEV_OPT_CLOSE_ON_FREE);
    if (bev != nullptr) bufferevent_openssl_set_allow_dirty_shutdown(bev, 1);
  } else {
    bev = bufferevent_socket_new(loop->base, fd, BEV_OPT_CLOSE_ON_FREE);
  }
  if (bev == nullptr) {
    close(fd);
    open.fetch_sub(1);
    return;
  }
  auto c = std::make_shared<Connection>(loop, limits);
  c->bev = bev;
  c->peer = std::move(peer);
  c->loopback = loopback;
  c->deadline = evtimer_new(loop->base, &Impl::OnDeadline, c.get());
  c->idle = evtimer_new(loop->base, &Impl::OnIdle, c.get());
  loop->connections.emplace(c.get(), c);
  bufferevent_setcb(bev, &Impl::OnRead, &Impl::OnWrite, &Impl::OnEvent, c.get());
  bufferevent_enable(bev, EV_READ | EV_WRITE);
  ArmIdle(c.get());
}

void EventHttpServer::Impl::Close(Connection* c) {
  if (c->closed) return;
  c->closed = true;
  if (c->busy) c->gone.store(true, std::memory_order_release);
  if (c->bev != nullptr) {
    bufferevent_free(c->bev);
    c->bev = nullptr;
  }
  for (event** e : {&c->deadline, &c->idle, &c->linger}) {
    if (*e != nullptr) {
      event_free(*e);
      *e = nullptr;
    }
  }
  open.fetch_sub(1);
  c->loop->connections.erase(c);  // may destroy c: nothing after this
}

void EventHttpServer::Impl::ArmIdle(Connection* c) {
  if (c->idle == nullptr) return;
  const timeval t = TimevalOf(options.idle_timeout);
  evtimer_add(c->idle, &t);
}

void EventHttpServer::Impl::Ready(Connection* c) {
  c->busy = false;
  c->head_request = false;
  bufferevent_setwatermark(c->bev, EV_READ, 0, 0);
}

void EventHttpServer::Impl::ProcessInput(Connection* c) {
  // A request answered at once may close its connection (Connection: close while
  // the server stops), which drops the loop's reference: this one keeps `c` alive
  // until the loop below has looked at `closed`.
  const std::shared_ptr<Connection> keep = c->shared_from_this();
  while (!c->closed && !c->busy && !c->close_after_write) {
    evbuffer* in = bufferevent_get_input(c->bev);
    const size_t length = evbuffer_get_length(in);
    evbuffer_iovec vec[16];
    const int n = length == 0 ? 0 : evbuffer_peek(in, -1, nullptr, vec, 16);
    http1::RequestParser::Event event = http1::RequestParser::Event::kNeedMore;
    size_t total = 0;
    if (n == 0) {
      size_t used = 0;
      event = c->parser.Feed({}, &used);
    }
    for (int i = 0; i < std::min(n, 16); ++i) {
      size_t used = 0;
      event = c->parser.Feed(
          absl::string_view(static_cast<const char*>(vec[i].iov_base), vec[i].iov_len), &used);
      total += used;
      if (event != http1::RequestParser::Event::kNeedMore) break;
    }
    evbuffer_drain(in, total);
    if (c->parser.started() && !c->parser.head_done() &&
        !evtimer_pending(c->deadline, nullptr)) {
      const timeval t = TimevalOf(options.header_timeout);
      evtimer_add(c->deadline, &t);
    }
    switch (event) {
      case http1::RequestParser::Event::kNeedMore:
        if (total < length) continue;  // more segments than one peek holds
        if (tls == nullptr && c->parser.body_remaining() > 0) {
          ReadBodyDirectly(c);
          if (c->parser.body_remaining() == 0) continue;  // complete: Feed reports it
        }
        // Between requests, and between a body's reads, the idle timer runs; while a
        // head arrives, its deadline does.
        if (!c->parser.started() || c->parser.head_done()) ArmIdle(c);
        return;
      case http1::RequestParser::Event::kHead:
        evtimer_del(c->deadline);
        evtimer_del(c->idle);
        if (c->parser.head().expect_continue) {
          static constexpr char kContinue[] = "HTTP/1.1 100 Continue\r\n\r\n";
          bufferevent_write(c->bev, kContinue, sizeof(kContinue) - 1);
        }
        continue;
      case http1::RequestParser::Event::kRequest:
        evtimer_del(c->deadline);
        evtimer_del(c->idle);
        Dispatch(c);
        continue;
      case http1::RequestParser::Event::kRefused:
        evtimer_del(c->deadline);
        Refuse(c, c->parser.refusal().status, c->parser.refusal().message);
        return;
    }
  }
}

// libevent 2.1's bufferevent reads 4 KiB a callback (evbuffer_read's cap), then the
// parser copies them: a 3.1 MB body took ~760 callbacks and two copies. On plain TCP
// the rest of a body is read from the socket into the body's own buffer instead
// (docs/performance.md, the event-driven HTTP front).
void EventHttpServer::Impl::ReadBodyDirectly(Connection* c) {
  const int fd = bufferevent_getfd(c->bev);
  while (c->parser.body_remaining() > 0) {
    int ready = 0;
    if (ioctl(fd, FIONREAD, &ready) != 0 || ready <= 0) return;
    const size_t want =
        static_cast<size_t>(std::min<int64_t>(ready, c->parser.body_remaining()));
    char* at = c->parser.ReserveBody(want);
    const ssize_t got = recv(fd, at, want, MSG_DONTWAIT);
    c->parser.CommitBody(want, got > 0 ? static_cast<size_t>(got) : 0);
    // An error or the peer's end: the bufferevent's next read sees it too.
    if (got <= 0) return;
  }
}

void EventHttpServer::Impl::Refuse(Connection* c, int status, absl::string_view message) {
  c->close_after_write = true;
  c->busy = true;
  Write(c, HttpResponse{.status = status, .body = ErrorBody(message)});
}

void EventHttpServer::Impl::Dispatch(Connection* c) {
  const http1::RequestHead& head = c->parser.head();
  HttpRequest request;
  request.method = head.method;
  const size_t query = head.target.find('?');
  request.path = head.target.substr(0, query);
  request.headers = head.headers;
  request.peer = c->peer;
  request.loopback_peer = c->loopback;
  c->head_request = head.method == "HEAD";
  c->keep_alive_10 = head.minor_version == 0 && head.keep_alive;
  if (!head.keep_alive || stopping.load()) c->close_after_write = true;
  c->accept_coding.clear();
  if (std::optional<absl::string_view> accept = head.Find("Accept-Encoding")) {
    c->accept_coding = PickCoding(*accept);
  }
  std::string body = std::move(c->parser.body());
  c->busy = true;
  if (std::optional<absl::string_view> coding = head.Find("Content-Encoding");
      coding && !absl::EqualsIgnoreCase(absl::StripAsciiWhitespace(*coding), "identity")) {
    const absl::string_view name = absl::StripAsciiWhitespace(*coding);
    absl::StatusOr<std::string> decoded;
    if (absl::EqualsIgnoreCase(name, "gzip") || absl::EqualsIgnoreCase(name, "x-gzip")) {
      decoded = Inflate(body, 15 + 16, options.max_body_bytes);
    } else if (absl::EqualsIgnoreCase(name, "deflate")) {
      // HTTP's deflate is zlib's format; some clients send raw deflate.
      decoded = Inflate(body, 15, options.max_body_bytes);
      if (decoded.status().code() == absl::StatusCode::kInvalidArgument) {
        decoded = Inflate(body, -15, options.max_body_bytes);
      }
    } else {
      return Refuse(c, 415, absl::StrCat("Content-Encoding: \"", name.substr(0, 64),
                                         "\" is not understood; use gzip, deflate or identity"));
    }
    if (!decoded.ok()) {
      return Refuse(c, decoded.status().code() == absl::StatusCode::kResourceExhausted ? 413 : 400,
                    decoded.status().message());
    }
    body = *std::move(decoded);
  }
  request.body = std::move(body);
  c->parser.Next();
  // Bytes of a pipelined request wait in the buffer; reading stops past kPipelineBuffer.
  bufferevent_setwatermark(c->bev, EV_READ, 0, kPipelineBuffer);
  handler(std::move(request), HttpResponder(c->shared_from_this()));
}

void EventHttpServer::Impl::Write(Connection* c, HttpResponse response) {
  if (c->closed) return;  // the client left: the answer is dropped
  Loop* loop = c->loop.get();
  if (stopping.load()) c->close_after_write = true;
  if (c->head_request) {
    response.body.clear();
    response.tail.clear();
  }
  // A small tail joins the body (one write below); a large one stays by reference.
  size_t tail_bytes = 0;
  for (const std::string& part : response.tail) tail_bytes += part.size();
  if (tail_bytes > 0 && response.body.size() + tail_bytes <= 65536) {
    for (const std::string& part : response.tail) response.body += part;
    response.tail.clear();
    tail_bytes = 0;
  }
  std::string head = absl::StrCat("HTTP/1.1 ", response.status, " ", Reason(response.status),
                                  "\r\n", loop->Date(), "Content-Type: ", response.content_type,
                                  "\r\nContent-Length: ", response.body.size() + tail_bytes,
                                  "\r\n");
  for (const auto& [name, value] : response.headers) absl::StrAppend(&head, name, ": ", value, "\r\n");
  if (c->close_after_write) {
    head += "Connection: close\r\n";
  } else if (c->keep_alive_10) {
    head += "Connection: keep-alive\r\n";
  }
  head += "\r\n";
  evbuffer* out = bufferevent_get_output(c->bev);
  // A small answer on plain TCP with nothing queued before it is written at once:
  // through the bufferevent it would cost a poll for writability and two epoll_ctl.
  if (tls == nullptr && evbuffer_get_length(out) == 0 && response.body.size() <= 65536 &&
      response.tail.empty()) {
    iovec parts[2] = {{head.data(), head.size()}, {response.body.data(), response.body.size()}};
    const ssize_t sent = writev(bufferevent_getfd(c->bev), parts, response.body.empty() ? 1 : 2);
    size_t done = sent > 0 ? static_cast<size_t>(sent) : 0;
    const size_t head_done = std::min(done, head.size());
    head.erase(0, head_done);
    response.body.erase(0, done - head_done);
    if (head.empty() && response.body.empty()) {
      if (c->close_after_write) return OnWrite(c->bev, c);
      return Ready(c);
    }
  }
  evbuffer_add(out, head.data(), head.size());
  AddToBuffer(out, std::move(response.body));
  for (std::string& part : response.tail) AddToBuffer(out, std::move(part));
  if (c->close_after_write) return;  // OnWrite closes once it is flushed
  Ready(c);
}

void EventHttpServer::Impl::OnRead(bufferevent*, void* arg) {
  auto* c = static_cast<Connection*>(arg);
  c->loop->server->ProcessInput(c);
}

void EventHttpServer::Impl::OnWrite(bufferevent* bev, void* arg) {
  auto* c = static_cast<Connection*>(arg);
  Impl* self = c->loop->server;
  if (!c->close_after_write || !c->busy || evbuffer_get_length(bufferevent_get_output(bev)) > 0) {
    return;
  }
  // Answered and flushed: close, after a lingering read on plain TCP so that the
  // client reads the answer before the socket goes (a close with unread bytes
  // would reset the connection).
  if (self->tls != nullptr || c->linger != nullptr || self->stopping.load()) return self->Close(c);
  const int fd = bufferevent_getfd(bev);
  shutdown(fd, SHUT_WR);
  evtimer_del(c->deadline);
  evtimer_del(c->idle);
  c->linger = evtimer_new(c->loop->base, &Impl::OnLinger, c);
  evtimer_add(c->linger, &kLinger);
  bufferevent_setwatermark(bev, EV_READ, 0, 0);
  bufferevent_setcb(bev, &Impl::OnLingerRead, nullptr, &Impl::OnEvent, c);
}

void EventHttpServer::Impl::OnLingerRead(bufferevent* bev, void*) {
  evbuffer* in = bufferevent_get_input(bev);
  evbuffer_drain(in, evbuffer_get_length(in));
}

void EventHttpServer::Impl::OnLinger(evutil_socket_t, short, void* arg) {
  auto* c = static_cast<Connection*>(arg);
  c->loop->server->Close(c);
}

void EventHttpServer::Impl::OnEvent(bufferevent*, short what, void* arg) {
  auto* c = static_cast<Connection*>(arg);
  if (what & (BEV_EVENT_EOF | BEV_EVENT_ERROR | BEV_EVENT_TIMEOUT)) c->loop->server->Close(c);
}

void EventHttpServer::Impl::OnDeadline(evutil_socket_t, short, void* arg) {
  auto* c = static_cast<Connection*>(arg);
  Impl* self = c->loop->server;
  if (c->busy || c->closed) return;
  self->Refuse(c, 408, absl::StrCat("request header: not complete within ",
                                    absl::FormatDuration(self->options.header_timeout),
                                    " of its first byte (--http_header_timeout)"));
}

void EventHttpServer::Impl::OnIdle(evutil_socket_t, short, void* arg) {
  auto* c = static_cast<Connection*>(arg);
  Impl* self = c->loop->server;
  if (c->busy || c->closed) return;
  if (c->parser.head_done()) {  // a body stalled
    return self->Refuse(c, 408, absl::StrCat("request body: no byte for ",
                                             absl::FormatDuration(self->options.idle_timeout),
                                             " (--http_idle_timeout)"));
  }
  if (c->parser.started()) return;  // the header deadline decides
  self->Close(c);
}

void EventHttpServer::Impl::OnAccept(evconnlistener*, evutil_socket_t fd, sockaddr* addr, int,
                                     void* arg) {
  auto* self = static_cast<Impl*>(arg);
  if (self->open.load() >= self->options.max_connections || self->stopping.load()) {
    if (self->tls == nullptr) {
      const std::string body = ErrorBody(absl::StrCat(
          self->stopping.load() ? "the server is shutting down" : "too many connections",
          " (--http_max_connections=", self->options.max_connections, "); retry later"));
      const std::string answer =
          absl::StrCat("HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                       "Content-Length: ", body.size(), "\r\nConnection: close\r\n\r\n", body);
      (void)!send(fd, answer.data(), answer.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
    }
    close(fd);
    return;
  }
  self->open.fetch_add(1);
  int yes = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &yes, sizeof(yes));
  bool loopback = false;
  std::string peer = PeerOf(addr, &loopback);
  std::shared_ptr<Loop> loop = self->loops[self->next_loop++ % self->loops.size()];
  if (loop->id == std::this_thread::get_id()) {
    self->Open(loop, fd, std::move(peer), loopback);
    return;
  }
  if (!loop->Post([self, loop, fd, peer = std::move(peer), loopback]() mutable {
        self->Open(loop, fd, std::move(peer), loopback);
      })) {
    close(fd);
    self->open.fetch_sub(1);
  }
}

void EventHttpServer::Impl::OnAcceptError(evconnlistener* listener, void* arg) {
  // Out of descriptors (EMFILE/ENFILE): pause accepting for 100 ms rather than spin.
  auto* self = static_cast<Impl*>(arg);
  evconnlistener_disable(listener);
  const timeval t = {0, 100000};
  evtimer_add(self->listener_pause, &t);
}

// --- EventHttpServer ---

absl::StatusOr<std::unique_ptr<EventHttpServer>> EventHttpServer::Start(const Options& options,
                                                                        Handler handler) {
  static absl::once_flag once;
  absl::call_once(once, [] { evthread_use_pthreads(); });
  RaiseFileLimit();
  std::unique_ptr<EventHttpServer> server(new EventHttpServer());
  server->impl_ = std::make_unique<Impl>();
  Impl& impl = *server->impl_;
  impl.options = options;
  impl.handler = std::move(handler);
  impl.limits = {.max_head_bytes = options.max_head_bytes,
                 .max_body_bytes = options.max_body_bytes};
  if (!options.tls_cert.empty()) {
    absl::StatusOr<SSL_CTX*> tls = MakeTls(options);
    if (!tls.ok()) return tls.status();
    impl.tls = *tls;
  }
  const std::string address = absl::StrCat(
      options.host.find(':') == std::string::npos ? options.host : "[" + options.host + "]", ":",
      options.port);
  const int fd = Listen(options.host, options.port, &server->port_);
  if (fd < 0) return absl::UnavailableError(absl::StrCat(address, " (--http_port)"));
  for (int i = 0; i < std::max(1, options.loops); ++i) {
    auto loop = std::make_shared<Loop>();
    loop->server = &impl;
    loop->base = event_base_new();
    loop->inbox = event_new(loop->base, -1, EV_PERSIST, &RunPosted, loop.get());
    impl.loops.push_back(std::move(loop));
  }
  impl.listener = evconnlistener_new(impl.loops[0]->base, &Impl::OnAccept, &impl,
                                     LEV_OPT_CLOSE_ON_FREE | LEV_OPT_CLOSE_ON_EXEC, 0, fd);
  if (impl.listener == nullptr) {
    close(fd);
    return absl::InternalError("http_port: cannot listen (libevent)");
  }
  evconnlistener_set_error_cb(impl.listener, &Impl::OnAcceptError);
  impl.listener_pause = evtimer_new(
      impl.loops[0]->base,
      [](evutil_socket_t, short, void* arg) {
        evconnlistener_enable(static_cast<Impl*>(arg)->listener);
      },
      &impl);
  // Every loop's thread id is known before any loop runs (OnAccept and Send compare
  // them): the threads wait for `go`.
  for (const std::shared_ptr<Loop>& loop : impl.loops) {
    loop->thread = std::thread([raw = loop.get(), go = &impl.go] {
      go->WaitForNotification();
      // Keeps the loop running while it has nothing else to wait for.
      event* keep = event_new(raw->base, -1, EV_PERSIST, [](evutil_socket_t, short, void*) {},
                              nullptr);
      const timeval hour = {3600, 0};
      event_add(keep, &hour);
      event_base_dispatch(raw->base);
      event_free(keep);
    });
    loop->id = loop->thread.get_id();
  }
  impl.go.Notify();
  return server;
}

EventHttpServer::~EventHttpServer() { Stop(); }

int64_t EventHttpServer::open_connections() const { return impl_ ? impl_->open.load() : 0; }

void EventHttpServer::Stop() {
  if (impl_ == nullptr || impl_->stopping.exchange(true)) return;
  Impl& impl = *impl_;
  auto on_each_loop = [&impl](std::function<void(Loop&)> fn) {
    for (const std::shared_ptr<Loop>& loop : impl.loops) {
      absl::Notification done;
      if (loop->Post([&, raw = loop.get()] {
            fn(*raw);
            done.Notify();
          })) {
        done.WaitForNotification();
      }
    }
  };
  on_each_loop([&impl](Loop& loop) {
    if (&loop == impl.loops[0].get()) {
      evconnlistener_free(impl.listener);
      impl.listener = nullptr;
      event_free(impl.listener_pause);
      impl.listener_pause = nullptr;
    }
    // Idle connections close now; those with a request answer it with Connection: close.
    std::vector<Connection*> idle;
    for (auto& [raw, c] : loop.connections) {
      if (!c->busy) idle.push_back(raw);
    }
    for (Connection* c : idle) impl.Close(c);
  });
  const absl::Time give_up = absl::Now() + impl.options.drain_timeout;
  while (impl.open.load() > 0 && absl::Now() < give_up) absl::SleepFor(absl::Milliseconds(10));
  on_each_loop([&impl](Loop& loop) {
    std::vector<Connection*> all;
    for (auto& [raw, c] : loop.connections) all.push_back(raw);
    for (Connection* c : all) impl.Close(c);
  });
  for (const std::shared_ptr<Loop>& loop : impl.loops) {
    {
      absl::MutexLock lock(&loop->mu);
      loop->stopped = true;
    }
    event_base_loopbreak(loop->base);
    loop->thread.join();
    absl::MutexLock lock(&loop->mu);
    loop->posted.clear();
  }
}

}  // namespace mha::server

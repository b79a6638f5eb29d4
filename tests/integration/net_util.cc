#include "tests/integration/net_util.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace mha::testing {
namespace {

int64_t StatusField(pid_t pid, const std::string& field) {
  std::ifstream file(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(file, line)) {
    if (line.rfind(field + ":", 0) == 0) {
      std::istringstream value(line.substr(field.size() + 1));
      int64_t kib = -1;
      value >> kib;
      return kib;
    }
  }
  return -1;
}

int ConnectLoopback(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return -1;
  }
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  return fd;
}

bool WriteAll(int fd, const char* data, size_t size) {
  while (size > 0) {
    const ssize_t n = send(fd, data, size, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    data += n;
    size -= static_cast<size_t>(n);
  }
  return true;
}

void CloseWithReset(int fd) {
  if (fd < 0) return;
  const linger reset{.l_onoff = 1, .l_linger = 0};
  setsockopt(fd, SOL_SOCKET, SO_LINGER, &reset, sizeof(reset));
  close(fd);
}

std::string Be(uint64_t value, int bytes) {
  std::string out;
  for (int i = bytes - 1; i >= 0; --i) out.push_back(static_cast<char>((value >> (8 * i)) & 0xff));
  return out;
}

// HPACK literal header field without indexing, new name, no Huffman coding.
std::string Literal(const std::string& name, const std::string& value) {
  std::string out(1, '\0');
  out.push_back(static_cast<char>(name.size()));  // names and values here are < 127 bytes
  out += name;
  out.push_back(static_cast<char>(value.size()));
  out += value;
  return out;
}

}  // namespace

int64_t ResidentKib(pid_t pid) { return StatusField(pid, "VmRSS"); }
int64_t PeakResidentKib(pid_t pid) { return StatusField(pid, "VmHWM"); }

int OpenFds(pid_t pid) {
  DIR* dir = opendir(absl::StrCat("/proc/", pid, "/fd").c_str());
  if (dir == nullptr) return -1;
  int count = 0;
  while (const dirent* entry = readdir(dir)) {
    if (entry->d_name[0] != '.') ++count;
  }
  closedir(dir);
  return count;
}

RawConnection::RawConnection(int port) : fd_(ConnectLoopback(port)) {}
RawConnection::~RawConnection() {
  if (fd_ >= 0) close(fd_);
}

bool RawConnection::Send(const std::string& bytes) {
  return fd_ >= 0 && WriteAll(fd_, bytes.data(), bytes.size());
}

std::string RawConnection::ReadFor(absl::Duration timeout, bool* closed) {
  *closed = false;
  std::string out;
  const absl::Time deadline = absl::Now() + timeout;
  while (fd_ >= 0) {
    const int64_t left = absl::ToInt64Milliseconds(deadline - absl::Now());
    if (left <= 0) break;
    pollfd p{.fd = fd_, .events = POLLIN, .revents = 0};
    const int ready = poll(&p, 1, static_cast<int>(left));
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0) break;
    char buffer[4096];
    const ssize_t n = recv(fd_, buffer, sizeof(buffer), 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      *closed = true;
      break;
    }
    out.append(buffer, static_cast<size_t>(n));
  }
  return out;
}

std::string Http2Preface() {
  return std::string("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n") + Http2Frame(4, 0, 0, "");
}

// Built with append: GCC 12 warns falsely (-Wrestrict) on chains of string +.
std::string Http2Frame(uint8_t type, uint8_t flags, uint32_t stream, const std::string& payload) {
  std::string out = Be(payload.size(), 3);
  out.push_back(static_cast<char>(type));
  out.push_back(static_cast<char>(flags));
  out.append(Be(stream & 0x7fffffffu, 4));
  out.append(payload);
  return out;
}

std::string GrpcHeaders(uint32_t stream, const std::string& path) {
  const std::string block = Literal(":method", "POST") + Literal(":scheme", "http") +
                            Literal(":path", path) + Literal(":authority", "127.0.0.1") +
                            Literal("content-type", "application/grpc") + Literal("te", "trailers");
  return Http2Frame(1, 0x4 /* END_HEADERS */, stream, block);
}

std::string GrpcMessage(const std::string& message, uint32_t declared_length, uint8_t compressed) {
  std::string out(1, static_cast<char>(compressed));
  out.append(Be(declared_length, 4));
  out.append(message);
  return out;
}

std::vector<Http2FrameHeader> ParseHttp2Frames(const std::string& bytes) {
  std::vector<Http2FrameHeader> frames;
  size_t at = 0;
  while (at + 9 <= bytes.size()) {
    const auto byte = [&](size_t i) { return static_cast<uint8_t>(bytes[at + i]); };
    Http2FrameHeader h{
        .length = (uint32_t{byte(0)} << 16) | (uint32_t{byte(1)} << 8) | byte(2),
        .type = byte(3),
        .flags = byte(4),
        .stream = ((uint32_t{byte(5)} << 24) | (uint32_t{byte(6)} << 16) |
                   (uint32_t{byte(7)} << 8) | byte(8)) &
                  0x7fffffffu,
    };
    frames.push_back(h);
    at += 9 + h.length;
  }
  return frames;
}

TcpProxy::TcpProxy(int upstream_port) : upstream_port_(upstream_port) {
  listen_fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = 0;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof(addr);
  if (bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
      listen(listen_fd_, 128) == 0 &&
      getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &length) == 0) {
    port_ = ntohs(addr.sin_port);
  }
  acceptor_ = std::thread([this] { AcceptLoop(); });
}

TcpProxy::~TcpProxy() {
  stopping_ = true;
  acceptor_.join();
  CutAll();
  close(listen_fd_);
}

void TcpProxy::PauseDownstream(bool paused) { paused_ = paused; }

int TcpProxy::connections() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(links_.size());
}

void TcpProxy::CutAll() {
  std::vector<std::unique_ptr<Link>> links;
  {
    absl::MutexLock lock(&mu_);
    links.swap(links_);
  }
  for (auto& link : links) link->cut = true;
  for (auto& link : links) {
    link->up.join();
    link->down.join();
    CloseWithReset(link->client);
    CloseWithReset(link->server);
  }
}

void TcpProxy::AcceptLoop() {
  while (!stopping_) {
    pollfd p{.fd = listen_fd_, .events = POLLIN, .revents = 0};
    if (poll(&p, 1, 50) <= 0) continue;
    const int client = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (client < 0) continue;
    const int server = ConnectLoopback(upstream_port_);
    if (server < 0) {
      close(client);
      continue;
    }
    auto link = std::make_unique<Link>();
    link->client = client;
    link->server = server;
    Link* raw = link.get();
    raw->up = std::thread([this, raw] { Pump(raw, false); });
    raw->down = std::thread([this, raw] { Pump(raw, true); });
    absl::MutexLock lock(&mu_);
    links_.push_back(std::move(link));
  }
}

// Copies one direction until EOF, an error or a cut. Downstream (server ->
// client) stops reading while paused, so the server's socket buffer fills.
void TcpProxy::Pump(Link* link, bool downstream) {
  const int from = downstream ? link->server : link->client;
  const int to = downstream ? link->client : link->server;
  char buffer[16384];
  while (!link->cut) {
    if (downstream && paused_) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      continue;
    }
    pollfd p{.fd = from, .events = POLLIN, .revents = 0};
    const int ready = poll(&p, 1, 20);
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0) continue;
    const ssize_t n = recv(from, buffer, sizeof(buffer), 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      shutdown(to, SHUT_WR);
      return;
    }
    const char* data = buffer;
    size_t left = static_cast<size_t>(n);
    while (left > 0 && !link->cut) {  // the peer may stall: never block past a cut
      pollfd out{.fd = to, .events = POLLOUT, .revents = 0};
      if (poll(&out, 1, 20) <= 0) continue;
      const ssize_t sent = send(to, data, left, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (sent < 0 && (errno == EINTR || errno == EAGAIN)) continue;
      if (sent <= 0) return;
      data += sent;
      left -= static_cast<size_t>(sent);
    }
  }
}

RawServer::RawServer(std::string reply) {
  fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t size = sizeof(address);
  EXPECT_EQ(bind(fd_, reinterpret_cast<sockaddr*>(&address), size), 0);
  EXPECT_EQ(listen(fd_, 4), 0);
  EXPECT_EQ(getsockname(fd_, reinterpret_cast<sockaddr*>(&address), &size), 0);
  port_ = ntohs(address.sin_port);
  if (reply.empty()) return;
  thread_ = std::thread([fd = fd_, reply = std::move(reply)] {
    const int peer = accept(fd, nullptr, nullptr);
    if (peer < 0) return;
    char request[65536];
    if (recv(peer, request, sizeof(request), 0) > 0) {
      send(peer, reply.data(), reply.size(), MSG_NOSIGNAL);
    }
    close(peer);
  });
}

RawServer::~RawServer() {
  shutdown(fd_, SHUT_RDWR);
  if (thread_.joinable()) thread_.join();
  close(fd_);
}

}  // namespace mha::testing

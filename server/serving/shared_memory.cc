#include "server/serving/shared_memory.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "server/serving/abbreviate.h"

namespace mha::server {
namespace {

thread_local const SharedMemoryRegistry* current_registry = nullptr;

std::string Quoted(absl::string_view s) { return absl::StrCat("\"", Abbreviate(s), "\""); }

std::string Errno(int error) { return std::strerror(error); }

}  // namespace

bool RangeFits(uint64_t offset, uint64_t bytes, uint64_t size) {
  return offset <= size && bytes <= size - offset;
}

bool RangesOverlap(uint64_t a, uint64_t a_bytes, uint64_t b, uint64_t b_bytes) {
  if (a_bytes == 0 || b_bytes == 0) return false;
  // [a, a + a_bytes) and [b, b + b_bytes), without computing an end that overflows.
  return a < b ? b - a < a_bytes : a - b < b_bytes;
}

absl::Status CheckShmKey(absl::string_view key, absl::string_view field) {
  auto refuse = [&](absl::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " ", Quoted(key), ": ", why,
                     " (a POSIX shared-memory name: one leading '/', no other '/', at most ",
                     kMaxShmKeyBytes, " bytes)"));
  };
  if (key.empty() || key.front() != '/') return refuse("must start with '/'");
  if (key.size() < 2) return refuse("names nothing after '/'");
  if (key.size() > kMaxShmKeyBytes) return refuse(absl::StrCat("is ", key.size(), " bytes"));
  if (key.find('/', 1) != absl::string_view::npos) return refuse("has a '/' after the first");
  if (key.find('\0') != absl::string_view::npos) return refuse("has a NUL byte");
  if (key == "/." || key == "/..") return refuse("is a directory name");
  return absl::OkStatus();
}

bool IsLoopbackPeer(absl::string_view peer) {
  if (absl::StartsWith(peer, "unix:") || absl::StartsWith(peer, "unix-abstract:")) return true;
  std::string host;
  if (absl::ConsumePrefix(&peer, "ipv4:")) {
    host = std::string(peer.substr(0, peer.rfind(':')));
  } else if (absl::ConsumePrefix(&peer, "ipv6:")) {
    // "[::1]:5000"
    if (!absl::ConsumePrefix(&peer, "[")) return false;
    host = std::string(peer.substr(0, peer.find(']')));
  } else {
    host = std::string(peer);
    if (absl::StartsWith(host, "[") && absl::EndsWith(host, "]")) {
      host = host.substr(1, host.size() - 2);
    }
  }
  in_addr v4{};
  if (inet_pton(AF_INET, host.c_str(), &v4) == 1) {
    return (ntohl(v4.s_addr) >> 24) == 127;
  }
  if (const size_t percent = host.find('%'); percent != std::string::npos) host.resize(percent);
  in6_addr v6{};
  if (inet_pton(AF_INET6, host.c_str(), &v6) == 1) {
    if (IN6_IS_ADDR_LOOPBACK(&v6)) return true;
    return IN6_IS_ADDR_V4MAPPED(&v6) && v6.s6_addr[12] == 127;
  }
  return false;
}

SharedMemoryRegion::~SharedMemoryRegion() { close(fd_); }

absl::Status SharedMemoryRegion::CheckRange(uint64_t offset, uint64_t bytes) const {
  if (!RangeFits(offset, bytes, spec_.byte_size)) {
    return absl::InvalidArgumentError(absl::StrCat("shared memory region ", Quoted(spec_.name),
                                                   ": ", bytes, " bytes at offset ", offset,
                                                   " are beyond its ", spec_.byte_size, " bytes"));
  }
  return absl::OkStatus();
}

absl::Status SharedMemoryRegion::Read(uint64_t offset, uint64_t bytes, void* out) const {
  if (absl::Status in_range = CheckRange(offset, bytes); !in_range.ok()) return in_range;
  char* to = static_cast<char*>(out);
  uint64_t at = spec_.offset + offset;  // no overflow: registered offset + byte_size fit
  while (bytes > 0) {
    const ssize_t got = pread(fd_, to, bytes, static_cast<off_t>(at));
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("shared memory region ", Quoted(spec_.name), " (key ", Quoted(spec_.key),
                       "): cannot read ", bytes, " bytes at file offset ", at, ": ",
                       got == 0 ? "the file was truncated" : Errno(errno)));
    }
    to += got;
    at += static_cast<uint64_t>(got);
    bytes -= static_cast<uint64_t>(got);
  }
  return absl::OkStatus();
}

absl::Status SharedMemoryRegion::Write(uint64_t offset, const void* data, uint64_t bytes) const {
  if (absl::Status in_range = CheckRange(offset, bytes); !in_range.ok()) return in_range;
  uint64_t at = spec_.offset + offset;
  struct stat st {};
  if (fstat(fd_, &st) != 0 || static_cast<uint64_t>(st.st_size) < at + bytes) {
    return absl::FailedPreconditionError(
        absl::StrCat("shared memory region ", Quoted(spec_.name), " (key ", Quoted(spec_.key),
                     "): cannot write ", bytes, " bytes at file offset ", at,
                     ": the file was truncated to ", st.st_size, " bytes"));
  }
  const char* from = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t put = pwrite(fd_, from, bytes, static_cast<off_t>(at));
    if (put < 0 && errno == EINTR) continue;
    if (put <= 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("shared memory region ", Quoted(spec_.name), " (key ", Quoted(spec_.key),
                       "): cannot write ", bytes, " bytes at file offset ", at, ": ",
                       put == 0 ? "nothing written" : Errno(errno)));
    }
    from += put;
    at += static_cast<uint64_t>(put);
    bytes -= static_cast<uint64_t>(put);
  }
  return absl::OkStatus();
}

absl::Status SharedMemoryRegistry::Register(const RegionSpec& spec, bool peer_is_loopback) {
  if (!peer_is_loopback && !options_.allow_remote) {
    return absl::PermissionDeniedError(absl::StrCat(
        "shared memory region ", Quoted(spec.name),
        ": register from a peer that is not on this host; a region is a file of this host's "
        "/dev/shm (start the server with --shared_memory_allow_remote to allow it)"));
  }
  if (spec.name.empty() || spec.name.size() > kMaxRegionNameBytes ||
      spec.name.find('\0') != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("name ", Quoted(spec.name), ": expected 1 to ",
                                                   kMaxRegionNameBytes, " bytes, no NUL"));
  }
  if (absl::Status key = CheckShmKey(spec.key); !key.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("shared memory region ", Quoted(spec.name), ": ", key.message()));
  }
  if (spec.byte_size == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("shared memory region ", Quoted(spec.name), ": byte_size: expected >= 1"));
  }
  absl::MutexLock lock(&mu_);
  if (regions_.contains(spec.name)) {
    return absl::AlreadyExistsError(absl::StrCat("shared memory region ", Quoted(spec.name),
                                                 " is already registered; unregister it first"));
  }
  if (static_cast<int64_t>(regions_.size()) >= options_.max_regions) {
    return absl::ResourceExhaustedError(
        absl::StrCat("shared memory region ", Quoted(spec.name), ": ", regions_.size(),
                     " regions are registered, the most --shared_memory_max_regions allows"));
  }
  if (spec.byte_size > static_cast<uint64_t>(options_.max_bytes - bytes_)) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "shared memory region ", Quoted(spec.name), ": byte_size ", spec.byte_size, " with the ",
        bytes_, " bytes registered is more than --shared_memory_max_bytes ", options_.max_bytes));
  }
  const int fd = shm_open(spec.key.c_str(), O_RDWR, 0);
  if (fd < 0) {
    const int error = errno;
    return absl::InvalidArgumentError(absl::StrCat("shared memory region ", Quoted(spec.name),
                                                   ": key ", Quoted(spec.key),
                                                   ": cannot open it: ", Errno(error)));
  }
  struct stat st {};
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    close(fd);
    return absl::InvalidArgumentError(absl::StrCat("shared memory region ", Quoted(spec.name),
                                                   ": key ", Quoted(spec.key),
                                                   ": not a shared-memory file"));
  }
  if (st.st_uid != geteuid()) {
    close(fd);
    return absl::PermissionDeniedError(
        absl::StrCat("shared memory region ", Quoted(spec.name), ": key ", Quoted(spec.key),
                     ": owned by uid ", st.st_uid, ", not the server's uid ", geteuid(),
                     "; create it as the server's user (mode 0600)"));
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (!RangeFits(spec.offset, spec.byte_size, size)) {
    close(fd);
    return absl::InvalidArgumentError(absl::StrCat(
        "shared memory region ", Quoted(spec.name), ": offset ", spec.offset, " + byte_size ",
        spec.byte_size, " is beyond the ", size, " bytes of key ", Quoted(spec.key)));
  }
  regions_.emplace(spec.name, std::shared_ptr<const SharedMemoryRegion>(
                                  new SharedMemoryRegion(spec, fd, st.st_dev, st.st_ino)));
  bytes_ += static_cast<int64_t>(spec.byte_size);
  return absl::OkStatus();
}

void SharedMemoryRegistry::Unregister(absl::string_view name) {
  std::vector<std::shared_ptr<const SharedMemoryRegion>> dropped;  // closed outside the lock
  absl::MutexLock lock(&mu_);
  if (name.empty()) {
    for (auto& [unused, region] : regions_) dropped.push_back(std::move(region));
    regions_.clear();
    bytes_ = 0;
    return;
  }
  const auto it = regions_.find(name);
  if (it == regions_.end()) return;
  bytes_ -= static_cast<int64_t>(it->second->spec().byte_size);
  dropped.push_back(std::move(it->second));
  regions_.erase(it);
}

absl::StatusOr<std::vector<RegionSpec>> SharedMemoryRegistry::Status(absl::string_view name) const {
  std::vector<RegionSpec> out;
  absl::MutexLock lock(&mu_);
  if (name.empty()) {
    for (const auto& [unused, region] : regions_) out.push_back(region->spec());
    return out;
  }
  const auto it = regions_.find(name);
  if (it == regions_.end()) {
    return absl::NotFoundError(
        absl::StrCat("shared memory region ", Quoted(name), " is not registered"));
  }
  out.push_back(it->second->spec());
  return out;
}

absl::StatusOr<std::shared_ptr<const SharedMemoryRegion>> SharedMemoryRegistry::Find(
    absl::string_view name) const {
  absl::MutexLock lock(&mu_);
  const auto it = regions_.find(name);
  if (it == regions_.end()) {
    return absl::NotFoundError(
        absl::StrCat("shared memory region ", Quoted(name), " is not registered"));
  }
  return it->second;
}

const SharedMemoryRegistry* CurrentSharedMemory() { return current_registry; }

ScopedSharedMemory::ScopedSharedMemory(const SharedMemoryRegistry* registry)
    : previous_(current_registry) {
  current_registry = registry;
}

ScopedSharedMemory::~ScopedSharedMemory() { current_registry = previous_; }

}  // namespace mha::server

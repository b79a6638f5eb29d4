#include "server/serving/shared_memory.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "base/status_macros.h"
#include "server/serving/abbreviate.h"

namespace mha::server {
namespace {

thread_local const SharedMemoryRegistry* current_registry = nullptr;

std::string Quoted(absl::string_view s) { return absl::StrCat("\"", Abbreviate(s), "\""); }

std::string Errno(int error) { return std::strerror(error); }

// The mappings the SIGBUS handler may repair, one slot per mapped region. A slot is
// claimed (in_use) before its range is published and its range cleared before the
// mapping goes; the handler reads only atomics and calls only mmap and sigaction.
// begin is set first and cleared last, and the handler skips begin 0 and reads begin
// again after end, so that it never pairs one mapping's begin with another's end.
struct MappedSlot {
  std::atomic<bool> in_use{false};
  std::atomic<uintptr_t> begin{0}, end{0};
  std::atomic<uint64_t> faults{0};
};
MappedSlot mapped_slots[kMaxMappedRegions];
struct sigaction previous_sigbus;
std::once_flag sigbus_once;

void OnSigbus(int signal, siginfo_t* info, void* context) {
  const uintptr_t address = reinterpret_cast<uintptr_t>(info->si_addr);
  for (MappedSlot& slot : mapped_slots) {
    const uintptr_t begin = slot.begin.load(std::memory_order_acquire);
    if (begin == 0 || address < begin) continue;
    const uintptr_t end = slot.end.load(std::memory_order_acquire);
    // A begin that changed meanwhile: the slot was recycled; end may be another's.
    if (address >= end || slot.begin.load(std::memory_order_acquire) != begin) continue;
    // Zero pages over the whole mapping: the access is retried and reads zeros, and
    // no later access faults. The region is failed for every request naming it.
    slot.faults.fetch_add(1, std::memory_order_acq_rel);
    const size_t length = end - begin;
    if (mmap(reinterpret_cast<void*>(begin), length, PROT_READ | PROT_WRITE,
             MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) != MAP_FAILED) {
      return;
    }
    break;  // cannot repair: as if the fault were not ours
  }
  if (previous_sigbus.sa_flags & SA_SIGINFO) {
    previous_sigbus.sa_sigaction(signal, info, context);
  } else if (previous_sigbus.sa_handler != SIG_DFL && previous_sigbus.sa_handler != SIG_IGN) {
    previous_sigbus.sa_handler(signal);
  } else {
    // The default action: the access is retried and kills the process, as it would
    // have without this handler.
    struct sigaction fallback {};
    fallback.sa_handler = SIG_DFL;
    sigaction(SIGBUS, &fallback, nullptr);
  }
}

void InstallSigbusHandler() {
  std::call_once(sigbus_once, [] {
    struct sigaction action {};
    action.sa_sigaction = OnSigbus;
    action.sa_flags = SA_SIGINFO;
    sigemptyset(&action.sa_mask);
    sigaction(SIGBUS, &action, &previous_sigbus);
  });
}

// A free slot for [begin, end), or -1.
int ClaimSlot(uintptr_t begin, uintptr_t end) {
  for (int i = 0; i < kMaxMappedRegions; ++i) {
    bool expected = false;
    if (!mapped_slots[i].in_use.compare_exchange_strong(expected, true)) continue;
    mapped_slots[i].faults.store(0, std::memory_order_relaxed);
    mapped_slots[i].begin.store(begin, std::memory_order_release);
    mapped_slots[i].end.store(end, std::memory_order_release);
    return i;
  }
  return -1;
}

void ReleaseSlot(int i) {
  mapped_slots[i].end.store(0, std::memory_order_release);
  mapped_slots[i].begin.store(0, std::memory_order_release);
  mapped_slots[i].in_use.store(false, std::memory_order_release);
}

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

SharedMemoryRegion::SharedMemoryRegion(RegionSpec spec, int fd, dev_t device, ino_t inode,
                                       void* mapping, size_t mapped_bytes, uint64_t map_offset,
                                       int slot)
    : spec_(std::move(spec)),
      fd_(fd),
      device_(device),
      inode_(inode),
      mapping_(mapping),
      mapped_bytes_(mapped_bytes),
      map_offset_(map_offset),
      data_(static_cast<char*>(mapping) + (mapped_bytes - spec_.byte_size)),
      slot_(slot) {}

SharedMemoryRegion::~SharedMemoryRegion() {
  ReleaseSlot(slot_);
  munmap(mapping_, mapped_bytes_);
  close(fd_);
}

uint64_t SharedMemoryRegion::faults() const {
  return mapped_slots[slot_].faults.load(std::memory_order_acquire);
}

absl::Status SharedMemoryRegion::CheckNoFaultSince(uint64_t seen) const {
  if (faults() != seen) return Truncated("while a request used it");
  return absl::OkStatus();
}

absl::Status SharedMemoryRegion::Truncated(absl::string_view how) const {
  return absl::FailedPreconditionError(
      absl::StrCat("shared memory region ", Quoted(spec_.name), " (key ", Quoted(spec_.key),
                   "): the file was truncated ", how,
                   "; restore its size, then unregister the region and register it again"));
}

absl::Status SharedMemoryRegion::CheckIntact() const {
  struct stat st {};
  if (fstat(fd_, &st) != 0) return Truncated(absl::StrCat("(fstat: ", Errno(errno), ")"));
  // No overflow: the registered offset + byte_size fit in the file at register.
  if (static_cast<uint64_t>(st.st_size) < spec_.offset + spec_.byte_size) {
    return Truncated(absl::StrCat("to ", st.st_size, " bytes, below the region's [", spec_.offset,
                                  ", ", spec_.offset + spec_.byte_size, ")"));
  }
  const uint64_t faults_now = faults();
  absl::MutexLock lock(&repair_mu_);
  if (repaired_ == faults_now) return absl::OkStatus();
  // The file is whole again: its pages replace the handler's zeros at the same
  // addresses (requests still running over them fail by their fault count).
  if (mmap(mapping_, mapped_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd_,
           static_cast<off_t>(map_offset_)) == MAP_FAILED) {
    return Truncated(absl::StrCat("earlier, and cannot be mapped again: ", Errno(errno)));
  }
  repaired_ = faults_now;
  return absl::OkStatus();
}

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
  if (absl::Status intact = CheckIntact(); !intact.ok()) return intact;
  const uint64_t seen = faults();
  if (bytes > 0) std::memcpy(out, data_ + offset, bytes);
  return CheckNoFaultSince(seen);
}

absl::Status SharedMemoryRegion::Write(uint64_t offset, const void* data, uint64_t bytes) const {
  if (absl::Status in_range = CheckRange(offset, bytes); !in_range.ok()) return in_range;
  if (absl::Status intact = CheckIntact(); !intact.ok()) return intact;
  const uint64_t seen = faults();
  if (bytes > 0) std::memcpy(data_ + offset, data, bytes);
  return CheckNoFaultSince(seen);
}

namespace {

// What Register checks of a spec before it looks at the registry or the file.
absl::Status CheckSpec(const RegionSpec& spec, bool peer_is_loopback, bool allow_remote) {
  if (!peer_is_loopback && !allow_remote) {
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
  return absl::OkStatus();
}

// The spec's file, open read-write: a regular file of the server's uid that holds
// [offset, offset + byte_size).
struct OpenedFile {
  int fd;
  struct stat st;
};
absl::StatusOr<OpenedFile> OpenRegionFile(const RegionSpec& spec) {
  const int fd = shm_open(spec.key.c_str(), O_RDWR, 0);
  if (fd < 0) {
    const int error = errno;
    return absl::InvalidArgumentError(absl::StrCat("shared memory region ", Quoted(spec.name),
                                                   ": key ", Quoted(spec.key),
                                                   ": cannot open it: ", Errno(error)));
  }
  struct stat st {};
  absl::Status refused;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    refused = absl::InvalidArgumentError(absl::StrCat("shared memory region ", Quoted(spec.name),
                                                      ": key ", Quoted(spec.key),
                                                      ": not a shared-memory file"));
  } else if (st.st_uid != geteuid()) {
    refused = absl::PermissionDeniedError(
        absl::StrCat("shared memory region ", Quoted(spec.name), ": key ", Quoted(spec.key),
                     ": owned by uid ", st.st_uid, ", not the server's uid ", geteuid(),
                     "; create it as the server's user (mode 0600)"));
  } else if (!RangeFits(spec.offset, spec.byte_size, static_cast<uint64_t>(st.st_size))) {
    refused = absl::InvalidArgumentError(absl::StrCat(
        "shared memory region ", Quoted(spec.name), ": offset ", spec.offset, " + byte_size ",
        spec.byte_size, " is beyond the ", st.st_size, " bytes of key ", Quoted(spec.key)));
  }
  if (!refused.ok()) {
    close(fd);
    return refused;
  }
  return OpenedFile{fd, st};
}

}  // namespace

absl::Status SharedMemoryRegistry::Register(const RegionSpec& spec, bool peer_is_loopback) {
  MHA_RETURN_IF_ERROR(CheckSpec(spec, peer_is_loopback, options_.allow_remote));
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
  MHA_ASSIGN_OR_RETURN(const OpenedFile file, OpenRegionFile(spec));
  // Mapped from the page holding offset to the region's end.
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  const uint64_t map_offset = spec.offset - spec.offset % page;
  const size_t mapped_bytes = static_cast<size_t>(spec.offset - map_offset + spec.byte_size);
  InstallSigbusHandler();
  void* mapping = mmap(nullptr, mapped_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, file.fd,
                       static_cast<off_t>(map_offset));
  if (mapping == MAP_FAILED) {
    const int error = errno;
    close(file.fd);
    return absl::ResourceExhaustedError(absl::StrCat("shared memory region ", Quoted(spec.name),
                                                     ": cannot map its ", spec.byte_size,
                                                     " bytes: ", Errno(error)));
  }
  const uintptr_t begin = reinterpret_cast<uintptr_t>(mapping);
  const int slot = ClaimSlot(begin, begin + mapped_bytes);
  if (slot < 0) {
    munmap(mapping, mapped_bytes);
    close(file.fd);
    return absl::ResourceExhaustedError(
        absl::StrCat("shared memory region ", Quoted(spec.name), ": ", kMaxMappedRegions,
                     " regions are mapped (registered, or unregistered and still in use)"));
  }
  regions_.emplace(spec.name, std::shared_ptr<const SharedMemoryRegion>(new SharedMemoryRegion(
                                  spec, file.fd, file.st.st_dev, file.st.st_ino, mapping,
                                  mapped_bytes, map_offset, slot)));
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

// Triton's system shared memory extension, transport-free: the registry of POSIX
// shared-memory regions a co-located client registers, and the region arithmetic
// that inputs and outputs by region go through (server/kserve/inference_codec.h).
// The gRPC front (SystemSharedMemory{Status,Register,Unregister}) and the HTTP
// routes (server/kserve/shared_memory_answers.h) both call it. docs/service.md has
// the contract, docs/deploy.md how to deploy it.
//
//   SharedMemoryRegistry registry({.max_regions = 64, .max_bytes = int64_t{4} << 30});
//   registry.Register({.name = "in", .key = "/mha_in", .offset = 0, .byte_size = 4096},
//                     /*peer_is_loopback=*/true);
//   std::shared_ptr<const SharedMemoryRegion> in = registry.Find("in").value();
//   in->Read(/*offset=*/0, /*bytes=*/16, buffer);   // pread from the region's file
//   registry.Unregister("in");  // `in` stays usable until its last holder drops it
//
// How bytes move (a decision, measured in docs/performance.md): the registry maps
// each region (MAP_SHARED, read and write) when it is registered and keeps the
// descriptor shm_open gave. An input is read in place: the decoded request points
// into the mapping, its finite values are checked there at decode, and the core
// reads it again at compute time (a client that rewrites its region meanwhile
// changes its own answer, unchecked); a merged call copies it into the batch like
// any input. An aligned output ((region offset + tensor offset) % 4 == 0) is
// computed into the mapping; a misaligned one is computed into the request's own
// buffer and copied in once computed.
//
// A client may truncate its file under a mapping. Two guards keep the server up and
// the answer honest:
//   - each request checks, with one fstat per region it names, that the file still
//     holds the region when the request is decoded;
//   - a SIGBUS from a mapped page past the file's end (the truncation raced the
//     request) is caught by a process-wide handler (installed with the first
//     region) that maps zero pages over that region's whole mapping and counts a
//     fault on it; the faulting access is retried and reads zeros. Every request
//     records the region's fault count at decode and fails with FAILED_PRECONDITION
//     naming the region, "truncated", if it changed by the time it computed
//     (CheckNoFaultSince). The next request to find the file whole again maps it
//     back over the same addresses (CheckIntact), so a client that restores its
//     file's size needs no new register. A SIGBUS at any other address goes to the
//     handler that was there before (the default one kills the process, as
//     without ours).
// The handler finds the region in a fixed table of kMaxMappedRegions slots
// (lock-free, async-signal-safe); a mapping holds a slot until its last holder
// drops the region, registered or not.
//
// Safety (the register call's checks, in this order, the first failure answered):
//   peer      a peer that is not loopback: PERMISSION_DENIED (unless
//             allow_remote, --shared_memory_allow_remote)
//   name      1..256 bytes, no NUL: INVALID_ARGUMENT naming `name`
//   key       a POSIX shm name: one leading '/', no other '/', not "/." or "/..",
//             no NUL, at most 255 bytes: INVALID_ARGUMENT naming `key`
//   byte_size >= 1: INVALID_ARGUMENT naming `byte_size`
//   exists    a registered name: ALREADY_EXISTS naming the region (Triton's; HTTP 400)
//   limits    more than max_regions regions or max_bytes registered bytes in all:
//             RESOURCE_EXHAUSTED naming the flag
//   open      shm_open(key, O_RDWR) fails: INVALID_ARGUMENT naming `key` and errno
//   owner     not a regular file, or its st_uid is not the server's effective uid:
//             PERMISSION_DENIED naming `key` and both uids
//   bounds    offset + byte_size beyond the file's fstat size: INVALID_ARGUMENT
//             naming `offset`/`byte_size` and the size
//   map       mmap fails (address space), or kMaxMappedRegions regions are mapped:
//             RESOURCE_EXHAUSTED naming the region
// Unregistering an unknown name succeeds (Triton's); "" unregisters every region.
// Status of an unknown name is NOT_FOUND; "" lists every region, by name.
//
// Thread safety: thread-safe. A region (shared_ptr) outlives the registry's entry:
// requests in flight keep theirs until they finish.
#ifndef MHA_SERVER_SERVING_SHARED_MEMORY_H_
#define MHA_SERVER_SERVING_SHARED_MEMORY_H_

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace mha::server {

inline constexpr size_t kMaxRegionNameBytes = 256;
inline constexpr size_t kMaxShmKeyBytes = 255;  // NAME_MAX, the leading '/' included
// Regions mapped at once, registered or held by requests after their unregister.
inline constexpr int kMaxMappedRegions = 4096;

// What a register call names (Triton's SystemSharedMemoryRegisterRequest), and what
// status lists.
struct RegionSpec {
  std::string name;
  std::string key;
  uint64_t offset = 0;     // where the region starts in the file
  uint64_t byte_size = 0;  // its length
};

// One registered region: its mapping and the kept descriptor of its file. Offsets
// are relative to the region's start and bounded by its byte_size (checked again
// here: the caller's bounds are checked first, naming the request's fields).
class SharedMemoryRegion {
 public:
  ~SharedMemoryRegion();
  SharedMemoryRegion(const SharedMemoryRegion&) = delete;
  SharedMemoryRegion& operator=(const SharedMemoryRegion&) = delete;

  const RegionSpec& spec() const { return spec_; }
  // The file it lives in (st_dev, st_ino): two regions over one file overlap when
  // their absolute ranges do.
  dev_t device() const { return device_; }
  ino_t inode() const { return inode_; }

  // The region's byte_size bytes, mapped (the first at the file's spec().offset).
  // Reads and writes through it may fault if the client truncates the file: see
  // above; check CheckIntact() after using them.
  char* data() const { return data_; }
  // OK when the file holds the region (an fstat); a mapping a fault replaced with
  // zeros is then mapped back onto the file. Else FAILED_PRECONDITION naming the
  // region, "truncated".
  absl::Status CheckIntact() const;
  // Faults the SIGBUS handler repaired in this region so far (no system call).
  uint64_t faults() const;
  // FAILED_PRECONDITION naming the region, "truncated while a request used it", when
  // faults() is no longer `seen` (what a request read or wrote may be zeros).
  absl::Status CheckNoFaultSince(uint64_t seen) const;

  // CheckIntact(), then copies `bytes` bytes at `offset` of the region into `out`, or
  // from `data` to `offset` of the region; FAILED_PRECONDITION if a fault hit the
  // copy. INVALID_ARGUMENT for a range beyond the region.
  absl::Status Read(uint64_t offset, uint64_t bytes, void* out) const;
  absl::Status Write(uint64_t offset, const void* data, uint64_t bytes) const;

 private:
  friend class SharedMemoryRegistry;
  SharedMemoryRegion(RegionSpec spec, int fd, dev_t device, ino_t inode, void* mapping,
                     size_t mapped_bytes, uint64_t map_offset, int slot);
  absl::Status CheckRange(uint64_t offset, uint64_t bytes) const;
  absl::Status Truncated(absl::string_view how) const;

  const RegionSpec spec_;
  const int fd_;
  const dev_t device_;
  const ino_t inode_;
  void* const mapping_;        // page-aligned start of the mapping
  const size_t mapped_bytes_;  // its length
  const uint64_t map_offset_;  // its offset in the file
  char* const data_;           // the region's first byte in it
  const int slot_;             // in the SIGBUS handler's table
  mutable absl::Mutex repair_mu_;
  mutable uint64_t repaired_ ABSL_GUARDED_BY(repair_mu_) = 0;  // faults mapped back
};

struct SharedMemoryOptions {
  int64_t max_regions = 64;               // --shared_memory_max_regions
  int64_t max_bytes = int64_t{16} << 30;  // --shared_memory_max_bytes: registered in all
  bool allow_remote = false;              // --shared_memory_allow_remote
};

class SharedMemoryRegistry {
 public:
  explicit SharedMemoryRegistry(SharedMemoryOptions options) : options_(options) {}

  const SharedMemoryOptions& options() const { return options_; }

  // The checks above, then the region is registered under spec.name.
  absl::Status Register(const RegionSpec& spec, bool peer_is_loopback);
  // One region ("" = every one); unknown names succeed.
  void Unregister(absl::string_view name);
  // One region's spec ("" = every one, by name); NOT_FOUND naming an unknown name.
  absl::StatusOr<std::vector<RegionSpec>> Status(absl::string_view name) const;
  // The region registered under `name`, held for as long as the caller keeps it.
  // NOT_FOUND naming it when unknown.
  absl::StatusOr<std::shared_ptr<const SharedMemoryRegion>> Find(absl::string_view name) const;

 private:
  const SharedMemoryOptions options_;
  mutable absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<const SharedMemoryRegion>, std::less<>> regions_
      ABSL_GUARDED_BY(mu_);
  int64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

// INVALID_ARGUMENT naming `field` unless `key` is a POSIX shm name (above).
absl::Status CheckShmKey(absl::string_view key, absl::string_view field = "key");
// `offset` + `bytes` <= `size` without overflow.
bool RangeFits(uint64_t offset, uint64_t bytes, uint64_t size);
// Whether [a, a + a_bytes) and [b, b + b_bytes) share a byte (empty ranges share none).
bool RangesOverlap(uint64_t a, uint64_t a_bytes, uint64_t b, uint64_t b_bytes);
// Whether a peer, as gRPC writes it ("ipv4:127.0.0.1:5000", "ipv6:[::1]:5000",
// "unix:/path") or as a bare address ("127.0.0.1", "::1"), is on this host:
// 127.0.0.0/8, ::1, ::ffff:127.0.0.0/104, or a Unix socket.
bool IsLoopbackPeer(absl::string_view peer);

// The registry the current decode resolves regions in: set by RequestPath::Submit
// around its front's decode (server/serving/submit.h), so that any front's codec
// finds it without front code; nullptr when the server has none (--shared_memory=none)
// or outside a decode.
const SharedMemoryRegistry* CurrentSharedMemory();
class ScopedSharedMemory {
 public:
  explicit ScopedSharedMemory(const SharedMemoryRegistry* registry);
  ~ScopedSharedMemory();
  ScopedSharedMemory(const ScopedSharedMemory&) = delete;
  ScopedSharedMemory& operator=(const ScopedSharedMemory&) = delete;

 private:
  const SharedMemoryRegistry* previous_;
};

}  // namespace mha::server

#endif  // MHA_SERVER_SERVING_SHARED_MEMORY_H_

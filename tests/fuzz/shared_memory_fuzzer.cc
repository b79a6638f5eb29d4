// libFuzzer target (g): Triton's system shared memory, what a client controls:
// the HTTP register body (ParseRegisterBody), the key and peer checks, the region
// arithmetic, and a registry over one real shm file of this process registering
// the parsed spec and reading/writing fuzzed ranges of it.
// Input layout: bytes 0-15 are two little-endian uint64s (a read's offset and
// length within the region, lengths capped at 8192); byte 16 picks the key (even:
// the body's own key; odd: a real file made for the iteration, so that register gets
// past shm_open);
// the rest is the body, also tried as a key and as a peer.
// Checks: the arithmetic agrees with 128-bit sums; every refusal is a documented
// code with a message; an accepted key has the POSIX shape; a registered region
// lies within the file; a read succeeds exactly when its range fits the region and
// returns the bytes the file holds; nothing outlives the iteration.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "server/kserve/shared_memory_answers.h"
#include "server/serving/shared_memory.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

using mha::server::RegionSpec;
using mha::server::SharedMemoryRegistry;

constexpr size_t kFileBytes = 4096;

unsigned char Pattern(uint64_t at) { return static_cast<unsigned char>(at * 7 + 3); }

// A shm file of kFileBytes holding Pattern, under `key`; the caller unlinks it
// (once registered: the registry keeps its descriptor), so none outlives an iteration.
void MakeFile(const std::string& key) {
  const int fd = shm_open(key.c_str(), O_CREAT | O_TRUNC | O_RDWR, 0600);
  MHA_FUZZ_CHECK(fd >= 0);
  MHA_FUZZ_CHECK(ftruncate(fd, kFileBytes) == 0);
  static const std::vector<unsigned char> bytes = [] {
    std::vector<unsigned char> b(kFileBytes);
    for (size_t i = 0; i < kFileBytes; ++i) b[i] = Pattern(i);
    return b;
  }();
  MHA_FUZZ_CHECK(pwrite(fd, bytes.data(), kFileBytes, 0) == static_cast<ssize_t>(kFileBytes));
  close(fd);
}

uint64_t Load64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

bool Documented(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kNotFound:
    case absl::StatusCode::kResourceExhausted:
    case absl::StatusCode::kPermissionDenied:
    case absl::StatusCode::kAlreadyExists:
      return !status.message().empty();
    default:
      return false;
  }
}

void CheckArithmetic(uint64_t a, uint64_t a_bytes, uint64_t b, uint64_t b_bytes) {
  using u128 = unsigned __int128;
  MHA_FUZZ_CHECK(mha::server::RangeFits(a, a_bytes, b) == (u128{a} + a_bytes <= u128{b}));
  const bool overlap =
      a_bytes != 0 && b_bytes != 0 && u128{a} < u128{b} + b_bytes && u128{b} < u128{a} + a_bytes;
  MHA_FUZZ_CHECK(mha::server::RangesOverlap(a, a_bytes, b, b_bytes) == overlap);
  MHA_FUZZ_CHECK(mha::server::RangesOverlap(b, b_bytes, a, a_bytes) == overlap);
}

void CheckKey(absl::string_view key) {
  const absl::Status status = mha::server::CheckShmKey(key);
  const bool posix = key.size() >= 2 && key.size() <= 255 && key[0] == '/' &&
                     key.find('/', 1) == absl::string_view::npos &&
                     key.find('\0') == absl::string_view::npos && key != "/." && key != "/..";
  MHA_FUZZ_CHECK(status.ok() == posix, "key of %zu bytes\n", key.size());
  MHA_FUZZ_CHECK(status.ok() || status.code() == absl::StatusCode::kInvalidArgument);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 17) return 0;
  static const std::string file_key = absl::StrCat("/mha_shm_fuzz_", getpid());
  const uint64_t read_offset = Load64(data);
  const uint64_t read_bytes = Load64(data + 8) % 8193;
  const bool real_key = (data[16] & 1) != 0;
  const absl::string_view body(reinterpret_cast<const char*>(data + 17), size - 17);

  CheckArithmetic(read_offset, Load64(data + 8), Load64(data + 8) ^ read_offset, read_bytes);
  CheckKey(body);
  (void)mha::server::IsLoopbackPeer(body);

  absl::StatusOr<RegionSpec> spec = mha::server::ParseRegisterBody("fuzz", body);
  if (!spec.ok()) {
    MHA_FUZZ_CHECK(spec.status().code() == absl::StatusCode::kInvalidArgument &&
                       !spec.status().message().empty(),
                   "%s\n", spec.status().ToString().c_str());
    return 0;
  }
  CheckArithmetic(spec->offset, spec->byte_size, kFileBytes, read_bytes);
  if (real_key) {
    spec->key = file_key;
    MakeFile(file_key);
  }
  SharedMemoryRegistry registry({.max_regions = 4, .max_bytes = int64_t{1} << 40});
  const absl::Status registered = registry.Register(*spec, /*peer_is_loopback=*/true);
  if (real_key) shm_unlink(file_key.c_str());
  if (!registered.ok()) {
    MHA_FUZZ_CHECK(Documented(registered), "%s\n", registered.ToString().c_str());
  } else {
    MHA_FUZZ_CHECK(spec->byte_size >= 1);
    auto region = registry.Find("fuzz");
    MHA_FUZZ_CHECK(region.ok());
    std::vector<char> buffer(read_bytes);
    const absl::Status read = (*region)->Read(read_offset, read_bytes, buffer.data());
    const bool fits = mha::server::RangeFits(read_offset, read_bytes, spec->byte_size);
    if (!fits) MHA_FUZZ_CHECK(read.code() == absl::StatusCode::kInvalidArgument);
    if (read.ok()) {
      MHA_FUZZ_CHECK(fits);
      for (uint64_t i = 0; i < read_bytes; ++i) {
        MHA_FUZZ_CHECK(static_cast<unsigned char>(buffer[i]) ==
                       Pattern(spec->offset + read_offset + i));
      }
    }
    registry.Unregister("");
    MHA_FUZZ_CHECK(registry.Status("")->empty());
  }
  return 0;
}

// The system shared-memory registry (server/serving/shared_memory.h), its region
// arithmetic and the HTTP register body (server/kserve/shared_memory_answers.h),
// against real POSIX shared-memory files of this process.
#include "server/serving/shared_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "proto/inference/grpc_service.pb.h"
#include "server/kserve/shared_memory_answers.h"

namespace mha::server {
namespace {

// Whether `text` contains `part` (gmock is not linked).
bool Has(absl::string_view text, absl::string_view part) {
  return text.find(part) != absl::string_view::npos;
}

constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max();

// A shm file of `size` bytes (zeros), mode 0600, unlinked at the end of the test. A
// file of the same name may be there already: one a death test's child left (it dies
// before its destructors) under a process id now used again; it is emptied and taken.
class ShmFile {
 public:
  explicit ShmFile(size_t size, absl::string_view tag = "")
      : key_(absl::StrCat("/mha_shm_unit_", getpid(), "_", tag, "_", counter_++)) {
    fd_ = shm_open(key_.c_str(), O_CREAT | O_TRUNC | O_RDWR, 0600);
    EXPECT_GE(fd_, 0) << key_;
    EXPECT_EQ(ftruncate(fd_, static_cast<off_t>(size)), 0);
  }
  ~ShmFile() {
    close(fd_);
    shm_unlink(key_.c_str());
  }
  const std::string& key() const { return key_; }
  int fd() const { return fd_; }

 private:
  static inline int counter_ = 0;
  std::string key_;
  int fd_ = -1;
};

RegionSpec Spec(const std::string& name, const ShmFile& file, uint64_t offset, uint64_t bytes) {
  return {.name = name, .key = file.key(), .offset = offset, .byte_size = bytes};
}

TEST(SharedMemoryArithmeticTest, RangeFits) {
  EXPECT_TRUE(RangeFits(0, 0, 0));
  EXPECT_TRUE(RangeFits(0, 16, 16));
  EXPECT_TRUE(RangeFits(16, 0, 16));
  EXPECT_FALSE(RangeFits(1, 16, 16));
  EXPECT_FALSE(RangeFits(17, 0, 16));
  EXPECT_FALSE(RangeFits(kMax, 2, kMax));  // no wrap-around
  EXPECT_FALSE(RangeFits(2, kMax, kMax));
  EXPECT_TRUE(RangeFits(kMax - 1, 1, kMax));
}

TEST(SharedMemoryArithmeticTest, RangesOverlap) {
  EXPECT_FALSE(RangesOverlap(0, 16, 16, 16));  // adjacent
  EXPECT_FALSE(RangesOverlap(16, 16, 0, 16));
  EXPECT_TRUE(RangesOverlap(0, 17, 16, 16));
  EXPECT_TRUE(RangesOverlap(16, 16, 0, 17));
  EXPECT_TRUE(RangesOverlap(4, 1, 0, 16));  // inside
  EXPECT_TRUE(RangesOverlap(0, 16, 4, 1));
  EXPECT_FALSE(RangesOverlap(0, 0, 0, 16));  // empty ranges share nothing
  EXPECT_TRUE(RangesOverlap(kMax - 1, 1, 0, kMax));
  EXPECT_FALSE(RangesOverlap(kMax - 1, 1, 0, kMax - 1));
  EXPECT_TRUE(RangesOverlap(0, kMax, kMax - 1, kMax));  // ends past 2^64 do not wrap
}

TEST(SharedMemoryArithmeticTest, Keys) {
  EXPECT_TRUE(CheckShmKey("/a").ok());
  EXPECT_TRUE(CheckShmKey("/psm_1234abcd").ok());
  EXPECT_TRUE(CheckShmKey("/..a").ok());
  EXPECT_TRUE(CheckShmKey("/" + std::string(254, 'k')).ok());
  for (const std::string& bad :
       {std::string(""), std::string("a"), std::string("/"), std::string("//a"),
        std::string("/a/b"), std::string("/."), std::string("/.."), std::string("a/"),
        std::string("/a\0b", 4), "/" + std::string(255, 'k')}) {
    absl::Status status = CheckShmKey(bad);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_TRUE(Has(std::string(status.message()), "key ")) << bad;
  }
}

TEST(SharedMemoryArithmeticTest, LoopbackPeers) {
  for (const char* peer :
       {"ipv4:127.0.0.1:5000", "ipv4:127.3.2.1:1", "ipv6:[::1]:5000", "ipv6:[::ffff:127.0.0.1]:80",
        "unix:/tmp/s", "127.0.0.1", "::1", "[::1]", "unix-abstract:x"}) {
    EXPECT_TRUE(IsLoopbackPeer(peer)) << peer;
  }
  for (const char* peer : {"ipv4:192.0.2.2:5000", "ipv6:[fd00::2]:5000", "ipv6:[::ffff:10.0.0.1]:1",
                           "10.0.0.1", "", "ipv4:", "ipv6:::1", "garbage", "ipv4:128.0.0.1:1"}) {
    EXPECT_FALSE(IsLoopbackPeer(peer)) << peer;
  }
}

TEST(SharedMemoryRegistryTest, RegisterStatusUnregister) {
  ShmFile file(4096);
  SharedMemoryRegistry registry({});
  ASSERT_TRUE(registry.Register(Spec("b", file, 0, 4096), true).ok());
  ASSERT_TRUE(registry.Register(Spec("a", file, 1024, 1024), true).ok());
  absl::StatusOr<std::vector<RegionSpec>> all = registry.Status("");
  ASSERT_TRUE(all.ok());
  ASSERT_EQ(all->size(), 2u);
  EXPECT_EQ((*all)[0].name, "a");  // by name
  EXPECT_EQ((*all)[0].offset, 1024u);
  EXPECT_EQ((*all)[0].byte_size, 1024u);
  EXPECT_EQ((*all)[0].key, file.key());
  EXPECT_EQ((*all)[1].name, "b");

  absl::Status twice = registry.Register(Spec("a", file, 0, 16), true);
  EXPECT_EQ(twice.code(), absl::StatusCode::kAlreadyExists);
  EXPECT_TRUE(Has(std::string(twice.message()), "\"a\""));

  EXPECT_EQ(registry.Status("nope").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(registry.Find("nope").status().code(), absl::StatusCode::kNotFound);
  registry.Unregister("nope");  // succeeds, as in Triton
  registry.Unregister("a");
  EXPECT_EQ(registry.Status("a").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(registry.Status("")->size(), 1u);
  registry.Unregister("");
  EXPECT_TRUE(registry.Status("")->empty());
  // The bytes were given back: a region the size of the limit registers again.
  SharedMemoryRegistry small({.max_regions = 1, .max_bytes = 4096});
  ASSERT_TRUE(small.Register(Spec("x", file, 0, 4096), true).ok());
  small.Unregister("x");
  EXPECT_TRUE(small.Register(Spec("y", file, 0, 4096), true).ok());
}

TEST(SharedMemoryRegistryTest, Refusals) {
  ShmFile file(4096);
  SharedMemoryRegistry registry({.max_regions = 2, .max_bytes = 6000});
  auto expect = [&](const RegionSpec& spec, absl::StatusCode code, const std::string& names,
                    bool loopback = true) {
    absl::Status status = registry.Register(spec, loopback);
    EXPECT_EQ(status.code(), code) << status;
    EXPECT_TRUE(Has(std::string(status.message()), names)) << status;
  };
  expect(Spec("r", file, 0, 16), absl::StatusCode::kPermissionDenied,
         "--shared_memory_allow_remote", /*loopback=*/false);
  expect(Spec("", file, 0, 16), absl::StatusCode::kInvalidArgument, "name");
  expect(Spec(std::string(257, 'n'), file, 0, 16), absl::StatusCode::kInvalidArgument, "name");
  expect({.name = "r", .key = "/a/b", .byte_size = 16}, absl::StatusCode::kInvalidArgument,
         "key \"/a/b\"");
  expect({.name = "r", .key = "no_slash", .byte_size = 16}, absl::StatusCode::kInvalidArgument,
         "key");
  expect(Spec("r", file, 0, 0), absl::StatusCode::kInvalidArgument, "byte_size");
  expect({.name = "r", .key = "/mha_shm_unit_absent_key", .byte_size = 16},
         absl::StatusCode::kInvalidArgument, "cannot open");
  expect(Spec("r", file, 4000, 97), absl::StatusCode::kInvalidArgument, "offset 4000");
  expect(Spec("r", file, kMax, 2), absl::StatusCode::kInvalidArgument, "beyond");
  expect(Spec("r", file, 0, 7000), absl::StatusCode::kResourceExhausted,
         "--shared_memory_max_bytes");
  ASSERT_TRUE(registry.Register(Spec("r1", file, 0, 16), true).ok());
  ASSERT_TRUE(registry.Register(Spec("r2", file, 0, 16), true).ok());
  expect(Spec("r3", file, 0, 16), absl::StatusCode::kResourceExhausted,
         "--shared_memory_max_regions");
  EXPECT_EQ(registry.Status("")->size(), 2u);

  SharedMemoryRegistry remote({.allow_remote = true});
  EXPECT_TRUE(remote.Register(Spec("r", file, 0, 16), /*peer_is_loopback=*/false).ok());
}

TEST(SharedMemoryRegistryTest, RefusesAFileOfAnotherUser) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to give a file away";
  ShmFile file(4096);
  ASSERT_EQ(fchown(file.fd(), 65534, 65534), 0);
  SharedMemoryRegistry registry({});
  absl::Status status = registry.Register(Spec("theirs", file, 0, 16), true);
  EXPECT_EQ(status.code(), absl::StatusCode::kPermissionDenied) << status;
  EXPECT_TRUE(Has(std::string(status.message()), "uid 65534"));
  EXPECT_TRUE(Has(std::string(status.message()), file.key()));
}

TEST(SharedMemoryRegistryTest, ReadWriteAndTruncation) {
  ShmFile file(4096);
  SharedMemoryRegistry registry({});
  ASSERT_TRUE(registry.Register(Spec("r", file, 1000, 100), true).ok());
  std::shared_ptr<const SharedMemoryRegion> region = *registry.Find("r");
  const char hello[] = "hello";
  ASSERT_TRUE(region->Write(10, hello, 5).ok());
  char file_bytes[5] = {};
  ASSERT_EQ(pread(file.fd(), file_bytes, 5, 1010), 5);  // at the region's offset + 10
  EXPECT_EQ(std::string(file_bytes, 5), "hello");
  char back[5] = {};
  ASSERT_TRUE(region->Read(10, 5, back).ok());
  EXPECT_EQ(std::string(back, 5), "hello");
  // Beyond the region (not the file): refused, naming the region.
  EXPECT_EQ(region->Read(96, 5, back).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(region->Write(kMax, hello, 5).code(), absl::StatusCode::kInvalidArgument);

  // Unregistered, the region stays usable by its holder.
  registry.Unregister("r");
  ASSERT_TRUE(region->Read(10, 5, back).ok());

  // Truncated by the client: a failed request, never a signal; the file is not grown back.
  ASSERT_EQ(ftruncate(file.fd(), 1005), 0);
  absl::Status read = region->Read(0, 100, back);
  EXPECT_EQ(read.code(), absl::StatusCode::kFailedPrecondition) << read;
  EXPECT_TRUE(Has(std::string(read.message()), "truncated"));
  absl::Status written = region->Write(10, hello, 5);
  EXPECT_EQ(written.code(), absl::StatusCode::kFailedPrecondition) << written;
  struct stat st {};
  ASSERT_EQ(fstat(file.fd(), &st), 0);
  EXPECT_EQ(st.st_size, 1005);
}

TEST(SharedMemoryRegistryTest, TheRegionIsMappedInPlace) {
  ShmFile file(3 * 4096);
  SharedMemoryRegistry registry({});
  ASSERT_TRUE(registry.Register(Spec("m", file, 4100, 5000), true).ok());
  std::shared_ptr<const SharedMemoryRegion> region = *registry.Find("m");
  // The client's bytes are the region's, and the region's the client's.
  ASSERT_EQ(pwrite(file.fd(), "abc", 3, 4100), 3);
  EXPECT_EQ(std::string(region->data(), 3), "abc");
  std::memcpy(region->data() + 4999, "z", 1);
  char last = 0;
  ASSERT_EQ(pread(file.fd(), &last, 1, 4100 + 4999), 1);
  EXPECT_EQ(last, 'z');
  EXPECT_TRUE(region->CheckIntact().ok());
  EXPECT_EQ(region->faults(), 0u);
}

// A client truncates its file under the mapping and the server then touches a page
// past the new end: the SIGBUS handler maps zeros there and counts a fault; the
// process lives on, what saw the fault fails, and once the file is whole again the
// region maps it back.
TEST(SharedMemoryRegistryTest, AFaultPastTheTruncatedEndFailsItsUsersNotTheProcess) {
  ShmFile file(4 * 4096);
  SharedMemoryRegistry registry({});
  ASSERT_TRUE(registry.Register(Spec("t", file, 0, 4 * 4096), true).ok());
  ASSERT_TRUE(registry.Register(Spec("other", file, 0, 4096), true).ok());
  std::shared_ptr<const SharedMemoryRegion> region = *registry.Find("t");
  std::shared_ptr<const SharedMemoryRegion> other = *registry.Find("other");
  std::memset(region->data(), 7, 4 * 4096);
  const uint64_t seen = region->faults();
  ASSERT_EQ(ftruncate(file.fd(), 4096), 0);
  // Within the first page nothing faults; fstat sees the truncation.
  EXPECT_EQ(region->CheckIntact().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(region->faults(), seen);
  volatile char* past = region->data() + 2 * 4096 + 5;
  const char value = *past;  // SIGBUS, repaired
  EXPECT_EQ(value, 0);
  past[1] = 1;  // writable, and goes nowhere
  EXPECT_EQ(region->faults(), seen + 1);
  absl::Status status = region->CheckNoFaultSince(seen);
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
  EXPECT_TRUE(Has(std::string(status.message()), "while a request used it")) << status;
  EXPECT_TRUE(Has(std::string(status.message()), "\"t\"")) << status;
  EXPECT_EQ(region->CheckIntact().code(), absl::StatusCode::kFailedPrecondition);  // still short
  // The other region over the same file did not fault and is intact (its page stays).
  EXPECT_EQ(other->faults(), 0u);
  EXPECT_TRUE(other->CheckIntact().ok());
  EXPECT_EQ(other->data()[0], 7);
  // The client restores the size: the next check maps the file back, and the
  // region reads and writes the file's bytes again.
  ASSERT_EQ(ftruncate(file.fd(), 4 * 4096), 0);
  EXPECT_TRUE(region->CheckIntact().ok());
  const uint64_t after = region->faults();
  EXPECT_EQ(region->data()[0], 7);              // the page the truncation kept
  EXPECT_EQ(region->data()[2 * 4096 + 5], 0);   // the file's, zero-filled when regrown
  ASSERT_EQ(pwrite(file.fd(), "q", 1, 3 * 4096), 1);
  EXPECT_EQ(region->data()[3 * 4096], 'q');
  region->data()[4 * 4096 - 1] = 'z';
  char last = 0;
  ASSERT_EQ(pread(file.fd(), &last, 1, 4 * 4096 - 1), 1);
  EXPECT_EQ(last, 'z');
  EXPECT_TRUE(region->CheckNoFaultSince(after).ok());
}

// A SIGBUS at an address that is no region's still ends the process.
TEST(SharedMemoryRegistryDeathTest, AFaultOutsideEveryRegionIsNotSwallowed) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  ShmFile file(4096);
  SharedMemoryRegistry registry({});
  ASSERT_TRUE(registry.Register(Spec("r", file, 0, 4096), true).ok());  // the handler is in
  EXPECT_DEATH(
      {
        ShmFile mine(2 * 4096, "mine");
        void* map = mmap(nullptr, 2 * 4096, PROT_READ, MAP_SHARED, mine.fd(), 0);
        if (map == MAP_FAILED) std::abort();
        if (ftruncate(mine.fd(), 0) != 0) std::abort();
        // This process dies before its destructors: its names go now (the mappings stay).
        shm_unlink(mine.key().c_str());
        shm_unlink(file.key().c_str());
        volatile const char* p = static_cast<const char*>(map) + 4096;
        std::printf("%d", *p);
        std::exit(0);  // not reached
      },
      "");
}

TEST(SharedMemoryRegistryTest, CurrentIsScoped) {
  SharedMemoryRegistry a({}), b({});
  EXPECT_EQ(CurrentSharedMemory(), nullptr);
  {
    ScopedSharedMemory outer(&a);
    EXPECT_EQ(CurrentSharedMemory(), &a);
    {
      ScopedSharedMemory inner(&b);
      EXPECT_EQ(CurrentSharedMemory(), &b);
    }
    EXPECT_EQ(CurrentSharedMemory(), &a);
  }
  EXPECT_EQ(CurrentSharedMemory(), nullptr);
}

TEST(SharedMemoryAnswersTest, RegisterBody) {
  absl::StatusOr<RegionSpec> spec =
      ParseRegisterBody("r", R"({"key": "/k", "offset": 8, "byte_size": 16, "x": [1]})");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->name, "r");
  EXPECT_EQ(spec->key, "/k");
  EXPECT_EQ(spec->offset, 8u);
  EXPECT_EQ(spec->byte_size, 16u);
  EXPECT_EQ(ParseRegisterBody("r", R"({"key": "/k", "byte_size": 16})")->offset, 0u);
  EXPECT_EQ(
      ParseRegisterBody("r", R"({"key": "/k", "byte_size": 18446744073709551615})")->byte_size,
      kMax);
  for (const auto& [body, names] : std::vector<std::pair<std::string, std::string>>{
           {"", "invalid JSON"},
           {"{", "invalid JSON"},
           {"[]", "expected a JSON object"},
           {R"({"byte_size": 16})", "key: required"},
           {R"({"key": 5, "byte_size": 16})", "key: expected a string"},
           {R"({"key": "/k"})", "byte_size: required"},
           {R"({"key": "/k", "byte_size": "16"})", "byte_size: expected an integer >= 0"},
           {R"({"key": "/k", "byte_size": -1})", "byte_size: expected an integer >= 0"},
           {R"({"key": "/k", "byte_size": 1.5})", "byte_size: expected an integer >= 0"},
           {R"({"key": "/k", "byte_size": 16, "offset": null})", "offset: expected"},
           {R"({"key": "/k", "byte_size": 1e30})", "byte_size: expected"},
           {std::string("{\"key\": \"/k\"}\0", 14), "NUL"},
           {std::string(40, '[') + std::string(40, ']'), "nesting deeper than 32"}}) {
    absl::StatusOr<RegionSpec> refused = ParseRegisterBody("r", body);
    ASSERT_FALSE(refused.ok()) << body;
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << body;
    EXPECT_TRUE(Has(std::string(refused.status().message()), names)) << body;
  }
}

TEST(SharedMemoryAnswersTest, RoutesAnswer) {
  ShmFile file(64);
  SharedMemoryRegistry registry({});
  EXPECT_EQ(SharedMemoryStatusBody(nullptr, "").status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_EQ(SharedMemoryUnregister(nullptr, "").code(), absl::StatusCode::kUnimplemented);
  EXPECT_EQ(SharedMemoryRegisterBody(nullptr, "r", "{}", true).code(),
            absl::StatusCode::kUnimplemented);
  EXPECT_EQ(*SharedMemoryStatusBody(&registry, ""), "[]");
  const std::string body = absl::StrCat(R"({"key": ")", file.key(), R"(", "byte_size": 64})");
  ASSERT_TRUE(SharedMemoryRegisterBody(&registry, "r", body, true).ok());
  EXPECT_EQ(SharedMemoryRegisterBody(&registry, "r", body, true).code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(SharedMemoryRegisterBody(&registry, "s", body, false).code(),
            absl::StatusCode::kPermissionDenied);
  const nlohmann::json status = nlohmann::json::parse(*SharedMemoryStatusBody(&registry, "r"));
  EXPECT_EQ(status, nlohmann::json::parse(absl::StrCat(R"([{"name": "r", "key": ")", file.key(),
                                                       R"(", "offset": 0, "byte_size": 64}])")));
  EXPECT_EQ(SharedMemoryStatusBody(&registry, "s").status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(SharedMemoryUnregister(&registry, "s").ok());
  EXPECT_TRUE(SharedMemoryUnregister(&registry, "").ok());
  EXPECT_EQ(*SharedMemoryStatusBody(&registry, ""), "[]");
}

// Triton's field numbers, as its clients put them on the wire.
TEST(SharedMemoryAnswersTest, RegisterRequestWireFormat) {
  inference::SystemSharedMemoryRegisterRequest request;
  request.set_name("r");
  request.set_key("/k");
  request.set_offset(1);
  request.set_byte_size(2);
  EXPECT_EQ(request.SerializeAsString(), std::string("\x0a\x01r\x12\x02/k\x18\x01\x20\x02", 11));
  inference::SystemSharedMemoryStatusResponse status;
  auto& region = (*status.mutable_regions())["r"];
  region.set_name("r");
  region.set_key("/k");
  region.set_offset(1);
  region.set_byte_size(2);
  // regions = 1 (a map entry: key 1, value 2 holding RegionStatus fields 1-4).
  EXPECT_EQ(status.SerializeAsString(),
            std::string("\x0a\x10\x0a\x01r\x12\x0b\x0a\x01r\x12\x02/k\x18\x01\x20\x02", 18));
}

}  // namespace
}  // namespace mha::server

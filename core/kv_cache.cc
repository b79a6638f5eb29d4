#include "core/kv_cache.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>

#include "absl/strings/str_cat.h"

namespace mha::core {

namespace {

// A chunk is a mapping of its own, so that a released chunk beyond the pool's
// retain_ goes straight back to the system instead of fragmenting the heap. One of
// a huge page or more starts on a huge page's boundary and is advised as
// transparent huge pages (MADV_HUGEPAGE: Debian's default THP mode is `madvise`):
// a decode step streams its chunks, and with 4 KiB pages it takes a TLB miss every
// 4 KiB (docs/performance.md, "The cache on huge pages"). With THP `never` the
// advice changes nothing, and the chunk has small pages as before.
constexpr size_t kHugePage = size_t{2} << 20;

float* MapChunk(size_t bytes) {
  const size_t span = bytes >= kHugePage ? bytes + kHugePage : bytes;
  void* mapped = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (mapped == MAP_FAILED) return nullptr;
  if (span == bytes) return static_cast<float*>(mapped);
  // The span's head before the boundary and its tail after the chunk go back.
  char* start = static_cast<char*>(mapped);
  char* chunk = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(start) + kHugePage - 1) /
                                        kHugePage * kHugePage);
  if (chunk > start) munmap(start, static_cast<size_t>(chunk - start));
  // munmap of the chunk takes its last page whole.
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  if (char* end = chunk + (bytes + page - 1) / page * page; end < start + span) {
    munmap(end, static_cast<size_t>(start + span - end));
  }
  madvise(chunk, bytes, MADV_HUGEPAGE);
  return reinterpret_cast<float*>(chunk);
}

}  // namespace

KvCachePool::KvCachePool(int64_t budget_bytes, int64_t retain_bytes)
    : budget_(budget_bytes), retain_(retain_bytes) {}

KvCachePool::~KvCachePool() {
  absl::MutexLock lock(&mu_);
  for (auto& [bytes, blocks] : free_) {
    for (float* block : blocks) munmap(block, bytes);
  }
}

int64_t KvCachePool::used_bytes() const {
  absl::MutexLock lock(&mu_);
  return used_;
}

int64_t KvCachePool::retained_bytes() const {
  absl::MutexLock lock(&mu_);
  return retained_;
}

float* KvCachePool::Allocate(size_t bytes) {
  {
    absl::MutexLock lock(&mu_);
    if (used_ + static_cast<int64_t>(bytes) > budget_) return nullptr;
    used_ += static_cast<int64_t>(bytes);
    if (auto it = free_.find(bytes); it != free_.end() && !it->second.empty()) {
      float* block = it->second.back();
      it->second.pop_back();
      retained_ -= static_cast<int64_t>(bytes);
      return block;
    }
  }
  float* block = MapChunk(bytes);
  if (block == nullptr) {
    absl::MutexLock lock(&mu_);
    used_ -= static_cast<int64_t>(bytes);
  }
  return block;
}

void KvCachePool::Release(float* block, size_t bytes) {
  {
    absl::MutexLock lock(&mu_);
    used_ -= static_cast<int64_t>(bytes);
    if (retained_ + static_cast<int64_t>(bytes) <= retain_) {
      free_[bytes].push_back(block);
      retained_ += static_cast<int64_t>(bytes);
      return;
    }
  }
  munmap(block, bytes);
}

KvSequence::KvSequence(KvCachePool* pool, int64_t num_heads, int64_t head_size, bool bf16)
    : pool_(pool), num_heads_(num_heads), head_size_(head_size), bf16_(bf16) {}

KvSequence::~KvSequence() { ReleaseFrom(0); }

void KvSequence::ReleaseFrom(size_t first) {
  for (size_t b = first; b < blocks_.size(); b += static_cast<size_t>(blocks_[b].count)) {
    pool_->Release(blocks_[b].chunk, static_cast<size_t>(blocks_[b].count) * block_bytes());
  }
  blocks_.resize(first);
}

absl::Status KvSequence::Reserve(int64_t tokens) {
  constexpr int64_t kBt = KvCachePool::kBlockTokens;
  const int64_t want = size_ + tokens;
  const size_t first_new = blocks_.size();
  while (capacity() < want) {
    const int64_t held = static_cast<int64_t>(blocks_.size());
    const int64_t needed = (want - capacity() + kBt - 1) / kBt;
    int64_t count = std::max(needed, std::clamp<int64_t>(held, 1, KvCachePool::kChunkBlocks));
    float* chunk = pool_->Allocate(static_cast<size_t>(count) * block_bytes());
    if (chunk == nullptr && needed < count) {  // the blocks needed alone may fit
      count = needed;
      chunk = pool_->Allocate(static_cast<size_t>(count) * block_bytes());
    }
    if (chunk == nullptr) {
      const int64_t more = static_cast<int64_t>((blocks_.size() - first_new) + needed) *
                           static_cast<int64_t>(block_bytes());
      ReleaseFrom(first_new);
      return absl::ResourceExhaustedError(
          absl::StrCat("K/V cache budget: ", tokens, " more tokens need ", more,
                       " more bytes, and the cache's ", pool_->budget_bytes(), "-byte budget has ",
                       pool_->budget_bytes() - pool_->used_bytes(), " left"));
    }
    for (int64_t i = 0; i < count; ++i) {
      blocks_.push_back({chunk, static_cast<int32_t>(i), static_cast<int32_t>(count)});
    }
  }
  return absl::OkStatus();
}

}  // namespace mha::core

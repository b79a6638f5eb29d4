#include "core/kv_cache.h"

#include <sys/mman.h>

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace mha::core {

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
  // A mapping of its own, so that a released chunk beyond retain_ goes straight
  // back to the system instead of fragmenting the heap.
  void* block = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (block == MAP_FAILED) {
    absl::MutexLock lock(&mu_);
    used_ -= static_cast<int64_t>(bytes);
    return nullptr;
  }
  return static_cast<float*>(block);
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

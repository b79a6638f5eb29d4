#include "core/kv_cache.h"

#include <sys/mman.h>

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
  // A mapping of its own, so that a released block beyond retain_ goes straight
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

KvSequence::~KvSequence() {
  for (float* block : blocks_) pool_->Release(block, block_bytes());
}

absl::Status KvSequence::Reserve(int64_t tokens) {
  const int64_t want = size_ + tokens;
  const size_t first_new = blocks_.size();
  while (capacity() < want) {
    float* block = pool_->Allocate(block_bytes());
    if (block == nullptr) {
      const int64_t needed = static_cast<int64_t>((blocks_.size() - first_new + 1) * block_bytes());
      while (blocks_.size() > first_new) {
        pool_->Release(blocks_.back(), block_bytes());
        blocks_.pop_back();
      }
      return absl::ResourceExhaustedError(
          absl::StrCat("K/V cache budget: ", tokens, " more tokens need ", needed,
                       " more bytes, and the cache's ", pool_->budget_bytes(), "-byte budget has ",
                       pool_->budget_bytes() - pool_->used_bytes(), " left"));
    }
    blocks_.push_back(block);
  }
  return absl::OkStatus();
}

}  // namespace mha::core

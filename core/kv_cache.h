// The key/value cache of attention sessions: projected keys and values kept per
// head in fixed-size blocks, handed out by one pool under one byte budget.
//
// A block holds kBlockTokens tokens of one sequence, f32 (bf16 for a bf16 model's
// sequence: half the bytes): for each head, its keys transposed, (p, kBlockTokens),
// token r of the block in column r, so that a query's scores against a block
// vectorise across its keys; and its values, (kBlockTokens, p), token r in row r,
// stored in column panels of 256 bytes a row (kernels::ValueIndex) so that the
// context kernel reads them in one run.
// A sequence is a list of blocks; token t is column (row) t % kBlockTokens of block
// t / kBlockTokens. Nothing is padded to the longest sequence, and a sequence's
// last block is its only partly used one.
//
// Blocks come in chunks: a sequence's next chunk holds as many blocks as it already
// has, at least 1 and at most kChunkBlocks (1, 1, 2, 4, 8, 8, ... blocks as decode
// steps add them one at a time), or all the blocks one Reserve needs when that is more
// (a prefill's blocks in one chunk); only the blocks needed when the budget has room
// for no more. A chunk of n blocks is laid out head by head: head h's keys of its first
// block, that block's values, the keys of its second block, ..., then head h + 1. A
// decode step reads one head of every block in order (paged_pass.cc), so that each
// chunk gives it n x 2 x kBlockTokens x p elements in one run where blocks of their own
// gave it runs of kBlockTokens x p (measured in docs/performance.md, "Attention-only
// worker"; a prefill of 4,032 tokens of a Llama-3-8B layer gives each head one run of
// 126 blocks). A sequence holds at most kChunkBlocks - 1 blocks more than it needs, and
// at most twice what it needs when short.
//
// The pool keeps released chunks for reuse, up to `retain_bytes` of them, because
// first-touching fresh pages costs far more than the arithmetic of a decode step;
// beyond that it returns them to the system (chunks are their own mappings), so
// memory goes back once sessions end.
//
//   KvCachePool pool(/*budget_bytes=*/1 << 30);
//   KvSequence seq(&pool, /*num_heads=*/12, /*head_size=*/64);
//   absl::Status s = seq.Reserve(128);   // RESOURCE_EXHAUSTED over the budget
//   ... MultiHeadAttention::ForwardPaged writes rows size()..size()+127, Append(128)
//
// Thread safety: the pool is thread-safe; a KvSequence is used by one thread at a
// time (a session runs one step at a time).
#ifndef MHA_CORE_KV_CACHE_H_
#define MHA_CORE_KV_CACHE_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"

namespace mha::core {

class KvCachePool {
 public:
  // Tokens per block: 32 keeps a bert_base block at 192 KiB (keys and values of
  // 12 heads of 64) and a decode step's per-block overhead small next to its
  // 32 x p multiply-adds per head.
  static constexpr int64_t kBlockTokens = 32;
  // Blocks in a sequence's largest chunk (see above): 8 of a Llama-3-8B layer's
  // heads (G 8, d_h 128, f32) are 2 MiB.
  static constexpr int64_t kChunkBlocks = 8;

  explicit KvCachePool(int64_t budget_bytes, int64_t retain_bytes = int64_t{16} << 20);
  ~KvCachePool();
  KvCachePool(const KvCachePool&) = delete;
  KvCachePool& operator=(const KvCachePool&) = delete;

  int64_t budget_bytes() const { return budget_; }
  int64_t used_bytes() const;      // in blocks held by sequences
  int64_t retained_bytes() const;  // released, kept for reuse

 private:
  friend class KvSequence;
  // A zero-filled-or-reused chunk of `bytes`; nullptr when the budget would be
  // exceeded (or the system refuses memory).
  float* Allocate(size_t bytes);
  void Release(float* block, size_t bytes);

  const int64_t budget_;
  const int64_t retain_;
  mutable absl::Mutex mu_;
  int64_t used_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t retained_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<size_t, std::vector<float*>> free_ ABSL_GUARDED_BY(mu_);  // by chunk size
};

// One sequence's cached keys and values. Releases its chunks when destroyed.
class KvSequence {
 public:
  // `bf16`: elements are bfloat16 (uint16_t), else float.
  KvSequence(KvCachePool* pool, int64_t num_heads, int64_t head_size, bool bf16 = false);
  ~KvSequence();
  KvSequence(const KvSequence&) = delete;
  KvSequence& operator=(const KvSequence&) = delete;

  // Makes room for `tokens` more tokens after size(). RESOURCE_EXHAUSTED naming the
  // pool's budget when the blocks they need would exceed it (a chunk the budget
  // cannot hold whole shrinks to those blocks first); the sequence is then unchanged.
  absl::Status Reserve(int64_t tokens);
  // Tokens written (ForwardPaged writes rows size().. and then appends them).
  int64_t size() const { return size_; }
  int64_t capacity() const {
    return static_cast<int64_t>(blocks_.size()) * KvCachePool::kBlockTokens;
  }
  int64_t bytes() const { return static_cast<int64_t>(blocks_.size() * block_bytes()); }
  void Append(int64_t tokens) { size_ += tokens; }
  // Forgets the tokens from `tokens` on (at most size()); their blocks stay reserved
  // and the next steps write over them: steps undone (the decode benches hold a
  // session at one context this way).
  void Truncate(int64_t tokens) { size_ = std::clamp<int64_t>(tokens, 0, size_); }

  int64_t num_heads() const { return num_heads_; }
  int64_t head_size() const { return head_size_; }
  bool bf16() const { return bf16_; }
  // Block b's keys of head h, (p, kBlockTokens) transposed; its values,
  // (kBlockTokens, p) in column panels, right after them. T is float, or uint16_t for a bf16
  // sequence.
  template <typename T>
  T* keys(int64_t b, int64_t h) const {
    const Block& block = blocks_[b];
    return reinterpret_cast<T*>(block.chunk) +
           (h * block.count + block.index) * 2 * KvCachePool::kBlockTokens * head_size_;
  }
  template <typename T>
  T* values(int64_t b, int64_t h) const {
    return keys<T>(b, h) + KvCachePool::kBlockTokens * head_size_;
  }

 private:
  // Block `index` of a chunk of `count` blocks at `chunk`.
  struct Block {
    float* chunk;
    int32_t index, count;
  };
  size_t block_bytes() const {
    return static_cast<size_t>(2 * num_heads_ * KvCachePool::kBlockTokens * head_size_) *
           (bf16_ ? 2 : 4);
  }
  // Gives back the chunks of blocks_[first..]; blocks_ keeps those before.
  void ReleaseFrom(size_t first);

  KvCachePool* const pool_;
  const int64_t num_heads_, head_size_;
  const bool bf16_;
  std::vector<Block> blocks_;  // chunks start at blocks with index 0
  int64_t size_ = 0;
};

}  // namespace mha::core

#endif  // MHA_CORE_KV_CACHE_H_

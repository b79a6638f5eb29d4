// oneDNN matmul plumbing of the attention layer: the CPU engine, primitives with a
// caller-owned scratchpad, a per-thread argument binder, cached primitives, and
// Linear, a weight matrix applied with a cached matmul.
//
// Internal to core/: not part of the public API. Only core/*.cc include it; the
// server and the client never see oneDNN types.
//
// Worked example, projecting 2 batch rows of the first 3 of 4 tokens each, d = 8
// input features into p_o = 16 outputs, row-major f32:
//   Linear w(w_data, /*b=*/nullptr, /*n=*/16, /*k=*/8, Dt::f32);
//   Bindings args;                   // one per thread
//   dnnl::stream stream(CpuEngine());
//   w.Run(stream, args, /*batch=*/2, /*rows=*/3,
//         {.data = x, .row_stride = 8, .batch_stride = 4 * 8},     // x (2, 4, 8)
//         {.data = y, .row_stride = 16, .batch_stride = 4 * 16},   // y (2, 4, 16)
//         Dt::f32);                  // y[b, r, :] = x[b, r, :] W^T for r < 3
//   stream.wait();
#ifndef MHA_CORE_MATMUL_H_
#define MHA_CORE_MATMUL_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "oneapi/dnnl/dnnl.hpp"

namespace mha::core::internal {

using Dt = dnnl::memory::data_type;

// The process-wide CPU engine; created on first use, never destroyed.
dnnl::engine& CpuEngine();

// Bytes per element of the types used here: s8, bf16, or f32 and s32.
inline size_t SizeOf(Dt dt) { return dt == Dt::s8 ? 1 : dt == Dt::bf16 ? 2 : 4; }

// Whether oneDNN makes bf16 matmuls on this CPU (oneDNN 2.7: AVX-512 and up). Where
// it does not, bf16 and int8 models run their bf16 GEMMs in f32 (docs/core.md).
bool Bf16MatmulsSupported();

// The threads a primitive created here and now is planned for: oneDNN runs inline
// inside a parallel region, else on this thread's omp_get_max_threads(). Part of every
// primitive cache key, because a call's thread count follows its size.
int64_t PlanThreads();

// A matmul with a caller-owned scratchpad. Debian's oneDNN is built with
// DNNL_ENABLE_CONCURRENT_EXEC, where a library-managed scratchpad belongs to the
// primitive, so one primitive run from two threads at once would share it. With
// scratchpad_mode::user every execution brings its own, and primitives are safe to
// share between threads. Copies are handles to the same primitive.
struct Matmul {
  dnnl::matmul prim;
  dnnl::memory::desc weights;  // the layout the primitive chose (for format_tag::any)
  dnnl::memory::desc scratchpad;

  static Matmul Make(const dnnl::matmul::desc& desc, dnnl::primitive_attr attr);
};

// Matmul primitives made by this process so far (Matmul::Make calls): what tests
// read to show that a warmed model builds none for a new request shape.
int64_t MatmulsMade();

// Matmuls keyed by the caller's description of the shape. Bounded: when full it
// starts over. Thread-safe.
class MatmulCache {
 public:
  using Key = std::array<int64_t, 5>;

  std::optional<Matmul> Find(const Key& key) const;
  // Builds the primitive (outside the lock) and caches it; if another thread added
  // the key meanwhile, returns that one.
  Matmul Add(const Key& key, const dnnl::matmul::desc& desc, const dnnl::primitive_attr& attr);

 private:
  mutable absl::Mutex mu_;
  absl::flat_hash_map<Key, Matmul> cache_ ABSL_GUARDED_BY(mu_);
};

// The arguments of one thread's GEMMs. A memory object is made once per (argument,
// shape) and re-pointed with set_data_handle afterwards, so a GEMM costs no
// allocation: with tiny blocks the allocations cost more than the math.
// Not thread-safe: one per thread.
class Bindings {
 public:
  // A 2-D plain operand (rows, cols) with row stride `ld` (or column-major when
  // `transposed`), element type `dt`, at `ptr`.
  void Bind(int arg, int64_t rows, int64_t cols, int64_t ld, bool transposed, Dt dt,
            const void* ptr);
  // Any operand, keyed by argument and descriptor (for the projections' 2-D and 3-D
  // views). The argument is part of the key: src and dst often share a descriptor.
  void Bind(int arg, const dnnl::memory::desc& md, const void* ptr);
  void Set(int arg, const dnnl::memory& mem) { args_[arg] = mem; }
  void Erase(int arg) {
    if (args_.contains(arg)) args_.erase(arg);
  }

  // Runs `m` on the bound arguments and this binder's scratchpad.
  void Execute(const Matmul& m, dnnl::stream& stream);

  // An int8 Linear's per-call buffers: a chunk's quantized rows, their scales and
  // its int32 sums. Kept here, with the thread's other GEMM state, so that they are
  // touched once and reused.
  struct Int8Chunk {
    std::vector<int8_t> rows;
    std::vector<float> scales;
    std::vector<int32_t> sums;
  };
  Int8Chunk& int8_chunk() { return int8_chunk_; }
  // A Linear's share of the columns, computed densely before it is copied out.
  std::vector<char>& columns() { return columns_; }

 private:
  struct Described {
    int arg;
    dnnl::memory::desc md;
    dnnl::memory mem;
  };

  absl::flat_hash_map<std::array<int64_t, 6>, dnnl::memory> memories_;
  std::vector<Described> described_;
  std::unordered_map<int, dnnl::memory> args_;
  std::vector<char> scratchpad_;
  Int8Chunk int8_chunk_;
  std::vector<char> columns_;
};

// One operand of a batched projection: `batch` row-major matrices, where row r of
// matrix bi starts (bi * batch_stride + r * row_stride) elements after `data`.
// T is `const void` or `const char` for what is read, `void` for what is written.
template <typename T>
struct StridedOperand {
  T* data = nullptr;
  int64_t row_stride = 0;    // elements from one row to the next
  int64_t batch_stride = 0;  // elements from one matrix to the next
};

// Where Linear::RunSegments puts its n columns: in segments of `width` columns,
// segment s of call row r (batch matrix r / rows_per_batch, row r % rows_per_batch in
// it) starting segments[s].data + (batch matrix * batch_stride + row * row_stride)
// elements in.
struct ColumnSegments {
  struct Segment {
    void* data = nullptr;
    int64_t row_stride = 0;
    int64_t batch_stride = 0;
  };
  int64_t width = 0;
  int64_t rows_per_batch = 1;
  std::vector<Segment> segments;  // n / width of them
};

// The row counts a projection's primitives are built for (docs/warm_start.md): a call
// of `rows` rows runs as chunks of these, largest first: 1024-row chunks, then a
// multiple of 128, then a multiple of 16, then the remainder (1..15 rows) as itself.
// So no row count past warm-up builds a primitive, except remainders below 16.
// An int8 Linear's chunks stop at kInt8RowChunkMax rows: each chunk's int32 sums
// are rescaled after its GEMM, while they are still in cache.
constexpr int64_t kRowChunkMax = 1024;
constexpr int64_t kInt8RowChunkMax = 128;
inline int64_t RowChunk(int64_t rows, int64_t most = kRowChunkMax) {
  if (rows >= most) return most;
  if (rows >= 128) return rows / 128 * 128;
  if (rows >= 16) return rows / 16 * 16;
  return rows;
}
// The chunks RowChunk makes of calls of up to max_rows rows, remainders aside: 16, 32,
// ..., 128, 256, ..., up to max_rows and `most` (the row counts Prepare builds for).
inline std::vector<int64_t> RowChunkSizes(int64_t max_rows, int64_t most = kRowChunkMax) {
  std::vector<int64_t> sizes;
  for (int64_t m = 16; m <= max_rows && m <= most; m += m < 128 ? 16 : 128) sizes.push_back(m);
  return sizes;
}

// A weight matrix W (n, k) applied as dst = src W^T (+ b) with a oneDNN matmul.
// Primitives are built once per (row chunk, row strides, dtype, threads) and cached;
// the weights are reordered once into each blocked layout a primitive asks for.
// An s8 Linear (int8 models) holds W quantized, symmetric, one scale per output
// feature (row of W). Each call quantizes its f32 src rows the same way, one scale
// per row, runs an s8 x s8 -> s32 GEMM, and rescales the sums by both scales and adds
// the f32 bias (kernels::DequantizeRows): oneDNN 2.6's brgemm takes neither per-row
// scales nor runtime scales (either falls back to a reference or a slower kernel;
// docs/core.md, "int8 models").
// An f32 Linear made with `row_path` also keeps W packed in panels (kernels::PanelRows,
// another n * k floats) for RunRows: a few rows, hand-written, on the calling thread's
// OpenMP team, for decode steps, where oneDNN's GEMM takes longer than streaming the
// weights (docs/performance.md, "Sessions").
// Thread-safe.
class Linear {
 public:
  // w: (n, k) row-major f32, b: (n) or nullptr; both copied. dt: the type the
  // matmul reads src and W in (W is converted once), or s8: W quantized, src f32
  // (quantized per row at each call).
  Linear(const float* w, const float* b, int64_t n, int64_t k, Dt dt, bool row_path = false);

  // dst[bi, r, :] = src[bi, r, :] W^T + b for bi < batch, r < rows. src is in the
  // constructor's dt (f32 for s8), dst in dst_dt. Each batch matrix runs as 2-D GEMMs over its
  // rows in RowChunk pieces, so the primitives depend on neither batch nor rows.
  void Run(dnnl::stream& stream, Bindings& args, int64_t batch, int64_t rows,
           StridedOperand<const void> src, StridedOperand<void> dst, Dt dst_dt) const;

  // An s8 Linear's Run of `rows` f32 rows (row stride src_ld) into dst's segments
  // (dst_dt bf16 or f32): each chunk's sums are rescaled straight into a layout that
  // is not one row-major matrix (an int8 model's head-major Q, K, V: ProjectIntoHeads).
  void RunSegments(dnnl::stream& stream, Bindings& args, int64_t rows, const float* src,
                   int64_t src_ld, const ColumnSegments& dst, Dt dst_dt) const;

  // Builds the primitives Run would use for every chunk of 16..max_rows rows (every
  // multiple of 16 up to 128, of 128 up to kRowChunkMax) at these row strides and the
  // calling thread's PlanThreads(), and packs the weights for them; for the output
  // columns [n0, n1) alone (RunColumns), or all of them (n1 < 0). Returns how many it
  // built.
  int Prepare(int64_t max_rows, int64_t src_ld, int64_t dst_ld, Dt dst_dt, int64_t n0 = 0,
              int64_t n1 = -1) const;

  // Run's 2-D case for the output columns [n0, n1) alone: dst[r, n0:n1] =
  // src[r, :] W[n0:n1, :]^T + b[n0:n1], for one thread of a team that shares out a
  // small call's columns (ForwardOneRegion). Each thread then reads its share of W
  // alone, which stays in its core's cache from call to call. Not for s8. The
  // columns are computed into a dense buffer (Bindings::columns) and copied to dst.
  // The primitive reads its columns in place in W's packed layout when that layout
  // keeps each block of columns contiguous and n0 starts a block (oneDNN 2.6's brgemm
  // layouts for f32 and bf16 do, in blocks of kColumnBlock); otherwise it packs its
  // own copy of those columns.
  static constexpr int64_t kColumnBlock = 64;
  void RunColumns(dnnl::stream& stream, Bindings& args, int64_t rows,
                  StridedOperand<const void> src, StridedOperand<void> dst, Dt dst_dt, int64_t n0,
                  int64_t n1) const;

  // RunColumns of the n columns [n0, n0 + n), for a caller that runs many such blocks
  // as tasks on its team (an attention head's Q, K or V columns: ProjectHeadColumns).
  // One primitive per row chunk serves every n0: it is built for the columns [0, n)
  // and reads the others at their offset in W's packed layout, when that layout's
  // column blocks divide n0 (else these columns are packed on their own, as in
  // RunColumns). A dst with row stride n is written in place.
  void RunColumnBlock(dnnl::stream& stream, Bindings& args, int64_t rows,
                      StridedOperand<const void> src, StridedOperand<void> dst, Dt dst_dt,
                      int64_t n0, int64_t n) const;
  // Builds what RunColumnBlock uses for blocks of n columns at every multiple of n, as
  // Prepare does for Run: the primitives for [0, n), and for each other block that
  // W's packed layout does not let them serve (a layout chosen per CPU). Returns how
  // many it built.
  int PrepareColumnBlocks(int64_t max_rows, int64_t src_ld, int64_t n, Dt dst_dt) const;

  // y (m, n) = x (m, k) W^T + b for f32 rows at strides ldx and ldy, split by panels
  // over omp_get_max_threads() threads. Only when has_row_path(m): made with
  // `row_path`, and 1 <= m <= kRowPathRows. Up to three rows take the time of one
  // (reading the weights); from four on oneDNN's GEMM, which computes closer to the
  // cores' peak, is faster (docs/performance.md, "Sessions").
  // An s8 Linear made with `row_path` on a CPU with AVX-512 VNNI keeps W in int8
  // panels instead (kernels::Int8PanelRows, n * k bytes) and runs the rows quantized.
  static constexpr int64_t kRowPathRows = 3;
  bool has_row_path(int64_t m) const {
    return (!panels_.empty() || !int8_panels_.empty()) && m >= 1 && m <= kRowPathRows;
  }
  void RunRows(const float* x, int64_t ldx, int64_t m, float* y, int64_t ldy) const;
  // RunRows' part `part` of `parts` (that share of the panels) on the calling thread,
  // for a caller already on a team (a decode step's one region: RunPhases).
  void RunRowsPart(const float* x, int64_t ldx, int64_t m, float* y, int64_t ldy, int part,
                   int parts) const;

 private:
  using Key = std::array<int64_t, 7>;  // rows, src_ld, dst_ld, dst dtype, threads, n0, n1
  struct Entry {
    Matmul matmul;
    dnnl::memory::desc src_md, dst_md, bias_md;
    dnnl::memory weights;  // read-only, shared by every call
    // When `weights` is a view into the whole matrix's packing: its column blocks'
    // width and the bytes from one to the next (else 0), so that the same primitive
    // reads any other block-aligned columns at an offset (RunColumnBlock).
    int64_t col_block = 0;
    int64_t col_block_bytes = 0;
  };

  // Entries are shared so that a cache reset never frees one a caller still runs.
  // `built` (if given) is set when this call made the entry.
  std::shared_ptr<const Entry> Lookup(const Key& key, bool* built = nullptr) const;
  // The largest chunk a call runs: kInt8RowChunkMax for s8, else kRowChunkMax.
  int64_t ChunkMax() const { return dt_ == Dt::s8 ? kInt8RowChunkMax : kRowChunkMax; }
  // Prepare for one chunk of `rows` rows: 1 if it built its primitive.
  int PrepareRows(int64_t rows, int64_t src_ld, int64_t dst_ld, Dt dst_dt, int64_t n0,
                  int64_t n1) const;
  // A chunk of an s8 Linear's call: `rows` f32 rows from src, into dst (row stride
  // dst_ld), or into `segments` as rows row0.. of the call.
  struct Int8Rows {
    int64_t rows = 0;
    const float* src = nullptr;
    char* dst = nullptr;
    int64_t dst_ld = 0;
    const ColumnSegments* segments = nullptr;
    int64_t row0 = 0;
  };
  // Run of an s8 Linear over its chunks, and one chunk with its quantization and
  // rescaling split over `parts` threads.
  void RunInt8(dnnl::stream& stream, Bindings& args, const std::vector<Int8Rows>& chunks,
               int64_t src_ld, Dt dst_dt) const;
  void RunInt8Chunk(dnnl::stream& stream, Bindings& args, int parts, const Int8Rows& c,
                    int64_t src_ld, Dt dst_dt) const;
  // The primitive key of a chunk of `rows` rows: an s8 Linear's GEMM reads and
  // writes dense buffers of its own whatever the caller's strides.
  Key KeyOf(int64_t rows, int64_t src_ld, int64_t dst_ld, Dt dst_dt, int64_t n0 = 0,
            int64_t n1 = -1) const;
  // One row chunk of `m` rows through e, for RunDense and RunColumnBlock: src at
  // `src`, the n columns from n0 to `dst` (row stride dst_ld), straight when
  // `in_place` (e writes that layout), else through Bindings::columns(); W at
  // `weights` (a view at another column block, bound by pointer) or e.weights (null).
  void RunChunk(dnnl::stream& stream, Bindings& args, const Entry& e, int64_t m, int64_t n0,
                int64_t n, const char* src, char* dst, int64_t dst_ld, size_t dst_size,
                bool in_place, const char* weights) const;
  // Run's f32/bf16 path over the output columns [n0, n1).
  void RunDense(dnnl::stream& stream, Bindings& args, int64_t batch, int64_t rows,
                StridedOperand<const void> src, StridedOperand<void> dst, Dt dst_dt, int64_t n0,
                int64_t n1) const;
  // The weights of a primitive over the columns [n0, n1) whose layout is `want`
  // (k, n1 - n0): a view into the whole matrix's packing in the same layout, or a
  // packing of their own.
  // A view sets e's col_block and col_block_bytes.
  dnnl::memory ColumnWeights(const dnnl::memory::desc& want, int64_t n0, int64_t n1, Entry& e) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The weights reordered into `want`, made once per distinct layout.
  dnnl::memory PackedWeights(const dnnl::memory::desc& want, const dnnl::memory::desc& plain) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const int64_t n_, k_;
  const Dt dt_;
  std::vector<char> plain_;  // W (n, k) row-major in dt_
  std::vector<float> bias_;
  std::vector<float> col_scales_;     // s8: W[i, :] = plain_[i, :] * col_scales_[i]
  std::vector<float> panels_;         // W in RunRows' panels, or empty
  std::vector<int8_t> int8_panels_;   // s8: W in Int8PanelRows' panels, or empty
  std::vector<int32_t> column_sums_;  // s8: each panel column's sum of weights
  mutable absl::Mutex mu_;
  mutable absl::flat_hash_map<Key, std::shared_ptr<const Entry>> cache_ ABSL_GUARDED_BY(mu_);
  mutable std::vector<std::pair<dnnl::memory::desc, dnnl::memory>> packed_ ABSL_GUARDED_BY(mu_);
  // ColumnWeights' own packings, by first column and layout.
  mutable std::vector<std::tuple<int64_t, dnnl::memory::desc, dnnl::memory>> column_packed_
      ABSL_GUARDED_BY(mu_);
};

}  // namespace mha::core::internal

#endif  // MHA_CORE_MATMUL_H_

#include "core/matmul.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <optional>

#include "core/kernels.h"

namespace mha::core::internal {
namespace {

using dnnl::memory;

// Primitive caches are bounded: when one grows past this, it starts over. Shapes
// repeat in serving (the batcher pads to few sizes), so this almost never fires.
constexpr size_t kMaxCachedPrimitives = 1024;

std::atomic<int64_t> matmuls_made{0};

}  // namespace

int64_t MatmulsMade() { return matmuls_made.load(std::memory_order_relaxed); }

dnnl::engine& CpuEngine() {
  static dnnl::engine* engine = new dnnl::engine(dnnl::engine::kind::cpu, 0);
  return *engine;
}

bool Bf16MatmulsSupported() {
  static const bool supported = [] {
    using memory = dnnl::memory;
    const memory::desc a({16, 16}, Dt::bf16, memory::format_tag::ab);
    try {
      dnnl::matmul::primitive_desc(
          dnnl::matmul::desc(a, a, memory::desc({16, 16}, Dt::f32, memory::format_tag::ab)),
          CpuEngine());
      return true;
    } catch (const dnnl::error&) {
      return false;
    }
  }();
  return supported;
}

int64_t PlanThreads() { return omp_in_parallel() ? 1 : omp_get_max_threads(); }

Matmul Matmul::Make(const dnnl::matmul::desc& desc, dnnl::primitive_attr attr) {
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  matmuls_made.fetch_add(1, std::memory_order_relaxed);
  dnnl::matmul::primitive_desc pd(desc, attr, CpuEngine());
  return {dnnl::matmul(pd), pd.weights_desc(), pd.scratchpad_desc()};
}

std::optional<Matmul> MatmulCache::Find(const Key& key) const {
  absl::ReaderMutexLock lock(&mu_);
  auto it = cache_.find(key);
  if (it == cache_.end()) return std::nullopt;
  return it->second;
}

Matmul MatmulCache::Add(const Key& key, const dnnl::matmul::desc& desc,
                        const dnnl::primitive_attr& attr) {
  Matmul prim = Matmul::Make(desc, attr);
  absl::MutexLock lock(&mu_);
  if (cache_.size() >= kMaxCachedPrimitives) cache_.clear();
  return cache_.try_emplace(key, prim).first->second;  // a handle: copies share it
}

void Bindings::Bind(int arg, int64_t rows, int64_t cols, int64_t ld, bool transposed, Dt dt,
                    const void* ptr) {
  const std::array<int64_t, 6> key{arg, rows, cols, ld, transposed, static_cast<int64_t>(dt)};
  auto it = memories_.find(key);
  if (it == memories_.end()) {
    const memory::dims strides = transposed ? memory::dims{1, ld} : memory::dims{ld, 1};
    it = memories_
             .emplace(key, memory(memory::desc({rows, cols}, dt, strides), CpuEngine(),
                                  const_cast<void*>(ptr)))
             .first;
  } else {
    it->second.set_data_handle(const_cast<void*>(ptr));
  }
  args_[arg] = it->second;
}

void Bindings::Bind(int arg, const memory::desc& md, const void* ptr) {
  for (auto& d : described_) {
    if (d.arg == arg && d.md == md) {
      d.mem.set_data_handle(const_cast<void*>(ptr));
      args_[arg] = d.mem;
      return;
    }
  }
  described_.push_back({arg, md, memory(md, CpuEngine(), const_cast<void*>(ptr))});
  args_[arg] = described_.back().mem;
}

void Bindings::Execute(const Matmul& m, dnnl::stream& stream) {
  const size_t bytes = m.scratchpad.get_size();
  if (bytes > 0) {
    if (scratchpad_.size() < bytes) scratchpad_.resize(bytes);
    const std::array<int64_t, 6> key{DNNL_ARG_SCRATCHPAD, static_cast<int64_t>(bytes)};
    auto it = memories_.find(key);
    if (it == memories_.end()) {
      it = memories_.emplace(key, memory(m.scratchpad, CpuEngine(), scratchpad_.data())).first;
    } else {
      it->second.set_data_handle(scratchpad_.data());
    }
    args_[DNNL_ARG_SCRATCHPAD] = it->second;
  }
  m.prim.execute(stream, args_);
}

Linear::Linear(const float* w, const float* b, int64_t n, int64_t k, Dt dt, bool row_path)
    : n_(n), k_(k), dt_(dt) {
  const size_t count = static_cast<size_t>(n * k);
  plain_.resize(count * SizeOf(dt));
  if (dt == Dt::s8) {
    // Each row of W is an output feature: quantized as a call's input rows are.
    col_scales_.resize(n);
    kernels::QuantizeRows(w, k, n, k, reinterpret_cast<int8_t*>(plain_.data()), col_scales_.data());
  } else if (dt == Dt::bf16) {
    kernels::ToBf16(w, reinterpret_cast<uint16_t*>(plain_.data()), static_cast<int64_t>(count));
  } else {
    std::memcpy(plain_.data(), w, count * sizeof(float));
  }
  if (b != nullptr) bias_.assign(b, b + n);
  if (row_path && dt == Dt::f32) {
    panels_.resize(kernels::PanelCount(n) * k * kernels::kPanelColumns);
    kernels::PackPanels(w, n, k, panels_.data());
  }
  if (row_path && dt == Dt::s8 && kernels::Int8RowPathSupported()) {
    int8_panels_.resize(kernels::Int8PanelCount(n) * kernels::Int8PanelDepth(k) *
                        kernels::kInt8PanelColumns);
    column_sums_.resize(n);
    kernels::PackInt8Panels(reinterpret_cast<const int8_t*>(plain_.data()), n, k,
                            int8_panels_.data(), column_sums_.data());
  }
}

void Linear::RunRows(const float* x, int64_t ldx, int64_t m, float* y, int64_t ldy) const {
  const int64_t panels =
      int8_panels_.empty() ? kernels::PanelCount(n_) : kernels::Int8PanelCount(n_);
  const int threads = static_cast<int>(std::min<int64_t>(panels, PlanThreads()));
  // Contiguous runs of panels per thread: each streams one range of the weights.
#pragma omp parallel num_threads(threads) if (threads > 1)
  RunRowsPart(x, ldx, m, y, ldy, omp_get_thread_num(), omp_get_num_threads());
}

void Linear::RunRowsPart(const float* x, int64_t ldx, int64_t m, float* y, int64_t ldy, int part,
                         int parts) const {
  const float* b = bias_.empty() ? nullptr : bias_.data();
  if (!int8_panels_.empty()) {
    const int64_t panels = kernels::Int8PanelCount(n_);
    const int64_t first = panels * part / parts, last = panels * (part + 1) / parts;
    if (first == last) return;
    // Rows quantized as RunInt8 does, then shifted to u8 for vpdpbusd; a few KB, by
    // each part for itself.
    const int64_t depth = kernels::Int8PanelDepth(k_);
    thread_local std::vector<int8_t> rows;
    rows.assign(m * depth, 0);
    float scales[kRowPathRows];
    for (int64_t r = 0; r < m; ++r) {
      kernels::QuantizeRows(x + r * ldx, ldx, 1, k_, rows.data() + r * depth, scales + r);
    }
    for (int8_t& v : rows) v = static_cast<int8_t>(static_cast<uint8_t>(v) ^ 0x80u);
    const kernels::Int8Epilogue epilogue{.column_sums = column_sums_.data(),
                                         .row_scales = scales,
                                         .col_scales = col_scales_.data(),
                                         .bias = b,
                                         .y = y,
                                         .ldy = ldy};
    kernels::Int8PanelRows(reinterpret_cast<const uint8_t*>(rows.data()), depth, m,
                           int8_panels_.data(), n_, k_, epilogue, first, last);
    return;
  }
  const int64_t panels = kernels::PanelCount(n_);
  const int64_t first = panels * part / parts, last = panels * (part + 1) / parts;
  if (first < last) kernels::PanelRows(x, ldx, m, panels_.data(), n_, k_, b, y, ldy, first, last);
}

Linear::Key Linear::KeyOf(int64_t rows, int64_t src_ld, int64_t dst_ld, Dt dst_dt, int64_t n0,
                          int64_t n1) const {
  if (dt_ == Dt::s8) return {rows, k_, n_, static_cast<int64_t>(Dt::s32), PlanThreads(), 0, n_};
  return {rows, src_ld, dst_ld, static_cast<int64_t>(dst_dt), PlanThreads(), n0, n1 < 0 ? n_ : n1};
}

void Linear::RunInt8Chunk(dnnl::stream& stream, Bindings& args, int parts, const Int8Rows& c,
                          int64_t src_ld, Dt dst_dt) const {
  const int64_t m = c.rows;
  const std::shared_ptr<const Entry> entry = Lookup(KeyOf(m, 0, 0, dst_dt));
  const Entry& e = *entry;
  Bindings::Int8Chunk& chunk = args.int8_chunk();
  if (chunk.rows.size() < static_cast<size_t>(m * k_)) chunk.rows.resize(m * k_);
  if (chunk.scales.size() < static_cast<size_t>(m)) chunk.scales.resize(m);
  if (chunk.sums.size() < static_cast<size_t>(m * n_)) chunk.sums.resize(m * n_);
  const size_t dst_size = SizeOf(dst_dt);
#pragma omp parallel for num_threads(parts) if (parts > 1)
  for (int64_t t = 0; t < parts; ++t) {
    const int64_t a = m * t / parts, b = m * (t + 1) / parts;
    kernels::QuantizeRows(c.src + a * src_ld, src_ld, b - a, k_, chunk.rows.data() + a * k_,
                          chunk.scales.data() + a);
  }
  args.Bind(DNNL_ARG_SRC, e.src_md, chunk.rows.data());
  args.Bind(DNNL_ARG_DST, e.dst_md, chunk.sums.data());
  args.Set(DNNL_ARG_WEIGHTS, e.weights);
  args.Erase(DNNL_ARG_BIAS);
  args.Execute(e.matmul, stream);
  stream.wait();
  args.Erase(DNNL_ARG_WEIGHTS);
  const float* bias = bias_.empty() ? nullptr : bias_.data();
  const bool bf16 = dst_dt == Dt::bf16;
#pragma omp parallel for num_threads(parts) if (parts > 1)
  for (int64_t t = 0; t < parts; ++t) {
    const int64_t a = m * t / parts, b = m * (t + 1) / parts;
    if (c.segments == nullptr) {
      kernels::DequantizeRows(chunk.sums.data() + a * n_, b - a, n_, chunk.scales.data() + a,
                              col_scales_.data(), bias, c.dst + a * c.dst_ld * dst_size, c.dst_ld,
                              bf16);
      continue;
    }
    const ColumnSegments& cs = *c.segments;
    thread_local std::vector<void*> places;
    places.resize(cs.segments.size());
    for (int64_t r = a; r < b; ++r) {
      const int64_t row = c.row0 + r;
      const int64_t bi = row / cs.rows_per_batch, i = row % cs.rows_per_batch;
      for (size_t s = 0; s < places.size(); ++s) {
        const ColumnSegments::Segment& seg = cs.segments[s];
        places[s] = static_cast<char*>(seg.data) +
                    (bi * seg.batch_stride + i * seg.row_stride) * static_cast<int64_t>(dst_size);
      }
      kernels::DequantizeRowSegments(chunk.sums.data() + r * n_, n_, chunk.scales[r],
                                     col_scales_.data(), bias, cs.width, places.data(), bf16);
    }
  }
}

void Linear::RunInt8(dnnl::stream& stream, Bindings& args, const std::vector<Int8Rows>& chunks,
                     int64_t src_ld, Dt dst_dt) const {
  const int threads = static_cast<int>(PlanThreads());
  const int64_t count = static_cast<int64_t>(chunks.size());
  if (threads > 1 && count >= threads) {
    // A chunk per thread at a time, each quantized, multiplied and rescaled by its
    // thread alone (one-thread primitives): no barrier between the three steps, and
    // each chunk's rows and sums stay in that core's cache (docs/core.md).
#pragma omp parallel num_threads(threads)
    {
      thread_local Bindings local;
      thread_local std::optional<dnnl::stream> local_stream;
      if (!local_stream) local_stream.emplace(CpuEngine());
#pragma omp for schedule(dynamic, 1)
      for (int64_t c = 0; c < count; ++c) {
        RunInt8Chunk(*local_stream, local, 1, chunks[c], src_ld, dst_dt);
      }
    }
    return;
  }
  for (const Int8Rows& c : chunks) {
    // Rows split over the call's threads; one thread for a few rows.
    const int64_t parts = std::min<int64_t>(threads, (c.rows * std::max(k_, n_) + 8191) / 8192);
    RunInt8Chunk(stream, args, static_cast<int>(parts), c, src_ld, dst_dt);
  }
}

void Linear::RunSegments(dnnl::stream& stream, Bindings& args, int64_t rows, const float* src,
                         int64_t src_ld, const ColumnSegments& dst, Dt dst_dt) const {
  std::vector<Int8Rows> chunks;
  for (int64_t r0 = 0; r0 < rows;) {
    const int64_t m = RowChunk(rows - r0, kInt8RowChunkMax);
    chunks.push_back({.rows = m, .src = src + r0 * src_ld, .segments = &dst, .row0 = r0});
    r0 += m;
  }
  RunInt8(stream, args, chunks, src_ld, dst_dt);
}

void Linear::Run(dnnl::stream& stream, Bindings& args, int64_t batch, int64_t rows,
                 StridedOperand<const void> src, StridedOperand<void> dst, Dt dst_dt) const {
  if (dt_ == Dt::s8) {
    std::vector<Int8Rows> chunks;
    for (int64_t bi = 0; bi < batch; ++bi) {
      for (int64_t r0 = 0; r0 < rows;) {
        const int64_t m = RowChunk(rows - r0, kInt8RowChunkMax);
        chunks.push_back({.rows = m,
                          .src = static_cast<const float*>(src.data) + bi * src.batch_stride +
                                 r0 * src.row_stride,
                          .dst = static_cast<char*>(dst.data) +
                                 (bi * dst.batch_stride + r0 * dst.row_stride) * SizeOf(dst_dt),
                          .dst_ld = dst.row_stride});
        r0 += m;
      }
    }
    RunInt8(stream, args, chunks, src.row_stride, dst_dt);
    return;
  }
  RunDense(stream, args, batch, rows, src, dst, dst_dt, 0, n_);
}

void Linear::RunColumns(dnnl::stream& stream, Bindings& args, int64_t rows,
                        StridedOperand<const void> src, StridedOperand<void> dst, Dt dst_dt,
                        int64_t n0, int64_t n1) const {
  RunDense(stream, args, 1, rows, src, dst, dst_dt, n0, n1);
}

void Linear::RunColumnBlock(dnnl::stream& stream, Bindings& args, int64_t rows,
                            StridedOperand<const void> src, StridedOperand<void> dst, Dt dst_dt,
                            int64_t n0, int64_t n) const {
  const size_t src_size = SizeOf(dt_), dst_size = SizeOf(dst_dt);
  for (int64_t r0 = 0; r0 < rows;) {
    const int64_t m = RowChunk(rows - r0);
    // The key's dst_ld is n whatever dst's: a share's primitive writes densely.
    std::shared_ptr<const Entry> entry = Lookup(KeyOf(m, src.row_stride, n, dst_dt, 0, n));
    const bool shared = entry->col_block > 0 && n0 % entry->col_block == 0;
    if (!shared && n0 != 0) entry = Lookup(KeyOf(m, src.row_stride, n, dst_dt, n0, n0 + n));
    const char* w = nullptr;
    if (shared) {
      w = static_cast<const char*>(entry->weights.get_data_handle()) +
          n0 / entry->col_block * entry->col_block_bytes;
    }
    RunChunk(stream, args, *entry, m, n0, n,
             static_cast<const char*>(src.data) + r0 * src.row_stride * src_size,
             static_cast<char*>(dst.data) + r0 * dst.row_stride * dst_size, dst.row_stride,
             dst_size, /*in_place=*/dst.row_stride == n, w);
    r0 += m;
  }
  // The workspace (and its bindings) may outlive this layer: a pool shared by the
  // versions of a model. It must not keep the layer's weights alive.
  args.Erase(DNNL_ARG_WEIGHTS);
  args.Erase(DNNL_ARG_BIAS);
}

void Linear::RunDense(dnnl::stream& stream, Bindings& args, int64_t batch, int64_t rows,
                      StridedOperand<const void> src, StridedOperand<void> dst, Dt dst_dt,
                      int64_t n0, int64_t n1) const {
  const size_t src_size = SizeOf(dt_), dst_size = SizeOf(dst_dt);
  // A share of the columns is computed into a dense buffer and copied out: with a
  // strided destination oneDNN 2.6 leaves its brgemm kernels for a GEMM that reads
  // plain weights, which would need a copy of these columns of W.
  const bool part = n1 - n0 != n_;
  for (int64_t bi = 0; bi < batch; ++bi) {
    for (int64_t r0 = 0; r0 < rows;) {
      const int64_t m = RowChunk(rows - r0);
      const std::shared_ptr<const Entry> entry =
          Lookup(KeyOf(m, src.row_stride, dst.row_stride, dst_dt, n0, n1));
      RunChunk(stream, args, *entry, m, n0, n1 - n0,
               static_cast<const char*>(src.data) +
                   (bi * src.batch_stride + r0 * src.row_stride) * src_size,
               static_cast<char*>(dst.data) +
                   (bi * dst.batch_stride + r0 * dst.row_stride + n0) * dst_size,
               dst.row_stride, dst_size, /*in_place=*/!part, /*weights=*/nullptr);
      r0 += m;
    }
  }
  args.Erase(DNNL_ARG_WEIGHTS);  // as in RunColumnBlock
  args.Erase(DNNL_ARG_BIAS);
}

void Linear::RunChunk(dnnl::stream& stream, Bindings& args, const Entry& e, int64_t m, int64_t n0,
                      int64_t n, const char* src, char* dst, int64_t dst_ld, size_t dst_size,
                      bool in_place, const char* weights) const {
  const size_t row_bytes = n * dst_size;
  std::vector<char>& dense = args.columns();
  if (!in_place && dense.size() < m * row_bytes) dense.resize(m * row_bytes);
  args.Bind(DNNL_ARG_SRC, e.src_md, src);
  args.Bind(DNNL_ARG_DST, e.dst_md, in_place ? dst : dense.data());
  if (weights != nullptr) {
    args.Bind(DNNL_ARG_WEIGHTS, e.matmul.weights, weights);
  } else {
    args.Set(DNNL_ARG_WEIGHTS, e.weights);
  }
  if (bias_.empty()) {
    args.Erase(DNNL_ARG_BIAS);
  } else {
    args.Bind(DNNL_ARG_BIAS, e.bias_md, bias_.data() + n0);
  }
  args.Execute(e.matmul, stream);
  for (int64_t r = 0; !in_place && r < m; ++r) {
    std::memcpy(dst + r * dst_ld * dst_size, dense.data() + r * row_bytes, row_bytes);
  }
}

int Linear::Prepare(int64_t max_rows, int64_t src_ld, int64_t dst_ld, Dt dst_dt, int64_t n0,
                    int64_t n1) const {
  int built = 0;
  for (const int64_t m : RowChunkSizes(max_rows, ChunkMax())) {
    built += PrepareRows(m, src_ld, dst_ld, dst_dt, n0, n1);
  }
  return built;
}

int Linear::PrepareColumnBlocks(int64_t max_rows, int64_t src_ld, int64_t n, Dt dst_dt) const {
  int built = Prepare(max_rows, src_ld, n, dst_dt, 0, n);
  for (const int64_t m : RowChunkSizes(max_rows, ChunkMax())) {
    const std::shared_ptr<const Entry> first = Lookup(KeyOf(m, src_ld, n, dst_dt, 0, n));
    for (int64_t n0 = n; n0 + n <= n_; n0 += n) {
      if (first->col_block > 0 && n0 % first->col_block == 0) continue;
      built += PrepareRows(m, src_ld, n, dst_dt, n0, n0 + n);
    }
  }
  return built;
}

int Linear::PrepareRows(int64_t rows, int64_t src_ld, int64_t dst_ld, Dt dst_dt, int64_t n0,
                        int64_t n1) const {
  bool made = false;
  Lookup(KeyOf(rows, src_ld, dst_ld, dst_dt, n0, n1), &made);
  return made ? 1 : 0;
}

std::shared_ptr<const Linear::Entry> Linear::Lookup(const Key& key, bool* built) const {
  absl::MutexLock lock(&mu_);
  auto it = cache_.find(key);
  if (it != cache_.end()) return it->second;
  if (cache_.size() >= kMaxCachedPrimitives) cache_.clear();
  const auto [rows, src_ld, dst_ld, dst_dt, threads, n0, n1] = key;
  const int64_t n = n1 - n0;
  auto e = std::make_shared<Entry>();
  e->src_md = memory::desc({rows, k_}, dt_, {src_ld, 1});
  // A share of the columns goes to a dense buffer (RunDense).
  e->dst_md = memory::desc({rows, n}, static_cast<Dt>(dst_dt), {n == n_ ? dst_ld : n, 1});
  if (!bias_.empty() && dt_ != Dt::s8) e->bias_md = memory::desc({1, n}, Dt::f32, {n, 1});
  const memory::desc w_any({k_, n}, dt_, memory::format_tag::any);
  e->matmul = Matmul::Make(dnnl::matmul::desc(e->src_md, w_any, e->bias_md, e->dst_md), {});
  e->weights = n == n_ ? PackedWeights(e->matmul.weights, memory::desc({k_, n_}, dt_, {1, k_}))
                       : ColumnWeights(e->matmul.weights, n0, n1, *e);
  cache_.emplace(key, e);
  if (built != nullptr) *built = true;
  return e;
}

memory Linear::ColumnWeights(const memory::desc& want, int64_t n0, int64_t n1, Entry& e) const {
  // In a blocked layout whose column blocks are outermost, each block of columns is
  // one contiguous run of every row: the columns from a block's start on are the
  // same layout over fewer columns, at an offset into the whole matrix's packing.
  dnnl_memory_desc_t d = want.data;
  const auto& b = d.format_desc.blocking;
  int64_t col_block = 1, row_block = 1;
  bool blocked =
      d.format_kind == dnnl_blocked && d.ndims == 2 && d.offset0 == 0 && d.extra.flags == 0;
  for (int i = 0; blocked && i < b.inner_nblks; ++i) {
    (b.inner_idxs[i] == 1 ? col_block : row_block) *= b.inner_blks[i];
  }
  blocked = blocked && b.strides[0] == row_block * col_block &&
            b.strides[1] == d.padded_dims[0] / row_block * b.strides[0] && n0 % col_block == 0;
  const dnnl::engine& eng = CpuEngine();
  if (blocked) {
    d.dims[1] = n_;
    d.padded_dims[1] = (n_ + col_block - 1) / col_block * col_block;
    const memory whole = PackedWeights(memory::desc(d), memory::desc({k_, n_}, dt_, {1, k_}));
    char* base = static_cast<char*>(whole.get_data_handle());
    const int64_t block_bytes = b.strides[1] * static_cast<int64_t>(SizeOf(dt_));
    // Re-pointing a padded layout (set_data_handle) writes zeros into its padding,
    // here the next columns' weights, which other threads read: only unpadded ones.
    if (want.get_size() == static_cast<size_t>(k_ * (n1 - n0)) * SizeOf(dt_)) {
      e.col_block = col_block;
      e.col_block_bytes = block_bytes;
    }
    return memory(want, eng, base + n0 / col_block * block_bytes);
  }
  // Any other layout: these columns packed on their own (rows n0..n1 of W are
  // contiguous in plain_), once for every chunk size that asks for this layout.
  for (const auto& [first, md, mem] : column_packed_) {
    if (first == n0 && md == want) return mem;
  }
  memory src(memory::desc({k_, n1 - n0}, dt_, {1, k_}), eng,
             const_cast<char*>(plain_.data()) + n0 * k_ * SizeOf(dt_));
  memory dst(want, eng);
  dnnl::stream stream(eng);
  dnnl::reorder(src, dst).execute(stream, src, dst);
  stream.wait();
  column_packed_.emplace_back(n0, want, dst);
  return dst;
}

memory Linear::PackedWeights(const memory::desc& want, const memory::desc& plain) const {
  for (const auto& [md, mem] : packed_) {
    if (md == want) return mem;
  }
  const dnnl::engine& eng = CpuEngine();
  memory src(plain, eng, const_cast<char*>(plain_.data()));
  memory dst(want, eng);
  dnnl::stream stream(eng);
  dnnl::reorder(src, dst).execute(stream, src, dst);
  stream.wait();
  packed_.emplace_back(want, dst);
  return dst;
}

}  // namespace mha::core::internal

// Row kernels of the fused attention loop: online-softmax statistics, exp, additive
// scores, and float <-> bfloat16 conversion. Internal to core/; plain loops written so the
// compiler vectorises them, with AVX-512 and AVX2 clones picked at load time, and a few
// in intrinsics: the exponentials in AVX-512 and AVX2 (picked as ActiveIsa says), the
// int8 row path in AVX-512 (picked by the CPU's flags).
#ifndef MHA_CORE_KERNELS_H_
#define MHA_CORE_KERNELS_H_

#include <cstdint>

namespace mha::core::kernels {

// SmallScores, SmallContext(Bf16), TransposedScores(Bf16), the Group kernels and
// PanelRows are built for three instruction sets and run the best this CPU has: AVX-512
// (sums in vectors of 16 floats), AVX2 with FMA (vectors of 8, in register blocks a
// quarter the size: groups of up to 2 rows, 4 over a bf16 cache, where AVX-512 takes 8)
// or baseline x86-64 (docs/performance.md, "On an AVX2 CPU"). The other kernels are
// cloned per instruction set by the compiler.
enum class Isa { kBaseline, kAvx2, kAvx512 };
Isa CpuIsa();
// For tests and benchmarks: those kernels run the lower of CpuIsa() and `cap`,
// process-wide, from the next call (kAvx512 lifts the cap).
void CapIsa(Isa cap);
Isa ActiveIsa();
const char* IsaName(Isa isa);

// Max of s[0, n); -inf when n == 0.
float RowMax(const float* s, int64_t n);
// RowMax of `rows` rows of n (row i at s + i * n) to out[i].
void RowMaxes(const float* s, int64_t n, int64_t rows, float* out);

// p[j] = exp(s[j] - m) for j < n, returns the sum of p[0, n). p may alias s.
// With base2, p[j] = 2^(s[j] - m): for scores in log2 units (their GEMM's scale times
// log2 e), which spares the exponentials a multiply and half the range reduction.
// In AVX-512 or AVX2 intrinsics as ActiveIsa() says, on baseline x86-64 the portable
// loop below.
float ExpSubSum(const float* s, float m, float* p, int64_t n, bool base2 = false);

// ExpSubSum over `rows` rows of n scores in place (row i at s + i * n), each against
// its own reference m[i], its sum added to sums[i]: one call for a paged block's
// query rows, whose rows of kBlockTokens are too short for one call each to keep the
// exponentials' chains in flight (docs/performance.md, "One call for a block's rows").
void ExpSubSumRows(float* s, int64_t n, const float* m, float* sums, int64_t rows,
                   bool base2 = false);

// Same as ExpSubSum, writing bfloat16 (round to nearest even) to p; the sum is of the f32 values.
// Those are exp to 3e-6 relative (a shorter polynomial: a bfloat16 keeps 8 bits, so
// p[j] is exp rounded to bfloat16 or, rarely, the neighbour of that). s may be
// overwritten (the portable version's f32 exponentials go there).
float ExpSubSumBf16(float* s, float m, uint16_t* p, int64_t n, bool base2 = false);

// The portable versions, for CPUs without AVX2 and for the tests that hold the two
// to the same values: ExpSubSumBf16Portable writes its f32 exponentials to tmp (n).
float ExpSubSumPortable(const float* s, float m, float* p, int64_t n, bool base2 = false);
float ExpSubSumBf16Portable(const float* s, float m, uint16_t* p, int64_t n, float* tmp,
                            bool base2 = false);

// Additive scores of one query against n keys, for one head:
//   s[j] = sum_a w[a] tanh(qa[a] + kt[a * ld + j])   for j < n, a < pa
// qa (pa): the query's projection A_q q; kt (pa, ld): the keys' projections A_k k_j
// transposed, key j in column j; w (pa): w_v. tanh is accurate to ~1e-7 absolute.
void AdditiveScores(const float* qa, const float* kt, int64_t ld, const float* w, int64_t pa,
                    float* s, int64_t n);

// A small attention block's two products in plain loops, for blocks so small that
// a oneDNN primitive's look-up, binding and dispatch cost more than the arithmetic
// (the toy model's (2, 4, 100) request: 4 x 6 blocks of 20 features). f32, dense:
//   SmallScores:  s (mq, nk) = scale * q (mq, p) k (nk, p)^T
//   SmallContext: o (mq, p) (+)= probs (mq, nk) v (nk, p)     (+= when accumulate)
void SmallScores(const float* q, const float* k, int64_t p, int64_t mq, int64_t nk, float scale,
                 float* s);
void SmallContext(const float* probs, const float* v, int64_t p, int64_t mq, int64_t nk,
                  bool accumulate, float* o, const void* prefetch = nullptr,
                  int64_t prefetch_bytes = 0);

// Scores against keys stored transposed (the K/V cache's blocks, core/kv_cache.h):
//   s (mq, nk) = scale * q (mq, p) kt[:, :nk], kt (p, ld) with key j in column j.
// Vectorised across keys, so one query costs p multiply-adds per vector of keys
// instead of a dot product (and a horizontal sum) per key.
void TransposedScores(const float* q, const float* kt, int64_t ld, int64_t p, int64_t mq,
                      int64_t nk, float scale, float* s, const void* prefetch = nullptr,
                      int64_t prefetch_bytes = 0);

// The same against bfloat16 keys, and SmallContext against bfloat16 values (the K/V
// cache of a bf16 model); products and sums in f32.
void TransposedScoresBf16(const float* q, const uint16_t* kt, int64_t ld, int64_t p, int64_t mq,
                          int64_t nk, float scale, float* s, const void* prefetch = nullptr,
                          int64_t prefetch_bytes = 0);
void SmallContextBf16(const float* probs, const uint16_t* v, int64_t p, int64_t mq, int64_t nk,
                      float* o, const void* prefetch = nullptr,
                      int64_t prefetch_bytes = 0);  // accumulates

// The paged pass's kernels for a grouped-query group: the query rows of every query
// head sharing one key/value head (times the step's new tokens) against one cache
// block, with the same results as TransposedScores(Bf16) and SmallContext(Bf16)
// (accumulating) up to the order of f32 additions. Rows go in register-blocked
// groups (of up to 8; Isa): each vector of keys (scores) or of a value row
// (context) is loaded once for all of a group's rows, instead of once per row, so the
// block streams through once per group and the multiply-adds of the rows run side by
// side.
//   GroupScores:  s (mq, nk) = scale * q (mq, p) kt[:, :nk], kt (p, ld)
//   GroupContext: o (mq, p) += probs (mq, nk) v (nk, p), v in column panels
//                 (ValueIndex<T>) of panel_rows >= nk rows
// read_ahead > 0: each cache line of kt or v they read, they prefetch the line
// read_ahead bytes past it into L1 (an f32 cache on Intel CPUs: into L2). The paged
// pass reads a head's run of blocks in memory order (a block's keys, its values, the
// next block's keys) and passes kReadAhead, f32 or bf16 (docs/performance.md,
// "Reading ahead of the kernels").
inline constexpr int64_t kReadAhead = 8 << 10;
void GroupScores(const float* q, const float* kt, int64_t ld, int64_t p, int64_t mq, int64_t nk,
                 float scale, float* s, int64_t read_ahead = 0);
void GroupScoresBf16(const float* q, const uint16_t* kt, int64_t ld, int64_t p, int64_t mq,
                     int64_t nk, float scale, float* s, int64_t read_ahead = 0);
// The values of a cache block in column panels of 256 bytes a row: columns
// [c0, c0 + w) of all its panel_rows rows together, row by row (c0 a multiple of
// kValuePanel<T>, 64 f32 or 128 bf16 columns; w = min(kValuePanel<T>, p - c0)), so that
// GroupContext reads an f32 block in one sequential run where rows of p would have
// it stride through the block once per group of 64 columns (docs/performance.md,
// "Values in column panels"). p <= kValuePanel<T> is the plain row layout.
// ValueIndex<T>: where row j's column c is.
template <typename T>
inline constexpr int64_t kValuePanel = 256 / static_cast<int64_t>(sizeof(T));
template <typename T>
int64_t ValueIndex(int64_t j, int64_t c, int64_t p, int64_t panel_rows) {
  const int64_t c0 = c / kValuePanel<T> * kValuePanel<T>;
  const int64_t w = p - c0 < kValuePanel<T> ? p - c0 : kValuePanel<T>;
  return c0 * panel_rows + j * w + (c - c0);
}
void GroupContext(const float* probs, const float* v, int64_t panel_rows, int64_t p, int64_t mq,
                  int64_t nk, float* o, int64_t read_ahead = 0);
void GroupContextBf16(const float* probs, const uint16_t* v, int64_t panel_rows, int64_t p,
                      int64_t mq, int64_t nk, float* o, int64_t read_ahead = 0);

// A few rows through a weight matrix W (n, k): y (m, n) = x (m, k) W^T + b, row
// strides ldx and ldy. A few rows (a decode step's projections) read every weight
// once for 2m FLOPs, so they run at the rate W streams from memory; a general GEMM's
// packing and blocking only add to that. W is packed once (PackPanels) into panels of
// kPanelColumns output columns, each (k, kPanelColumns) row-major and contiguous: one
// sequential read per panel, whose columns' sums for up to three rows at a time stay
// in registers over all k. The last panel is zero-padded. PanelRows computes the
// columns of panels [first, last), so that threads can share the panels; b may be null.
constexpr int64_t kPanelColumns = 128;
int64_t PanelCount(int64_t n);
void PackPanels(const float* w, int64_t n, int64_t k, float* panels);  // PanelCount(n) * k * 128
void PanelRows(const float* x, int64_t ldx, int64_t m, const float* panels, int64_t n, int64_t k,
               const float* b, float* y, int64_t ldy, int64_t first, int64_t last);

void Scale(float* x, float factor, int64_t n);  // x *= factor
void ToBf16(const float* x, uint16_t* y, int64_t n);

// int8 projections (Linear over s8 weights). QuantizeRows: m rows of k bf16 values
// (row stride ldx) to symmetric int8, one scale per row: scales[r] = max |x[r, :]| /
// 127 (0 for a zero row) and q[r, j] = round(x[r, j] / scales[r]), rows of q dense.
// DequantizeRows: y[r, j] = acc[r, j] * row_scales[r] * col_scales[j] + b[j] (b may be
// null) for m rows of n int32 sums (dense), into f32 or bf16 rows (`bf16`) of stride ldy.
void QuantizeRows(const uint16_t* x, int64_t ldx, int64_t m, int64_t k, int8_t* q, float* scales);
// The same from f32 rows.
void QuantizeRows(const float* x, int64_t ldx, int64_t m, int64_t k, int8_t* q, float* scales);
void DequantizeRows(const int32_t* acc, int64_t m, int64_t n, const float* row_scales,
                    const float* col_scales, const float* b, void* y, int64_t ldy, bool bf16);
// The same for one row whose n columns go in segments of `width` (dividing n) to
// n / width places: columns [s * width, (s + 1) * width) to dst[s].
void DequantizeRowSegments(const int32_t* acc, int64_t n, float row_scale, const float* col_scales,
                           const float* b, int64_t width, void* const* dst, bool bf16);

// An int8 Linear's decode rows (Linear::RunRows of an s8 Linear), on AVX-512 VNNI:
// W (n, k) s8 packed once (PackInt8Panels) into panels of kInt8PanelColumns output
// columns: for each group of 4 inputs, 4 vectors of 16 columns x 4 bytes, the
// operand layout of vpdpbusd (u8 x s8 -> s32). Rows come quantized to s8 and are
// shifted to u8 (+128), so each column's sum is corrected by 128 * (its weights' sum).
// Int8PanelRows computes the exact s32 sums of m <= 3 rows (row stride ldx bytes, k
// padded to Int8PanelDepth(k) with zeros) for the columns of panels [first, last)
// and writes them rescaled as DequantizeRows does, into f32 rows of y.
// Int8RowPathSupported: whether this CPU has VNNI.
constexpr int64_t kInt8PanelColumns = 64;
bool Int8RowPathSupported();
int64_t Int8PanelDepth(int64_t k);  // k rounded up to a multiple of 4
int64_t Int8PanelCount(int64_t n);
// panels: Int8PanelCount(n) * Int8PanelDepth(k) * 64 bytes; column_sums: n, each
// 128 times the column's sum of weights (the correction of the u8 shift).
void PackInt8Panels(const int8_t* w, int64_t n, int64_t k, int8_t* panels, int32_t* column_sums);
struct Int8Epilogue {
  const int32_t* column_sums;  // PackInt8Panels'
  const float* row_scales;     // m
  const float* col_scales;     // n
  const float* bias;           // n, or null
  float* y;
  int64_t ldy;
};
void Int8PanelRows(const uint8_t* x, int64_t ldx, int64_t m, const int8_t* panels, int64_t n,
                   int64_t k, const Int8Epilogue& epilogue, int64_t first, int64_t last);

}  // namespace mha::core::kernels

#endif  // MHA_CORE_KERNELS_H_

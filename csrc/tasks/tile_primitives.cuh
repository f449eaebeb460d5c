// Tile primitives the superoptimizer's generated task bodies are composed of (mpk_dist/superopt/codegen.py,
// csrc/tasks/generated/). Each one is a block-level step of a µGraph's block graph:
//   load8 / pack8      16-byte loads of 8 values of an input tile into registers, 8 results back to bf16
//   unpack_param       a parameter's 8 values from its 16 bytes copied ahead (stage_row_fetch_first, fused_gemv.cuh)
//   row_sum_sq         a row reduction (sum over k of x^2) over the block's worker threads
//   stage_row          an element-wise operand computed in registers and staged in shared memory
//   rows_sum_sq,       the same for all kB rows of the tile at once (the staged path): the rows' loads in
//   stage_rows         flight together, one block reduction for every row's statistic
//   rows_share_sum_sq  the statistics of kB rows from each thread's vectors already in registers (the rows read
//                      once: MPK_NORM_ROWS_IN_REGS)
//   gemv_acc           the matmul accumulated over the K loop for the tile's N_TILE weight rows
//                      (tensor cores for batch >= 2 under MPK_LINEAR_MMA=1: linear_mma.cuh's order)
// The reduction and GEMV keep the hand-written kinds' loops and summation orders (rms_norm.cuh's
// share_sum_sq and block_sum, fused_gemv.cuh's per-lane order), so a generated body that rounds as
// its reference gives the same bits as the hand-written task.
#pragma once
#include "fused_gemv.cuh"

namespace mpk {
namespace tile {

// 8 consecutive values of a row into fp32 registers (16-byte aligned: K % 8 == 0, checked by the host): the fp32
// residual stream, or bf16 activations written earlier in this kernel (coherent load). rms_norm.cuh's load8_any.
template <typename T>
__device__ __forceinline__ void load8(const T* p, float* f) { load8_any(p, f); }

// Read-only bf16 parameters (norm weights): streaming, non-coherent load.
__device__ __forceinline__ void load8_param(const bf16* p, float* f) { unpack8(ld_stream_v4(p), f); }

// A parameter's 16 bytes (read-only: streaming, non-coherent load), for unpack_param.
__device__ __forceinline__ uint4 load_param16(const bf16* p) { return ld_stream_v4(p); }

// A parameter's 8 values from its 16 bytes, loaded (copied) elsewhere: stage_row_fetch_first (fused_gemv.cuh).
__device__ __forceinline__ void unpack_param(uint4 v, float* f) { unpack8(v, f); }

// 8 fp32 values rounded to bf16, as one 16-byte vector.
__device__ __forceinline__ uint4 pack8(const float* f) {
  __align__(16) bf16 o[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) o[i] = f2bf(f[i]);
  return *reinterpret_cast<const uint4*>(o);
}

// bf16(bf16(x[i] * r) * p[i]) for 8 values x and the parameter's 8 bf16 values p (16 bytes), packed as pack8 packs:
// fused_gemv.cuh's norm8_of (bf16x2 arithmetic unless MPK_NORM_BF16X2 is 0; the same bits either way).
__device__ __forceinline__ uint4 scale_mul8(const float* x, float r, uint4 p) {
  return norm8_of(x, p, r);
}

// sum_k x[k]^2 of one fp32 row on every worker thread (block_sum ends with a barrier); rms_norm.cuh's order
// (share_sum_sq, then block_sum), so the statistic is bit-identical to the rms_norm task's.
__device__ __forceinline__ float row_sum_sq(const float* x, int K, float* smem, int tid, int nt) {
  return block_sum(share_sum_sq(x, K, tid, nt), smem, tid, nt);
}

// st[k..k+7] = row.load8(k) over one row of K: the element-wise operand in registers, staged (fused_gemv.cuh's
// stage_row, the hand-written kinds' loop).
using ::mpk::stage_row;

// ---- all kB rows at once (the staged path of the generated bodies) ----
// Why: row by row, each row's statistic is a block reduction (two barriers) and each staged vector's loads
// wait for the previous vector's store (the store may alias the source, so the compiler keeps the order).
// The trace's marks (linear_mma.cuh kMarkMmaStart) put that prologue at 11-12 us of a qwen3-8b batch-8
// norm_linear tile (8 block reductions, 8 chained round trips to L2) against 13-46 us for the weights
// themselves; together it took 7-8 us. (A silu_linear tile's 21-25 us stayed: its prologue is compute, silu of
// every row in every tile, so above two rows silu_mul is its own level: megakernel_backend.SILU_FUSE_MAX_BATCH.)
// Here every row's loads of a k step are issued before any store or sum. Same values in the same order per row:
// the same bits.
// NOTE: kB is the kernel's compile-time batch (MPK_FUSED_WITH_BATCH), so the per-row arrays stay in registers.

// MPK_STAGE_ROWS_TOGETHER 0: the same two primitives row by row (row_sum_sq, stage_row), for the bitwise
// GPU test and the A/B (tests/runtime/test_code_variants_gpu.py).
#ifndef MPK_STAGE_ROWS_TOGETHER
#define MPK_STAGE_ROWS_TOGETHER 1
#endif
constexpr int kStageVectors = 8;  // staged 16-byte vectors a thread loads before it stores the first

// Where rows_block_sum leaves the rows' totals: after block_sum's scratch (one float a warp, at most 32 warps) and
// before the staging area, so that the staging does not overwrite them.
constexpr int kRowTotalsAt = 32;
constexpr int kMaxStagedRows = 16;  // MPK_FUSED_WITH_BATCH's largest kB
static_assert(kRowTotalsAt + kMaxStagedRows <= kStageOffset, "the rows' totals overlap the staging area");

// ss[b] = finish(the block's sum of every thread's ss[b]) for rows b < kB, on every worker thread: per row warp_sum, then
// the warps' partials in warp order (block_sum's order, all rows in one pair of barriers). Thread b sums row b's
// partials and leaves the total for every thread to read (before, every thread summed every row's partials: kB x
// nwarps adds a thread, ~130 of a batch-8 prologue's ~950 instructions). The partials sit in the staging area
// (stage_base), which nothing has written yet, and are read before the last barrier, so the staging may overwrite
// them after it.
// finish(total) is what every thread gets for a row (the total itself by default): a norm prologue passes its row
// factor (r = rsqrt(total / K + eps)), so that thread b computes row b's factor once instead of every thread
// computing all kB of them (an IEEE division each: ~100 of the ~590 instructions). The same function of the same
// total: the same bits.
// MPK_ROW_TOTALS_BY_ONE 0: every thread sums every row's partials and finishes every row (the v0.46 code), for the
// A/B and the bitwise test; measured +0.9% at qwen3-8b batch 8 on an H100 (docs/PERF.md v0.47).
#ifndef MPK_ROW_TOTALS_BY_ONE
#define MPK_ROW_TOTALS_BY_ONE 1
#endif

// rows_block_sum's default finish: the row's total.
struct RowTotal {
  __device__ __forceinline__ float operator()(float total) const { return total; }
};

template <int kB, class Finish = RowTotal>
__device__ __forceinline__ void rows_block_sum(float (&ss)[kB], float* smem, int tid, int nt,
                                               const Finish& finish = Finish{}) {
  static_assert(kB <= kMaxStagedRows, "more rows than the totals' room");
  const int warp = tid >> 5, lane = tid & 31, nwarps = nt >> 5;
  float* part = smem + kStageOffset;  // kB x nwarps floats of the staging area
#pragma unroll
  for (int b = 0; b < kB; ++b) {
    const float w = warp_sum(ss[b]);
    if (lane == 0) part[b * nwarps + warp] = w;
  }
  worker_barrier(nt);
  if constexpr (!MPK_ROW_TOTALS_BY_ONE) {
#pragma unroll
    for (int b = 0; b < kB; ++b) {
      float s = 0.f;
      for (int i = 0; i < nwarps; ++i) s += part[b * nwarps + i];
      ss[b] = finish(s);
    }
    worker_barrier(nt);  // every thread has read the partials before the rows are staged over them
    return;
  }
  if (tid < kB) {
    float s = 0.f;
    for (int i = 0; i < nwarps; ++i) s += part[tid * nwarps + i];
    smem[kRowTotalsAt + tid] = finish(s);
  }
  worker_barrier(nt);  // the totals are written, and every partial has been read before the rows are staged over them
#pragma unroll
  for (int b = 0; b < kB; ++b) ss[b] = smem[kRowTotalsAt + b];
}

// ss[b] = finish(sum_k x_b[k]^2) for rows b < kB (row(b): row b's fp32 pointer) on every worker thread: per row
// share_sum_sq's order (a thread's 8-vectors, each in element order), every row's vector at a k step loaded
// before any is summed, then rows_block_sum. Each statistic has row_sum_sq's bits.
template <int kB, class RowPtr, class Finish = RowTotal>
__device__ __forceinline__ void rows_sum_sq(const RowPtr& row, int K, float* smem, float (&ss)[kB], int tid, int nt,
                                            const Finish& finish = Finish{}) {
  if (!MPK_STAGE_ROWS_TOGETHER || kB == 1) {  // one row: nothing to overlap (see stage_rows)
    for (int b = 0; b < kB; ++b) ss[b] = finish(row_sum_sq(row(b), K, smem, tid, nt));
    return;
  }
#pragma unroll
  for (int b = 0; b < kB; ++b) ss[b] = 0.f;
  for (int k = tid * 8; k < K; k += nt * 8) {
    float f[kB][8];
#pragma unroll
    for (int b = 0; b < kB; ++b) load8_any(row(b) + k, f[b]);
#pragma unroll
    for (int b = 0; b < kB; ++b) ss[b] = sum_sq8(f[b], ss[b]);
  }
  rows_block_sum<kB>(ss, smem, tid, nt, finish);
}

// MPK_NORM_ROWS_IN_REGS 1 (default): above one row, where a thread's share of each row is one 8-vector (K <= 8 x
// worker threads), a generated norm prologue reads the rows once: each thread keeps its vector of every row in
// registers across the statistic's block reduction and computes its staged operand vectors from them
// (rows_share_sum_sq, then the operand's from_regs), instead of reading the rows again after the statistic
// (stage_rows). Why: at qwen3-8b batch 8 that second read is 128 tiles x 128 KB of fp32 rows out of L2 (v0.43's
// diagnostic T put the whole pass at ~2.3% of the step); measured -0.6 / -0.75% there (docs/PERF.md v0.46). The function holding kB x 8 values is not inlined (the generated
// body's <name>_rows_in_regs): its callers run with the worker loop's registers live and already spill. 0: the
// two passes, for the bitwise GPU test. Same values, same order: the same bits.
#ifndef MPK_NORM_ROWS_IN_REGS
#define MPK_NORM_ROWS_IN_REGS 1
#endif

// Whether a thread's share of a row of K is at most one 8-vector (the rows-in-registers prologue's condition).
__device__ __forceinline__ bool share_is_one_vector(int K, int nt) { return K <= 8 * nt; }

// ss[b] = finish(sum_k x_b[k]^2) from each thread's one vector v[b] of row b (mine: the thread's vector lies within the
// row; a thread past it holds something else and adds nothing), on every worker thread: share_sum_sq's value
// per thread, then rows_block_sum. The bits of row_sum_sq.
template <int kB, class Finish = RowTotal>
__device__ __forceinline__ void rows_share_sum_sq(const float (&v)[kB][8], bool mine, float* smem, float (&ss)[kB],
                                                  int tid, int nt, const Finish& finish = Finish{}) {
#pragma unroll
  for (int b = 0; b < kB; ++b) ss[b] = mine ? sum_sq8(v[b], 0.f) : 0.f;
  rows_block_sum<kB>(ss, smem, tid, nt, finish);
}

// st[b * K + k ..] = make_row(b).load8(k) for rows b < kB: up to kStageVectors vectors' loads (rows, then
// k steps when there are fewer rows) before their stores. Each vector is computed as stage_row computes it.
template <int kB, class MakeRow>
__device__ __forceinline__ void stage_rows(bf16* st, int K, const MakeRow& make_row, int tid, int nt) {
  // NOTE: one row (batch 1) takes the row-by-row loop. Batched at batch 1 (up to 8 guarded k steps, 3 of them
  // real at K = 12288), run_silu_linear had 3.4x the instructions, ptxas spilled 128 bytes in it and in
  // run_norm_linear, and the whole kernel ran 50% slower (qwen3-8b b1 7.60 vs 5.01 ms, docs/PERF.md v0.13). Not
  // through the entry's larger stack frame (592 -> 864 B): padded alone, that frame cost nothing.
  if (!MPK_STAGE_ROWS_TOGETHER || kB == 1) {
    for (int b = 0; b < kB; ++b) stage_row(st + (size_t)b * K, K, make_row(b), tid, nt);
    return;
  }
  constexpr int kRows = kB < kStageVectors ? kB : kStageVectors;  // rows a batch covers
  constexpr int kSteps = kStageVectors / kRows;                   // k steps a batch covers
  for (int b0 = 0; b0 < kB; b0 += kRows) {
    for (int k0 = tid * 8; k0 < K; k0 += kSteps * nt * 8) {
      uint4 v[kSteps][kRows];
#pragma unroll
      for (int j = 0; j < kSteps; ++j)
#pragma unroll
        for (int r = 0; r < kRows; ++r)
          if (k0 + j * nt * 8 < K && b0 + r < kB) v[j][r] = make_row(b0 + r).load8(k0 + j * nt * 8);
#pragma unroll
      for (int j = 0; j < kSteps; ++j)
#pragma unroll
        for (int r = 0; r < kRows; ++r)
          if (k0 + j * nt * 8 < K && b0 + r < kB)
            *reinterpret_cast<uint4*>(st + (size_t)(b0 + r) * K + k0 + j * nt * 8) = v[j][r];
    }
  }
}

// The matmul accumulated over K for the tile's n_tile weight rows and B staged operand rows; the
// one non-inlined GEMV instance of fused_gemv.cuh (shared with the hand-written kinds: same
// summation order, no extra template instance in the one-kernel build).
template <int B, class XS, class EpiT>
__device__ __forceinline__ void gemv_acc(const XS& xs, const bf16* __restrict__ w, int K, int n_tile, const EpiT& epi,
                                         int tid, int nt) {
  gemv_fused<B>(xs, w, K, n_tile, epi, staged_bytes(B, K), tid, nt);  // xs: the B rows staged in shared memory
}

// The same for one operand row computed per element (when the staged rows do not fit).
template <class Row, class EpiT>
__device__ __forceinline__ void gemv_acc_row(const Row& row, const bf16* __restrict__ w, int K, int n_tile,
                                             const EpiT& epi, int b, int tid, int nt) {
  gemv_rowwise(row, w, K, n_tile, epi, b, tid, nt);
}

}  // namespace tile
}  // namespace mpk

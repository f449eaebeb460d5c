// Tile primitives the superoptimizer's generated task bodies are composed of (mpk_dist/superopt/codegen.py,
// csrc/tasks/generated/). Each one is a block-level step of a µGraph's block graph:
//   load8 / pack8      16-byte loads of 8 values of an input tile into registers, 8 results back to bf16
//   row_sum_sq         a row reduction (sum over k of x^2) over the block's worker threads
//   stage_row          an element-wise operand computed in registers and staged in shared memory
//   rows_sum_sq,       the same for every batch row at once: one block reduction for all rows' statistics,
//   stage_rows         several vectors' loads before their stores (MPK_STAGE_ROWS_TOGETHER)
//   gemv_acc           the matmul accumulated over the K loop for the tile's N_TILE weight rows
//                      (tensor cores for batch >= 2 under MPK_LINEAR_MMA=1: linear_mma.cuh's order)
// The reduction and GEMV keep the hand-written kinds' loops and summation orders (rms_norm.cuh's
// fmaf over tid-strided k, fused_gemv.cuh's per-lane order), so a generated body that rounds as
// its reference gives the same bits as the hand-written task.
#pragma once
#include "fused_gemv.cuh"

namespace mpk {
namespace tile {

// 8 consecutive values of a row into fp32 registers (16-byte aligned: K % 8 == 0, checked by the host).
__device__ __forceinline__ void load8(const float* p, float* f) {
  const float4 a = *reinterpret_cast<const float4*>(p), c = *reinterpret_cast<const float4*>(p + 4);
  f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w;
  f[4] = c.x; f[5] = c.y; f[6] = c.z; f[7] = c.w;
}

// bf16 activations written earlier in this kernel (coherent load; see ld_act_v4).
__device__ __forceinline__ void load8(const bf16* p, float* f) { unpack8(ld_act_v4(p), f); }

// Read-only bf16 parameters (norm weights): streaming, non-coherent load.
__device__ __forceinline__ void load8_param(const bf16* p, float* f) { unpack8(ld_stream_v4(p), f); }

// 8 fp32 values rounded to bf16, as one 16-byte vector.
__device__ __forceinline__ uint4 pack8(const float* f) {
  __align__(16) bf16 o[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) o[i] = f2bf(f[i]);
  return *reinterpret_cast<const uint4*>(o);
}

// sum_k x[k]^2 of one fp32 row on every worker thread (block_sum ends with a barrier); the loop of
// rms_norm.cuh's fp32 path, so the statistic is bit-identical to the rms_norm task's.
__device__ __forceinline__ float row_sum_sq(const float* x, int K, float* smem, int tid, int nt) {
  float ss = 0.f;
  for (int k = tid; k < K; k += nt) {
    const float f = x[k];
    ss = fmaf(f, f, ss);
  }
  return block_sum(ss, smem, tid, nt);
}

// st[k..k+7] = row.load8(k) over one row of K: the element-wise operand in registers, staged.
template <class Row>
__device__ __forceinline__ void stage_row(bf16* st, int K, const Row& row, int tid, int nt) {
  for (int k = tid * 8; k < K; k += nt * 8) *reinterpret_cast<uint4*>(st + k) = row.load8(k);
}

// ---- all B rows at once (MPK_STAGE_ROWS_TOGETHER; the generated bodies' staged path) ----
// Why: row by row, each row's statistic is a block reduction (two barriers) and each staged vector's
// loads wait for the previous vector's store (the store may alias the source, so the compiler keeps
// the order): at batch 8 that is 16 barriers and 8 (K = 4096) or 24 (K = 12288) memory round trips
// before the weight stream starts. Together: one reduction for every row and kStageAhead vectors'
// loads issued before their stores. The same values in the same order, so the same bits.
#ifndef MPK_STAGE_ROWS_TOGETHER
#define MPK_STAGE_ROWS_TOGETHER 0
#endif
constexpr int kMaxStageRows = 16;  // the kernel's rows (MPK_BATCH <= 16: larger batches are 16-row blocks)
constexpr int kStageAhead = 8;     // staged vectors a thread loads before it stores the first

// smem[b] = sum_k x_b[k]^2 for rows b < B (row(b) gives row b's fp32 pointer), in shared memory at smem[0..B),
// for every thread once it returns. Per row the loop, warp sums and warp order of row_sum_sq / block_sum, so
// each sum has its bits; the warps' partials sit at smem[kMaxStageRows..), over the staging area, which is not
// written before this returns. Needs (kMaxStageRows + B * nwarps) floats of shared memory.
template <class RowPtr>
__device__ __forceinline__ void rows_sum_sq(int B, int K, const RowPtr row, float* smem, int tid, int nt) {
  const int warp = tid >> 5, lane = tid & 31, nwarps = nt >> 5;
  float* part = smem + kMaxStageRows;
  for (int b = 0; b < B; ++b) {
    const float* x = row(b);
    float ss = 0.f;
    for (int k = tid; k < K; k += nt) {
      const float f = x[k];
      ss = fmaf(f, f, ss);
    }
    ss = warp_sum(ss);
    if (lane == 0) part[b * nwarps + warp] = ss;
  }
  worker_barrier(nt);
  if (tid < B) {  // smem[0..B) lies below the partials: no barrier between the reads and the write
    float s = 0.f;
    for (int i = 0; i < nwarps; ++i) s += part[tid * nwarps + i];
    smem[tid] = s;
  }
  worker_barrier(nt);
}

// Whether the staged path can take its B rows together: at most kMaxStageRows rows, and rows_sum_sq's partials
// within the staged rows' shared memory (staged_bytes; true for any K >= 2 x warps).
__device__ __forceinline__ bool rows_together(int B, int K, int nt) {
  return MPK_STAGE_ROWS_TOGETHER && B <= kMaxStageRows &&
         (uint32_t)(kMaxStageRows + B * (nt >> 5)) * (uint32_t)sizeof(float) <= staged_bytes(B, K);
}

// st[b * K + k ..] = make_row(b).load8(k) for rows b < B: kStageAhead vectors' loads before their stores.
template <class MakeRow>
__device__ __forceinline__ void stage_rows(bf16* st, int K, int B, const MakeRow make_row, int tid, int nt) {
  const int per_row = K / 8, n = B * per_row;  // K % 8 == 0 (host-checked for the fused kinds)
  for (int i0 = tid; i0 < n; i0 += kStageAhead * nt) {
    uint4 v[kStageAhead];
#pragma unroll
    for (int u = 0; u < kStageAhead; ++u) {
      // Past the last vector a clamped (repeated) load, never stored: loaded under `i < n` instead, the array
      // went to local memory (ptxas: 128 B of spills, the kernel entry's stack frame 592 -> 880 B).
      const int i = min(i0 + u * nt, n - 1);
      v[u] = make_row(i / per_row).load8((i % per_row) * 8);
    }
#pragma unroll
    for (int u = 0; u < kStageAhead; ++u) {
      const int i = i0 + u * nt;
      if (i < n) *reinterpret_cast<uint4*>(st + (size_t)(i / per_row) * K + (size_t)(i % per_row) * 8) = v[u];
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

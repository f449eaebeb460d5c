// Tile primitives the superoptimizer's generated task bodies are composed of (mpk_dist/superopt/codegen.py,
// csrc/tasks/generated/). Each one is a block-level step of a µGraph's block graph:
//   load8 / pack8      16-byte loads of 8 values of an input tile into registers, 8 results back to bf16
//   row_sum_sq         a row reduction (sum over k of x^2) over the block's worker threads
//   stage_row          an element-wise operand computed in registers and staged in shared memory
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

// Warp-level tensor-core instructions (mma.sync, sm_80+) shared by the task kinds that use them:
// linear_mma.cuh (the batch 2..16 linear tiles) and attention_mma_walk.cuh (decode attention).
//
// Fragment layouts (lane = 4 * g + t, g = lane / 4, t = lane % 4), bf16 operands, fp32 accumulators:
//  * m16n8k16: A (16 x 16, row) a0 = (row g, k 2t, 2t+1), a1 = (row g + 8, k 2t, 2t+1), a2 = (row g, k 2t+8,
//    2t+9), a3 = (row g + 8, k 2t+8, 2t+9); B (16 x 8, col) b0 = (k 2t, 2t+1, col g), b1 = (k 2t+8, 2t+9, col g);
//  * C / D (16 x 8): d0, d1 = (row g, cols 2t, 2t+1), d2, d3 = (row g + 8, cols 2t, 2t+1).
// A register pair of bf16 holds the lower k (or col) in its low 16 bits.
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

namespace mpk {

// D = A * B + D for one m16n8k16 bf16 tile with fp32 accumulators.
__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                               uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Two floats as one bf16 pair (round to nearest), a in the low half.
__device__ __forceinline__ uint32_t pack_bf16x2(float a, float b) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// The 8 x 8 b16 matrix held as lane (g, t): row g, cols 2t, 2t+1, transposed across the warp (sm_75+): the
// result is in the same layout, so lane (g, t) gets the old (2t, g) and (2t + 1, g).
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
  return y;
}

}  // namespace mpk

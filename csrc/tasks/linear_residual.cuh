// linear_residual: y[b, n] = residual[b, n] + bf16(x[b] . w[n]) for the N_TILE rows of one tile
// (mpk_dist/taskgraph/tasks/linear_residual.py): the tp-1 residual add as the linear's epilogue.
// The product is rounded once to bf16 (what the unfused linear stores) and added to the fp32
// residual in fp32 (what the unfused add computes). GEMV: fused_gemv.cuh; x is a bf16 activation.
#pragma once
#include "fused_gemv.cuh"

namespace mpk {

__device__ void linear_residual(int B, const bf16* x, int ldx, const bf16* w, const float* res, float* y, int ldy,
                                int K, int n_tile, int tid, int nt) {
  const Epi epi{y, res, ldy, kEpiResidual};
  MPK_FUSED_WITH_BATCH(B, (gemv_fused<kB>(XRows{x, ldx}, w, K, n_tile, epi, 0u, tid, nt)));
}

}  // namespace mpk

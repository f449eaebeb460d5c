// norm_linear: y[b, n0:n0+N_TILE] = rms_norm(x[b], norm_w) . w[n0:n0+N_TILE] (mpk_dist/taskgraph/tasks/norm_linear.py).
//
// Prologue: the tile computes r = rsqrt(mean(x[b]^2) + eps) for each of its B rows of the fp32
// residual stream with the loop and block reduction of rms_norm.cuh (share_sum_sq, block_sum), so r (and every
// normalised value bf16(norm_w * bf16(x * r))) is bit-identical to what the standalone rms_norm
// task writes. The normalised rows are staged in shared memory (B*K bf16) when the launch has that
// much, else computed per element (gemv_rowwise). GEMV and epilogue: fused_gemv.cuh. Requires
// K % 8 == 0 and 16-byte aligned rows (the fusion pass fuses only such linears).
#pragma once
#include "fused_gemv.cuh"

namespace mpk {

// rsqrt(mean(x^2) + eps) of one row, on every worker thread (block_sum ends with a barrier).
__device__ __forceinline__ float row_rstd(const float* x, int K, float eps, float* smem, int tid, int nt) {
  return rsqrtf(block_sum(share_sum_sq(x, K, tid, nt), smem, tid, nt) / (float)K + eps);
}

__device__ void norm_linear(int B, const float* x, int ldx, const bf16* nw, const bf16* w, const Epi& epi, int K,
                            int n_tile, float eps, float* smem, int tid, int nt) {
  if (stage_fits(B, K)) {
    bf16* st = stage_base(smem);  // [B, K] normalised rows
    if (MPK_NORM_ONE_ROUND && B == 1) {  // the norm weights' copies beside the statistic's loads (fused_gemv.cuh)
      stage_row_fetch_first(st, K, NormRow{x, nw, 0.f}, [&] { return row_rstd(x, K, eps, smem, tid, nt); }, tid, nt);
    } else {
      for (int b = 0; b < B; ++b) {
        const float* xr = x + (size_t)b * ldx;
        stage_row(st + (size_t)b * K, K, NormRow{xr, nw, row_rstd(xr, K, eps, smem, tid, nt)}, tid, nt);
      }
    }
    worker_barrier(nt);  // the staged rows are complete before any warp reads them
    MPK_FUSED_WITH_BATCH(B, (gemv_fused<kB>(XRows{st, K}, w, K, n_tile, epi, staged_bytes(kB, K), tid, nt)));
    return;
  }
  for (int b = 0; b < B; ++b) {
    const float* xr = x + (size_t)b * ldx;
    gemv_rowwise(NormRow{xr, nw, row_rstd(xr, K, eps, smem, tid, nt)}, w, K, n_tile, epi, b, tid, nt);
  }
}

}  // namespace mpk

// silu_linear: y[b, n0:n0+N_TILE] = (residual +) (silu(gate[b]) * up[b]) . w[n0:n0+N_TILE]
// (mpk_dist/taskgraph/tasks/silu_linear.py): silu_mul as the down projection's prologue.
//
// Prologue: a = bf16(bf16(silu(gate)) * up) (silu_mul.cuh's rounding) for the B rows, staged in
// shared memory (B*K bf16) when the launch has that much, else computed per element
// (gemv_rowwise: same values, one expf per element and weight row, so staging is the fast path).
// Epilogue: fused_gemv.cuh (kEpiResidual at tp 1, kEpiBf16 for the partial at tp > 1).
#pragma once
#include "fused_gemv.cuh"

namespace mpk {

__device__ void silu_linear(int B, const bf16* gu, int ldg, int up, const bf16* w, const Epi& epi, int K, int n_tile,
                            float* smem, int tid, int nt) {
  if (stage_fits(B, K)) {
    bf16* st = stage_base(smem);  // [B, K] activations
    for (int b = 0; b < B; ++b) stage_row(st + (size_t)b * K, K, SiluRow{gu + (size_t)b * ldg, up}, tid, nt);
    worker_barrier(nt);  // the staged rows are complete before any warp reads them
    MPK_FUSED_WITH_BATCH(B, (gemv_fused<kB>(XRows{st, K}, w, K, n_tile, epi, staged_bytes(kB, K), tid, nt)));
    return;
  }
  for (int b = 0; b < B; ++b) gemv_rowwise(SiluRow{gu + (size_t)b * ldg, up}, w, K, n_tile, epi, b, tid, nt);
}

}  // namespace mpk

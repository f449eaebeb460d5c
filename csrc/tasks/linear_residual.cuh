// linear_residual: y[b, n] = residual[b, n] + bf16(x[b] . w[n]) for the N_TILE rows of one tile
// (mpk_dist/taskgraph/tasks/linear_residual.py): the tp-1 residual add as the linear's epilogue.
// The product is rounded once to bf16 (what the unfused linear stores) and added to the fp32
// residual in fp32 (what the unfused add computes). GEMV: fused_gemv.cuh; x is a bf16 activation.
//
// MPK_LINEAR_RESIDUAL_STAGE 1 (a measurement variant, off; docs/PERF.md v0.21): with B >= 2 rows the tile first
// copies its x rows into shared memory (stage_row, as silu_linear stages its prologue) and sums from there. Why:
// at batch 2 qwen3-8b's down level ran ~5 us slower as linear_residual (x read from global memory inside the weight
// loop) than as silu_linear (x staged). Same values, same sums: the logits must not change.
#pragma once
#include "fused_gemv.cuh"

#ifndef MPK_LINEAR_RESIDUAL_STAGE
#define MPK_LINEAR_RESIDUAL_STAGE 0
#endif

namespace mpk {

// One bf16 activation row as stage_row reads it.
struct ActRow {
  const bf16* x;
  __device__ __forceinline__ uint4 load8(int k) const { return ld_act_v4(x + k); }
};

// With MPK_FLAG_WORDS: y_flags (y's flagged copy to write, step tag `tag`) and res_flags (the residual's flagged copy,
// read instead of res), each nullptr when the program has none (flag_words.cuh).
// With MPK_SILU_DOWN: y_copy (nullptr: none) gets y's values too (fusion 'silu_down': the residual stream the
// gate|up tiles then add their down partials into).
__device__ void linear_residual(int B, const bf16* x, int ldx, const bf16* w, const float* res, float* y, int ldy,
                                int K, int n_tile, float* smem, int tid, int nt
#if MPK_SILU_DOWN
                                , float* y_copy
#endif
#if MPK_FLAG_WORDS
                                , uint64_t* y_flags, const uint64_t* res_flags, uint32_t tag
#endif
) {
#if MPK_FLAG_WORDS
  Epi epi{y, res, ldy, kEpiResidual};
  epi.y_flags = y_flags;
  epi.res_flags = res_flags;
  epi.tag = tag;
#elif MPK_SILU_DOWN
  Epi epi{y, res, ldy, kEpiResidual};
#else
  const Epi epi{y, res, ldy, kEpiResidual};
#endif
#if MPK_SILU_DOWN
  epi.y_copy = y_copy;
#endif
#if MPK_LINEAR_RESIDUAL_STAGE
  if (B >= 2 && stage_fits(B, K)) {
    bf16* st = stage_base(smem);  // [B, K] copies of the x rows
    for (int b = 0; b < B; ++b) stage_row(st + (size_t)b * K, K, ActRow{x + (size_t)b * ldx}, tid, nt);
    worker_barrier(nt);  // the staged rows are complete before any warp reads them
    MPK_FUSED_WITH_BATCH(B, (gemv_fused<kB>(XRows{st, K}, w, K, n_tile, epi, staged_bytes(kB, K), tid, nt)));
    return;
  }
#else
  (void)smem;
#endif
  MPK_FUSED_WITH_BATCH(B, (gemv_fused<kB>(XRows{x, ldx}, w, K, n_tile, epi, 0u, tid, nt)));
}

#if MPK_FLAG_WORDS
// linear_residual with its x rows already gathered into shared memory (st: [B, K] bf16 at the stage) and its residual
// slice after them (res: [B, n_tile] fp32) by a polling tile (csrc/runtime/dispatch.cuh flag_gather): the staged GEMV,
// y's flagged copy written beside y. The GEMV's own shared memory (tensor-core partials) starts above the residual.
__device__ void linear_residual_staged(int B, const bf16* st, const bf16* w, const float* res, float* y, int ldy, int K,
                                       int n_tile, uint64_t* y_flags, uint32_t tag, int tid, int nt) {
  Epi epi{y, res, ldy, kEpiResidual};
  epi.res_ld = n_tile;
  epi.y_flags = y_flags;
  epi.tag = tag;
  const uint32_t used = ((staged_bytes(B, K) + 15u) & ~15u) + (uint32_t)(B * n_tile) * (uint32_t)sizeof(float);
  MPK_FUSED_WITH_BATCH(B, (gemv_fused<kB>(XRows{st, K}, w, K, n_tile, epi, used, tid, nt)));
}
#endif

}  // namespace mpk

// paged_attention (mpk_dist/taskgraph/tasks/paged_attention.py): the GROUP query heads of one kv
// head, for each of the N tokens of a ragged pass, over positions 0..pos[b] of sequence slot[b],
// read page by page through the page table (PagedKv, qkv_prep_paged.cuh). fp32 scores, softmax
// and products like the reference; output rounded once to bf16; padding tokens (slot -1) get 0.
// Pointers: q/out at the first column of query head h*GROUP (row stride Q_STRIDE); k/v pools at
// kv head h of row 0 of page 0.
// Work split: one warp per token (tokens of a pass belong to different sequences or sit at
// different positions, so the warps need no merge and no shared memory); each warp runs an online
// softmax over its token's positions, lane l holding elements l*epl .. l*epl+epl-1 of a row, as
// attention.cuh does. Limits (checked on the host, serving/megakernel_paged.py): GROUP <= 8, D <= 256.
#pragma once
#include "common.cuh"
#include "attention.cuh"
#include "qkv_prep_paged.cuh"

namespace mpk {

// MG, ME: compile-time bounds of the per-lane arrays (MPK_ATTN_BOUNDS, attention.cuh): the fixed 8 x 8
// arrays spilled ~500 B at 512 threads; the guards keep the arithmetic of every instance the same.
template <int MG, int ME>
__device__ __noinline__ void paged_attention_token(const bf16* q, const bf16* kc, const bf16* vc, const PagedKv& kv,
                                                  int slot, int n_pos, bf16* out, int D, int G, float scale, int lane) {
  const int epl = (D + 31) / 32;
  float qv[MG][ME], acc[MG][ME], m[MG], l[MG];
  attn_warp_init<MG, ME>(q, D, G, lane, qv, acc, m, l);
  for (int t0 = 0; t0 < n_pos; t0 += kv.page_size) {
    const size_t page_base = (size_t)kv.page(slot, t0 / kv.page_size) * kv.page_stride;  // validated by the caller
    const int rows = min(kv.page_size, n_pos - t0);
    for (int r = 0; r < rows; ++r) {
      const size_t row = page_base + (size_t)r * kv.pos_stride;
      attn_warp_step<MG, ME>(qv, kc + row, vc + row, D, G, scale, lane, acc, m, l);
    }
  }
#pragma unroll
  for (int j = 0; j < MG; ++j) {
    if (j < G) {
#pragma unroll
      for (int i = 0; i < ME; ++i) {
        const int d = lane * epl + i;
        if (i < epl && d < D) out[(size_t)j * D + d] = f2bf(l[j] > 0.f ? acc[j][i] / l[j] : 0.f);
      }
    }
  }
}

// Returns false (on every thread) when a token's page table row has a bad entry.
__device__ bool paged_attention(const bf16* q, const bf16* kc, const bf16* vc, const int32_t* pos,
                                const int32_t* slots, const PagedKv& kv, bf16* out, int B, int D, int G, int q_stride,
                                float scale, int tid, int nt) {
  if (!paged_tokens_ok(kv, pos, slots, B, true, tid, nt)) return false;
  const int warp = tid >> 5, lane = tid & 31, nwarps = nt >> 5;
  for (int b = warp; b < B; b += nwarps) {
    bf16* o = out + (size_t)b * q_stride;
    const int s = slots[b];
    if (s < 0) {  // padding token: zeros, as the reference
      for (int i = lane; i < G * D; i += 32) o[i] = f2bf(0.f);
      continue;
    }
    const bf16* qb = q + (size_t)b * q_stride;
    const int n = pos[b] + 1;
    MPK_ATTN_BOUNDS(G, (D + 31) / 32, (paged_attention_token<kMG, kME>(qb, kc, vc, kv, s, n, o, D, G, scale, lane)));
  }
  return true;
}

}  // namespace mpk

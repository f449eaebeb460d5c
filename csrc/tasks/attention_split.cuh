// attention_split (split-KV decode attention; mpk_dist/taskgraph/tasks/attention_split.py): for the
// GROUP query heads of one kv head and every sequence b, the softmax partial over cache positions
// [s0, s1) ∩ [0, pos[b]]: unnormalised fp32 acc[d] = sum_t exp(s_t - m) v[t, d], m = max_t s_t,
// l = sum_t exp(s_t - m), written as one (D + 2)-float entry per (b, g): acc[0..D), m, l.
// An empty range writes acc = 0, m = -inf, l = 0 (attention_merge gives it weight 0).
// Pointers: q at the first column of query head h*GROUP; k/v cache at head h, position 0,
// sequence 0; out at entry (h, b = 0, this split, g = 0), sequences OUT_STRIDE floats apart.
// Two paths, same math:
//  * staged (dynamic shared memory >= attention_smem_bytes(nwarps, G, D), the unsplit attention's
//    need): warp w takes positions s0 + w, s0 + w + nwarps, ... of one sequence with an online
//    softmax; the warps' partials are merged through shared memory.
//  * per-warp (less shared memory): warp w takes whole sequences b = w, w + nwarps, ... and walks
//    the range alone; no shared memory, fewer warps busy at small B.
// Limits (as attention): GROUP <= 8, D <= 256.
#pragma once
#include "attention.cuh"
#include "fused_gemv.cuh"  // dynamic_smem_bytes()

namespace mpk {

// One warp's online softmax over positions begin, begin + step, ... < end for G query heads.
// Lane holds elements lane * epl + i of q, acc. m = -inf and l = 0 when it saw no position.
// MG, ME: compile-time bounds (>= G, >= epl) of the per-lane arrays, one instance per
// MPK_ATTN_BOUNDS pair (attention.cuh): the fixed 8 x 8 arrays spilled ~750 B at 512 threads. The loops
// keep their runtime guards, so every instance does the same arithmetic.
template <int MG, int ME>
struct SplitWarpState {
  float acc[MG][ME], m[MG], l[MG];
};

template <int MG, int ME>
__device__ __forceinline__ void split_warp_partial(const bf16* q, const bf16* kc, const bf16* vc, int D, int G,
                                                   int kv_ps, int begin, int end, int step, float scale,
                                                   SplitWarpState<MG, ME>& st, int lane) {
  float qv[MG][ME];
  attn_warp_init<MG, ME>(q, D, G, lane, qv, st.acc, st.m, st.l);
  for (int t = begin; t < end; t += step)
    attn_warp_step<MG, ME>(qv, kc + (size_t)t * kv_ps, vc + (size_t)t * kv_ps, D, G, scale, lane, st.acc, st.m, st.l);
}

// Staged path for one sequence: warps split the range, merged through shared memory into `out`.
template <int MG, int ME>
__device__ __noinline__ void attention_split_seq(const bf16* q, const bf16* kc, const bf16* vc, float* out, int D, int G, int kv_ps,
                                    int s0, int e, float scale, float* smem, int tid, int nt) {
  const int warp = tid >> 5, lane = tid & 31, nwarps = nt >> 5;
  SplitWarpState<MG, ME> st;
  split_warp_partial<MG, ME>(q, kc, vc, D, G, kv_ps, s0 + warp, e, nwarps, scale, st, lane);
  attn_warp_store<MG, ME>(st.acc, st.m, st.l, smem + (size_t)warp * G * (D + 2), D, G, D + 2, lane);
  worker_barrier(nt);
  for (int idx = tid; idx < G * (D + 2); idx += nt) {
    const int j = idx / (D + 2), d = idx % (D + 2);
    float M = -INFINITY;
    for (int w = 0; w < nwarps; ++w) M = fmaxf(M, smem[(size_t)w * G * (D + 2) + j * (D + 2) + D]);
    float v = d == D ? M : 0.f;
    if (d != D && M != -INFINITY) {
      for (int w = 0; w < nwarps; ++w) {  // warp order: deterministic
        const float* sw = smem + (size_t)w * G * (D + 2) + j * (D + 2);
        v += sw[d] * expf(sw[D] - M);  // a warp that saw no position has m = -inf: factor 0
      }
    }
    out[idx] = v;  // d < D: acc, d == D: m, d == D + 1: l (same rescaling as acc)
  }
  worker_barrier(nt);  // shared memory is reused by the next sequence / task
}

// Per-warp path: warp w takes whole sequences b = w, w + nwarps, ... and walks the range alone.
template <int MG, int ME>
__device__ __noinline__ void attention_split_per_warp(const bf16* q, const bf16* kc, const bf16* vc, const int32_t* pos,
                                                      float* out, int B, int D, int G, int q_stride, int kv_ps,
                                                      int kv_bs, int s0, int s1, int out_stride, float scale, int tid,
                                                      int nt) {
  const int warp = tid >> 5, lane = tid & 31, nwarps = nt >> 5;
  for (int b = warp; b < B; b += nwarps) {
    SplitWarpState<MG, ME> st;
    split_warp_partial<MG, ME>(q + (size_t)b * q_stride, kc + (size_t)b * kv_bs, vc + (size_t)b * kv_bs, D, G, kv_ps,
                               s0, min(s1, pos[b] + 1), 1, scale, st, lane);
    attn_warp_store<MG, ME>(st.acc, st.m, st.l, out + (size_t)b * out_stride, D, G, D + 2, lane);
  }
}

__device__ void attention_split(const bf16* q, const bf16* kc, const bf16* vc, const int32_t* pos, float* out, int B,
                                int D, int G, int q_stride, int kv_ps, int kv_bs, int s0, int s1, int out_stride,
                                float scale, float* smem, int tid, int nt) {
  const int nwarps = nt >> 5;
  const bool staged = (uint32_t)attention_smem_bytes(nwarps, G, D) <= dynamic_smem_bytes();
  if (staged) {
    for (int b = 0; b < B; ++b) {  // e <= s0: no position; the loops below see none and store (0, -inf, 0)
      const bf16 *qb = q + (size_t)b * q_stride, *kb = kc + (size_t)b * kv_bs, *vb = vc + (size_t)b * kv_bs;
      float* ob = out + (size_t)b * out_stride;
      const int e = min(s1, pos[b] + 1);
      MPK_ATTN_BOUNDS(G, (D + 31) / 32,
                      (attention_split_seq<kMG, kME>(qb, kb, vb, ob, D, G, kv_ps, s0, e, scale, smem, tid, nt)));
    }
    return;
  }
  MPK_ATTN_BOUNDS(G, (D + 31) / 32, (attention_split_per_warp<kMG, kME>(q, kc, vc, pos, out, B, D, G, q_stride, kv_ps,
                                                                      kv_bs, s0, s1, out_stride, scale, tid, nt)));
}

}  // namespace mpk

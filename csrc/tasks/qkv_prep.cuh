// qkv_prep (mpk_dist/taskgraph/tasks/qkv_prep.py): one head for all B sequences.
//  q tile : dst[b*dst_bs + d] = rope(norm(qkv[b, head]))           (DST_POS_STRIDE = 0)
//  kv tile: k_cache[b*dst_bs + pos[b]*dst_ps + d] = rope(norm(k)), v_cache[...] = v (v at +V_OFFSET)
// Per-head RMSNorm only when norm_w != nullptr (Qwen3). Rounding follows torch on bf16: the normed
// head is rounded, cos/sin are rounded to bf16, and x*cos, r*sin and their sum are each rounded.
// inv_freq[D/2] is fp32 from the host (any llama3 scaling included). One warp per sequence;
// lane l holds the pairs (d, d + D/2) for d = l, l + 32, ... (D <= 512).
#pragma once
#include "common.cuh"

namespace mpk {

// One head row of one sequence, one warp (lane 0..31): the per-head RMSNorm (when norm_w != nullptr)
// and the rope at position `pos`; src / dst: the head's D values. qk_norm_rope (below) is the hook a
// superoptimizer-generated body replaces: mpk::gen::qk_norm_rope (same signature;
// csrc/tasks/generated/qk_norm_rope.cuh, rendered from the qk_norm_rope µGraph by
// mpk_dist.superopt.codegen_rope) when MPK_SUPEROPT_QK_NORM_ROPE is 1 and the model has q/k norms; this is
// its body with kMaxPairs per-lane pair slots (common.cuh MPK_ROPE_PAIRS picks the instance for D).
template <int kMaxPairs>
__device__ __forceinline__ void qk_norm_rope_pairs(const bf16* src, const bf16* norm_w, const float* inv_freq, int pos,
                                                   bf16* dst, int D, float eps, int lane) {
  const int half = D / 2;
  // Every load first (the head, the norm weights, the frequencies): issued together, one memory round trip
  // instead of three in a row behind the warp sum (the prep time did not move: docs/PERF.md v0.9). Same
  // values, same arithmetic below.
  float lo[kMaxPairs], hi[kMaxPairs], wlo[kMaxPairs], whi[kMaxPairs], freq[kMaxPairs], ss = 0.f;
#pragma unroll
  for (int i = 0; i < kMaxPairs; ++i) {
    const int d = lane + 32 * i;
    lo[i] = hi[i] = wlo[i] = whi[i] = freq[i] = 0.f;
    if (d < half) {
      lo[i] = bf2f(src[d]);
      hi[i] = bf2f(src[d + half]);
      if (norm_w != nullptr) {
        wlo[i] = bf2f(norm_w[d]);
        whi[i] = bf2f(norm_w[d + half]);
      }
      freq[i] = inv_freq[d];
    }
  }
#pragma unroll
  for (int i = 0; i < kMaxPairs; ++i)
    if (lane + 32 * i < half) ss += lo[i] * lo[i] + hi[i] * hi[i];
  if (norm_w != nullptr) {
    const float r = rsqrtf(warp_sum(ss) / (float)D + eps);
#pragma unroll
    for (int i = 0; i < kMaxPairs; ++i) {
      const int d = lane + 32 * i;
      if (d < half) {
        lo[i] = round_bf(wlo[i] * round_bf(lo[i] * r));
        hi[i] = round_bf(whi[i] * round_bf(hi[i] * r));
      }
    }
  }
#pragma unroll
  for (int i = 0; i < kMaxPairs; ++i) {
    const int d = lane + 32 * i;
    if (d < half) {
      const float ang = (float)pos * freq[i];  // fp32 product, as torch forms the angles
      float cr, sr;
      rope_cos_sin(ang, cr, sr);
      const float c = round_bf(cr), s = round_bf(sr);
      // rotate-half: out[d] = x[d] c - x[d+h] s ; out[d+h] = x[d+h] c + x[d] s
      dst[d] = f2bf(round_bf(lo[i] * c) + round_bf(-hi[i] * s));
      dst[d + half] = f2bf(round_bf(hi[i] * c) + round_bf(lo[i] * s));
    }
  }
}

__device__ __forceinline__ void qk_norm_rope(const bf16* src, const bf16* norm_w, const float* inv_freq, int pos,
                                             bf16* dst, int D, float eps, int lane) {
  MPK_ROPE_PAIRS(D, (qk_norm_rope_pairs<kPairs>(src, norm_w, inv_freq, pos, dst, D, eps, lane)));
}

}  // namespace mpk

// Superoptimized body (mpk_dist.runtime.superopt_tasks): MPK_SUPEROPT comes from the generated .cu; a
// build whose search gave no lowerable µGraph has -DMPK_SUPEROPT_QK_NORM_ROPE=0. The hook header forwards
// to "generated/qk_norm_rope.cuh" on the include path: the build's per-µGraph folder (first on the path),
// else csrc/tasks/generated (see generated/qk_norm_rope_hook.cuh for why it is not included from here).
#ifndef MPK_SUPEROPT_QK_NORM_ROPE
#define MPK_SUPEROPT_QK_NORM_ROPE MPK_SUPEROPT
#endif
#if MPK_SUPEROPT_QK_NORM_ROPE
#include "generated/qk_norm_rope_hook.cuh"
#endif

namespace mpk {

__device__ void qkv_prep(const bf16* qkv, const int32_t* pos, const bf16* norm_w, const float* inv_freq, bf16* dst,
                         bf16* dst_v, int B, int D, int qkv_stride, int v_offset, int dst_bs, int dst_ps, int is_kv,
                         float eps, int tid, int nt) {
  const int warp = tid >> 5, lane = tid & 31, nwarps = nt >> 5;
  for (int b = warp; b < B; b += nwarps) {
    const int p = pos[b];
    const bf16* src = qkv + (size_t)b * qkv_stride;
    const size_t o = (size_t)b * dst_bs + (size_t)p * dst_ps;
#if MPK_SUPEROPT_QK_NORM_ROPE
    if (norm_w != nullptr)  // the generated body is the qk_norm_rope µGraph's: norm, then rope
      gen::qk_norm_rope(src, norm_w, inv_freq, p, dst + o, D, eps, lane);
    else
#endif
      qk_norm_rope(src, norm_w, inv_freq, p, dst + o, D, eps, lane);
    if (is_kv) {
      for (int d = lane; d < D; d += 32) dst_v[o + d] = src[v_offset + d];
    }
  }
}

}  // namespace mpk

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

__device__ void qkv_prep(const bf16* qkv, const int32_t* pos, const bf16* norm_w, const float* inv_freq, bf16* dst,
                         bf16* dst_v, int B, int D, int qkv_stride, int v_offset, int dst_bs, int dst_ps, int is_kv,
                         float eps, int tid, int nt) {
  const int warp = tid >> 5, lane = tid & 31, nwarps = nt >> 5, half = D / 2;
  constexpr int kMaxPairs = 8;
  for (int b = warp; b < B; b += nwarps) {
    const int p = pos[b];
    const bf16* src = qkv + (size_t)b * qkv_stride;
    const size_t o = (size_t)b * dst_bs + (size_t)p * dst_ps;
    float lo[kMaxPairs], hi[kMaxPairs], ss = 0.f;
#pragma unroll
    for (int i = 0; i < kMaxPairs; ++i) {
      const int d = lane + 32 * i;
      lo[i] = hi[i] = 0.f;
      if (d < half) {
        lo[i] = bf2f(src[d]);
        hi[i] = bf2f(src[d + half]);
        ss += lo[i] * lo[i] + hi[i] * hi[i];
      }
    }
    if (norm_w != nullptr) {
      const float r = rsqrtf(warp_sum(ss) / (float)D + eps);
#pragma unroll
      for (int i = 0; i < kMaxPairs; ++i) {
        const int d = lane + 32 * i;
        if (d < half) {
          lo[i] = round_bf(bf2f(norm_w[d]) * round_bf(lo[i] * r));
          hi[i] = round_bf(bf2f(norm_w[d + half]) * round_bf(hi[i] * r));
        }
      }
    }
#pragma unroll
    for (int i = 0; i < kMaxPairs; ++i) {
      const int d = lane + 32 * i;
      if (d < half) {
        const float ang = (float)p * inv_freq[d];  // fp32 product, as torch forms the angles
        const float c = round_bf(cosf(ang)), s = round_bf(sinf(ang));
        // rotate-half: out[d] = x[d] c - x[d+h] s ; out[d+h] = x[d+h] c + x[d] s
        dst[o + d] = f2bf(round_bf(lo[i] * c) + round_bf(-hi[i] * s));
        dst[o + d + half] = f2bf(round_bf(hi[i] * c) + round_bf(lo[i] * s));
      }
    }
    if (is_kv) {
      for (int d = lane; d < D; d += 32) dst_v[o + d] = src[v_offset + d];
    }
  }
}

}  // namespace mpk

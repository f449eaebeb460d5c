// attention_merge (split-KV decode attention; mpk_dist/taskgraph/tasks/attention_merge.py): for one
// (kv head h, sequence b), combine the SPLITS partials (acc_i, m_i, l_i) of each of the GROUP query
// heads with the log-sum-exp rule, all fp32:
//   M = max_i m_i,  w_i = exp(m_i - M),  o[d] = sum_i w_i acc_i[d] / sum_i w_i l_i
// and round o once to bf16 (as the unsplit attention rounds softmax(..) v). Splits with m_i = -inf
// (no position in range) are skipped; they are summed in index order, so the result is deterministic.
// Pointers: part at entry (h, b, split 0, g 0) of the [Hkv, B, SPLITS, GROUP, D + 2] scratch; out at
// row b, first column of query head h*GROUP. One thread per output element; no shared memory.
#pragma once
#include "common.cuh"

namespace mpk {

// Partials a thread loads before it uses the first: the loop over splits was one L2 round trip per
// split (9 at qwen3-8b's context ~512), twice (max, then sums): ~6 us a merge tile on the H200 trace.
// Chunks are folded in index order, so the sums, and every bit of the result, are as one at a time.
constexpr int kMergeChunk = 8;

__device__ void attention_merge(const float* part, bf16* out, int D, int G, int splits, int tid, int nt) {
  const int entry = D + 2, per_split = G * entry;
  for (int idx = tid; idx < G * D; idx += nt) {
    const int j = idx / D, d = idx % D;
    const float* p = part + (size_t)j * entry;
    float M = -INFINITY;
    for (int i0 = 0; i0 < splits; i0 += kMergeChunk) {
      float m[kMergeChunk];
#pragma unroll
      for (int u = 0; u < kMergeChunk; ++u) m[u] = i0 + u < splits ? p[(size_t)(i0 + u) * per_split + D] : -INFINITY;
#pragma unroll
      for (int u = 0; u < kMergeChunk; ++u) M = fmaxf(M, m[u]);
    }
    float num = 0.f, den = 0.f;
    if (M != -INFINITY) {
      for (int i0 = 0; i0 < splits; i0 += kMergeChunk) {
        float m[kMergeChunk], a[kMergeChunk], l[kMergeChunk];
#pragma unroll
        for (int u = 0; u < kMergeChunk; ++u) {
          const bool in = i0 + u < splits;
          const float* pi = p + (size_t)(i0 + u) * per_split;
          m[u] = in ? pi[D] : -INFINITY;
          a[u] = in ? pi[d] : 0.f;
          l[u] = in ? pi[D + 1] : 0.f;
        }
#pragma unroll
        for (int u = 0; u < kMergeChunk; ++u) {
          if (m[u] == -INFINITY) continue;  // empty range (or past the last split): weight 0, acc not summed
          const float w = expf(m[u] - M);
          num = fmaf(w, a[u], num);
          den = fmaf(w, l[u], den);
        }
      }
    }
    out[idx] = f2bf(den > 0.f ? num / den : 0.f);
  }
}

}  // namespace mpk

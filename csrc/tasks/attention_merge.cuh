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
#include "flag_words.cuh"  // the merged output's flagged copy (MPK_FLAG_WORDS)
#include "trace_marks.cuh"

namespace mpk {

// MPK_MERGE_LOADS_AHEAD 1 (the default): the sums' loads do not wait for the range's m test (acc and l are read and
// summed for an empty range too, whose scratch entry exists, and the sum is not taken), and both loops are unrolled by
// kMergeUnroll, so a thread has that many ranges' loads in flight at once. Why: in the plain loop (0) each group of
// ranges' acc and l loads waited behind its m test, about ten dependent L2 round trips in the last tile of a head;
// measured 1.1% faster on qwen3-0.6b, 0.7% on qwen3-1.7b, no change on qwen3-8b (docs/PERF.md v0.22). Same
// operations in the same order: the same bits (tests/runtime/test_code_variants_gpu.py).
#ifndef MPK_MERGE_LOADS_AHEAD
#define MPK_MERGE_LOADS_AHEAD 1
#endif
#ifndef MPK_MERGE_UNROLL
#define MPK_MERGE_UNROLL 16  // ranges a thread has in flight (the batch-1 programs here split a head into 16)
#endif
constexpr int kMergeUnroll = MPK_MERGE_UNROLL;

// With MPK_FLAG_WORDS, out_flags (nullptr: none) gets out's flagged copy, a word per column pair (flag_words.cuh;
// G x D is even and nt a multiple of 32, so element pairs sit on lane pairs).
__device__ void attention_merge(const float* part, bf16* out, int D, int G, int splits, int tid, int nt
#if MPK_FLAG_WORDS
                                , uint64_t* out_flags = nullptr, uint32_t tag = 0
#endif
) {
  const int entry = D + 2, per_split = G * entry;
  for (int idx = tid; idx < G * D; idx += nt) {
    const int j = idx / D, d = idx % D;
    const float* p = part + (size_t)j * entry;
    float M = -INFINITY;
#if MPK_MERGE_LOADS_AHEAD
#pragma unroll kMergeUnroll
#endif
    for (int i = 0; i < splits; ++i) M = fmaxf(M, p[(size_t)i * per_split + D]);
    float num = 0.f, den = 0.f;
    if (M != -INFINITY) {
#if MPK_MERGE_LOADS_AHEAD
#pragma unroll kMergeUnroll
      for (int i = 0; i < splits; ++i) {
        const float* pi = p + (size_t)i * per_split;
        const float m = pi[D], acc = pi[d], l = pi[D + 1];
        // Computed for an empty range too (m = -inf: w = 0, acc maybe never written) and then not taken, so the
        // loads do not wait for the test; a taken range's sums are the loop's below.
        const float w = expf(m - M);
        const float num_i = fmaf(w, acc, num), den_i = fmaf(w, l, den);
        const bool empty = m == -INFINITY;  // empty range: weight 0, acc never read into the sum
        num = empty ? num : num_i;
        den = empty ? den : den_i;
      }
#else
      for (int i = 0; i < splits; ++i) {
        const float* pi = p + (size_t)i * per_split;
        const float m = pi[D];
        if (m == -INFINITY) continue;  // empty range: weight 0, acc never read into the sum
        const float w = expf(m - M);
        num = fmaf(w, pi[d], num);
        den = fmaf(w, pi[D + 1], den);
      }
#endif
    }
#if MPK_FLAG_WORDS
    const bf16 o = f2bf(den > 0.f ? num / den : 0.f);
    out[idx] = o;
    if (out_flags != nullptr) flag_store_pair(out_flags, (size_t)idx, o, tag);
#else
    out[idx] = f2bf(den > 0.f ? num / den : 0.f);
#endif
  }
}

// Entry (h, b = 0, range 0, g = 0) of the scratch, from a split tile's own entry (range `split`).
__device__ __forceinline__ const float* split_head_partials(const float* own, int split, int G, int D) {
  return own - (size_t)split * G * (D + 2);
}

// Ranges of a head, from the scratch's per-sequence stride (SPLITS x GROUP x (D + 2) floats).
__device__ __forceinline__ int split_count(int out_stride, int G, int D) { return out_stride / (G * (D + 2)); }

// The merge done by the last split tile of kv head h (fusion 'attn_merge'; tasks/attention_split.py): every
// tile of the head ends here; the one whose ticket add completes the head's `splits` merges all B
// sequences of the head from the scratch (part_head: entry (h, b = 0, range 0, g = 0), sequences
// part_stride floats apart) into `merged` (row 0, first column of query head h*GROUP; rows
// merged_stride apart). Same sums as the merge tiles.
__device__ void attention_merge_last(uint32_t* ticket, const float* part_head, bf16* merged, int B, int D, int G,
                                     int splits, int part_stride, int merged_stride, int tid, int nt
#if MPK_FLAG_WORDS
                                     , uint64_t* merged_flags = nullptr, uint32_t tag = 0
#endif
) {
  __shared__ int last;
  worker_barrier(nt);  // every thread's partial stores precede thread 0's release in the ticket
  if (tid == 0) last = ticket_last(ticket, (uint32_t)splits);
  worker_barrier(nt);  // hands thread 0's acquired view (the other ranges' partials) to every thread
  trace_mark(3, tid);  // trace: the ticket is taken (the last tile's head merge follows)
  if (!last) return;
  for (int b = 0; b < B; ++b)
#if MPK_FLAG_WORDS
    attention_merge(part_head + (size_t)b * part_stride, merged + (size_t)b * merged_stride, D, G, splits, tid, nt,
                    merged_flags == nullptr ? nullptr : merged_flags + (size_t)b * merged_stride / 2, tag);
#else
    attention_merge(part_head + (size_t)b * part_stride, merged + (size_t)b * merged_stride, D, G, splits, tid, nt);
#endif
}

}  // namespace mpk

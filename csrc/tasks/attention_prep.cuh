// attention_prep (mpk_dist/taskgraph/tasks/attention_prep.py; fusion 'attn_prep'): one tile = (kv head j,
// sequence b). First qkv_prep's work for that pair: k head j -> norm + rope -> K cache at pos[b], v head j
// -> V cache at pos[b], the GROUP q heads of group j -> norm + rope -> the q rows attention reads; then a
// block barrier; then exactly attention's tile (j, b): attention_seq over positions 0..pos[b]. The task
// body (run_attention_prep in csrc/runtime/dispatch.cuh) strings the two halves together.
// Bit-identical to qkv_prep + attention: the per-head body is qkv_prep.cuh's qk_norm_rope (or the
// superoptimizer's gen::qk_norm_rope under MPK_SUPEROPT_QK_NORM_ROPE, chosen as qkv_prep chooses it), one
// warp per head as there, and the attention is attention.cuh's attention_seq<MG, ME> through
// MPK_ATTN_BOUNDS with the same threads and shared memory (its merge's, attention.cuh attention_merge_smem_bytes).
// Pointers: qkv at row b, query head j*G (k head k_off further, v head v_off after it); q / out at row
// b, query head j*G; k / v cache at sequence b, position 0, head j.
#pragma once
#include "common.cuh"
#include "qkv_prep.cuh"
#include "attention.cuh"
#include "weight_stream.cuh"  // smem_below_ring(): room for attention_seq's merge

// MPK_PREP_ONE_SITE 0: the q heads and the k head each with their own inlined body (the old code; a GPU test
// checks the default against it bit for bit, tests/runtime/test_code_variants_gpu.py).
#ifndef MPK_PREP_ONE_SITE
#define MPK_PREP_ONE_SITE 1
#endif

namespace mpk {

// One head of one sequence, one warp: the body qkv_prep runs for it (same hook, same choice).
__device__ __forceinline__ void attn_prep_head(const bf16* src, const bf16* norm_w, const float* inv_freq, int pos,
                                               bf16* dst, int D, float eps, int lane) {
#if MPK_SUPEROPT_QK_NORM_ROPE
  if (norm_w != nullptr)  // the generated body is the qk_norm_rope µGraph's: norm, then rope
    gen::qk_norm_rope(src, norm_w, inv_freq, pos, dst, D, eps, lane);
  else
#endif
    qk_norm_rope(src, norm_w, inv_freq, pos, dst, D, eps, lane);
}

// The prep half: warps 0..G-1 take the q heads of the group, warp G the kv head (k roped into the cache
// at position p = *pos, v copied) when append_begin <= p < append_end (attention_split_prep: only the range
// holding p appends; a position outside writes no cache row), looping when there are fewer warps. The position
// is read here, beside the head's loads, so a caller need not wait for it first (one memory round trip fewer
// on the attention's critical path). Not inlined: its per-lane arrays get their own register allocation, apart
// from the attention's (as qkv_prep and attention are apart).
__device__ __noinline__ void attention_prep_heads(const bf16* qkv, const bf16* q_norm, const bf16* k_norm,
                                                  const float* inv_freq, bf16* q, bf16* kc, bf16* vc,
                                                  const int32_t* pos, int append_begin, int append_end, int D, int G,
                                                  int k_off, int v_off, int kv_ps, float eps, int tid, int nt) {
  const int warp = tid >> 5, lane = tid & 31, nwarps = nt >> 5;
  const int p = *pos;
  const bool append = append_begin <= p && p < append_end;
  const size_t o = (size_t)p * kv_ps;
  for (int h = warp; h < G + (append ? 1 : 0); h += nwarps) {
#if MPK_PREP_ONE_SITE
    // One inlined body for the q heads and the k head: the code is fetched cold every layer, so the k warp
    // running its own copy doubled the bytes the tile fetched (same arguments as the two sites below).
    const bool is_k = h >= G;
    const bf16* src = is_k ? qkv + k_off : qkv + (size_t)h * D;
    attn_prep_head(src, is_k ? k_norm : q_norm, inv_freq, p, is_k ? kc + o : q + (size_t)h * D, D, eps, lane);
    if (is_k)
      for (int d = lane; d < D; d += 32) vc[o + d] = src[v_off + d];
#else
    if (h < G) {
      attn_prep_head(qkv + (size_t)h * D, q_norm, inv_freq, p, q + (size_t)h * D, D, eps, lane);
    } else {
      const bf16* src = qkv + k_off;
      attn_prep_head(src, k_norm, inv_freq, p, kc + o, D, eps, lane);
      for (int d = lane; d < D; d += 32) vc[o + d] = src[v_off + d];
    }
#endif
  }
}

// Whether a tile's shape, position and the launch's shared memory are ones the bodies handle (else the
// worker reports a bad task before anything is written): G <= kAttnMaxG, D even and <= 32 * kAttnMaxEpl,
// 0 <= p < max_seq, and dynamic shared memory for attention_seq's merge in kAttnMaxMergePhases phases, its least
// (mpk_dist.taskgraph.lowering_attn_prep.attn_prep_smem_bytes; from 4 warps and D >= 8 each phase count needs less).
__device__ __forceinline__ bool attention_prep_ok(int D, int G, int p, int max_seq, int nt) {
  return G >= 1 && G <= kAttnMaxG && D <= 32 * kAttnMaxEpl && !(D & 1) && p >= 0 && p < max_seq &&
         (uint32_t)attention_merge_smem_bytes(nt >> 5, G, D, kAttnMaxMergePhases) <= smem_below_ring();
}

}  // namespace mpk

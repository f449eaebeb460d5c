// attention_split_prep (mpk_dist/taskgraph/tasks/attention_split_prep.py; the 'attn_prep' fusion in a
// split-KV program): tile (kv head j, KV range i), for each sequence b: the q heads of group j normed and
// roped into shared memory (every range of head j computes the same q; none writes a q buffer), k and v
// of head j appended at pos[b] only by the range holding pos[b] (attention_prep.cuh's
// attention_prep_heads with append = that test), a block barrier, then attention_split.cuh's staged
// attention_split_seq on that q: the partial the unfused qkv_prep + attention_split give, bit for bit.
// The body itself (run_attention_split_prep) is in csrc/runtime/dispatch.cuh next to run_attention_prep.
// Shared memory: the staged merge's nwarps * G * (D + 2) floats, then G * D bf16 of q
// (mpk_dist.taskgraph.lowering_attn_prep.split_prep_smem_bytes sizes the launch for it), then, with
// REC_FLAG_STAGE_KV, the range's cache rows below each sequence's position (attention_split.cuh
// KvStage; their copies fly during the prep; the row at the position, appended here, is read from the cache).
#pragma once
#include "attention_split.cuh"
#include "attention_prep.cuh"

namespace mpk {

__host__ __device__ inline int split_prep_smem_bytes(int nwarps, int G, int D) {
  return attention_smem_bytes(nwarps, G, D) + G * D * (int)sizeof(bf16);
}

// Whether the shape and the launch's shared memory are ones the body handles (else a bad task, before
// anything is written): G <= kAttnMaxG, D even and <= 32 * kAttnMaxEpl, the staged share plus q.
__device__ __forceinline__ bool split_prep_ok(int D, int G, int nt) {
  return G >= 1 && G <= kAttnMaxG && D <= 32 * kAttnMaxEpl && !(D & 1) &&
         (uint32_t)split_prep_smem_bytes(nt >> 5, G, D) <= smem_below_ring();
}

// The tile's q rows: right after the staged merge's floats.
__device__ __forceinline__ bf16* split_prep_q(float* smem, int G, int D, int nt) {
  return reinterpret_cast<bf16*>(smem + attention_smem_bytes(nt >> 5, G, D) / (int)sizeof(float));
}

// Byte offset of the cache-row stage: after q, 16-byte aligned for cp.async.
__host__ __device__ inline int split_prep_stage_at(int nwarps, int G, int D) {
  return align16(split_prep_smem_bytes(nwarps, G, D));
}

}  // namespace mpk

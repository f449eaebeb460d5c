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
// Staged cache rows (record flag REC_FLAG_STAGE_KV, staged path only): the range's k and v rows are first
// copied into shared memory after the merge scratch (KvStage below), all at once, and the walk reads them
// there; the same values in the same order, so the same bits.
// Limits (as attention): GROUP <= 8, D <= 256.
#pragma once
#include "attention.cuh"
#include "fused_gemv.cuh"  // dynamic_smem_bytes()
#include "trace_marks.cuh"

namespace mpk {

// ---- the range's cache rows in shared memory (REC_FLAG_STAGE_KV) ----
// Why: a warp walks its positions one after another, and each k / v row load is a memory round trip
// behind the previous position's softmax update (4 positions a warp for a 64-position range at 16 warps,
// each ~1 us under the weight stream). Staged, every row of the range is requested at once (16-byte
// cp.async by all the tile's threads) and the walk reads shared memory.
constexpr int kStageChunk = 8;  // bf16 per 16-byte cp.async

// Rows [begin, end) of one sequence staged: row t of k at k + (t - begin) * D (v likewise). The default
// (end = 0) stages nothing: every row comes from the cache.
struct KvStage {
  const bf16* k = nullptr;
  const bf16* v = nullptr;
  int begin = 0, end = 0;
};

// Shared-memory bytes of the stage for B sequences of `rows` positions (k and v).
__host__ __device__ inline int kv_stage_bytes(int B, int rows, int D) { return B * rows * 2 * D * (int)sizeof(bf16); }

__host__ __device__ inline int align16(int bytes) { return (bytes + 15) & ~15; }

// Whether the rows can be staged: 16-byte aligned rows and strides, and the stage (ending `end_bytes` into
// the dynamic shared memory) within the launch's.
__device__ __forceinline__ bool kv_stage_ok(const bf16* kc, const bf16* vc, int D, int kv_ps, int kv_bs,
                                            int end_bytes) {
  return D % kStageChunk == 0 && kv_ps % kStageChunk == 0 && kv_bs % kStageChunk == 0 &&
         ((reinterpret_cast<uintptr_t>(kc) | reinterpret_cast<uintptr_t>(vc)) & 15) == 0 &&
         (uint32_t)end_bytes <= smem_below_ring();
}

// Sequence b's part of the stage at `stage`: k rows then v rows, `rows` positions each.
__device__ __forceinline__ KvStage kv_stage_of(bf16* stage, int b, int rows, int D, int begin, int end) {
  KvStage st;
  st.k = stage + (size_t)b * 2 * rows * D;
  st.v = st.k + (size_t)rows * D;
  st.begin = begin;
  st.end = end;
  return st;
}

// Issue the copies of rows [s0, min(s1, pos[b] + written)) of k and v of every sequence (written: 1 when
// row pos[b] is in the cache already, 0 when this tile appends it). Each thread waits for its own
// copies (cp_async_wait_all) and a block barrier publishes them.
__device__ __forceinline__ void kv_stage_issue(const bf16* kc, const bf16* vc, const int32_t* pos, int B, int D,
                                               int kv_ps, int kv_bs, int s0, int s1, int written, bf16* stage,
                                               int tid, int nt) {
  const int rows = s1 - s0, per_row = D / kStageChunk, per_seq = 2 * rows * per_row;
  for (int i = tid; i < B * per_seq; i += nt) {
    const int b = i / per_seq, j = i % per_seq;
    const bool is_v = j >= rows * per_row;
    const int r = (is_v ? j - rows * per_row : j) / per_row, c = j % per_row;
    if (s0 + r >= min(s1, pos[b] + written)) continue;
    const size_t src = (size_t)b * kv_bs + (size_t)(s0 + r) * kv_ps + (size_t)c * kStageChunk;
    cp_async16(stage + ((size_t)b * 2 + (is_v ? 1 : 0)) * rows * D + (size_t)r * D + (size_t)c * kStageChunk,
               (is_v ? vc : kc) + src);
  }
}

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
                                                   SplitWarpState<MG, ME>& st, int lane,
                                                   const KvStage& stage = KvStage()) {
  float qv[MG][ME];
  attn_warp_init<MG, ME>(q, D, G, lane, qv, st.acc, st.m, st.l);
  for (int t = begin; t < end; t += step) {
    const bool staged = t < stage.end;  // stage.begin <= begin: a staged range starts at the tile's first row
    const bf16* kr = staged ? stage.k + (size_t)(t - stage.begin) * D : kc + (size_t)t * kv_ps;
    const bf16* vr = staged ? stage.v + (size_t)(t - stage.begin) * D : vc + (size_t)t * kv_ps;
    attn_warp_step<MG, ME>(qv, kr, vr, D, G, scale, lane, st.acc, st.m, st.l);
  }
}

// Staged path for one sequence: warps split the range, merged through shared memory into `out`.
template <int MG, int ME>
__device__ __noinline__ void attention_split_seq(const bf16* q, const bf16* kc, const bf16* vc, float* out, int D, int G, int kv_ps,
                                    int s0, int e, float scale, float* smem, int tid, int nt,
                                    const KvStage& stage = KvStage()) {
  const int warp = tid >> 5, lane = tid & 31, nwarps = nt >> 5;
  float* mine = smem + (size_t)warp * G * (D + 2);  // this warp's merge entries
  const bool unstaged = stage.end <= stage.begin;
  if (MPK_ATTN_SPLIT_MMA_WALK && unstaged && attn_mma_walk_ok<MG, ME>(q, kc, vc, D, G, kv_ps, e)) {
    attn_mma_walk<MG, ME>(q, kc, vc, D, G, kv_ps, s0 + warp, e, nwarps, scale, lane, mine, D + 2);
  } else {
    SplitWarpState<MG, ME> st;
    if (MPK_ATTN_SPLIT_BLOCK_WALK && unstaged && attn_block_walk_ok<MG, ME>(kc, vc, D, kv_ps, mine)) {
      float qv[MG][ME];
      attn_warp_init<MG, ME>(q, D, G, lane, qv, st.acc, st.m, st.l);
      attn_block_walk<MG, ME>(qv, mine, kc, vc, D, G, kv_ps, s0 + warp, e, nwarps, scale, lane, st.acc, st.m, st.l);
    } else {
      split_warp_partial<MG, ME>(q, kc, vc, D, G, kv_ps, s0 + warp, e, nwarps, scale, st, lane, stage);
    }
    attn_warp_store<MG, ME>(st.acc, st.m, st.l, mine, D, G, D + 2, lane);
  }
  worker_barrier(nt);
  trace_mark(1, tid);  // trace: every warp's walk is done (the block merge follows)
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
                                float scale, float* smem, int tid, int nt, bool stage_kv) {
  const int nwarps = nt >> 5;
  const bool staged = (uint32_t)attention_smem_bytes(nwarps, G, D) <= dynamic_smem_bytes();
  if (staged) {
    // The cache rows after the merge scratch; rows <= pos[b] are all written (qkv_prep ran before this tile).
    const int stage_at = align16(attention_smem_bytes(nwarps, G, D));
    bf16* stage = reinterpret_cast<bf16*>(reinterpret_cast<char*>(smem) + stage_at);
    const bool use = stage_kv && kv_stage_ok(kc, vc, D, kv_ps, kv_bs, stage_at + kv_stage_bytes(B, s1 - s0, D));
    if (use) {
      kv_stage_issue(kc, vc, pos, B, D, kv_ps, kv_bs, s0, s1, 1, stage, tid, nt);
      cp_async_wait_all();
      worker_barrier(nt);
    }
    for (int b = 0; b < B; ++b) {  // e <= s0: no position; the loops below see none and store (0, -inf, 0)
      const bf16 *qb = q + (size_t)b * q_stride, *kb = kc + (size_t)b * kv_bs, *vb = vc + (size_t)b * kv_bs;
      float* ob = out + (size_t)b * out_stride;
      const int e = min(s1, pos[b] + 1);
      const KvStage st = use ? kv_stage_of(stage, b, s1 - s0, D, s0, e) : KvStage();
      MPK_ATTN_BOUNDS(G, (D + 31) / 32,
                      (attention_split_seq<kMG, kME>(qb, kb, vb, ob, D, G, kv_ps, s0, e, scale, smem, tid, nt, st)));
    }
    return;
  }
  MPK_ATTN_BOUNDS(G, (D + 31) / 32, (attention_split_per_warp<kMG, kME>(q, kc, vc, pos, out, B, D, G, q_stride, kv_ps,
                                                                      kv_bs, s0, s1, out_stride, scale, tid, nt)));
}

}  // namespace mpk

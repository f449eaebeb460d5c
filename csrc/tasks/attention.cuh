// attention (decode, GQA; mpk_dist/taskgraph/tasks/attention.py): the GROUP query heads sharing one
// kv head, for every sequence b, over cache positions 0..pos[b]. fp32 scores, softmax and
// products like the torch reference; output rounded once to bf16.
// Pointers: q/out at the first column of query head h*GROUP; k/v cache at head h, position 0,
// sequence 0. Warp w takes positions w, w + nwarps, ... with an online softmax per query head;
// the warps' (m, l, acc) are merged through shared memory (nwarps * G * (D + 2) floats).
// Limits (checked on the host): GROUP <= 8, D <= 256.
#pragma once
#include "common.cuh"

namespace mpk {

constexpr int kAttnMaxG = 8;
constexpr int kAttnMaxEpl = 8;  // elements per lane: D <= 256

// Runs CALL with constexpr kMG = the power of two >= G (<= kAttnMaxG) and kME = 2, 4 or 8 >= epl
// (the host checked G <= kAttnMaxG and D <= 32 * kAttnMaxEpl).
#define MPK_ATTN_ME(G_, EPL_, CALL, MG_)                  \
  do {                                                    \
    constexpr int kMG = MG_;                              \
    if ((EPL_) <= 2) { constexpr int kME = 2; CALL; }     \
    else if ((EPL_) <= 4) { constexpr int kME = 4; CALL; } \
    else { constexpr int kME = 8; CALL; }                 \
  } while (0)
#define MPK_ATTN_BOUNDS(G_, EPL_, CALL)                                  \
  do {                                                                   \
    if ((G_) <= 1) MPK_ATTN_ME(G_, EPL_, CALL, 1);                       \
    else if ((G_) <= 2) MPK_ATTN_ME(G_, EPL_, CALL, 2);                  \
    else if ((G_) <= 4) MPK_ATTN_ME(G_, EPL_, CALL, 4);                  \
    else MPK_ATTN_ME(G_, EPL_, CALL, kAttnMaxG);                          \
  } while (0)

// ---- the per-warp online softmax shared by attention, attention_split, paged_attention and attention_prep --
// Lane l holds elements l*epl .. l*epl+epl-1 of a head (epl = ceil(D / 32)); qv, acc, m, l live in registers.
// The runtime guards (j < G, i < epl && d < D) make every (MG, ME) instance do the same arithmetic.

// q of the G heads into registers; acc = 0, m = -inf, l = 0 (a warp that sees no position keeps them).
template <int MG, int ME>
__device__ __forceinline__ void attn_warp_init(const bf16* q, int D, int G, int lane, float (&qv)[MG][ME],
                                               float (&acc)[MG][ME], float (&m)[MG], float (&l)[MG]) {
  const int epl = (D + 31) / 32;
#pragma unroll
  for (int j = 0; j < MG; ++j) {
    m[j] = -INFINITY;
    l[j] = 0.f;
#pragma unroll
    for (int i = 0; i < ME; ++i) {
      const int d = lane * epl + i;
      acc[j][i] = 0.f;
      qv[j][i] = (j < G && i < epl && d < D) ? bf2f(q[(size_t)j * D + d]) : 0.f;
    }
  }
}

// Cache positions whose k and v rows a warp loads before it scores the first of them
// (MPK_ATTN_UNROLL, mpk_dist.runtime.codegen.ATTN_UNROLLS). A warp walks its positions one after
// another, so with one row in flight every position cost a full memory round trip (qwen3-8b at
// context 512: ~35 us a layer in the 8 attention tiles). The rows are scored in the same order as
// before, so the arithmetic, and every bit of the result, does not depend on this.
#ifndef MPK_ATTN_UNROLL
#define MPK_ATTN_UNROLL 4
#endif
constexpr int kAttnRowsInFlight = MPK_ATTN_UNROLL;
static_assert(kAttnRowsInFlight >= 1 && kAttnRowsInFlight <= 16, "MPK_ATTN_UNROLL: 1..16 rows in flight");

// One lane's elements lane*epl .. lane*epl+epl-1 of a k row and a v row, as raw bf16 pairs (element i
// in the low half of word i/2 when i is even), so rows in flight cost ME registers, not 2 * ME.
template <int ME>
struct AttnKvRow {
  static constexpr int kWords = (ME + 1) / 2;
  uint32_t k[kWords], v[kWords];
};

// Element i of a row held as bf16 pairs, widened exactly as bf2f does (bf16 is fp32's high half).
template <int ME>
__device__ __forceinline__ float attn_row_elem(const uint32_t (&w)[AttnKvRow<ME>::kWords], int i) {
  const uint32_t x = w[i >> 1];
  return __uint_as_float((i & 1) ? (x & 0xffff0000u) : (x << 16));
}

// One row's elements of this lane: one vector load when they fill the lane's ME slots and are aligned
// (D == 32 * ME, the usual head dims 64, 128, 256), else element by element; elements past D are 0.
template <int ME>
__device__ __forceinline__ void attn_load_half(const bf16* r, int D, int lane, uint32_t (&w)[AttnKvRow<ME>::kWords]) {
  const int epl = (D + 31) / 32;
  const bf16* p = r + lane * epl;
  constexpr int kBytes = ME * (int)sizeof(bf16);
  if (epl == ME && D == 32 * ME && (kBytes == 4 || kBytes == 8 || kBytes == 16) &&
      (reinterpret_cast<uintptr_t>(p) & (kBytes - 1)) == 0) {
    if constexpr (kBytes == 4) {
      w[0] = *reinterpret_cast<const uint32_t*>(p);
    } else if constexpr (kBytes == 8) {
      const uint2 v = *reinterpret_cast<const uint2*>(p);
      w[0] = v.x; w[1] = v.y;
    } else if constexpr (kBytes == 16) {
      const uint4 v = *reinterpret_cast<const uint4*>(p);
      w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
    }
    return;
  }
#pragma unroll
  for (int i = 0; i < AttnKvRow<ME>::kWords; ++i) w[i] = 0u;
#pragma unroll
  for (int i = 0; i < ME; ++i) {
    const int d = lane * epl + i;
    if (i < epl && d < D) {
      const uint32_t bits = __bfloat16_as_ushort(p[i]);
      w[i >> 1] |= (i & 1) ? (bits << 16) : bits;
    }
  }
}

template <int ME>
__device__ __forceinline__ void attn_load_row(const bf16* kr, const bf16* vr, int D, int lane, AttnKvRow<ME>& row) {
  attn_load_half<ME>(kr, D, lane, row.k);
  attn_load_half<ME>(vr, D, lane, row.v);
}

// One cache position whose rows are loaded: fp32 score per head, then the online-softmax update.
template <int MG, int ME>
__device__ __forceinline__ void attn_warp_update(const float (&qv)[MG][ME], const AttnKvRow<ME>& row, int G,
                                                 float scale, float (&acc)[MG][ME], float (&m)[MG], float (&l)[MG]) {
  float kv[ME], vv[ME];
#pragma unroll
  for (int i = 0; i < ME; ++i) {
    kv[i] = attn_row_elem<ME>(row.k, i);
    vv[i] = attn_row_elem<ME>(row.v, i);
  }
#pragma unroll
  for (int j = 0; j < MG; ++j) {
    if (j < G) {
      float s = 0.f;
#pragma unroll
      for (int i = 0; i < ME; ++i) s = fmaf(qv[j][i], kv[i], s);
      s = warp_sum(s) * scale;
      const float mn = fmaxf(m[j], s), corr = expf(m[j] - mn), e = expf(s - mn);
      l[j] = l[j] * corr + e;
#pragma unroll
      for (int i = 0; i < ME; ++i) acc[j][i] = acc[j][i] * corr + e * vv[i];
      m[j] = mn;
    }
  }
}

// Positions begin, begin + step, ... < end (k and v rows `pos_stride` elements apart from kc, vc), in
// that order, kAttnRowsInFlight rows loaded ahead of their scoring.
template <int MG, int ME>
__device__ __forceinline__ void attn_warp_range(const float (&qv)[MG][ME], const bf16* kc, const bf16* vc,
                                                size_t pos_stride, int begin, int end, int step, int D, int G,
                                                float scale, int lane, float (&acc)[MG][ME], float (&m)[MG],
                                                float (&l)[MG]) {
  for (int t0 = begin; t0 < end; t0 += kAttnRowsInFlight * step) {
    AttnKvRow<ME> rows[kAttnRowsInFlight];
#pragma unroll
    for (int u = 0; u < kAttnRowsInFlight; ++u) {
      const int t = t0 + u * step;
      if (t < end) attn_load_row<ME>(kc + (size_t)t * pos_stride, vc + (size_t)t * pos_stride, D, lane, rows[u]);
    }
#pragma unroll
    for (int u = 0; u < kAttnRowsInFlight; ++u)
      if (t0 + u * step < end) attn_warp_update<MG, ME>(qv, rows[u], G, scale, acc, m, l);
  }
}

// A warp's state as G entries of (acc[0..D), m, l), `entry` floats apart (shared memory for the block merge,
// or split-KV's partial buffer).
template <int MG, int ME>
__device__ __forceinline__ void attn_warp_store(const float (&acc)[MG][ME], const float (&m)[MG], const float (&l)[MG],
                                                float* dst, int D, int G, int entry, int lane) {
  const int epl = (D + 31) / 32;
#pragma unroll
  for (int j = 0; j < MG; ++j) {
    if (j < G) {
#pragma unroll
      for (int i = 0; i < ME; ++i) {
        const int d = lane * epl + i;
        if (i < epl && d < D) dst[(size_t)j * entry + d] = acc[j][i];
      }
      if (lane == 0) { dst[(size_t)j * entry + D] = m[j]; dst[(size_t)j * entry + D + 1] = l[j]; }
    }
  }
}

__host__ __device__ inline int attention_smem_bytes(int nwarps, int G, int D) { return nwarps * G * (D + 2) * 4; }

// MG, ME: compile-time bounds (>= G, >= epl) of the per-lane register arrays. One instance per (MG, ME)
// in {1, 2, 4, 8} x {2, 4, 8} keeps the arrays as small as the model needs: with the old fixed 8 x 8
// the worker kernel (128 registers at 512 threads) spilled them to local memory. Every loop keeps its
// runtime guard (j < G, i < epl && d < D), so the arithmetic is the same for every instance.
template <int MG, int ME>
__device__ __noinline__ void attention_seq(const bf16* q, const bf16* kc, const bf16* vc, bf16* out, int D, int G,
                                           int kv_ps, int n_pos, float scale, float* smem, int tid, int nt) {
  const int warp = tid >> 5, lane = tid & 31, nwarps = nt >> 5;
  float qv[MG][ME], acc[MG][ME], m[MG], l[MG];
  attn_warp_init<MG, ME>(q, D, G, lane, qv, acc, m, l);
  attn_warp_range<MG, ME>(qv, kc, vc, kv_ps, warp, n_pos, nwarps, D, G, scale, lane, acc, m, l);
  attn_warp_store<MG, ME>(acc, m, l, smem + (size_t)warp * G * (D + 2), D, G, D + 2, lane);
  worker_barrier(nt);
  for (int idx = tid; idx < G * D; idx += nt) {
    const int j = idx / D, d = idx % D;
    float M = -INFINITY;
    for (int w = 0; w < nwarps; ++w) M = fmaxf(M, smem[(size_t)w * G * (D + 2) + j * (D + 2) + D]);
    float L = 0.f, O = 0.f;
    if (M != -INFINITY) {
      for (int w = 0; w < nwarps; ++w) {
        const float* st = smem + (size_t)w * G * (D + 2) + j * (D + 2);
        const float f = expf(st[D] - M);  // warps with no position have m = -inf: factor 0
        L += st[D + 1] * f;
        O += st[d] * f;
      }
    }
    out[(size_t)j * D + d] = f2bf(L > 0.f ? O / L : 0.f);
  }
  worker_barrier(nt);  // shared memory is reused by the next sequence / task
}

__device__ void attention(const bf16* q, const bf16* kc, const bf16* vc, const int32_t* pos, bf16* out, int B, int D,
                          int G, int q_stride, int kv_ps, int kv_bs, float scale, float* smem, int tid, int nt) {
  const int epl = (D + 31) / 32;
  for (int b = 0; b < B; ++b) {
    const bf16 *qb = q + (size_t)b * q_stride, *kb = kc + (size_t)b * kv_bs, *vb = vc + (size_t)b * kv_bs;
    bf16* ob = out + (size_t)b * q_stride;
    const int n = pos[b] + 1;
    MPK_ATTN_BOUNDS(G, epl, (attention_seq<kMG, kME>(qb, kb, vb, ob, D, G, kv_ps, n, scale, smem, tid, nt)));
  }
}

}  // namespace mpk

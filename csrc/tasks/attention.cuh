// attention (decode, GQA; mpk_dist/taskgraph/tasks/attention.py): the GROUP query heads sharing one
// kv head, for every sequence b, over cache positions 0..pos[b]. fp32 scores, softmax and
// products like the torch reference; output rounded once to bf16.
// Pointers: q/out at the first column of query head h*GROUP; k/v cache at head h, position 0,
// sequence 0. Warp w takes positions w, w + nwarps, ... with an online softmax per query head (8 at a
// time in attention_block_walk.cuh where the shape allows it, else one at a time in attn_warp_step);
// the warps' (m, l, acc) are merged through shared memory (nwarps * G * (D + 2) floats, or less in phases:
// attention_merge_smem_bytes).
// Limits (checked on the host): GROUP <= 8, D <= 256.
#pragma once
#include "common.cuh"
#include "attention_block_walk.cuh"
#include "attention_mma_walk.cuh"
#include "trace_marks.cuh"
#include "weight_stream.cuh"  // smem_below_ring(): the merge takes the phases the launch's shared memory asks for

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

// MPK_ATTN_GUARD_HEADS 1: the walk's old per-head order (each head behind its j < G branch), kept so a GPU test
// can check the interleaved default against it bit for bit (tests/runtime/test_code_variants_gpu.py).
#ifndef MPK_ATTN_GUARD_HEADS
#define MPK_ATTN_GUARD_HEADS 0
#endif

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

// One cache position (k and v rows at kr, vr): fp32 score per head, then the online-softmax update.
template <int MG, int ME>
__device__ __forceinline__ void attn_warp_step(const float (&qv)[MG][ME], const bf16* kr, const bf16* vr, int D, int G,
                                               float scale, int lane, float (&acc)[MG][ME], float (&m)[MG],
                                               float (&l)[MG]) {
  const int epl = (D + 31) / 32;
  float kv[ME], vv[ME];
#pragma unroll
  for (int i = 0; i < ME; ++i) {
    const int d = lane * epl + i;
    const bool in = i < epl && d < D;
    kv[i] = in ? bf2f(kr[d]) : 0.f;
    vv[i] = in ? bf2f(vr[d]) : 0.f;
  }
#if MPK_ATTN_GUARD_HEADS
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
#else
  // Every one of the MG heads, without a j < G guard: guarded (above), each head was a branch with its own
  // convergence barrier and the heads' warp sums (5 dependent shuffles each) ran one after another; unguarded
  // they interleave. A head j >= G (only when G is not a power of two) has q = 0, stays finite and is never
  // stored (attn_warp_store keeps j < G), so heads j < G get the same operations and bits as guarded.
  float s[MG];
#pragma unroll
  for (int j = 0; j < MG; ++j) {
    s[j] = 0.f;
#pragma unroll
    for (int i = 0; i < ME; ++i) s[j] = fmaf(qv[j][i], kv[i], s[j]);
  }
#pragma unroll
  for (int j = 0; j < MG; ++j) s[j] = warp_sum(s[j]) * scale;
#pragma unroll
  for (int j = 0; j < MG; ++j) {
    const float mn = fmaxf(m[j], s[j]), corr = expf(m[j] - mn), e = expf(s[j] - mn);
    l[j] = l[j] * corr + e;
#pragma unroll
    for (int i = 0; i < ME; ++i) acc[j][i] = acc[j][i] * corr + e * vv[i];
    m[j] = mn;
  }
#endif
}

// A warp's state as G entries of (acc[0..D), m, l), `entry` floats apart (shared memory for the block merge,
// or split-KV's partial buffer).
// Its two parts: the accumulators (head j's dims at dst[j * entry + d]) and the (m, l) pairs (at ml[j * stride] and
// ml[j * stride + 1]), which attention_seq's phased merge stores at different times.
template <int MG, int ME>
__device__ __forceinline__ void attn_warp_store_acc(const float (&acc)[MG][ME], float* dst, int D, int G, int entry,
                                                    int lane) {
  const int epl = (D + 31) / 32;
#pragma unroll
  for (int j = 0; j < MG; ++j) {
    if (j < G) {
#pragma unroll
      for (int i = 0; i < ME; ++i) {
        const int d = lane * epl + i;
        if (i < epl && d < D) dst[(size_t)j * entry + d] = acc[j][i];
      }
    }
  }
}

template <int MG>
__device__ __forceinline__ void attn_warp_store_ml(const float (&m)[MG], const float (&l)[MG], float* ml, int G,
                                                   int stride, int lane) {
#pragma unroll
  for (int j = 0; j < MG; ++j)
    if (j < G && lane == 0) { ml[(size_t)j * stride] = m[j]; ml[(size_t)j * stride + 1] = l[j]; }
}

template <int MG, int ME>
__device__ __forceinline__ void attn_warp_store(const float (&acc)[MG][ME], const float (&m)[MG], const float (&l)[MG],
                                                float* dst, int D, int G, int entry, int lane) {
  attn_warp_store_acc<MG, ME>(acc, dst, D, G, entry, lane);
  attn_warp_store_ml<MG>(m, l, dst + D, G, entry, lane);
}

// ---- cache rows into L2 before the tile's wait (MPK_ATTN_PREFETCH; prefetch_task in runtime/dispatch.cuh) ----
// A warp walks its positions one after another, each row load a memory round trip behind the last:
// from HBM, under the linears' weight stream, ~35 us a layer for qwen3-8b's 8 tiles at context 512.
// Rows below this step's position were written by earlier steps, so the tile can pull them into L2
// while it waits for q (L2 is where the GPU keeps global memory coherent, so a row written after its
// prefetch is still read new). A hint only: the values read, and so the result, do not change.
#ifndef MPK_ATTN_PREFETCH
#define MPK_ATTN_PREFETCH 1
#endif

// Prefetch k and v rows of positions [begin, end) (clamped to [0, max_seq)) of one kv head into L2.
// bulk: one bulk prefetch per row (common.cuh bulk_prefetch_l2) when rows are 16-byte aligned.
__device__ __forceinline__ void attn_prefetch_rows(const bf16* kc, const bf16* vc, int D, size_t kv_ps, int begin,
                                                   int end, int max_seq, bool bulk, int tid, int nt) {
  begin = max(begin, 0);
  end = min(end, max_seq);
  const int row_bytes = D * (int)sizeof(bf16);
  const bool aligned = ((reinterpret_cast<uintptr_t>(kc) | reinterpret_cast<uintptr_t>(vc) | (kv_ps * sizeof(bf16)) |
                         (uintptr_t)row_bytes) & (kBulkAlign - 1)) == 0;
  if (bulk && aligned) {
    const int rows = max(end - begin, 0);
    for (int i = tid; i < 2 * rows; i += nt) {
      const bf16* row = (i >= rows ? vc : kc) + (size_t)(begin + (i >= rows ? i - rows : i)) * kv_ps;
      bulk_prefetch_l2(row, (uint32_t)row_bytes);
    }
    return;
  }
  // Lines touched by one row, whatever its alignment: one per 128 bytes, plus the line of its last byte.
  const int per_row = row_bytes / kL2LineBytes + 1;
  const int n = max(end - begin, 0) * per_row;
  for (int i = tid; i < 2 * n; i += nt) {
    const bool v = i >= n;
    const int j = v ? i - n : i;
    const int off = min((j % per_row) * kL2LineBytes, row_bytes - 1);
    const char* row = reinterpret_cast<const char*>((v ? vc : kc) + (size_t)(begin + j / per_row) * kv_ps);
    asm volatile("prefetch.global.L2 [%0];" ::"l"(row + off));
  }
}

__host__ __device__ inline int attention_smem_bytes(int nwarps, int G, int D) { return nwarps * G * (D + 2) * 4; }

// ---- the block merge in phases (attention_seq; docs/PERF.md v0.51) ----
// Why: the merge's nwarps * G * (D + 2) floats are the launch's largest shared-memory need at the 8B presets'
// batch 1 (33,280 B at 16 warps, 4 heads of 128), which puts the launch at the SM's 64 KB carveout step: the SM's
// other 192 KB are the L1 the weight streams run through, and every level measured slower with less of it
// (docs/PERF.md v0.30, v0.45, v0.50). In P phases the warps hand over their accumulators a slice of S = nwarps / P
// warps at a time, through S slots; the (m, l) pairs of every warp are stored first (the merge needs every warp's m
// before any factor), and each output's running sum waits in shared memory between phases. Every output is summed
// over the warps in the same order with the same factors as in one phase, so the bits do not depend on P.
// MPK_ATTN_PHASED_MERGE 1 builds it (KernelShape.attn_phased_merge: the host asks for it with MPK_ATTN_MERGE_PHASES=2|4);
// 0, the default, keeps attention_seq's code as it was, one phase only: the phased code's kernel has a 16 B larger
// entry frame and refills a passed argument twice (ptxas), which tests/runtime/test_attn_prep_build.py's tripwires
// let into the default build only once the GPU shows it does not slow the kernel (docs/PERF.md v0.51).
#ifndef MPK_ATTN_PHASED_MERGE
#define MPK_ATTN_PHASED_MERGE 0
#endif
constexpr int kAttnMaxMergePhases = MPK_ATTN_PHASED_MERGE ? 4 : 1;

// Dynamic shared memory of attention_seq's merge in `phases` phases (1: attention_smem_bytes).
__host__ __device__ inline int attention_merge_smem_bytes(int nwarps, int G, int D, int phases) {
  if (phases <= 1) return attention_smem_bytes(nwarps, G, D);
  const int slots = (nwarps + phases - 1) / phases;
  return (slots * G * (D + 2) + nwarps * G * 2 + G * D) * 4;
}

// The fewest phases (1, 2, 4; 1 without MPK_ATTN_PHASED_MERGE) whose merge fits `bytes`; 0 when none does. The
// launch's shared memory decides (mpk_dist/runtime/tables.py smem_bytes sizes it: MPK_ATTN_MERGE_PHASES).
__host__ __device__ inline int attention_merge_phases(int nwarps, int G, int D, uint32_t bytes) {
  for (int p = 1; p <= kAttnMaxMergePhases; p *= 2)
    if ((uint32_t)attention_merge_smem_bytes(nwarps, G, D, p) <= bytes) return p;
  return 0;
}

// Where the merge keeps what: slot s holds G entries of (acc[0..D), -, -) for warp p * slots + s in phase p; the
// (m, l) pairs are in each warp's own slot entry when there is one phase (the unphased layout, attn_warp_store's),
// else in an area of their own; the running sums of G * D outputs follow.
struct AttnMergeRoom {
  float* smem;
  int nwarps, G, D, phases, slots;
  __device__ AttnMergeRoom(float* s, int nw, int g, int d, int p)
      : smem(s), nwarps(nw), G(g), D(d), phases(p), slots((nw + p - 1) / p) {}
  // Slot s (no division on the merge's paths: warp w of phase p is slot w - p * slots).
  __device__ float* slot(int s) const { return smem + (size_t)s * G * (D + 2); }
  __device__ float* ml(int w) const {
    return phases == 1 ? slot(w) + D : smem + (size_t)slots * G * (D + 2) + (size_t)w * G * 2;
  }
  __device__ int ml_stride() const { return phases == 1 ? D + 2 : 2; }
  __device__ float* running() const { return smem + (size_t)slots * G * (D + 2) + (size_t)nwarps * G * 2; }
};

// The merge, run by every thread of the block once every warp has stored its (m, l) pairs: in phase p the warps of
// that phase store their accumulators (store_acc(slot, entry): this warp's), then the block sums them into its
// outputs. out[j * D + d] = sum_w acc_w f_w / sum_w l_w f_w with f_w = exp(m_w - max_w m_w), w in order.
template <typename StoreAcc>
__device__ __forceinline__ void attn_block_merge(const AttnMergeRoom& room, StoreAcc&& store_acc, bf16* out, int tid,
                                                 int nt) {
  const int warp = tid >> 5, G = room.G, D = room.D, nwarps = room.nwarps;
  const int stride = room.ml_stride(), my_phase = warp / room.slots;
  for (int p = 0; p < room.phases; ++p) {
    if (my_phase == p) store_acc(room.slot(warp - p * room.slots), D + 2);
    worker_barrier(nt);
    if (p == 0) trace_mark(1, tid);  // trace: every warp's walk is done (the block merge follows)
    const bool last = p + 1 == room.phases;
    const int w0 = p * room.slots, w1 = min(nwarps, w0 + room.slots);
    for (int idx = tid; idx < G * D; idx += nt) {
      const int j = idx / D, d = idx % D;
      float M = -INFINITY;
      for (int w = 0; w < nwarps; ++w) M = fmaxf(M, room.ml(w)[(size_t)j * stride]);
      float O = p == 0 ? 0.f : room.running()[idx];
      if (M != -INFINITY) {
        if (last) {  // every warp's l with its factor, and the last phase's accumulators
          float L = 0.f;
          for (int w = 0; w < nwarps; ++w) {
            const float* ml = room.ml(w) + (size_t)j * stride;
            const float f = expf(ml[0] - M);  // warps with no position have m = -inf: factor 0
            L += ml[1] * f;
            if (w >= w0) O += room.slot(w - w0)[(size_t)j * (D + 2) + d] * f;
          }
          out[(size_t)j * D + d] = f2bf(L > 0.f ? O / L : 0.f);
          continue;
        }
        for (int w = w0; w < w1; ++w)
          O += room.slot(w - w0)[(size_t)j * (D + 2) + d] * expf(room.ml(w)[(size_t)j * stride] - M);
      }
      if (last)
        out[(size_t)j * D + d] = f2bf(0.f);
      else
        room.running()[idx] = O;  // this thread's own output: read back by it in the next phase
    }
    if (!last) worker_barrier(nt);  // the slots are the next phase's
  }
  worker_barrier(nt);  // shared memory is reused by the next sequence / task
}

// MPK_ATTN_MERGE_MARK k >= 0 (a measurement build; -1, none, by default): attention_seq stamps trace mark k when its
// block merge is done (the output stored, after the merge's closing barrier), so that with MPK_POST_FENCE_MARK the
// 2.6-4.0 us between an unsplit tile's walk and its post's fence (docs/PERF.md v0.40) splits into the merge and the
// fence. Pick a mark the tile leaves unset (it sets 0, 1, 4 and 5; 2 and 3 under MPK_ATTN_WALK_MARKS).
#ifndef MPK_ATTN_MERGE_MARK
#define MPK_ATTN_MERGE_MARK -1
#endif

// MG, ME: compile-time bounds (>= G, >= epl) of the per-lane register arrays. One instance per (MG, ME)
// in {1, 2, 4, 8} x {2, 4, 8} keeps the arrays as small as the model needs: with the old fixed 8 x 8
// the worker kernel (128 registers at 512 threads) spilled them to local memory. Every loop keeps its
// runtime guard (j < G, i < epl && d < D), so the arithmetic is the same for every instance.
// The merge takes as many phases as the launch's shared memory asks for (attention_merge_phases; callers check that
// one fits: attention_prep_ok).
#if MPK_ATTN_PHASED_MERGE
template <int MG, int ME>
__device__ __noinline__ void attention_seq(const bf16* q, const bf16* kc, const bf16* vc, bf16* out, int D, int G,
                                           int kv_ps, int n_pos, float scale, float* smem, int tid, int nt) {
  const int warp = tid >> 5, lane = tid & 31, nwarps = nt >> 5;
  const AttnMergeRoom room(smem, nwarps, G, D, max(1, attention_merge_phases(nwarps, G, D, smem_below_ring())));
  auto finish = [&](auto&& store_acc, auto&& store_ml) {
    store_ml(room.ml(warp), room.ml_stride());
    attn_block_merge(room, store_acc, out, tid, nt);
  };
  if (MPK_ATTN_MMA_WALK && attn_mma_walk_ok<MG, ME>(q, kc, vc, D, G, kv_ps, n_pos)) {
    attn_mma_walk_then<MG, ME>(q, kc, vc, D, G, kv_ps, warp, n_pos, nwarps, scale, lane, finish, tid);
  } else {
    float qv[MG][ME], acc[MG][ME], m[MG], l[MG];
    attn_warp_init<MG, ME>(q, D, G, lane, qv, acc, m, l);
    // The scalar block walk only in builds without the tensor-core walk (MPK_ATTN_MMA_WALK=0, its A/B baseline):
    // beside it, it would run for no preset shape and only add code and registers to attention_seq. It keeps q in
    // the warp's own merge entry, so only with one phase (a slot per warp).
    float* mine = room.slot(warp);  // this warp's own slot with one phase (the only case that uses it)
    if (!MPK_ATTN_MMA_WALK && MPK_ATTN_BLOCK_WALK && room.phases == 1 &&
        attn_block_walk_ok<MG, ME>(kc, vc, D, kv_ps, mine))
      attn_block_walk<MG, ME>(qv, mine, kc, vc, D, G, kv_ps, warp, n_pos, nwarps, scale, lane, acc, m, l);
    else
      for (int t = warp; t < n_pos; t += nwarps)
        attn_warp_step<MG, ME>(qv, kc + (size_t)t * kv_ps, vc + (size_t)t * kv_ps, D, G, scale, lane, acc, m, l);
    finish([&](float* dst, int entry) { attn_warp_store_acc<MG, ME>(acc, dst, D, G, entry, lane); },
           [&](float* ml, int stride) { attn_warp_store_ml<MG>(m, l, ml, G, stride, lane); });
  }
#if MPK_ATTN_MERGE_MARK >= 0
  trace_mark(MPK_ATTN_MERGE_MARK, tid);  // trace: the block merge is done (the post's barrier and fence follow)
#endif
}
#else  // the one-phase merge as it was before the phases (the default; docs/PERF.md v0.51)
template <int MG, int ME>
__device__ __noinline__ void attention_seq(const bf16* q, const bf16* kc, const bf16* vc, bf16* out, int D, int G,
                                           int kv_ps, int n_pos, float scale, float* smem, int tid, int nt) {
  const int warp = tid >> 5, lane = tid & 31, nwarps = nt >> 5;
  float* mine = smem + (size_t)warp * G * (D + 2);  // this warp's merge entries
  if (MPK_ATTN_MMA_WALK && attn_mma_walk_ok<MG, ME>(q, kc, vc, D, G, kv_ps, n_pos)) {
    attn_mma_walk<MG, ME>(q, kc, vc, D, G, kv_ps, warp, n_pos, nwarps, scale, lane, mine, D + 2, tid);
  } else {
    float qv[MG][ME], acc[MG][ME], m[MG], l[MG];
    attn_warp_init<MG, ME>(q, D, G, lane, qv, acc, m, l);
    // The scalar block walk only in builds without the tensor-core walk (MPK_ATTN_MMA_WALK=0, its A/B baseline):
    // beside it, it would run for no preset shape and only add code and registers to attention_seq.
    if (!MPK_ATTN_MMA_WALK && MPK_ATTN_BLOCK_WALK && attn_block_walk_ok<MG, ME>(kc, vc, D, kv_ps, mine))
      attn_block_walk<MG, ME>(qv, mine, kc, vc, D, G, kv_ps, warp, n_pos, nwarps, scale, lane, acc, m, l);
    else
      for (int t = warp; t < n_pos; t += nwarps)
        attn_warp_step<MG, ME>(qv, kc + (size_t)t * kv_ps, vc + (size_t)t * kv_ps, D, G, scale, lane, acc, m, l);
    attn_warp_store<MG, ME>(acc, m, l, mine, D, G, D + 2, lane);
  }
  worker_barrier(nt);
  trace_mark(1, tid);  // trace: every warp's walk is done (the block merge follows)
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
#if MPK_ATTN_MERGE_MARK >= 0
  trace_mark(MPK_ATTN_MERGE_MARK, tid);  // trace: the block merge is done (the post's barrier and fence follow)
#endif
}
#endif

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

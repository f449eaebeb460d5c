// linear: y[b, n] = sum_k x[b, k] * w[n, k] for the N_TILE rows of one tile; `w` points at the
// tile's first row and `y` at its first column (mpk_dist/taskgraph/tasks/linear.py).
//
// bf16 weights and activations, fp32 accumulation, output rounded once (bf16 activations, or fp32
// logits rounded through bf16 when round_out_bf16 is set, as torch's bf16 matmul does).
// One warp per output row at a time; each lane streams 16-byte weight vectors with kLinUnroll of
// them in flight before the first use. x (B rows, stride ldx) is re-read from L1/L2 per row.
// Requires K % 8 == 0 and 16-byte aligned rows (checked on the host).
// MPK_LINEAR_MMA=1 (KernelShape.linear_mma) runs batch 2..16 on tensor cores instead (linear_mma.cuh:
// same loads and output rounding, another summation order); batch 1 always takes the scalar tile.
#pragma once
#include "common.cuh"
#include "gemv_pipe.cuh"
#include "linear_mma.cuh"
#include "weight_stream.cuh"

#ifndef MPK_LINEAR_MMA
#define MPK_LINEAR_MMA 0
#endif

namespace mpk {

#ifndef MPK_LINEAR_UNROLL
#define MPK_LINEAR_UNROLL 8
#endif
constexpr int kLinUnroll = MPK_LINEAR_UNROLL;
#ifndef MPK_LOAD_AHEAD
#define MPK_LOAD_AHEAD 1  // batch 1: a round's x vectors before any use (load_x_round); 0: inside the sum loop
#endif
constexpr int kLaneStride = 256;  // k values one 16-byte load of each of a warp's 32 lanes covers

// Batch row 0's x[k..k+7] for a lane's U chunks of one round (k = kb + u * kLaneStride + lane * 8), all issued
// before any is used; zero past K. Why: loaded inside the summing loop behind its `k < K` test, each x load
// was issued alone after the previous chunk's sum (the SASS shows one LD per branch, each followed by its
// FFMAs), a chain of U round trips per round -- L2 ones when x is a global activation (the o_proj tiles).
// The address is clamped into the row so the loads need no branch. Past K both the weight and the x vector
// are zero, and the caller adds their +0 product without a test (a test let the compiler sink each load
// back into its branch): an fp32 sum that starts at +0 never becomes -0 in round-to-nearest, and adding +0
// to anything else leaves it unchanged, so the sums keep their bits.
template <int U, class LoadX>
__device__ __forceinline__ void load_x_round(uint4 (&xv)[U], const LoadX& load, int kb, int K, int lane) {
  uint4 raw[U];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int k = kb + u * kLaneStride + lane * 8;
    raw[u] = load(k < K ? k : 0);
  }
#pragma unroll
  for (int u = 0; u < U; ++u) xv[u] = kb + u * kLaneStride + lane * 8 < K ? raw[u] : make_uint4(0, 0, 0, 0);
}

template <int B, typename OutT>
__device__ void linear_tile(const bf16* __restrict__ x, int ldx, const bf16* __restrict__ w, OutT* __restrict__ y,
                            int ldy, int K, int n_tile, bool round_out_bf16, int tid, int nt) {
  if (stream_fits(K, nt)) {  // MPK_LINEAR_TMA: same sums, weights through shared memory
    gemv_streamed<B>(MmaRows{x, ldx}, w, K, n_tile, MmaStore<OutT>{y, ldy, round_out_bf16}, tid, nt);
    return;
  }
  if (MPK_LINEAR_PIPE) {  // same sums, the next chunk's loads in flight while this one is summed
    gemv_pipelined<B, kLinUnroll>(MmaRows{x, ldx}, w, K, n_tile, MmaStore<OutT>{y, ldy, round_out_bf16}, tid, nt);
    return;
  }
  const int warp = tid >> 5, lane = tid & 31, nwarps = nt >> 5;
  for (int n = warp; n < n_tile; n += nwarps) {
    const bf16* wr = w + (size_t)n * K;
    float acc[B];
#pragma unroll
    for (int b = 0; b < B; ++b) acc[b] = 0.f;
    for (int kb = 0; kb < K; kb += kLinUnroll * 256) {
      uint4 wv[kLinUnroll];
#pragma unroll
      for (int u = 0; u < kLinUnroll; ++u) {  // issue every weight load before any use
        int k = kb + u * 256 + lane * 8;
        wv[u] = k < K ? ld_weight_v4(wr + k) : make_uint4(0, 0, 0, 0);
      }
      if constexpr (B == 1 && MPK_LOAD_AHEAD) {  // x before any use, as the weights (load_x_round)
        uint4 xv[kLinUnroll];
        load_x_round<kLinUnroll>(xv, [&](int k) { return ld_act_v4(x + k); }, kb, K, lane);
#pragma unroll
        for (int u = 0; u < kLinUnroll; ++u) acc[0] += dot8(wv[u], xv[u]);  // past K: + (+0), see load_x_round
      } else {
#pragma unroll
        for (int u = 0; u < kLinUnroll; ++u) {
          int k = kb + u * 256 + lane * 8;
          if (k < K) {
#pragma unroll
            for (int b = 0; b < B; ++b) acc[b] += dot8(wv[u], ld_act_v4(x + (size_t)b * ldx + k));
          }
        }
      }
    }
#pragma unroll
    for (int b = 0; b < B; ++b) {
      float s = warp_sum(acc[b]);
      if (lane == (b & 31)) store_out(y + (size_t)b * ldy + n, round_out_bf16 ? round_bf(s) : s);
    }
  }
}

// Variant: each warp computes R rows at once (R * kLinUnroll / R loads in flight per lane), for
// short K where one row gives a lane too few loads to cover memory latency (K = 1024: 4 loads).
// Selected with MPK_LINEAR_ROWS > 1 (KernelShape.linear_rows); 1 keeps linear_tile above.
template <int B, int R, typename OutT>
__device__ void linear_tile_rows(const bf16* __restrict__ x, int ldx, const bf16* __restrict__ w,
                                 OutT* __restrict__ y, int ldy, int K, int n_tile, bool round_out_bf16, int tid,
                                 int nt) {
  constexpr int U = kLinUnroll / R > 0 ? kLinUnroll / R : 1;
  const int warp = tid >> 5, lane = tid & 31, nwarps = nt >> 5;
  for (int n0 = warp * R; n0 < n_tile; n0 += nwarps * R) {
    float acc[R][B];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int b = 0; b < B; ++b) acc[r][b] = 0.f;
    for (int kb = 0; kb < K; kb += U * 256) {
      uint4 wv[R][U];
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int u = 0; u < U; ++u) {  // every weight load of the R rows before any use
          const int k = kb + u * 256 + lane * 8;
          wv[r][u] = (k < K && n0 + r < n_tile) ? ld_weight_v4(w + (size_t)(n0 + r) * K + k) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int k = kb + u * 256 + lane * 8;
        if (k < K) {
#pragma unroll
          for (int b = 0; b < B; ++b) {
            const uint4 xv = ld_act_v4(x + (size_t)b * ldx + k);
#pragma unroll
            for (int r = 0; r < R; ++r) acc[r][b] += dot8(wv[r][u], xv);
          }
        }
      }
    }
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int b = 0; b < B; ++b) {
        const float s = warp_sum(acc[r][b]);
        if (lane == (b & 31) && n0 + r < n_tile) store_out(y + (size_t)b * ldy + n0 + r, round_out_bf16 ? round_bf(s) : s);
      }
  }
}

// Runtime batch -> compile-time batch. B is fixed per generated kernel, so only one instance is
// live in practice; the switch keeps the body testable for every batch in one test kernel.
template <typename OutT>
__device__ void linear(int B, const bf16* x, int ldx, const bf16* w, OutT* y, int ldy, int K, int n_tile,
                       bool round_out_bf16, int tid, int nt) {
#define MPK_LINEAR_CASE(bb) \
  case bb: linear_tile<bb, OutT>(x, ldx, w, y, ldy, K, n_tile, round_out_bf16, tid, nt); break;
#ifdef MPK_BATCH
  // The generated kernel fixes the batch; the host checked every linear task has BATCH == MPK_BATCH.
  (void)B;
#if MPK_LINEAR_MMA && MPK_BATCH >= 2
  // Nothing else lives in the dynamic shared memory during a plain linear: reserved = 0.
  if (const int S = mma_slices(K, n_tile, nt, 0u)) {
    gemv_mma_tile<MPK_BATCH>(MmaRows{x, ldx}, w, K, n_tile, MmaStore<OutT>{y, ldy, round_out_bf16}, S, 0u,
                             MmaRowsAt{n_tile, 0}, tid, nt);
    return;
  }
#endif
#if defined(MPK_LINEAR_ROWS) && MPK_LINEAR_ROWS > 1
  linear_tile_rows<MPK_BATCH, MPK_LINEAR_ROWS, OutT>(x, ldx, w, y, ldy, K, n_tile, round_out_bf16, tid, nt);
#else
  linear_tile<MPK_BATCH, OutT>(x, ldx, w, y, ldy, K, n_tile, round_out_bf16, tid, nt);
#endif
#else
  switch (B) {
    MPK_LINEAR_CASE(1) MPK_LINEAR_CASE(2) MPK_LINEAR_CASE(3) MPK_LINEAR_CASE(4)
    MPK_LINEAR_CASE(5) MPK_LINEAR_CASE(6) MPK_LINEAR_CASE(7) MPK_LINEAR_CASE(8)
    MPK_LINEAR_CASE(9) MPK_LINEAR_CASE(10) MPK_LINEAR_CASE(11) MPK_LINEAR_CASE(12)
    MPK_LINEAR_CASE(13) MPK_LINEAR_CASE(14) MPK_LINEAR_CASE(15) MPK_LINEAR_CASE(16)
    default: break;
  }
#endif
#undef MPK_LINEAR_CASE
}

// Prefetch the tile's weight rows into L2: called before the task waits on its input event, so
// the dominant bytes are on their way while the producer tiles still run.
// MPK_PREFETCH_KB caps the prefetched head of the tile (-1: the whole tile; 0: none): all SMs'
// whole tiles can exceed the L2 (qwen3-8b: 132 x ~0.8 MB > 60 MB), evicting lines before use.
#ifndef MPK_PREFETCH_KB
#define MPK_PREFETCH_KB -1
#endif
// planned: bytes the host planned for this task (prefetch_plan.py), or -1 for the MPK_PREFETCH_KB cap.
__device__ __forceinline__ uint64_t linear_prefetch_bytes(int K, int n_tile, int planned) {
  uint64_t bytes = (uint64_t)n_tile * K * sizeof(bf16);
  if (planned >= 0) bytes = bytes < (uint64_t)planned ? bytes : (uint64_t)planned;
  else if (MPK_PREFETCH_KB >= 0 && bytes > (uint64_t)MPK_PREFETCH_KB * 1024) bytes = (uint64_t)MPK_PREFETCH_KB * 1024;
  return bytes;
}

__device__ __forceinline__ void linear_prefetch(const bf16* w, int K, int n_tile, int planned, bool bulk, int tid,
                                                int nt) {
  const uint64_t bytes = linear_prefetch_bytes(K, n_tile, planned);
  if (tid == 0) stream_prime(w, K, n_tile, nt);  // MPK_LINEAR_TMA: the first stages into shared memory
  if (bulk) prefetch_l2_bulk(w, bytes, tid, nt);
  else prefetch_l2(w, bytes, tid, nt);
}

// linear_prefetch for any linear kind from one call site (prefetch_task): one weight block, or (second != 0) the
// two blocks of n_tile / 2 rows each of norm_linear_silu, `second` elements apart, with half the bytes from the
// head of each (each half of the tile's warps starts there; no ring priming: that tile streams through registers).
__device__ __noinline__ void linear_blocks_prefetch(const bf16* w, int K, int n_tile, long long second, int planned,
                                                       bool bulk, int tid, int nt) {
  uint64_t bytes = linear_prefetch_bytes(K, n_tile, planned);
  if (second != 0) bytes /= 2;
  else if (tid == 0) stream_prime(w, K, n_tile, nt);  // MPK_LINEAR_TMA: the first stages into shared memory
  for (int b = 0; b < (second != 0 ? 2 : 1); ++b) {
    const bf16* head = w + b * second;
    if (bulk) prefetch_l2_bulk(head, bytes, tid, nt);
    else prefetch_l2(head, bytes, tid, nt);
  }
}

}  // namespace mpk

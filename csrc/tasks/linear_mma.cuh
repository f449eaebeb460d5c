// Tensor-core GEMV tile for batch 2..16 (MPK_LINEAR_MMA=1): y[b, n] = epi(b, n, sum_k x[b, k] * w[n, k])
// for the n_tile weight rows of one tile, with mma.sync.m16n8k16 (bf16 in, fp32 accumulators).
//
// Operands: the batch rows are the MMA's M (16, padded with zeros), the weight rows its N (8 per
// warp unit), k its K. Each lane streams 16-byte weight vectors with the same ld_weight_v4 as the
// scalar tile (kLinUnroll in flight before the first use), and reads 16-byte x vectors through the
// input policy (XS::load8(b, k), the fused kinds' interface), so neither operand is staged.
//
// NOTE: k permutation. The m16n8k16 fragments give lane (g = lane/4, q = lane%4) the k slots 2q, 2q+1,
// 2q+8, 2q+9. A dot product does not care which physical k sits in which slot as long as A and B agree,
// so for a chunk of 32 consecutive k, lane (g, q) loads w[g][kc + 8q .. +7] and x[g][kc + 8q .. +7]
// (one 16-byte vector each) and feeds elements 0..3 to one mma and 4..7 to a second. That keeps every
// load 16 bytes wide and coalesced (4 lanes cover 64 contiguous bytes of a row).
//
// Summation order (differs from the scalar path's per-lane fmaf chain + warp_sum, so results are
// close but not bit-equal; the GPU tests compare with a tolerance): each mma adds 16 products to its
// fp32 accumulator in the tensor core's own order; the mmas of one warp follow k upwards (chunk by
// chunk, elements 0..3 before 4..7 of each lane's vector). Split-K (below) sums the warps' slices in
// slice order 0, 1, ... S-1. For fixed (K, n_tile, worker threads, dynamic shared memory) the result is
// deterministic. The output is rounded once, by the epilogue, as in the scalar path.
//
// Split-K: a tile of n_tile rows has ceil(n_tile / 8) warp units; K is split into S slices so that every
// worker warp streams weights for about the same time (a qwen3-8b tile of ~30 rows would otherwise keep 4
// of 16 warps busy; one of 192 rows, 24 units, would run 2 units on half the warps): warps take (unit,
// slice) pairs round robin. The partial accumulators (128 floats per pair) go to the top of the dynamic
// shared memory, above `reserved` bytes the caller still uses (the fused kinds' staged rows); when they do
// not fit, fewer slices, and when that leaves most warps idle the caller takes the scalar tile instead
// (mma_slices). Requires K % 8 == 0 and 16-byte aligned rows (host-checked).
#pragma once
#include "common.cuh"
#include "mma_ops.cuh"
#include "trace_marks.cuh"
#include "weight_stream.cuh"  // smem_below_ring()

namespace mpk {

#ifndef MPK_LINEAR_UNROLL
#define MPK_LINEAR_UNROLL 8
#endif

// Activation rows x[b, k..k+7] of a row-major bf16 matrix (global or shared memory).
struct MmaRows {
  const bf16* x;
  int ld;
  __device__ __forceinline__ uint4 load8(int b, int k) const { return ld_act_v4(x + (size_t)b * ld + k); }
};

// Plain linear epilogue: y[b * ld + n] = s, rounded through bf16 when asked (fp32 logits), else the
// store's own rounding (bf16 activations) -- the scalar linear_tile's output rounding.
template <typename OutT>
struct MmaStore {
  OutT* y;
  int ld;
  bool round_out_bf16;
  __device__ __forceinline__ void operator()(int b, int n, float s) const {
    store_out(y + (size_t)b * ld + n, round_out_bf16 ? round_bf(s) : s);
  }
};

// MPK_MMA_X_AHEAD 1 (default): a round's x vectors are loaded right after its weight vectors, before the first
// mma, instead of one x load per chunk inside the mma loop. Why: each in-loop load was consumed by the next mma,
// a chain of U round trips per round -- L2 ones when x is a global activation (o_proj's linear_residual), as
// linear.cuh's load_x_round found for batch 1. The same values reach the same mmas, so the same bits. Batch
// rows 0..7 only (xa); above 8 rows the second half (xb) stays in the loop to keep the registers in bounds.
#ifndef MPK_MMA_X_AHEAD
#define MPK_MMA_X_AHEAD 1
#endif

// Where a tile's weight rows are: rows [0, half) from w, rows [half, n_tile) from w + jump (the gate and up
// halves of a kEpiPair tile, fused_gemv.cuh; half = n_tile for every other tile).
struct MmaRowsAt {
  int half;
  long long jump;
  __device__ __forceinline__ const bf16* row(const bf16* w, int r, int K) const {
    return r < half ? w + (size_t)r * K : w + jump + (size_t)(r - half) * K;
  }
};

// One warp's share: weight rows n0..n0+7 (lane row g), k over chunks [c0, c1) of 32, into d[4]
// (d[0], d[1]: batch g, rows 2q, 2q+1; d[2], d[3]: batch g + 8, same rows).
template <int B, class XS>
__device__ __forceinline__ void mma_unit(const XS& xs, const bf16* __restrict__ w, const MmaRowsAt& at, int K,
                                         int n_tile, int n0, int c0, int c1, float (&d)[4], int lane) {
  constexpr int U = MPK_LINEAR_UNROLL;
  constexpr bool kXAhead = MPK_MMA_X_AHEAD != 0;
  const int g = lane >> 2, q = lane & 3;
  const bool row_ok = n0 + g < n_tile;
  const bf16* wr = at.row(w, n0 + g, K);
  const int k_end = min(K, c1 * 32);
  const uint4 zero = make_uint4(0, 0, 0, 0);
  for (int cb = c0; cb < c1; cb += U) {
    uint4 wv[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {  // every weight load of the unit before any use
      const int k = (cb + u) * 32 + q * 8;
      wv[u] = (row_ok && k < k_end) ? ld_weight_v4(wr + k) : zero;
    }
    uint4 xah[kXAhead ? U : 1];
    if constexpr (kXAhead) {
#pragma unroll
      for (int u = 0; u < U; ++u) {  // batch row g's x vectors of the round, before any mma
        const int k = (cb + u) * 32 + q * 8;
        xah[u] = (cb + u < c1 && k < k_end && g < B) ? xs.load8(g, k) : zero;
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (cb + u >= c1) break;  // warp-uniform: the mma needs all 32 lanes
      const int k = (cb + u) * 32 + q * 8;
      const bool k_ok = k < k_end;
      const uint4 xa = kXAhead ? xah[kXAhead ? u : 0] : ((k_ok && g < B) ? xs.load8(g, k) : zero);  // batch row g
      const uint4 xb = (B > 8 && k_ok && g + 8 < B) ? xs.load8(g + 8, k) : zero;  // batch row g + 8
      mma_bf16_16816(d, xa.x, xb.x, xa.y, xb.y, wv[u].x, wv[u].y);  // elements 0..3 of each lane's 8
      mma_bf16_16816(d, xa.z, xb.z, xa.w, xb.w, wv[u].z, wv[u].w);  // elements 4..7
    }
  }
}

// The lane's 4 results of a unit through the epilogue (skipping padded batch rows and rows past n_tile).
template <int B, class EpiT>
__device__ __forceinline__ void mma_store(const EpiT& epi, const float (&d)[4], int n0, int n_tile, int lane) {
  const int g = lane >> 2, q = lane & 3;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int b = g + (i >> 1) * 8, n = n0 + 2 * q + (i & 1);
    if (b < B && n < n_tile) epi(b, n, d[i]);
  }
}

// Phase marks of the tensor-core tile (trace_marks.cuh; a linear task sets no other marks). From them the
// trace says how long a fused tile's prologue (staging its operand rows) and its weight stream take.
constexpr int kMarkMmaStart = 0;
constexpr int kMarkMmaStreamed = 1;

// Offset of shared-memory address p from the start of the launch's dynamic shared memory.
__device__ __forceinline__ uint32_t dyn_smem_offset(const void* p) {
  extern __shared__ float4 mpk_mma_smem4[];  // the launch's dynamic shared memory (aliases the kernel's)
  return (uint32_t)(__cvta_generic_to_shared(p) - __cvta_generic_to_shared(mpk_mma_smem4));
}

// Bytes of the split-K partials of `units` warp units in S slices (one m16n8 fp32 accumulator tile per warp).
constexpr uint32_t kMmaPartialFloats = 128;  // 32 lanes x d[4]
constexpr uint32_t kMmaPartialAlign = 16;    // float4 stores
__device__ __forceinline__ uint32_t mma_partial_bytes(int units, int S) {
  return (uint32_t)(units * S) * kMmaPartialFloats * (uint32_t)sizeof(float);
}

// MPK_MMA_BALANCED_SLICES 1 (default): the split-K slices S give every warp the same number of (unit, slice)
// pairs where a power of two allows it, dealt round robin (warp w takes pairs w, w + nwarps, ...). Why: with S
// chosen so that units x S <= warps, qwen3-8b's batch-8 gate_up tiles (24 units on 16 warps, S = 1) ran 2 units
// on half the warps and 1 on the rest, and its qkv tiles (6 units, S = 2) kept 12 of 16 warps streaming: both
// levels at ~74% / ~55% of their weights' time (docs/PERF.md v0.27). 0: the old choice (the A/B baseline).
// Measured (docs/PERF.md v0.28, one process): qwen3-8b batch 8 5.735 / 5.738 ms vs 5.811 / 5.822 with 0; the gate_up
// level 65 -> 60.5-62.2 us, its stream (mark 0 to mark 1) ~46 us for 201 MB.
#ifndef MPK_MMA_BALANCED_SLICES
#define MPK_MMA_BALANCED_SLICES 1
#endif
constexpr int kMmaMaxSlices = 16;  // largest split-K tried (a power of two; slices stay >= one unroll of chunks)

// Split-K slices S for a tile, or 0 when the tensor-core tile would keep fewer than half the warps streaming
// (few rows and no room for the partials): the caller runs the scalar tile then, which gives every warp a
// row. Balanced (above): the power of two S with the fewest chunks on the busiest warp (the smallest such S),
// whose partials fit above the `reserved` operand bytes, or, with one pair a warp at most and `over_ok`,
// anywhere below the ring (gemv_mma_tile then writes them over the operand rows once every warp has read them;
// not where the epilogue writes into the reserved bytes: a pair tile's sums).
__device__ __forceinline__ int mma_slices(int K, int n_tile, int nt, uint32_t reserved, bool over_ok = true) {
  const int nwarps = nt >> 5, units = (n_tile + 7) / 8, chunks = (K + 31) / 32;
  const uint32_t dyn = smem_below_ring();
  int S = 1;
#if MPK_MMA_BALANCED_SLICES
  int best = ((units + nwarps - 1) / nwarps) * chunks;  // S = 1: whole units, no partials
  for (int s = 2; s <= kMmaMaxSlices && s <= nwarps && chunks / s >= MPK_LINEAR_UNROLL; s <<= 1) {
    const uint32_t need = mma_partial_bytes(units, s) + kMmaPartialAlign;
    if (need > dyn || ((units * s > nwarps || !over_ok) && reserved + need > dyn)) break;  // more slices: more room
    const int cost = ((units * s + nwarps - 1) / nwarps) * ((chunks + s - 1) / s);
    if (cost < best) best = cost, S = s;
  }
#else
  S = units >= nwarps ? 1 : nwarps / units;
  S = max(1, min(S, chunks / MPK_LINEAR_UNROLL));
  const uint32_t need = mma_partial_bytes(units, S) + kMmaPartialAlign;
  if (S > 1 && (need > dyn || (!over_ok && reserved + need > dyn))) S = 1;  // no room
#endif
  return 2 * min(units * S, nwarps) >= nwarps ? S : 0;
}

// NOTE: not inlined, as gemv_tile: one copy per batch serves the plain and the fused kinds.
// S: mma_slices(...) > 0 (the caller decided this tile runs here); reserved: bytes at the start of the dynamic
// shared memory the operand XS reads and the epilogue writes (its staged rows, a pair tile's sums; 0 when x
// comes from global memory and the epilogue stores to it); at: where the weight rows are (MmaRowsAt).
template <int B, class XS, class EpiT>
__device__ __noinline__ void gemv_mma_tile(const XS xs, const bf16* __restrict__ w, int K, int n_tile, const EpiT epi,
                                           int S, uint32_t reserved, MmaRowsAt at, int tid, int nt) {
  static_assert(B >= 1 && B <= 16, "gemv_mma_tile: batch 1..16");
  const int warp = tid >> 5, lane = tid & 31, nwarps = nt >> 5;
  const int units = (n_tile + 7) / 8, chunks = (K + 31) / 32;
  trace_mark(kMarkMmaStart, tid);  // trace: the weight stream starts (a fused kind's operand rows are staged)
  if (S == 1) {
    for (int u = warp; u < units; u += nwarps) {
      float d[4] = {0.f, 0.f, 0.f, 0.f};
      mma_unit<B>(xs, w, at, K, n_tile, u * 8, 0, chunks, d, lane);
      mma_store<B>(epi, d, u * 8, n_tile, lane);
    }
    return;
  }
  // The partials sit at the top of the shared memory below the weight ring (all of it when the ring is off).
  const int pairs = units * S;  // (unit, slice) pairs: pair p = unit p / S, slice p % S
  const uint32_t need = mma_partial_bytes(units, S), dyn = smem_below_ring();
  // Over the staged operand rows (silu_linear's 8 x 12288 bf16 at batch 8 leave no room above them): the
  // rows are dead once every warp has finished its slice, so the partials wait for that. mma_slices allows
  // this only with one pair a warp at most, whose accumulators the warp holds until then.
  const bool over_operand = reserved + need + kMmaPartialAlign > dyn;
  extern __shared__ float4 mpk_mma_smem4[];  // the launch's dynamic shared memory (aliases the kernel's)
  float* part = reinterpret_cast<float*>(reinterpret_cast<char*>(mpk_mma_smem4) + ((dyn - need) & ~(kMmaPartialAlign - 1)));
  float d[4] = {0.f, 0.f, 0.f, 0.f};
  auto store_partial = [&](int p) {
    *reinterpret_cast<float4*>(part + (size_t)p * kMmaPartialFloats + lane * 4) = make_float4(d[0], d[1], d[2], d[3]);
  };
  for (int p = warp; p < pairs; p += nwarps) {  // slice s covers chunks [s*chunks/S, (s+1)*chunks/S)
    const int u = p / S, s = p % S;
    d[0] = d[1] = d[2] = d[3] = 0.f;
    mma_unit<B>(xs, w, at, K, n_tile, u * 8, s * chunks / S, (s + 1) * chunks / S, d, lane);
    if (!over_operand) store_partial(p);
  }
  if (over_operand) {
    worker_barrier(nt);  // every warp is done with the operand rows the partials overwrite
    if (warp < pairs) store_partial(warp);  // its one pair (mma_slices)
  }
  worker_barrier(nt);  // every slice's partials are in shared memory before the sums read them
  trace_mark(kMarkMmaStreamed, tid);  // trace: every warp's slice is streamed (the partials' sums follow)
  for (int u = warp; u < units; u += nwarps) {  // unit u: its slices summed in slice order, then the epilogue
    float r[4] = {0.f, 0.f, 0.f, 0.f};
    for (int s = 0; s < S; ++s) {
      const float4 p = *reinterpret_cast<const float4*>(part + (size_t)(u * S + s) * kMmaPartialFloats + lane * 4);
      r[0] += p.x; r[1] += p.y; r[2] += p.z; r[3] += p.w;
    }
    mma_store<B>(epi, r, u * 8, n_tile, lane);
  }
  worker_barrier(nt);  // the partials are read before the next task may reuse the shared memory
}

}  // namespace mpk

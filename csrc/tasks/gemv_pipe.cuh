// Software-pipelined GEMV loop of the linear kinds (MPK_LINEAR_PIPE=1): y[b, n] = epi(b, n, sum_k
// x[b, k] * w[n, k]) for the n_tile weight rows of one tile, one warp per row as in linear.cuh.
//
// Why: the plain loop issues U 16-byte loads per lane, waits for all of them, sums, and only then
// issues the next U; at a row's end it also reduces across the warp before the next row's first
// load. So each warp has nothing in flight for one memory latency per chunk, and a tile of few rows
// (o_proj: 2 rows x 2 chunks a warp) is a chain of dependent round trips rather than a stream.
// Here a warp walks its (row, chunk) sequence with two register buffers: the next chunk's loads --
// across a row boundary too -- are issued before the current chunk is summed and before a finished
// row's warp reduction, so between U and 2U loads a lane are always in flight.
//
// Same bits as the plain loop: each lane adds its k = lane * 8 + 256 j terms in increasing j into
// one fp32 accumulator per batch row, then warp_sum; only the load issue order changes.
#pragma once
#include "common.cuh"

#ifndef MPK_LINEAR_PIPE
#define MPK_LINEAR_PIPE 0
#endif

namespace mpk {

constexpr int kPipeLaneStride = 256;  // k values one 16-byte load of each of the 32 lanes covers

// The U 16-byte weight vectors of lane `lane` in chunk kb of row `wr` (zero past K).
template <int U>
__device__ __forceinline__ void pipe_load(uint4 (&buf)[U], const bf16* __restrict__ wr, int kb, int K, int lane) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int k = kb + u * kPipeLaneStride + lane * 8;
    buf[u] = k < K ? ld_weight_v4(wr + k) : make_uint4(0, 0, 0, 0);
  }
}

// acc[b] += the chunk's terms (the plain loop's order: u ascending, padding skipped).
template <int B, int U, class XS>
__device__ __forceinline__ void pipe_sum(float (&acc)[B], const uint4 (&buf)[U], const XS& xs, int kb, int K,
                                         int lane) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int k = kb + u * kPipeLaneStride + lane * 8;
    if (k < K) {
#pragma unroll
      for (int b = 0; b < B; ++b) acc[b] += dot8(buf[u], xs.load8(b, k));
    }
  }
}

// Row n is complete: reduce across the warp, hand each batch row's sum to the epilogue, reset.
template <int B, class EpiT>
__device__ __forceinline__ void pipe_finish_row(float (&acc)[B], const EpiT& epi, int n, int lane) {
#pragma unroll
  for (int b = 0; b < B; ++b) {
    const float s = warp_sum(acc[b]);
    if (lane == (b & 31)) epi(b, n, s);
    acc[b] = 0.f;
  }
}

// The chunk after (n, kb) in this warp's sequence: the next chunk of the row, else the first chunk
// of the warp's next row (n + nwarps). Returns true when row n ends with chunk kb.
__device__ __forceinline__ bool pipe_next(int n, int kb, int K, int chunk, int nwarps, int& n2, int& kb2) {
  kb2 = kb + chunk;
  n2 = n;
  if (kb2 < K) return false;
  kb2 = 0;
  n2 = n + nwarps;
  return true;
}

template <int B, int U, class XS, class EpiT>
__device__ __forceinline__ void gemv_pipelined(const XS& xs, const bf16* __restrict__ w, int K, int n_tile,
                                               const EpiT& epi, int tid, int nt) {
  constexpr int kChunk = U * kPipeLaneStride;
  const int lane = tid & 31, nwarps = nt >> 5;
  int n = tid >> 5, kb = 0;
  if (n >= n_tile) return;
  float acc[B];
#pragma unroll
  for (int b = 0; b < B; ++b) acc[b] = 0.f;
  uint4 a[U], c[U];  // two buffers, unrolled by hand: indexing a register array by a variable spills it
  pipe_load<U>(a, w + (size_t)n * K, kb, K, lane);
  for (;;) {
    int n2, kb2, n3, kb3;
    const bool end_a = pipe_next(n, kb, K, kChunk, nwarps, n2, kb2);
    if (n2 < n_tile) pipe_load<U>(c, w + (size_t)n2 * K, kb2, K, lane);  // in flight while `a` is summed
    pipe_sum<B, U>(acc, a, xs, kb, K, lane);
    if (end_a) pipe_finish_row<B>(acc, epi, n, lane);
    if (n2 >= n_tile) return;
    const bool end_c = pipe_next(n2, kb2, K, kChunk, nwarps, n3, kb3);
    if (n3 < n_tile) pipe_load<U>(a, w + (size_t)n3 * K, kb3, K, lane);
    pipe_sum<B, U>(acc, c, xs, kb2, K, lane);
    if (end_c) pipe_finish_row<B>(acc, epi, n2, lane);
    if (n3 >= n_tile) return;
    n = n3;
    kb = kb3;
  }
}

}  // namespace mpk

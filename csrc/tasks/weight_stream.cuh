// Weight streaming through shared memory with bulk copies (MPK_LINEAR_TMA=1; KernelShape.linear_tma).
//
// Why: with 16-byte register loads a worker keeps 512 threads x MPK_LINEAR_UNROLL x 16 B = 64 KB of
// weights in flight, which covers HBM latency only once every SM streams a large tile; the 256-780 KB
// tiles of o/qkv/down projections pay a chain of round trips (docs/PERF.md v0.4: ~6 us over their
// bytes). Here the last worker warp is a producer that keeps kRingStages x kRingStageBytes (128 KB) of
// the tile's contiguous weight block in flight with cp.async.bulk, and the other warps consume whole
// rows from shared memory.
//
// Same arithmetic as fused_gemv.cuh's gemv_tile<B, 1>: one consumer warp per weight row, lane l sums
// k = l*8 + 256 j in increasing j with acc[b] += dot8(w, x), then warp_sum; so outputs are bitwise
// those of the register-load path (only which warp owns a row changes).
//
// Ring layout: the LAST kRingBytes of the launch's dynamic shared memory (the host adds them on top of
// every other need, mpk_dist/runtime/tables.py smem_bytes), then 2 x kRingStages mbarriers (full:
// producer's expect_tx + the copy's bytes; empty: one arrival per consumed row). A stage holds
// rows_per_stage = kRingStageBytes / (2 K) whole rows; chunk c (rows c*rps ..) goes to stage c % S.
// The barriers are re-initialised by every tile (the previous tile consumed every chunk it issued).
//
// Armed tags: a consumer warp skips the chunks other warps read, so it may reach chunk c + S of a
// stage while the stage's previous chunk c is still in flight; an mbarrier parity wait cannot tell
// phase c + S from phase c - S (both odd or both even) and would return at once. So the producer
// writes armed[s] = c (release) once stage s is free and about to receive chunk c, and a consumer
// waits for armed[s] == c (acquire) before its parity wait: then the barrier is in chunk c's phase.
//
// Primed before the wait: the aot worker calls stream_prime() (thread 0) for its next linear task
// BEFORE spinning on the task's input events, so the first kRingStages chunks are on their way (into
// shared memory, not just L2) while the producers of the inputs still run; gemv_streamed() then
// continues from the first chunk not yet issued. A primed ring the task did not consume (a path that
// does not stream: MMA tiles, the per-element fallback) is drained by stream_drain() after the task,
// so no copy is ever in flight when the barriers are re-initialised.
#pragma once
#include "common.cuh"

#ifndef MPK_LINEAR_UNROLL
#define MPK_LINEAR_UNROLL 8
#endif

#ifndef MPK_LINEAR_TMA
#define MPK_LINEAR_TMA 0
#endif

namespace mpk {

constexpr int kRingStages = 4;
constexpr uint32_t kRingStageBytes = 32 * 1024;
constexpr uint32_t kRingBarrierBytes = 2 * kRingStages * sizeof(uint64_t);
constexpr uint32_t kRingStateBytes = 32;  // RingState below
constexpr uint32_t kRingBytes = kRingStages * kRingStageBytes + kRingBarrierBytes + kRingStateBytes;

// Dynamic shared memory available to everything but the ring (the whole launch's when the ring is off).
__device__ __forceinline__ uint32_t smem_below_ring() {
  return MPK_LINEAR_TMA ? launch_smem_bytes() - kRingBytes : launch_smem_bytes();
}

// True when a [*, K] bf16 weight row fits one stage and the block has a producer warp besides consumers.
__device__ __forceinline__ bool stream_fits(int K, int nt) {
  return MPK_LINEAR_TMA && (uint32_t)K * sizeof(bf16) <= kRingStageBytes && nt >= 64;
}

struct RingState {
  const void* primed_w;  // weight block the ring was primed with (nullptr: not primed)
  int32_t primed_chunks;  // chunks issued by stream_prime
  int32_t pad;
  int32_t armed[kRingStages];  // chunk last issued into each stage (-1: none since ring_init)
};
static_assert(sizeof(RingState) == kRingStateBytes, "RingState: keep kRingStateBytes (and tables.py) in step");

struct WeightRing {
  char* stage0;      // stage s at stage0 + s * kRingStageBytes
  uint64_t* full;    // [kRingStages]
  uint64_t* empty;   // [kRingStages]
  RingState* state;  // written by thread 0 / the producer, read by all after a block barrier
};

__device__ __forceinline__ WeightRing weight_ring() {
  extern __shared__ __align__(128) char mpk_dyn_smem[];
  char* base = mpk_dyn_smem + (launch_smem_bytes() - kRingBytes);
  uint64_t* bars = reinterpret_cast<uint64_t*>(base + kRingStages * kRingStageBytes);
  return WeightRing{base, bars, bars + kRingStages, reinterpret_cast<RingState*>(bars + 2 * kRingStages)};
}

// Whole rows per stage and the tile's chunk count.
__device__ __forceinline__ int ring_rows_per_stage(int K) { return (int)(kRingStageBytes / ((uint32_t)K * sizeof(bf16))); }

// One thread: (re)initialise the barriers.
__device__ __forceinline__ void ring_init(const WeightRing& ring, int rps) {
  for (int s = 0; s < kRingStages; ++s) {
    mbar_init(&ring.full[s], 1);
    mbar_init(&ring.empty[s], (uint32_t)rps);
    ring.state->armed[s] = -1;  // plain store: the block barrier (or the task's) orders it before readers
  }
  fence_mbar_init();
}

// One thread: issue chunk c (stage c % kRingStages), waiting for the stage to be free when it was used.
__device__ __forceinline__ void ring_issue(const WeightRing& ring, const bf16* w, int K, int n_tile, int rps, int c) {
  const int s = c % kRingStages, use = c / kRingStages;
  if (use > 0) mbar_wait(&ring.empty[s], (uint32_t)((use - 1) & 1), "weight stage free");
  st_release_cta_shared(&ring.state->armed[s], c);  // consumers of chunk c may now wait on its phase
  const uint32_t row_bytes = (uint32_t)K * sizeof(bf16);
  const uint32_t bytes = (uint32_t)min(rps, n_tile - c * rps) * row_bytes;
  mbar_arrive_expect_tx(&ring.full[s], bytes);
  bulk_copy_g2s(ring.stage0 + (size_t)s * kRingStageBytes, w + (size_t)c * rps * K, bytes, &ring.full[s]);
}

// Thread 0 of an aot worker, before the task's waits: start the tile's first chunks (see the top).
__device__ __forceinline__ void stream_prime(const bf16* w, int K, int n_tile, int nt) {
  if (!stream_fits(K, nt) || n_tile <= 0) return;
  const WeightRing ring = weight_ring();
  const int rps = ring_rows_per_stage(K), nchunks = (n_tile + rps - 1) / rps;
  ring_init(ring, rps);
  const int n = min(nchunks, kRingStages);
  for (int c = 0; c < n; ++c) ring_issue(ring, w, K, n_tile, rps, c);
  ring.state->primed_w = w;
  ring.state->primed_chunks = n;
}

// Thread 0 after a task: a primed ring the task did not stream from is waited out and released.
__device__ __forceinline__ void stream_drain() {
  if (!MPK_LINEAR_TMA) return;
  const WeightRing ring = weight_ring();
  if (ring.state->primed_w == nullptr) return;
  for (int c = 0; c < ring.state->primed_chunks; ++c) mbar_wait(&ring.full[c], 0u, "primed stage drained");
  ring.state->primed_w = nullptr;
}

// Host-initialised state: the kernel's first task sees an unprimed ring (the launch zeroes nothing, so
// every worker clears it once at start).
__device__ __forceinline__ void stream_reset(int tid) {
  if (MPK_LINEAR_TMA && tid == 0) weight_ring().state->primed_w = nullptr;
}

// y[b, n] = epi(b, n, sum_k x[b, k] * w[n, k]) for the n_tile rows of w (contiguous [n_tile, K] bf16),
// weights streamed through the ring. Every worker thread calls it (it contains block barriers).
template <int B, class XS, class EpiT>
__device__ __noinline__ void gemv_streamed(const XS xs, const bf16* __restrict__ w, int K, int n_tile, const EpiT epi,
                                           int tid, int nt) {
  const WeightRing ring = weight_ring();
  const int warp = tid >> 5, lane = tid & 31, nwarps = nt >> 5, ncons = nwarps - 1;
  const int rps = ring_rows_per_stage(K);  // whole rows per stage (>= 1: stream_fits)
  const int nchunks = (n_tile + rps - 1) / rps;
  // Primed for this very block before the wait (stream_prime)? Then continue after its chunks.
  const bool primed = ring.state->primed_w == static_cast<const void*>(w);
  const int first = primed ? ring.state->primed_chunks : 0;
  if (tid == 0 && !primed) {
    stream_drain();  // primed for another block of weights: no copy may be in flight across ring_init
    ring_init(ring, rps);
  }
  worker_barrier(nt);  // barriers initialised (and the primed state read by all) before any copy or wait
  if (warp == nwarps - 1) {  // producer warp: lane 0 issues, in chunk order
    if (lane == 0)
      for (int c = first; c < nchunks; ++c) ring_issue(ring, w, K, n_tile, rps, c);
    __syncwarp();  // the warp reaches the block barrier below converged
  } else {
    constexpr int U = MPK_LINEAR_UNROLL;
    for (int n = warp; n < n_tile; n += ncons) {
      const int c = n / rps, s = c % kRingStages;
      smem_wait_eq(&ring.state->armed[s], c, "weight stage armed");  // the barrier is in chunk c's phase
      mbar_wait(&ring.full[s], (uint32_t)((c / kRingStages) & 1), "weight stage filled");
      const bf16* wr = reinterpret_cast<const bf16*>(ring.stage0 + (size_t)s * kRingStageBytes) + (size_t)(n % rps) * K;
      float acc[B];
#pragma unroll
      for (int b = 0; b < B; ++b) acc[b] = 0.f;
      for (int kb = 0; kb < K; kb += U * 256) {
        uint4 wv[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int k = kb + u * 256 + lane * 8;
          wv[u] = k < K ? *reinterpret_cast<const uint4*>(wr + k) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int k = kb + u * 256 + lane * 8;
          if (k < K) {
#pragma unroll
            for (int b = 0; b < B; ++b) acc[b] += dot8(wv[u], xs.load8(b, k));
          }
        }
      }
      __syncwarp();
      if (lane == 0) mbar_arrive(&ring.empty[s]);  // the warp's reads of the row are done
#pragma unroll
      for (int b = 0; b < B; ++b) {
        const float v = warp_sum(acc[b]);
        if (lane == (b & 31)) epi(b, n, v);
      }
    }
  }
  worker_barrier(nt);  // every chunk consumed: the ring and its barriers are free for the next tile
  if (tid == 0) {
    // Primed beyond this call's rows (a caller streaming part of the primed block): wait those copies
    // out too (chunks < kRingStages, so phase 0), then the ring is idle.
    for (int c = nchunks; c < first; ++c) mbar_wait(&ring.full[c], 0u, "primed stage drained");
    ring.state->primed_w = nullptr;  // read again only after the next task's barriers
  }
}

}  // namespace mpk

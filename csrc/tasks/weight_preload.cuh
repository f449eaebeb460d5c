// Batch-1 GEMV tiles' weights copied into shared memory BEFORE the task waits on its inputs
// (MPK_WEIGHT_PRELOAD_KB > 0; KernelShape.weight_preload_kb).
//
// Why: the L2 prefetch before the wait (linear.cuh linear_blocks_prefetch) brings a tile's head to L2, but the
// tile still pays an L2 round trip per round of weight loads after its inputs are ready (qwen3-0.6b's qkv tile:
// 2 us of its 4.7 us run streams 64 KB from L2, docs/PERF.md v0.18). The small models' whole tiles (32-96 KB)
// fit in shared memory, so the bytes can arrive while the producers of the inputs still run and the weight loop
// reads shared memory: only the activation waits for the event, as the issue asks.
//
// How: every worker thread issues 16-byte cp.async copies of the head of the tile's weight block (each of the two
// blocks' heads for norm_linear_silu) into the LAST kPreloadBytes of the dynamic shared memory (tables.smem_bytes
// adds them on top of every other need; smem_below_ring() leaves them out of the staging budget; the host refuses
// it together with the MPK_LINEAR_TMA ring, which streams the same bytes its own way). Thread 0 records the
// window (block pointer, bytes) in shared memory; gemv_tile waits for the copies
// (cp.async.wait_all + a block barrier) before the weight loop, after any prologue, so the prologue's activation
// loads also overlap the copies' tail. gemv_tile reads a round of weight vectors from shared memory when the round
// lies inside the window: the same 16 bytes, the same sums, so the same bits.
// The aot worker waits for its own copies after every preloaded task (preload_settle), so no copy is in flight
// when the next task's copies target the same bytes. The jit schedule never preloads (window empty).
#pragma once
#include "common.cuh"

#ifndef MPK_WEIGHT_PRELOAD_KB
#define MPK_WEIGHT_PRELOAD_KB 0
#endif
#ifndef MPK_BATCH
#define MPK_PRELOAD_BATCH 0
#else
#define MPK_PRELOAD_BATCH MPK_BATCH
#endif

namespace mpk {

// Preloading is compiled in only for batch-1 kernels (the scalar GEMV tile; batch >= 2 reads each weight vector
// once per row block anyway and runs tensor-core tiles from 4 rows).
constexpr uint32_t kPreloadBytes = MPK_PRELOAD_BATCH == 1 ? (uint32_t)MPK_WEIGHT_PRELOAD_KB * 1024u : 0u;
constexpr uint32_t kPreloadChunk = 16;  // bytes per cp.async

struct PreloadWindow {
  const bf16* w0;  // the tile's (first) weight block; its first n0 bytes are at the region's start
  const bf16* w1;  // norm_linear_silu's second block (up rows); its first n1 bytes follow the first block's
  uint32_t n0, n1;
};

__device__ __forceinline__ PreloadWindow& preload_window() {
  __shared__ PreloadWindow win;
  return win;
}

// Start of the preload region: the last kPreloadBytes of the dynamic shared memory.
__device__ __forceinline__ char* preload_base() {
  extern __shared__ __align__(128) char mpk_dyn_smem[];
  return mpk_dyn_smem + (launch_smem_bytes() - kPreloadBytes);
}

// Thread 0: no window (kernel start; every task the worker does not preload).
__device__ __forceinline__ void preload_clear(int tid) {
  if (kPreloadBytes > 0 && tid == 0) preload_window().n0 = preload_window().n1 = 0;
}

// Every worker thread, before the task's wait: copy up to kPreloadBytes of the tile's weights (the heads of its
// one or two blocks, half the budget each) into the region and record the window. Returns the bytes preloaded from
// the head of each block (the L2 prefetch takes over after them).
__device__ __forceinline__ uint64_t preload_weights(const bf16* w, int K, int n_tile, long long second, int tid,
                                                    int nt) {
  if (kPreloadBytes == 0) return 0;
  const int nblocks = second != 0 ? 2 : 1;
  const uint64_t block = (uint64_t)(second != 0 ? n_tile / 2 : n_tile) * K * sizeof(bf16);
  const uint64_t cap = (kPreloadBytes / nblocks) / kPreloadChunk * kPreloadChunk;
  const uint32_t n = (uint32_t)((block < cap ? block : cap) / kPreloadChunk * kPreloadChunk);
  char* base = preload_base();
  for (int b = 0; b < nblocks; ++b) {
    const char* src = reinterpret_cast<const char*>(w + b * second);
    for (uint32_t o = (uint32_t)tid * kPreloadChunk; o < n; o += (uint32_t)nt * kPreloadChunk)
      cp_async16(base + b * n + o, src + o);
  }
  if (tid == 0) {
    PreloadWindow& win = preload_window();
    win.w0 = w;
    win.n0 = n;
    win.w1 = second != 0 ? w + second : nullptr;
    win.n1 = second != 0 ? n : 0;
  }
  return n;
}

// Every worker thread, before the weight loop reads the window: this thread's copies have landed, and the barrier
// hands every thread's copies to the block. Uniform over the block (the window is in shared memory).
__device__ __forceinline__ void preload_ready(int nt) {
  if (kPreloadBytes == 0 || preload_window().n0 == 0) return;
  cp_async_wait_all();
  worker_barrier(nt);
}

// Every worker thread, after a task: its copies are complete before the next task's copies reuse the region.
__device__ __forceinline__ void preload_settle() {
  if (kPreloadBytes > 0 && preload_window().n0 != 0) cp_async_wait_all();
}

// The window of weight block w as seen by one gemv_tile call: the shared-memory address (32-bit, one register in
// the weight loop) of its bytes and how many there are (0: w is not preloaded).
struct PreloadView {
  uint32_t s;
  uint32_t n;
};

__device__ __forceinline__ PreloadView preload_view(const bf16* w) {
  if (kPreloadBytes == 0) return PreloadView{0, 0};
  const PreloadWindow& win = preload_window();
  const uint32_t base = smem_addr(preload_base());
  if (win.n0 != 0 && win.w0 == w) return PreloadView{base, win.n0};
  if (win.n1 != 0 && win.w1 == w) return PreloadView{base + win.n0, win.n1};
  return PreloadView{0, 0};
}

// True when the first `end` elements of the block are all in the window (compiled out without a preload).
__device__ __forceinline__ bool preload_covers(const PreloadView& v, size_t end) {
  return kPreloadBytes > 0 && end * sizeof(bf16) <= v.n;
}

// 16 bytes of the block at element offset e, from the window (preload_covers said it is there).
__device__ __forceinline__ uint4 ld_preloaded(const PreloadView& v, uint32_t e) {
  uint4 r;
  asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "r"(v.s + e * (uint32_t)sizeof(bf16)));
  return r;
}

}  // namespace mpk

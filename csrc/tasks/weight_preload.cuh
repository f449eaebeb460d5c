// A batch-1 linear tile behind a NARROW op copies the tail of its weight block into shared memory before its wait
// (MPK_WEIGHT_PRELOAD_KB > 0; KernelShape.weight_preload_kb).
//
// Why: behind unsplit attention (8 tiles on 8 SMs for ~14 us, qwen3-8b batch 1) every other SM waits with HBM idle,
// and the o_proj tiles already prefetch their whole 256 KB block into L2 there (mpk_dist/runtime/prefetch_plan.py).
// But L2 is not much faster than HBM when every SM reads it at once: 132 blocks reading 256 KB each from L2 reached
// 5.0 TB/s, against 4.2-4.7 from HBM (csrc/bench/sm_read_bw.cu --l2, docs/PERF.md v0.30), so o_proj still ran
// ~9.4 us after its input arrived. Shared memory is the storage that is faster: the bytes copied there while the
// attention runs are read at the SM's own shared-memory bandwidth after the wait.
//
// Which tiles: only the task a worker is about to wait on (not one hoisted ahead), only when the host planned a
// whole-tile prefetch for it (REC_PREFETCH > 0: it waits on a narrow op, prefetch_plan.py), and only single-block
// fused kinds whose GEMV is gemv_tile (linear_residual, norm_linear, silu_linear); every other task keeps the
// window empty and the kernel reads as before. The window holds whole rows from the END of the tile's block:
// the rows before it are read from global memory (L2-prefetched as planned), and gemv_tile's warps take rows in
// order, so the global rows' loads go out in the first round while other warps already read shared memory.
//
// How: every worker thread issues 16-byte cp.async copies of the tail rows into the LAST kPreloadBytes of the
// dynamic shared memory (tables.smem_bytes adds them on top of every other need; smem_below_ring() leaves them out
// of the staging budget; the host refuses it beside the MPK_LINEAR_TMA ring, the other tenant of that end).
// Thread 0 records the window (block pointer, first preloaded row) in shared memory; gemv_tile waits for the copies
// (cp.async.wait_all + a block barrier) before its weight loop and reads a row from shared memory when the row is in
// the window: the same 16 bytes, the same sums, so the same bits. The aot worker waits for its own copies after
// every preloaded task (preload_settle), so no copy is in flight when the next task's copies reuse the bytes.
// The jit schedule never preloads (the window stays empty).
#pragma once
#include "common.cuh"

#ifndef MPK_WEIGHT_PRELOAD_KB
#define MPK_WEIGHT_PRELOAD_KB 0
#endif
// What the region holds (measurement variants): the linear tiles' weight rows (MPK_PRELOAD_WEIGHTS, default 1) and/or
// the unsplit attention_prep tile's key rows (MPK_PRELOAD_ATTN_K, attention_mma_walk.cuh, default 0).
#ifndef MPK_PRELOAD_WEIGHTS
#define MPK_PRELOAD_WEIGHTS 1
#endif
#ifndef MPK_PRELOAD_ATTN_K
#define MPK_PRELOAD_ATTN_K 0
#endif
#ifndef MPK_BATCH
#define MPK_PRELOAD_BATCH 0
#else
#define MPK_PRELOAD_BATCH MPK_BATCH
#endif

namespace mpk {

// Compiled in only for batch-1 kernels (the scalar GEMV tile reads the window).
constexpr uint32_t kPreloadBytes = MPK_PRELOAD_BATCH == 1 ? (uint32_t)MPK_WEIGHT_PRELOAD_KB * 1024u : 0u;
constexpr uint32_t kPreloadChunk = 16;  // bytes per cp.async
constexpr int kNoPreloadRow = 0x7fffffff;  // PreloadView.row0 of a block with no rows in the window

struct PreloadWindow {
  const bf16* w;  // the tile's weight block (nullptr: no window)
  int row0;       // rows row0 .. n_tile - 1 of w are at the region's start, row after row
  int k_rows;     // MPK_PRELOAD_ATTN_K: key rows 0 .. k_rows - 1 of an attention_prep tile at the region's start
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

// Thread 0: no window (kernel start; before every task the worker might preload).
__device__ __forceinline__ void preload_clear(int tid) {
  if (kPreloadBytes > 0 && tid == 0) {
    preload_window().w = nullptr;
    preload_window().k_rows = 0;
  }
}

// Every worker thread, before the task's wait: copy the last whole rows of the tile's [n_tile, K] block that fit
// kPreloadBytes into the region and record the window. Returns the bytes at the head of the block NOT preloaded
// (the L2 prefetch's share); the whole block when nothing was copied.
__device__ __forceinline__ uint64_t preload_weights(const bf16* w, int K, int n_tile, int tid, int nt) {
  const uint64_t row_bytes = (uint64_t)K * sizeof(bf16), block = row_bytes * (uint64_t)n_tile;
  if (kPreloadBytes == 0 || !MPK_PRELOAD_WEIGHTS || row_bytes % kPreloadChunk != 0) return block;
  const int rows = (int)((uint64_t)kPreloadBytes / row_bytes < (uint64_t)n_tile ? kPreloadBytes / row_bytes : n_tile);
  if (rows <= 0) return block;
  const int row0 = n_tile - rows;
  const uint64_t head = row_bytes * (uint64_t)row0;
  const uint32_t n = (uint32_t)(block - head);
  const char* src = reinterpret_cast<const char*>(w) + head;
  char* base = preload_base();
  for (uint32_t o = (uint32_t)tid * kPreloadChunk; o < n; o += (uint32_t)nt * kPreloadChunk) cp_async16(base + o, src + o);
  if (tid == 0) {
    PreloadWindow& win = preload_window();
    win.w = w;
    win.row0 = row0;
  }
  return head;
}

// The window of weight block w as one gemv_tile call sees it: the shared-memory address (32-bit) of its first
// preloaded row and that row's index (kNoPreloadRow: w has no rows in the window).
struct PreloadView {
  uint32_t s;
  int row0;
};

__device__ __forceinline__ PreloadView preload_view(const bf16* w) {
  if (kPreloadBytes == 0) return PreloadView{0, kNoPreloadRow};
  const PreloadWindow& win = preload_window();
  if (win.w != nullptr && win.w == w) return PreloadView{smem_addr(preload_base()), win.row0};
  return PreloadView{0, kNoPreloadRow};
}

// Every thread of the block, before the weight loop reads the window: this thread's copies have landed, and the
// barrier hands every thread's copies to the block. Uniform over the block (the view comes from shared memory).
__device__ __forceinline__ void preload_ready(const PreloadView& v, int nt) {
  if (kPreloadBytes == 0 || v.row0 == kNoPreloadRow) return;
  cp_async_wait_all();
  worker_barrier(nt);
}

// Every worker thread, after a task: its copies are complete before the next task's copies reuse the region.
__device__ __forceinline__ void preload_settle() {
  if (kPreloadBytes > 0 && (preload_window().w != nullptr || preload_window().k_rows != 0)) cp_async_wait_all();
}

// MPK_PRELOAD_ATTN_K, every worker thread, before an unsplit attention_prep tile's wait: copy the key rows of
// positions 0 .. min(p, what fits) - 1 (D bf16 each, kv_ps apart in the cache) into the region, row after row.
// Position p itself is appended by the tile's prep, after the wait: the walk reads it from the cache.
__device__ __forceinline__ void preload_attn_keys(const bf16* kc, int D, int kv_ps, int p, int tid, int nt) {
  if (kPreloadBytes == 0 || !MPK_PRELOAD_ATTN_K) return;
  const int row_bytes = D * (int)sizeof(bf16);
  if (row_bytes % (int)kPreloadChunk != 0 || (kv_ps * (int)sizeof(bf16)) % (int)kPreloadChunk != 0) return;
  const int cap = (int)(kPreloadBytes / (uint32_t)row_bytes), rows = p < cap ? p : cap;
  if (rows <= 0) return;
  const int per_row = row_bytes / (int)kPreloadChunk;
  char* base = preload_base();
  for (int i = tid; i < rows * per_row; i += nt) {
    const int r = i / per_row, c = i % per_row;
    cp_async16(base + (size_t)r * row_bytes + (size_t)c * kPreloadChunk,
               reinterpret_cast<const char*>(kc + (size_t)r * kv_ps) + (size_t)c * kPreloadChunk);
  }
  if (tid == 0) preload_window().k_rows = rows;
}

// The key rows copied for the task being run (the walk's ks, ks_rows; 0 rows: none). Every thread waits for its own
// copies here; the caller's block barrier then hands them to the block.
__device__ __forceinline__ const bf16* preload_attn_keys_ready(int& rows) {
  rows = kPreloadBytes > 0 && MPK_PRELOAD_ATTN_K ? preload_window().k_rows : 0;
  if (rows > 0) cp_async_wait_all();
  return reinterpret_cast<const bf16*>(preload_base());
}

// 16 bytes of row n (>= v.row0) at column k, from the window.
__device__ __forceinline__ uint4 ld_preloaded(const PreloadView& v, int n, int K, int k) {
  uint4 r;
  const uint32_t a = v.s + (uint32_t)(((n - v.row0) * K + k) * (int)sizeof(bf16));
  asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "r"(a));
  return r;
}

}  // namespace mpk

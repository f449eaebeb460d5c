// row_pool: the last rows of every tile of a wide batch-1 linear level, summed by whichever of the level's tiles is
// free first (mpk_dist/runtime/row_pool.py plans it; the task record carries it: REC_POOL_*).
//
// Why: a wide level's tiles start within 0.5-2.3 us of each other but end 5-8 us apart (qwen3-8b's gate|up on the
// H100, docs/PERF.md v0.39), while the median tile streams at the level's byte rate: the SMs stream at different
// rates, and once fewer than ~110 of them are still streaming the HBM is no longer full. With the pool, a tile sums
// its static rows [0, n - P), then claims chunks of the pooled rows (the last P rows of each tile of the level) from
// the op's counter until none is left, so every SM streams until the level's last chunk.
//
// A chunk is one row a warp (a pair tile: one gate and one up row a warp of each half, i.e. nt / 64 columns). Each
// row is still one warp's sum over k in the same order, so the outputs are bit for bit those of the unpooled level.
// The tiles of a pooled op are uniform (row_pool.py checks it): tile j's rows are tile i's rows moved by
// (j - i) * n_tile, so a tile reaches any chunk from its own argument pointers.
#pragma once
#include "linear_residual.cuh"
#include "norm_linear_silu.cuh"

namespace mpk {

struct RowPool {
  uint32_t* counter = nullptr;  // the op's claim counter (zero between steps)
  int tiles = 0;                // tiles of the op; 0: no pool, the task sums only its own rows
  int tile = 0;                 // this task's tile index in the op
  int rows = 0;                 // pooled rows at the end of each tile (a pair tile: columns of each half)
};

// Rows a chunk holds: one a warp, or for a pair tile one column (a gate and an up row) a warp of each half.
__device__ __forceinline__ int pool_chunk_rows(bool pair, int nt) { return pair ? nt >> 6 : nt >> 5; }

// Whether the pool of a tile of n rows (a pair tile: columns of each half) is one the loops below can run: whole
// chunks, fewer than the tile's rows, batch 1. The host planned it so; a mismatch is reported as a bad task.
__device__ __forceinline__ bool pool_ok(const RowPool& p, int B, int n, bool pair, int nt) {
  const int c = pool_chunk_rows(pair, nt);
  return B == 1 && p.tiles > 0 && p.tile >= 0 && p.tile < p.tiles && p.rows > 0 && p.rows < n && c > 0 &&
         p.rows % c == 0 && p.counter != nullptr;
}

// The next chunk this block sums, or -1 when the pool is empty (every thread gets the same answer). The first
// barrier keeps a slow thread's read of the previous answer (and, in a pair tile, of the previous chunk's sums)
// ahead of the next claim.
__device__ __forceinline__ int pool_claim(const RowPool& p, int chunks, int tid, int nt) {
  __shared__ int slot;
  worker_barrier(nt);
  if (tid == 0) {
    const uint32_t c = pool_claim_next(p.counter, (uint32_t)chunks, (uint32_t)p.tiles);
    slot = c < (uint32_t)chunks ? (int)c : -1;
  }
  worker_barrier(nt);
  return slot;
}

// The first row of chunk c relative to this tile's first row (negative for an earlier tile's rows).
__device__ __forceinline__ long long pool_chunk_first(const RowPool& p, int c, int n, int chunk) {
  const int per_tile = p.rows / chunk;
  return (long long)(c / per_tile - p.tile) * n + (n - p.rows) + (long long)(c % per_tile) * chunk;
}

// linear_residual's pooled rows (after the tile's static rows [0, n_tile - rows)): x, w, res, y as the task's.
__device__ void linear_residual_pool(const RowPool& p, const bf16* x, int ldx, const bf16* w, const float* res,
                                     float* y, int ldy, int K, int n_tile, float* smem, int tid, int nt) {
  const int chunk = pool_chunk_rows(false, nt), chunks = p.tiles * (p.rows / chunk);
  for (int c = pool_claim(p, chunks, tid, nt); c >= 0; c = pool_claim(p, chunks, tid, nt)) {
    const long long first = pool_chunk_first(p, c, n_tile, chunk);
    linear_residual(1, x, ldx, w + first * K, res + first, y + first, ldy, K, chunk, smem, tid, nt
#if MPK_SILU_DOWN
                    , nullptr
#endif
#if MPK_FLAG_WORDS
                    , nullptr, nullptr, 0u
#endif
    );
  }
}

// norm_linear_silu's pooled columns (after the tile's static columns [0, h - rows) of each half): the normalised
// row is still staged at stage_base (the static part staged it; pair_silu read only the sums), the sums of a chunk go
// into the tile's pair buffer (the static sums are consumed: pool_claim's barrier). w: the tile's first gate row,
// up_rows: rows from a gate row to its up row, y: the tile's first output column. False when the static part did
// not stage its row (the host plans pools only where it fits).
__device__ bool silu_pair_pool(const RowPool& p, const bf16* w, long long up_rows, bf16* y, int ldy, int K, int h,
                               float* smem, int tid, int nt) {
  if (!stage_fits(1, K)) return false;
  bool staged = false;
  bf16* pair = pair_buffer(smem, 1, K, 2 * h, staged);
  if (pair == nullptr || !staged) return false;
  const int chunk = pool_chunk_rows(true, nt), chunks = p.tiles * (p.rows / chunk);
  Epi epi{pair, nullptr, 2 * chunk, kEpiPair};
  epi.pair_jump = up_rows * K;
  const XRows xs{stage_base(smem), K};
  for (int c = pool_claim(p, chunks, tid, nt); c >= 0; c = pool_claim(p, chunks, tid, nt)) {
    const long long first = pool_chunk_first(p, c, h, chunk);
    gemv_pair<1>(xs, w + first * K, K, 2 * chunk, epi, tid, nt);
    worker_barrier(nt);  // both halves' sums of the chunk are in shared memory
    pair_silu(pair, chunk, y + first, ldy, 1, tid, nt);
  }
  return true;
}

}  // namespace mpk

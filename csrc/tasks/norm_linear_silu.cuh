// norm_linear_silu: y[b, c0:c0+n] = silu(rms_norm(x[b]) . w[c0:c0+n]) * (rms_norm(x[b]) . w[UP_ROWS+c0:..+n])
// (mpk_dist/taskgraph/tasks/norm_linear_silu.py): the gate|up projection with the norm as its prologue and
// silu_mul as its epilogue, so the down projection reads the activation instead of recomputing silu over the
// whole intermediate size in each of its tiles.
//
// The prologue and the GEMV are norm_linear's (the generated body when the build has one, which stages the
// normalised rows exactly as the hand-written one), run with the kEpiPair epilogue (fused_gemv.cuh): the tile's
// 2n weight rows are its n gate rows and its n up rows, their sums stored rounded to bf16 (what the gate|up
// linear stores) in shared memory after the staged rows; then each (row, column) gets silu_mul.cuh's
// bf16(bf16(silu(gate)) * up). Same bits as norm_linear + silu_mul.
//
// MPK_SILU_DOWN 1 (set for programs with fusion 'silu_down', runtime.kernel): a tile whose task has the down weight
// (DownArgs.wd) also keeps its activation in shared memory and adds its down partial into the residual stream
// (down_partial.cuh). 0 (every other program): that code is not compiled.
#pragma once
#include "norm_linear.cuh"
#include "silu_mul.cuh"
#if MPK_SILU_DOWN
#include "down_partial.cuh"
#endif

namespace mpk {

#if MPK_SILU_DOWN
// The folded down projection of a tile (wd == nullptr: none).
struct DownArgs {
  const bf16* wd = nullptr;
  int ldw = 0, H = 0;
  float* xo = nullptr;
  int ldxo = 0;
};
#endif

constexpr uint32_t kPairAlign = 16;  // fusion.PAIR_ALIGN: the gate|up sums start 16-byte aligned

// y[b, c] = bf16(bf16(silu(g)) * u) for the tile's B x n columns; g, u: its rounded sums in shared memory
// ([B, 2n]: the n gate sums, then the n up sums, of each row).
// With MPK_FLAG_WORDS, y_flags (nullptr: none) gets y's flagged copy, a word per column pair (flag_words.cuh): the
// even column's thread writes it with its neighbour's value (a lane apart: n and ldy are even).
// act_copy (nullptr: none) gets the same values, [B, n] (MPK_SILU_DOWN: the down partial reads them there).
__device__ __forceinline__ void pair_silu(const bf16* pair, int n, bf16* y, int ldy, int B, int tid, int nt,
                                          bf16* act_copy = nullptr
#if MPK_FLAG_WORDS
                                          , uint64_t* y_flags = nullptr, uint32_t tag = 0
#endif
) {
  for (int i = tid; i < B * n; i += nt) {
    const int b = i / n, c = i - b * n;
    const bf16* p = pair + (size_t)b * 2 * n + c;
    const bf16 v = f2bf(silu_bf(bf2f(p[0])) * bf2f(p[n]));
    y[(size_t)b * ldy + c] = v;
    if (act_copy != nullptr) act_copy[i] = v;
#if MPK_FLAG_WORDS
    if (y_flags != nullptr) flag_store_pair(y_flags, (size_t)b * ldy + c, v, tag);
#endif
  }
}

// The tile's sums in shared memory after the staged rows (or, when those do not fit with the sums, after
// the reduction scratch while the rows are computed per element); nullptr when not even that fits.
__device__ __forceinline__ bf16* pair_buffer(float* smem, int B, int K, int n_tile, bool& staged) {
  const uint32_t sums = (uint32_t)B * (uint32_t)n_tile * (uint32_t)sizeof(bf16);
  const uint32_t after_rows = (staged_bytes(B, K) + kPairAlign - 1) / kPairAlign * kPairAlign;
  staged = after_rows + sums <= dynamic_smem_bytes();
  const uint32_t at = staged ? after_rows : staged_bytes(0, 0);
  if (at + sums > dynamic_smem_bytes()) return nullptr;
  return reinterpret_cast<bf16*>(reinterpret_cast<char*>(smem) + at);
}

// False when the launch's shared memory cannot hold the tile's sums (the worker reports a bad task).
template <class Body>
__device__ __forceinline__ bool norm_linear_silu(int B, const float* x, int ldx, const bf16* nw, const bf16* w,
                                                 long long up_rows, bf16* y, int ldy, int K, int n_tile, float eps,
                                                 float* smem, int tid, int nt, const Body& body
#if MPK_SILU_DOWN
                                                 , const DownArgs& down = DownArgs()
#endif
#if MPK_FLAG_WORDS
                                                 , uint64_t* y_flags = nullptr, uint32_t tag = 0
#endif
) {
  bool staged = false;
  bf16* pair = pair_buffer(smem, B, K, n_tile, staged);
  if (pair == nullptr) return false;
  bf16* act_copy = nullptr;
#if MPK_SILU_DOWN
  if (down.wd != nullptr) {
    // The activation copy goes where the staged rows were (dead once the sums are in): it must fit below the sums.
    if (!down_partial_ok(down.wd, n_tile / 2, down.ldw, B) ||
        staged_bytes(0, 0) + (uint32_t)(B * (n_tile / 2)) * (uint32_t)sizeof(bf16) >
            (uint32_t)(reinterpret_cast<char*>(pair) - reinterpret_cast<char*>(smem)))
      return false;
    act_copy = stage_base(smem);
  }
#endif
  Epi epi{pair, nullptr, n_tile, kEpiPair};
  epi.pair_jump = up_rows * K;
  if (staged) {
    body(B, x, ldx, nw, w, epi, K, n_tile, eps, smem, tid, nt);  // stages its rows below the sums
  } else {  // the rows per element (norm_linear's fallback), the sums right after the reduction scratch
    for (int b = 0; b < B; ++b) {
      const float* xr = x + (size_t)b * ldx;
      gemv_rowwise(NormRow{xr, nw, row_rstd(xr, K, eps, smem, tid, nt)}, w, K, n_tile, epi, b, tid, nt);
    }
  }
  worker_barrier(nt);  // every half's sums are in shared memory
#if MPK_FLAG_WORDS
  pair_silu(pair, n_tile / 2, y, ldy, B, tid, nt, act_copy, y_flags, tag);
#else
  pair_silu(pair, n_tile / 2, y, ldy, B, tid, nt, act_copy);
#endif
#if MPK_SILU_DOWN
  if (act_copy != nullptr) {
    worker_barrier(nt);  // the whole activation copy before any thread's rows read it
    // the row sums in shared memory after the gate|up sums when they fit there (vector reductions), else one
    // scalar add per row
    float* sums = reinterpret_cast<float*>(reinterpret_cast<char*>(pair) +
                                           (((uint32_t)(B * n_tile) * (uint32_t)sizeof(bf16) + kPairAlign - 1) &
                                            ~(kPairAlign - 1)));
    const uint32_t end = (uint32_t)(reinterpret_cast<char*>(sums) - reinterpret_cast<char*>(smem)) +
                         (uint32_t)(B * down.H) * (uint32_t)sizeof(float);
    if (!MPK_DOWN_VECTOR_RED || end > dynamic_smem_bytes() || !down_sums_vector_ok(down.xo, down.H, down.ldxo))
      sums = nullptr;
    down_partial(act_copy, B, n_tile / 2, down.wd, down.ldw, down.H, down.xo, down.ldxo, sums, tid, nt);
  }
#endif
  return true;
}

}  // namespace mpk

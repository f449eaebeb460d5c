// The GEMV loop of the fused linear kinds (norm_linear, linear_residual, silu_linear), with the
// input and the epilogue as policies: y[b, n] = epi(b, n, sum_k x[b, k] * w[n, k]) for the N_TILE
// weight rows of one tile. The loop is linear.cuh's (one warp per row, or MPK_LINEAR_ROWS rows per
// warp; each lane streams 16-byte weight vectors with kLinUnroll of them in flight before the first
// use; the same fp32 accumulation order), so a fused tile sums exactly as the unfused linear does.
//
// Input policies give 8 bf16 of x[b, k..k+7] as a uint4: XRows reads a bf16 matrix (global
// activations, or a prologue's result staged in shared memory by stage_row). When the staged
// input does not fit the launch's shared memory, gemv_rowwise computes the prologue per element
// (NormRow, SiluRow) with a bit-identical result. Every prologue rounds exactly as the unfused task
// that wrote x would have. Only the instantiations the fused graphs use exist (few templates keep
// the one-kernel build fast).
#pragma once
#include "common.cuh"
#include "linear.cuh"
#include "rms_norm.cuh"  // the norm prologues' row statistic (share_sum_sq)
#include "silu_mul.cuh"
#include "weight_stream.cuh"
#include "flag_words.cuh"  // Epi's flagged copies (MPK_FLAG_WORDS)

namespace mpk {

#if defined(MPK_LINEAR_ROWS) && MPK_LINEAR_ROWS > 1
constexpr int kFuseRows = MPK_LINEAR_ROWS;
#else
constexpr int kFuseRows = 1;
#endif

// Dynamic shared memory a fused tile may stage its prologue in (below the weight ring when
// MPK_LINEAR_TMA is on); it computes the prologue on the fly when the rows do not fit.
__device__ __forceinline__ uint32_t dynamic_smem_bytes() { return smem_below_ring(); }

// x[b, k..k+7] of a row-major bf16 matrix (global memory or shared memory; 16-byte aligned rows).
struct XRows {
  const bf16* x;
  int ld;
  __device__ __forceinline__ uint4 load8(int b, int k) const { return ld_act_v4(x + (size_t)b * ld + k); }
};

// bf16(bf16(x[i] * r) * g[i]) for the 8 fp32 values x and the norm weights' (or any parameter's) 16 bytes g, packed
// as pack8 packs. MPK_NORM_BF16X2 1 (default): x * r rounded to bf16 two at a time (cvt.rn.bf16x2.f32), then
// multiplied by g's pairs in bf16x2 (one rounding to nearest). The same bits as the fp32 path (0): a product of two
// bf16 values is exact in fp32 (8-bit significands), so both round the exact product once, to nearest even (products
// below fp32's normal range, which normalised rows times norm weights do not reach, could round twice on the fp32
// path). A third of the fp32 path's instructions (4 a pair instead of ~11: unpacking g, rounding each value back to
// fp32, packing). Every norm prologue computes its operand here (the generated bodies through tile::scale_mul8, the
// hand-written ones through norm8 / norm8_with). 0: the fp32 arithmetic (the v0.46 code), for the A/B and the bitwise
// tests; measured +0.9% at qwen3-8b batch 8 on an H100 (docs/PERF.md v0.47).
#ifndef MPK_NORM_BF16X2
#define MPK_NORM_BF16X2 1
#endif
__device__ __forceinline__ uint4 norm8_of(const float* x, uint4 g, float r) {  // x: 8 values
  if constexpr (MPK_NORM_BF16X2) {
    const uint32_t gw[4] = {g.x, g.y, g.z, g.w};
    uint32_t o[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const __nv_bfloat162 a = __floats2bfloat162_rn(x[2 * i] * r, x[2 * i + 1] * r);
      const __nv_bfloat162 c = __hmul2(a, *reinterpret_cast<const __nv_bfloat162*>(&gw[i]));
      o[i] = *reinterpret_cast<const uint32_t*>(&c);
    }
    return make_uint4(o[0], o[1], o[2], o[3]);
  } else {
    float gf[8];
    unpack8(g, gf);
    __align__(16) bf16 o[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) o[i] = f2bf(gf[i] * round_bf(x[i] * r));
    return *reinterpret_cast<const uint4*>(o);
  }
}

// The same from the row's 8 values as two float4 (a: the first four).
__device__ __forceinline__ uint4 norm8_of(float4 a, float4 c, uint4 g, float r) {
  const float f[8] = {a.x, a.y, a.z, a.w, c.x, c.y, c.z, c.w};
  return norm8_of(f, g, r);
}

__device__ __forceinline__ float4 row4(const float* xr, int k) { return *reinterpret_cast<const float4*>(xr + k); }

// norm8_of of one fp32 row at k: the row's loads, then the norm weights' (the order the default build was measured in).
__device__ __forceinline__ uint4 norm8(const float* xr, const bf16* nw, float r, int k) {
  const float4 a = row4(xr, k), c = row4(xr, k + 4);
  return norm8_of(a, c, ld_stream_v4(nw + k), r);
}

// The same with the norm weights' 16 bytes g loaded by the caller (stage_row_fetch_first).
__device__ __forceinline__ uint4 norm8_with(const float* xr, uint4 g, float r, int k) {
  return norm8_of(row4(xr, k), row4(xr, k + 4), g, r);
}

// The 8 values bf16(bf16(silu(gate)) * up) of silu_mul.cuh, gate at g[k..], up at g[up + k..].
__device__ __forceinline__ uint4 silu8(const bf16* g, int up, int k) {
  float fg[8], fu[8];
  unpack8(ld_act_v4(g + k), fg);
  unpack8(ld_act_v4(g + up + k), fu);
  __align__(16) bf16 o[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) o[i] = f2bf(silu_bf(fg[i]) * fu[i]);
  return *reinterpret_cast<const uint4*>(o);
}

// One input row with its prologue computed per element (the fallback path, gemv_rowwise).
struct NormRow {
  const float* x;
  const bf16* nw;
  float r;
  // stage_row_fetch_first: the norm weights at k (copied ahead of r), and the values from them
  __device__ __forceinline__ const bf16* params_at(int k) const { return nw + k; }
  __device__ __forceinline__ uint4 finish(uint4 g, int k, float rr) const { return norm8_with(x, g, rr, k); }
  __device__ __forceinline__ uint4 load8(int k) const { return norm8(x, nw, r, k); }
};

struct SiluRow {
  const bf16* g;
  int up;
  __device__ __forceinline__ uint4 load8(int k) const { return silu8(g, up, k); }
};

// Staged prologue rows live after the block-reduction scratch (kStageOffset floats >= 32 warps), so
// block_sum for row b+1's statistics never overwrites the already staged row b.
constexpr int kStageOffset = 64;

__device__ __forceinline__ bf16* stage_base(float* smem) { return reinterpret_cast<bf16*>(smem + kStageOffset); }

// Dynamic shared-memory bytes up to the end of B staged rows of K bf16 (the reduction scratch included).
__host__ __device__ __forceinline__ uint32_t staged_bytes(int B, int K) {
  return kStageOffset * (uint32_t)sizeof(float) + (uint32_t)B * (uint32_t)K * (uint32_t)sizeof(bf16);
}

// True when B staged rows of K bf16 fit the launch's dynamic shared memory (uniform over the block).
__device__ __forceinline__ bool stage_fits(int B, int K) { return staged_bytes(B, K) <= dynamic_smem_bytes(); }

// MPK_STAGE_ROW_ROLLED 1 (a measurement variant, off): stage_row's loop (also tile::stage_row) is not unrolled.
// Why: a thread stages 1-2 vectors of a row at the programs' shapes (K <= 2 x 8 x worker threads), so the unrolled
// copies nvcc emits are code a norm body carries every layer and never runs: with them rolled the generated norm
// bodies of qwen3-0.6b's batch-1 kernel drop ~230 SASS instructions each (run_norm_linear 1,237 -> 1,006,
// run_norm_linear_silu 2,316 -> 2,088; scripts/sass_sizes.py). Same values, same order: the same bits.
#ifndef MPK_STAGE_ROW_ROLLED
#define MPK_STAGE_ROW_ROLLED 0
#endif

// st[k..] = row.load8(k) over one row of K (the block's threads share it).
template <class Row>
__device__ __forceinline__ void stage_row(bf16* st, int K, const Row& row, int tid, int nt) {
#if MPK_STAGE_ROW_ROLLED
#pragma unroll 1
#endif
  for (int k = tid * 8; k < K; k += nt * 8) *reinterpret_cast<uint4*>(st + k) = row.load8(k);
}

// MPK_NORM_ONE_ROUND 1 (the default since v0.32: -0.4 to -1.8% on every preset, docs/PERF.md; 0 = the two-round
// prologue, kept for the bitwise GPU test): a batch-1 norm prologue (rms_norm -> linear, hand-written and
// generated bodies) copies the norm weights of the thread's staged vectors into their staging slots (cp.async) before
// the row statistic's loads and block reduction, so the prologue waits for one memory round trip, not two. Why: with
// the statistic first, those weights (an L2 hit since MPK_PREFETCH_NORM_W) were asked for only after the reduction,
// while the row itself is then in L1 (the statistic read it); the trace puts qwen3-0.6b's qkv and gate|up prologues
// at 1.0-1.5 us of a tile against 0.35 us for o_proj's (docs/PERF.md v0.31). Copies, not register loads: the task
// bodies run with the worker loop's registers live around them (253 of 255 at 256 threads), and even 4 registers held
// across the reduction spilled 6-16 B in run_norm_linear and the entry (ptxas -v). Each thread then reads back only
// its own slots (cp.async.wait_all, no barrier) and overwrites them with the values. Same values, same positions,
// same statistic: the same bits.
#ifndef MPK_NORM_ONE_ROUND
#define MPK_NORM_ONE_ROUND 1
#endif

// stage_row for a row whose values need the factor r = row_factor() (which reads the row and reduces over the
// block, leaving the staging area alone): the parameter's 16 bytes of each of the thread's staged vectors are in
// flight into the vector's slot before row_factor's loads. Row: const bf16* params_at(k) (the one parameter input's
// vector at k), uint4 finish(uint4 params, int k, float r) == load8(k) with r.
template <class Row, class RowFactor>
__device__ __forceinline__ float stage_row_fetch_first(bf16* st, int K, const Row& row, const RowFactor& row_factor,
                                                       int tid, int nt) {
  // NOTE: loops not unrolled: a thread has 1-2 vectors here, and the body is fetched cold every layer
#pragma unroll 1
  for (int k = tid * 8; k < K; k += nt * 8) cp_async16(st + k, row.params_at(k));  // stage_row's positions
  const float r = row_factor();
  cp_async_wait_all();  // this thread's copies: it reads only its own slots
#pragma unroll 1
  for (int k = tid * 8; k < K; k += nt * 8) {
    uint4* slot = reinterpret_cast<uint4*>(st + k);
    *slot = row.finish(*slot, k, r);
  }
  return r;
}

// Epilogue, chosen at run time (one GEMV instance serves every fused kind; the choice costs a
// branch per output element): store the fp32 sum rounded to bf16 (activations) or unrounded (fp32
// logits), or add the bf16-rounded product to the fp32 residual (the tp-1 residual add, computed
// as the unfused add does: bf16 partial + fp32 stream in fp32).
// kEpiPair (norm_linear_silu.cuh): the tile's n_tile weight rows are two halves, rows [0, n_tile/2) at w and rows
// [n_tile/2, n_tile) at w + pair_jump; each sum is stored rounded to bf16 (as kEpiBf16) into the tile's
// [B, n_tile] buffer y (shared memory), which the caller turns into silu(gate) * up.
enum EpiMode : int { kEpiBf16 = 0, kEpiF32 = 1, kEpiResidual = 2, kEpiPair = 3 };

struct Epi {
  void* y;
  const float* res;  // kEpiResidual only
  int ld;
  int mode;
  long long pair_jump = 0;  // kEpiPair only: elements from the first weight row to the first row of the second half
#if MPK_FLAG_WORDS
  // kEpiResidual with flagged words (flag_words.cuh): y's flagged copy written after y, the residual read from its
  // flagged copy instead of res (the plain value is not ordered for this reader), both at y's / res's element index
  uint64_t* y_flags = nullptr;
  const uint64_t* res_flags = nullptr;
  uint32_t tag = 0;
  int res_ld = -1;  // res's row stride when it is a gathered copy in shared memory (-1: ld, res in place)
#endif
#if MPK_SILU_DOWN
  float* y_copy = nullptr;  // kEpiResidual: a second output with y's values (fusion 'silu_down'; nullptr: none)
#endif
  __device__ __forceinline__ void operator()(int b, int n, float s) const {
    const size_t o = (size_t)b * ld + n;
#if MPK_FLAG_WORDS
    if (mode == kEpiResidual) {
      const size_t ro = res_ld < 0 ? o : (size_t)b * res_ld + n;
      const float v = round_bf(s) + (res_flags != nullptr ? flag_value(ld_relaxed_gpu_u64(res_flags + o)) : res[ro]);
      reinterpret_cast<float*>(y)[o] = v;
      if (y_flags != nullptr) st_relaxed_gpu_u64(y_flags + o, flag_word(v, tag));
      return;
    }
#endif
    if (mode == kEpiResidual) {
      const float v = round_bf(s) + res[o];
      reinterpret_cast<float*>(y)[o] = v;
#if MPK_SILU_DOWN
      if (y_copy != nullptr) y_copy[o] = v;
#endif
    } else if (mode == kEpiF32) reinterpret_cast<float*>(y)[o] = s;
    else reinterpret_cast<bf16*>(y)[o] = f2bf(s);  // kEpiBf16, kEpiPair
  }
};

// Whether an epilogue splits the tile's rows into two weight blocks (kEpiPair); other epilogue types never do.
__device__ __forceinline__ bool epi_is_pair(const Epi& e) { return e.mode == kEpiPair; }
template <class EpiT>
__device__ __forceinline__ bool epi_is_pair(const EpiT&) { return false; }
__device__ __forceinline__ long long epi_pair_jump(const Epi& e) { return e.pair_jump; }
template <class EpiT>
__device__ __forceinline__ long long epi_pair_jump(const EpiT&) { return 0; }
__device__ __forceinline__ const void* epi_out(const Epi& e) { return e.y; }  // kEpiPair: the sums in shared memory
template <class EpiT>
__device__ __forceinline__ const void* epi_out(const EpiT&) { return nullptr; }

// Phase marks of the batch-1 GEMV tile (trace_marks.cuh; the same slots as linear_mma.cuh's): the weight loop
// starts (a fused kind's prologue is done and its operand rows staged), and thread 0's warp has summed its rows
// (its own progress; the tile's other warps may still stream). From them the trace says how a linear level's
// run splits into prologue, stream and tail.
// Off by default: the two timer reads a tile cost qwen3-0.6b 0.7% a step (1.166 / 1.167 vs 1.159 / 1.157 ms; qwen3-8b
// 0.2%, docs/PERF.md v0.18). Traces that want them build with MPK_NVCC_EXTRA_FLAGS=-DMPK_GEMV_MARKS=1.
#ifndef MPK_GEMV_MARKS
#define MPK_GEMV_MARKS 0
#endif
constexpr int kMarkGemvStart = kMarkMmaStart;
constexpr int kMarkGemvWarp0Done = kMarkMmaStreamed;

// MPK_LONG_ROWS R > 1 (default 4 with MPK_LONG_MIN_ROWS 4 since v0.32: qwen3-0.6b -4%, qwen3-1.7b even, nothing
// at the 8B presets' unroll 16; docs/PERF.md; 1 = one row a warp, kept for the bitwise GPU test): batch-1 fused tiles
// with at least kLongMinRowsPerWarp rows a warp (at qwen3-0.6b: the qkv, gate|up and lm_head tiles; lm_head has
// ~1,190 rows a tile) sum R rows at once with the program's whole unroll of loads
// each, R x unroll 16-byte loads a lane in flight instead of unroll (R capped so that R x unroll <= kLongMaxLoads, the
// register budget of the widest one-row tile). Why: qwen3-0.6b's lm_head (K = 1024 at unroll 4: a row is one round of
// 4 loads a lane) is a chain of ~148 dependent rows a warp, 122 us for 311 MB (2.5 TB/s; docs/PERF.md v0.31 trace).
// MPK_LINEAR_ROWS splits the unroll over its rows instead, so it never put more bytes in flight at unroll 4. Same sums:
// each row's lane terms in increasing k, as with one row a warp.
// MPK_LONG_MIN_ROWS (default 4; 16 = lm_head only) is the rows a warp from which it applies: 4 takes qwen3-0.6b's
// qkv (4 rows a warp) and gate_up (6 a warp in each half of the pair tile) as well.
// MPK_LONG_MAX_LOADS (default 16) raises that cap for 256-thread kernels, whose threads have twice the registers:
// -DMPK_LONG_ROWS=8 -DMPK_LONG_MAX_LOADS=32 keeps 32 loads a lane (128 KB an SM, what 512 threads x 16 loads keep and
// what reached 4.7 TB/s in csrc/bench/sm_read_bw.cu) in flight in qwen3-0.6b's lm_head, where 16 give 64 KB (3.6 TB/s
// there at 256 threads). ptxas: gemv_tile<1, 8, ..., 4> without stack or spills, entry frame 80 B as the default.
#ifndef MPK_LONG_ROWS
#define MPK_LONG_ROWS 4
#endif
#ifndef MPK_LONG_MIN_ROWS
#define MPK_LONG_MIN_ROWS 4
#endif
constexpr int kLongMinRowsPerWarp = MPK_LONG_MIN_ROWS;
#ifndef MPK_LONG_MAX_LOADS
#define MPK_LONG_MAX_LOADS 16
#endif
constexpr int kLongMaxLoads = MPK_LONG_MAX_LOADS;  // R x unroll <= kLongMaxLoads
constexpr int kLongRowsCap = kLongMaxLoads / kLinUnroll > 1 ? kLongMaxLoads / kLinUnroll : 1;
constexpr int kLongRows = MPK_LONG_ROWS < kLongRowsCap ? MPK_LONG_ROWS : kLongRowsCap;

// NOTE: not inlined: one copy per batch serves all three fused kinds (inlined at each call site it
// tripled the batch-16 kernel's build time); the call costs nothing next to a tile's weight stream.
// UR: loads a row per round; 0 = the unroll split over the R rows (MPK_LINEAR_ROWS), > 0 = UR each (MPK_LONG_ROWS).
template <int B, int R, class XS, class EpiT, int UR = 0>
__device__ __noinline__ void gemv_tile(const XS xs, const bf16* __restrict__ w, int K, int n_tile, const EpiT epi,
                                       int tid, int nt) {
  constexpr int U = UR > 0 ? UR : (kLinUnroll / R > 0 ? kLinUnroll / R : 1);
  if (R == 1 && stream_fits(K, nt)) {  // MPK_LINEAR_TMA: same sums, weights through shared memory
    gemv_streamed<B>(xs, w, K, n_tile, epi, tid, nt);
    return;
  }
  if (R == 1 && MPK_LINEAR_PIPE) {  // same sums, the next chunk's loads in flight (gemv_pipe.cuh)
    gemv_pipelined<B, U>(xs, w, K, n_tile, epi, tid, nt);
    return;
  }
  const int warp = tid >> 5, lane = tid & 31, nwarps = nt >> 5;
  if constexpr (B == 1 && MPK_GEMV_MARKS) trace_mark(kMarkGemvStart, tid);  // trace: the weight loop starts
  constexpr bool kAhead = B == 1 && MPK_LOAD_AHEAD;  // x before its use (same bits)
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
      if constexpr (kAhead) {  // x before any use, as the weights (linear.cuh load_x_round)
        uint4 xv[U];
        load_x_round<U>(xv, [&](int k) { return xs.load8(0, k); }, kb, K, lane);
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
          for (int r = 0; r < R; ++r) acc[r][0] += dot8(wv[r][u], xv[u]);  // past K: + (+0), see load_x_round
      } else {
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int k = kb + u * 256 + lane * 8;
          if (k < K) {
#pragma unroll
            for (int b = 0; b < B; ++b) {
              const uint4 xv = xs.load8(b, k);
#pragma unroll
              for (int r = 0; r < R; ++r) acc[r][b] += dot8(wv[r][u], xv);
            }
          }
        }
      }
    }
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int b = 0; b < B; ++b) {
        const float s = warp_sum(acc[r][b]);
        if (lane == (b & 31) && n0 + r < n_tile) epi(b, n0 + r, s);
      }
  }
  if constexpr (B == 1 && MPK_GEMV_MARKS) trace_mark(kMarkGemvWarp0Done, tid);  // trace: thread 0's warp has summed its rows
}

// gemv_tile at the tile's row shape: MPK_LONG_ROWS rows of the whole unroll for tiles with at least
// kLongMinRowsPerWarp rows a warp (batch 1, one row a warp otherwise), else MPK_LINEAR_ROWS rows (default: one).
template <int B, class XS, class EpiT>
__device__ __forceinline__ void gemv_rows(const XS& xs, const bf16* __restrict__ w, int K, int n_tile, const EpiT& epi,
                                          int tid, int nt) {
  if constexpr (B == 1 && kFuseRows == 1 && kLongRows > 1) {
    if (n_tile >= kLongMinRowsPerWarp * (nt >> 5)) {
      gemv_tile<B, kLongRows, XS, EpiT, kLinUnroll>(xs, w, K, n_tile, epi, tid, nt);
      return;
    }
  }
  gemv_tile<B, kFuseRows>(xs, w, K, n_tile, epi, tid, nt);
}

// The fused kinds' GEMV (hand-written and generated bodies alike): tensor-core tiles for batch >= 2 under
// MPK_LINEAR_MMA=1 when enough warps stream (linear_mma.cuh, its own summation order), else gemv_tile.
// reserved: bytes at the start of the dynamic shared memory that xs reads (staged_bytes of the staged rows;
// 0 when x is a global activation).
// kEpiPair: the two halves of the tile's rows on the scalar tile (gemv_pair), tensor cores or not: the silu
// epilogue fusion is planned only for programs whose linears run scalar (megakernel_backend.fusions_for_batch).
template <int B, class XS>
__device__ __forceinline__ void gemv_pair(const XS& xs, const bf16* __restrict__ w, int K, int n_tile, const Epi& epi,
                                          int tid, int nt);
template <int B, class XS, class EpiT>  // other epilogue types are never pairs (epi_is_pair)
__device__ __forceinline__ void gemv_pair(const XS&, const bf16* __restrict__, int, int, const EpiT&, int, int) {}

template <int B, class XS, class EpiT>
__device__ __forceinline__ void gemv_fused(const XS& xs, const bf16* __restrict__ w, int K, int n_tile, const EpiT& epi,
                                           uint32_t reserved, int tid, int nt) {
  const bool pair = epi_is_pair(epi);
#if MPK_LINEAR_MMA
  if constexpr (B >= 2) {
    // A pair tile's sums sit in shared memory after the staged rows: the split-K partials go above them, never
    // over them (the epilogue writes the sums while other warps still read partials).
    if (pair) reserved = max(reserved, dyn_smem_offset(epi_out(epi)) + (uint32_t)(B * n_tile * sizeof(bf16)));
    if (const int S = mma_slices(K, n_tile, nt, reserved, !pair)) {
      gemv_mma_tile<B>(xs, w, K, n_tile, epi, S, reserved, MmaRowsAt{pair ? n_tile / 2 : n_tile, epi_pair_jump(epi)},
                       tid, nt);
      return;
    }
  }
#else
  (void)reserved;
#endif
  if (pair) {
    gemv_pair<B>(xs, w, K, n_tile, epi, tid, nt);
    return;
  }
  gemv_rows<B>(xs, w, K, n_tile, epi, tid, nt);
}

// Half the block's warps sum the first half of the rows (the gate rows of norm_linear_silu) and the other half the
// second (the up rows), each warp whole rows as gemv_tile always does: the same sums as the unfused gate|up tile,
// with as many rows per warp (the unfused projection's tiles hold n_tile rows of one half for all the warps).
// Under MPK_LINEAR_TMA the weight ring's producer and barriers span the block, so the halves run one after the
// other there. (In a -DMPK_GEMV_MARKS=1 build both halves' first threads set the tile's marks: the later one stays.)
template <int B, class XS>
__device__ __forceinline__ void gemv_pair(const XS& xs, const bf16* __restrict__ w, int K, int n_tile, const Epi& epi,
                                          int tid, int nt) {
  const int h = n_tile / 2;
  Epi first = epi, second = epi;
  first.mode = second.mode = kEpiBf16;
  second.y = static_cast<bf16*>(epi.y) + h;
  const bf16* w2 = w + epi.pair_jump;
  if (MPK_LINEAR_TMA) {
    gemv_rows<B>(xs, w, K, h, first, tid, nt);
    gemv_rows<B>(xs, w2, K, h, second, tid, nt);
    return;
  }
  const int half = (nt >> 6) << 5;  // the first half's threads: whole warps (nt - half for the second)
  const bool second_half = tid >= half;
  gemv_rows<B>(xs, second_half ? w2 : w, K, h, second_half ? second : first, second_half ? tid - half : tid,
               second_half ? nt - half : half);
}

// Fallback when the staged input does not fit the launch's shared memory: batch row b only, one
// warp per weight row, the prologue computed per element. Each lane sums its k = lane*8 + 256 j
// terms in increasing j, as gemv_tile does for any R and U, so the result is bit-identical to the
// staged path; slower (the weight block is re-read per batch row, one prologue per weight row).
template <class Row, class EpiT>
__device__ __forceinline__ void gemv_rowwise_body(const Row& row, const bf16* __restrict__ w, int K, int n_tile,
                                                  const EpiT& epi, int b, int tid, int nt) {
  const int warp = tid >> 5, lane = tid & 31, nwarps = nt >> 5;
  const int second = epi_is_pair(epi) ? n_tile / 2 : n_tile;  // kEpiPair: rows from here on are at w + pair_jump
  for (int n = warp; n < n_tile; n += nwarps) {
    const bf16* wr = n < second ? w + (size_t)n * K : w + epi_pair_jump(epi) + (size_t)(n - second) * K;
    float acc = 0.f;
    for (int k = lane * 8; k < K; k += 256) acc += dot8(ld_weight_v4(wr + k), row.load8(k));
    const float s = warp_sum(acc);
    if (lane == (b & 31)) epi(b, n, s);
  }
}

// MPK_ROWWISE_OUTLINED 1 (a measurement variant, off): the fallback is a call, not inlined into each norm body.
// Why: it never runs at the programs' shapes (the staged rows fit), yet inlined it is ~370 of run_norm_linear's 1,237
// SASS instructions and ~770 of run_norm_linear_silu's 2,316, straight-line bodies fetched cold every layer
// (nvdisasm, qwen3-0.6b b1 kernel). The row and epilogue go by value so no argument passes through the stack.
#ifndef MPK_ROWWISE_OUTLINED
#define MPK_ROWWISE_OUTLINED 0
#endif
template <class Row, class EpiT>
__device__ __noinline__ void gemv_rowwise_outlined(Row row, const bf16* __restrict__ w, int K, int n_tile, EpiT epi,
                                                   int b, int tid, int nt) {
  gemv_rowwise_body(row, w, K, n_tile, epi, b, tid, nt);
}

template <class Row, class EpiT>
__device__ __forceinline__ void gemv_rowwise(const Row& row, const bf16* __restrict__ w, int K, int n_tile,
                                             const EpiT& epi, int b, int tid, int nt) {
  if constexpr (MPK_ROWWISE_OUTLINED) gemv_rowwise_outlined(row, w, K, n_tile, epi, b, tid, nt);
  else gemv_rowwise_body(row, w, K, n_tile, epi, b, tid, nt);
}

// Runtime batch -> compile-time kB for CALL (the generated kernel fixes MPK_BATCH; the host checked
// every task's BATCH equals it). Without MPK_BATCH every batch 1..16 is instantiated.
#ifdef MPK_BATCH
#define MPK_FUSED_WITH_BATCH(B_, CALL) \
  do {                                 \
    constexpr int kB = MPK_BATCH;      \
    (void)(B_);                        \
    CALL;                              \
  } while (0)
#else
#define MPK_FUSED_BATCH_CASE(bb, CALL) \
  case bb: {                           \
    constexpr int kB = bb;             \
    CALL;                              \
  } break;
#define MPK_FUSED_WITH_BATCH(B_, CALL)                                                                   \
  do {                                                                                                   \
    switch (B_) {                                                                                        \
      MPK_FUSED_BATCH_CASE(1, CALL) MPK_FUSED_BATCH_CASE(2, CALL) MPK_FUSED_BATCH_CASE(3, CALL)          \
      MPK_FUSED_BATCH_CASE(4, CALL) MPK_FUSED_BATCH_CASE(5, CALL) MPK_FUSED_BATCH_CASE(6, CALL)          \
      MPK_FUSED_BATCH_CASE(7, CALL) MPK_FUSED_BATCH_CASE(8, CALL) MPK_FUSED_BATCH_CASE(9, CALL)          \
      MPK_FUSED_BATCH_CASE(10, CALL) MPK_FUSED_BATCH_CASE(11, CALL) MPK_FUSED_BATCH_CASE(12, CALL)       \
      MPK_FUSED_BATCH_CASE(13, CALL) MPK_FUSED_BATCH_CASE(14, CALL) MPK_FUSED_BATCH_CASE(15, CALL)       \
      MPK_FUSED_BATCH_CASE(16, CALL)                                                                     \
      default: break;                                                                                    \
    }                                                                                                    \
  } while (0)
#endif

}  // namespace mpk

// down_partial: the down projection folded into a norm_linear_silu tile (fusion 'silu_down',
// mpk_dist/taskgraph/tasks/norm_linear_silu.py; MPK_SILU_DOWN). The tile owns n activation columns [c0, c0 + n)
// of every batch row; it multiplies them by the matching n columns of the [H, I] down weight and adds the fp32
// result, one value per (row b, output r), into the residual stream xo with an atomic add (a reduction that
// returns nothing: RED.ADD.F32). o_proj's tiles initialised xo with x_mid (linear_residual's COPY), and the
// next level waits for every tile of this op, so the sum is complete when it is read. The adds land in no fixed
// order: the bits may differ between runs (the unfused down rounds its product once to bf16 instead).
//
// Why: the down projection was a level of its own after the gate|up tiles, with the boundary's lag (~1.2 us) and a
// tile's fixed costs (~2 us beyond its bytes at qwen3-0.6b, docs/PERF.md v0.34) on every layer's critical path.
// Measured slower (docs/PERF.md v0.35: the fused tile ~5 us longer at qwen3-0.6b), so the fusion is off by default.
#pragma once
#include "common.cuh"

// MPK_DOWN_VECTOR_RED 1 (default): the row sums gathered in shared memory, added four at a time
// (red.global.add.v4.f32); 0: one scalar atomic add per row (the first form, measured 10% slower than the unfused
// program at qwen3-0.6b, docs/PERF.md v0.35).
#ifndef MPK_DOWN_VECTOR_RED
#define MPK_DOWN_VECTOR_RED 1
#endif

// MPK_DOWN_DIAG (a timing diagnostic; WRONG sums, never for use): 1 stores the row sums instead of adding them (no
// atomics: what the loads and the arithmetic cost alone), 2 skips the down weights' loads (zero weights, the atomics
// kept: what the reductions cost alone). 0 (default): the real partial.
#ifndef MPK_DOWN_DIAG
#define MPK_DOWN_DIAG 0
#endif

namespace mpk {

constexpr int kDownVec = 8;        // bf16 per 16-byte load
constexpr int kDownWaves = 8;      // 16-byte weight loads a lane has in flight (32 registers)
constexpr int kDownMaxCols = 256;  // activation columns a tile may own: at most a warp of 16-byte vectors a row

// Whether the shapes are ones the body handles: whole 16-byte vectors of columns, at most a warp's worth a row,
// 16-byte aligned rows.
__device__ __forceinline__ bool down_partial_ok(const bf16* wd, int n, int ldw, int B) {
  return n % kDownVec == 0 && n >= kDownVec && n <= kDownMaxCols && ldw % kDownVec == 0 && B >= 1 &&
         (reinterpret_cast<uintptr_t>(wd) & 15) == 0;
}

// xo[b, r] += sum_c act[b, c] * wd[r, c] for r < H. act: [B, n] bf16 in shared memory (16-byte aligned; the
// values the tile stored as its activation), wd at column c0 of row 0 (rows ldw apart). A row's n columns are
// nv = n / 8 vectors, one lane each, so a warp takes 32 / nv rows a wave and a lane keeps kDownWaves waves' loads
// in flight; the nv lanes of a row are summed by shuffles and the first adds the sum. Not inlined, and the
// loads one vector a lane: with 4 rows x 4 vectors a thread inlined into the gate|up body, ptxas spilled across
// the whole kernel (entry frame 80 -> 320 B).
// With `sums` (shared memory for B x H floats; nullptr: none) the row sums are gathered there first and added with
// one 16-byte vector reduction per 4 outputs (red.global.add.v4.f32): a quarter of the atomic operations, which all
// of the op's ~128 tiles aim at the same H floats (measured: with one scalar add per row the fused gate|up tile ran
// 5.2 us longer at qwen3-0.6b, docs/PERF.md v0.35).
__device__ __noinline__ void down_partial(const bf16* act, int B, int n, const bf16* wd, int ldw, int H, float* xo,
                                          int ldxo, float* sums, int tid, int nt) {
  const int nv = n / kDownVec, per_wave = 32 / nv;
  const int lane = tid & 31, warp = tid >> 5, nwarps = nt >> 5;
  const int slot = lane / nv, v = lane - slot * nv;
  const bool active = slot < per_wave;
  const int step = per_wave * kDownWaves;
  for (int b = 0; b < B; ++b) {
    const uint4 a8 = active ? *reinterpret_cast<const uint4*>(act + (size_t)b * n + (size_t)v * kDownVec)
                            : make_uint4(0u, 0u, 0u, 0u);
    for (int r0 = warp * step; r0 < H; r0 += nwarps * step) {
      uint4 w[kDownWaves];
#pragma unroll
      for (int k = 0; k < kDownWaves; ++k) {
        const int r = r0 + k * per_wave + slot;
        w[k] = active && r < H && MPK_DOWN_DIAG != 2 ? ld_weight_v4(wd + (size_t)r * ldw + (size_t)v * kDownVec)
                                                      : make_uint4(0u, 0u, 0u, 0u);
      }
#pragma unroll
      for (int k = 0; k < kDownWaves; ++k) {
        const int r = r0 + k * per_wave + slot;
        const float s = dot8(w[k], a8);
        float sum = s;  // lane v = 0 of the row gathers its nv lanes (the others' sums are not used)
        for (int i = 1; i < nv; ++i) sum += __shfl_sync(kFullWarp, s, (lane + i) & 31);
        if (active && v == 0 && r < H) {
          if (sums != nullptr) sums[(size_t)b * H + r] = sum;
          else atomicAdd(xo + (size_t)b * ldxo + r, sum);
        }
      }
    }
  }
  if (sums == nullptr) return;
  worker_barrier(nt);  // every row sum is in shared memory
  for (int i = tid; i < B * H / 4; i += nt) {
    const int b = (4 * i) / H, r = 4 * i - b * H;
    const float4 s4 = *reinterpret_cast<const float4*>(sums + (size_t)b * H + r);
    if (MPK_DOWN_DIAG == 1) *reinterpret_cast<float4*>(xo + (size_t)b * ldxo + r) = s4;
    else red_add_v4_f32(xo + (size_t)b * ldxo + r, s4);
  }
}

// Whether the row sums can go through shared memory and vector reductions: whole float4s of 16-byte aligned rows.
__device__ __forceinline__ bool down_sums_vector_ok(const float* xo, int H, int ldxo) {
  return H % 4 == 0 && ldxo % 4 == 0 && (reinterpret_cast<uintptr_t>(xo) & 15) == 0;
}

// The down weight's columns of the tile into L2 before its wait: one prefetch per row (a row's n columns are
// 2n bytes, at most two 128-byte lines; the second when they cross a line). Not inlined: prefetch_task runs in the
// kernel entry, whose registers are the worker loop's.
__device__ __noinline__ void down_partial_prefetch(const bf16* wd, int n, int ldw, int H, int tid, int nt) {
  for (int r = tid; r < H; r += nt) {
    const char* p = reinterpret_cast<const char*>(wd + (size_t)r * ldw);
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
    const uintptr_t first = reinterpret_cast<uintptr_t>(p) / kL2LineBytes;
    if ((reinterpret_cast<uintptr_t>(p) + 2u * (uintptr_t)n - 1u) / kL2LineBytes != first)
      asm volatile("prefetch.global.L2 [%0];" ::"l"(p + 2 * n - 1));
  }
}

}  // namespace mpk

// argmax_partial: (max, INDEX_BASE + first argmax) of COLS fp32 logits per sequence, stored as an
// fp32 pair. `logits` points at column v0 of row 0, `out` at this tile's pair of row 0.
// Ties go to the lowest index; a NaN never wins (comparisons with NaN are false).
// Sampling (the launch's `sampling` words hold T > 0): the tile scores x * (1/T) + g, g the Gumbel
// draw of (seed, step, b, vocabulary id) (sampling_rng.cuh), so the best score over the whole
// vocabulary is a draw from softmax(x / T); reduce and select are unchanged.
#pragma once
#include "common.cuh"
#include "sampling_rng.cuh"

namespace mpk {

// True when (v, i) beats (bv, bi): a larger value, or an equal value at a smaller index.
__device__ __forceinline__ bool argmax_better(float v, float i, float bv, float bi) {
  return v > bv || (v == bv && i < bi);
}

__device__ __forceinline__ void warp_argmax(float& v, float& i) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, o), oi = __shfl_xor_sync(0xffffffffu, i, o);
    if (argmax_better(ov, oi, v, i)) { v = ov; i = oi; }
  }
}

constexpr float kNoIndex = 3.0e38f;

// Block-wide best pair of (v, i) (smem: 2 * nt / 32 floats); every thread gets the result.
__device__ void block_argmax(float& v, float& i, float* smem, int tid, int nt) {
  warp_argmax(v, i);
  if ((tid & 31) == 0) { smem[2 * (tid >> 5)] = v; smem[2 * (tid >> 5) + 1] = i; }
  worker_barrier(nt);
  v = -INFINITY;
  i = kNoIndex;
  for (int w = 0; w < (nt >> 5); ++w)
    if (argmax_better(smem[2 * w], smem[2 * w + 1], v, i)) { v = smem[2 * w]; i = smem[2 * w + 1]; }
  worker_barrier(nt);
}

// `sampling`: the launch's int32 [4] sampling words (nullptr or temperature 0: greedy); `step`
// is the kernel's step, one of the draw's counters. `cut` (nucleus programs, else nullptr): f32
// [B, 2] (M, last kept bin) from argmax_nucleus_cut; with top_p < 1 a token past it scores -inf.
__device__ void argmax_partial(const float* logits, float* out, const int32_t* sampling, const float* cut, int B,
                               int cols, int logits_stride, int out_stride, int index_base, int step, float* smem,
                               int tid, int nt) {
  const SamplingState st = load_sampling(sampling);
  const bool nucleus = cut != nullptr && nucleus_active(st);
  for (int b = 0; b < B; ++b) {
    float bv = -INFINITY, bi = kNoIndex;
    const float* row = logits + (size_t)b * logits_stride;
    if (st.inv_t > 0.0f) {
      const uint64_t key = rng_stream_key(st.seed, step, b);
      const float m = nucleus ? cut[2 * b] : 0.0f;
      const int last = nucleus ? (int)cut[2 * b + 1] : kNucleusBins;
      for (int c = tid; c < cols; c += nt) {
        const int id = index_base + c;
        const float l = row[c];
        const bool kept = !nucleus || nucleus_bin(nucleus_z(m, l, st.inv_t)) <= last;
        const float x = kept ? gumbel_score(l, st.inv_t, rng_gumbel(rng_uniform(rng_bits(key, id)))) : -INFINITY;
        if (argmax_better(x, (float)id, bv, bi)) { bv = x; bi = (float)id; }
      }
    } else {
      for (int c = tid; c < cols; c += nt) {
        const float x = row[c];
        if (argmax_better(x, (float)(index_base + c), bv, bi)) { bv = x; bi = (float)(index_base + c); }
      }
    }
    block_argmax(bv, bi, smem, tid, nt);
    if (tid == 0) { out[(size_t)b * out_stride] = bv; out[(size_t)b * out_stride + 1] = bi; }
  }
}

}  // namespace mpk

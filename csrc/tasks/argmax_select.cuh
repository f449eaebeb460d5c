// argmax_select: the step's token per sequence from the WORLD gathered candidates
// (cands: f32 [WORLD, B, 2]); written to next_token[b] (read by the next step_begin) and to
// token_out[step * B + b] (the launch's token rows, in mapped pinned memory for streaming).
// The index is exact in fp32 (vocabularies < 2^24). One warp per sequence.
#pragma once
#include "argmax_partial.cuh"

namespace mpk {

__device__ void argmax_select(const float* cands, int32_t* next_token, int32_t* token_out, int B, int world, int step,
                              int tid, int nt) {
  const int warp = tid >> 5, lane = tid & 31, nwarps = nt >> 5;
  for (int b = warp; b < B; b += nwarps) {
    float bv = -INFINITY, bi = kNoIndex;
    for (int r = lane; r < world; r += 32) {
      const float v = cands[((size_t)r * B + b) * 2], i = cands[((size_t)r * B + b) * 2 + 1];
      if (argmax_better(v, i, bv, bi)) { bv = v; bi = i; }
    }
    warp_argmax(bv, bi);
    if (lane == 0) {
      const int32_t tok = bi < kNoIndex ? (int32_t)bi : 0;
      next_token[b] = tok;
      token_out[(size_t)step * B + b] = tok;
    }
  }
}

}  // namespace mpk

// argmax_reduce: this rank's best (value, index) over its NTILES vocabulary-tile candidates.
// partial: f32 [B, NTILES, 2]; out: f32 [B, 2]. Ties to the lowest index.
#pragma once
#include "argmax_partial.cuh"

namespace mpk {

__device__ void argmax_reduce(const float* partial, float* out, int B, int ntiles, float* smem, int tid, int nt) {
  for (int b = 0; b < B; ++b) {
    float bv = -INFINITY, bi = kNoIndex;
    for (int t = tid; t < ntiles; t += nt) {
      const float* pr = partial + ((size_t)b * ntiles + t) * 2;
      if (argmax_better(pr[0], pr[1], bv, bi)) { bv = pr[0]; bi = pr[1]; }
    }
    block_argmax(bv, bi, smem, tid, nt);
    if (tid == 0) { out[2 * b] = bv; out[2 * b + 1] = bi; }
  }
}

}  // namespace mpk

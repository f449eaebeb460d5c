// allreduce_reduce (one-shot all-reduce, phase 2): out = sum over slots r = 0..WORLD-1 (rank order)
// of recv[r] in fp32, plus the residual once, rounded to bf16. `recv` points at slot 0, column c0.
#pragma once
#include "common.cuh"

namespace mpk {

__device__ void allreduce_reduce(const bf16* recv, const bf16* residual, bf16* out, int B, int cols, int world,
                                 int slot_stride, int stride, int tid, int nt) {
  for (int i = tid; i < B * cols; i += nt) {
    const size_t o = (size_t)(i / cols) * stride + i % cols;
    float s = 0.f;
    for (int r = 0; r < world; ++r) s += bf2f(recv[(size_t)r * slot_stride + o]);
    if (residual != nullptr) s += bf2f(residual[o]);
    out[o] = f2bf(s);
  }
}

}  // namespace mpk

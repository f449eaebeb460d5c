// allreduce_reduce (one-shot all-reduce, phase 2): out = sum over slots r = 0..WORLD-1 (rank order)
// of recv[r] in fp32, plus the residual once, stored once in out's dtype (fp32 for the residual
// stream). `recv` points at slot 0, column c0.
#pragma once
#include "common.cuh"

namespace mpk {

template <typename RecvT, typename ResT, typename OutT>
__device__ void allreduce_reduce(const RecvT* recv, const ResT* residual, OutT* out, int B, int cols, int world,
                                 int slot_stride, int stride, int tid, int nt) {
  for (int i = tid; i < B * cols; i += nt) {
    const size_t o = (size_t)(i / cols) * stride + i % cols;
    float s = 0.f;
    for (int r = 0; r < world; ++r) s += load_f(recv + (size_t)r * slot_stride + o);
    if (residual != nullptr) s += load_f(residual + o);
    store_out(out + o, s);
  }
}

}  // namespace mpk

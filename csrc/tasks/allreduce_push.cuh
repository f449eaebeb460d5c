// allreduce_push (one-shot all-reduce, phase 1): write my partial's column block [B, COLS] into
// slot[my_rank] of every rank's receive buffer. Published by the ALL_RANKS signal (worker.cuh).
#pragma once
#include "common.cuh"

namespace mpk {

template <typename T>  // bf16 partials of o_proj / down_proj, fp32 for the embedding's
__device__ void allreduce_push(const T* src, T* const* dst_per_rank, int world, int B, int cols, int src_stride,
                               int dst_stride, int tid, int nt) {
  const int per_rank = B * cols;
  for (int i = tid; i < world * per_rank; i += nt) {
    const int r = i / per_rank, j = i % per_rank, b = j / cols, c = j % cols;
    dst_per_rank[r][(size_t)b * dst_stride + c] = src[(size_t)b * src_stride + c];
  }
}

}  // namespace mpk

// gather_rows: out[b, c0:c0+COLS] = x[rows[b], c0:c0+COLS] (zeros where rows[b] < 0), converted to
// out's dtype (the fp32 residual stream into the head's input rows; docs/SERVING.md). One tile per
// column block, like add. Pointers are at column c0.
#pragma once
#include "common.cuh"

namespace mpk {

// Every thread reads all B row ids (B <= a few dozen) and reaches the same verdict from the same
// host-written input, so the check needs no shared flag and no barrier.
__device__ __forceinline__ bool gather_rows_ok(const int32_t* rows, int B, int x_rows) {
  for (int b = 0; b < B; ++b)
    if (rows[b] >= x_rows) return false;
  return true;
}

// Returns false (on every thread) when a row id is >= x_rows; the worker reports kErrBadTask.
template <typename XT, typename OutT>
__device__ bool gather_rows(const XT* x, const int32_t* rows, OutT* out, int B, int cols, int x_stride,
                            int out_stride, int x_rows, int tid, int nt) {
  if (!gather_rows_ok(rows, B, x_rows)) return false;
  for (int i = tid; i < B * cols; i += nt) {
    const int b = i / cols, c = i % cols;
    const int r = rows[b];
    store_out(out + (size_t)b * out_stride + c, r < 0 ? 0.0f : load_f(x + (size_t)r * x_stride + c));
  }
  return true;
}

}  // namespace mpk

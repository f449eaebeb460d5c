// add: out[b, c0:c0+COLS] = x + y in bf16 (one rounding, as torch). Pointers are at column c0.
#pragma once
#include "common.cuh"

namespace mpk {

__device__ void add(const bf16* x, const bf16* y, bf16* out, int B, int cols, int stride, int tid, int nt) {
  const bool vec = ((cols | stride) & 7) == 0 && ((reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(y) |
                                                   reinterpret_cast<uintptr_t>(out)) & 15) == 0;
  if (!vec) {
    for (int i = tid; i < B * cols; i += nt) {
      const size_t o = (size_t)(i / cols) * stride + i % cols;
      out[o] = f2bf(bf2f(x[o]) + bf2f(y[o]));
    }
    return;
  }
  const int per_row = cols / 8;
  for (int i = tid; i < B * per_row; i += nt) {
    const size_t o = (size_t)(i / per_row) * stride + (i % per_row) * 8;
    float fa[8], fb[8];
    unpack8(ld_act_v4(x + o), fa);
    unpack8(ld_act_v4(y + o), fb);
    __align__(16) bf16 r[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) r[j] = f2bf(fa[j] + fb[j]);
    *reinterpret_cast<uint4*>(out + o) = *reinterpret_cast<const uint4*>(r);
  }
}

}  // namespace mpk

// add: out[b, c0:c0+COLS] = x + y computed in fp32 and stored once in out's dtype. With the fp32
// residual stream x is the bf16 partial (o_proj / down_proj output), y and out are fp32; all-bf16
// graphs take the 16-byte path. Pointers are at column c0.
#pragma once
#include "common.cuh"

namespace mpk {

template <typename XT, typename YT, typename OutT>
__device__ void add(const XT* x, const YT* y, OutT* out, int B, int cols, int stride, int tid, int nt) {
  for (int i = tid; i < B * cols; i += nt) {
    const size_t o = (size_t)(i / cols) * stride + i % cols;
    store_out(out + o, load_f(x + o) + load_f(y + o));
  }
}

// All-bf16 specialisation: 16-byte loads and stores when rows and pointers are 8-element aligned.
template <>
__device__ void add<bf16, bf16, bf16>(const bf16* x, const bf16* y, bf16* out, int B, int cols, int stride, int tid,
                                      int nt) {
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

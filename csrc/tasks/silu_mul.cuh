// silu_mul: out[b, c] = bf16(bf16(silu(gate)) * up), gate = gu[b, c], up = gu[b, up_offset + c].
// silu in fp32, rounded to bf16 before the product, as F.silu on bf16 then a bf16 multiply.
#pragma once
#include "common.cuh"

namespace mpk {

__device__ __forceinline__ float silu_bf(float g) { return round_bf(g / (1.f + expf(-g))); }

__device__ void silu_mul(const bf16* gu, bf16* out, int B, int cols, int gu_stride, int up_offset, int out_stride,
                         int tid, int nt) {
  const bool vec = ((cols | gu_stride | up_offset | out_stride) & 7) == 0 &&
                   ((reinterpret_cast<uintptr_t>(gu) | reinterpret_cast<uintptr_t>(out)) & 15) == 0;
  if (!vec) {
    for (int i = tid; i < B * cols; i += nt) {
      const int b = i / cols, c = i % cols;
      const bf16* g = gu + (size_t)b * gu_stride + c;
      out[(size_t)b * out_stride + c] = f2bf(silu_bf(bf2f(g[0])) * bf2f(g[up_offset]));
    }
    return;
  }
  const int per_row = cols / 8;
  for (int i = tid; i < B * per_row; i += nt) {
    const int b = i / per_row, c = (i % per_row) * 8;
    const bf16* g = gu + (size_t)b * gu_stride + c;
    float fg[8], fu[8];
    unpack8(ld_act_v4(g), fg);
    unpack8(ld_act_v4(g + up_offset), fu);
    __align__(16) bf16 r[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) r[j] = f2bf(silu_bf(fg[j]) * fu[j]);
    *reinterpret_cast<uint4*>(out + (size_t)b * out_stride + c) = *reinterpret_cast<const uint4*>(r);
  }
}

}  // namespace mpk

// rms_norm: one row y = w * bf16(x / sqrt(mean(x^2) + eps)), statistics in fp32. The normalised
// row is rounded to bf16 before the weight multiply, like the torch reference (HF RMSNorm).
// x is bf16 (q/k norms, all-bf16 graphs) or fp32 (the residual stream); XT selects the loads.
// Every worker thread takes a share of the row; the sum of squares is reduced through shared memory
// (smem: nt / 32 floats, see block_sum in common.cuh).
#pragma once
#include "common.cuh"

namespace mpk {

template <typename XT>
__device__ void rms_norm(const XT* x, const bf16* w, bf16* y, int N, float eps, float* smem, int tid, int nt) {
  const bool vec = sizeof(XT) == sizeof(bf16) && (N & 7) == 0 && ((reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(y) |
                                     reinterpret_cast<uintptr_t>(w)) & 15) == 0;
  float ss = 0.f;
  if (vec) {
    for (int k = tid * 8; k < N; k += nt * 8) {
      float f[8];
      unpack8(ld_act_v4(x + k), f);
#pragma unroll
      for (int i = 0; i < 8; ++i) ss = fmaf(f[i], f[i], ss);
    }
  } else {
    for (int k = tid; k < N; k += nt) { const float f = load_f(x + k); ss = fmaf(f, f, ss); }
  }
  const float r = rsqrtf(block_sum(ss, smem, tid, nt) / (float)N + eps);
  if (vec) {
    for (int k = tid * 8; k < N; k += nt * 8) {
      float f[8], g[8];
      unpack8(ld_act_v4(x + k), f);
      unpack8(ld_stream_v4(w + k), g);
      __align__(16) bf16 o[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) o[i] = f2bf(g[i] * round_bf(f[i] * r));
      *reinterpret_cast<uint4*>(y + k) = *reinterpret_cast<const uint4*>(o);
    }
  } else {
    for (int k = tid; k < N; k += nt) y[k] = f2bf(bf2f(w[k]) * round_bf(load_f(x + k) * r));
  }
}

}  // namespace mpk

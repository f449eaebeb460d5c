// rms_norm: one row y = w * bf16(x / sqrt(mean(x^2) + eps)), statistics in fp32. The normalised
// row is rounded to bf16 before the weight multiply, like the torch reference (HF RMSNorm).
// x is bf16 (q/k norms, all-bf16 graphs) or fp32 (the residual stream); XT selects the loads.
// Every worker thread takes a share of the row; the sum of squares is reduced through shared memory
// (smem: nt / 32 floats, see block_sum in common.cuh).
#pragma once
#include "common.cuh"

namespace mpk {

// 8 values of a row into fp32 registers: bf16 activations (coherent 16-byte load) or the fp32 residual stream.
__device__ __forceinline__ void load8_any(const bf16* p, float* f) { unpack8(ld_act_v4(p), f); }
__device__ __forceinline__ void load8_any(const float* p, float* f) {
  const float4 a = *reinterpret_cast<const float4*>(p), c = *reinterpret_cast<const float4*>(p + 4);
  f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w; f[4] = c.x; f[5] = c.y; f[6] = c.z; f[7] = c.w;
}

// ss + the squares of 8 values, summed in element order.
__device__ __forceinline__ float sum_sq8(const float* f, float ss) {
#pragma unroll
  for (int i = 0; i < 8; ++i) ss = fmaf(f[i], f[i], ss);
  return ss;
}

// A thread's share of sum_k x[k]^2 over a row of K (K % 8 == 0, 16-byte aligned): its 8-vectors at k = 8 tid,
// 8 (tid + nt), ... in that order. Every row statistic of the kernel's norms sums in this order (this task, the
// norm prologues of norm_linear and of the generated bodies, tile::rows_share_sum_sq), so the fused and unfused
// programs' statistics are bit-identical; a thread whose share is one vector v (K <= 8 nt) has sum_sq8(v, 0).
template <typename XT>
__device__ __forceinline__ float share_sum_sq(const XT* x, int K, int tid, int nt) {
  float ss = 0.f;
  for (int k = tid * 8; k < K; k += nt * 8) {
    float f[8];
    load8_any(x + k, f);
    ss = sum_sq8(f, ss);
  }
  return ss;
}

template <typename XT>
__device__ void rms_norm(const XT* x, const bf16* w, bf16* y, int N, float eps, float* smem, int tid, int nt) {
  const bool vec = (N & 7) == 0 && ((reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(y) |
                                     reinterpret_cast<uintptr_t>(w)) & 15) == 0;
  float ss = 0.f;
  if (vec) {
    ss = share_sum_sq(x, N, tid, nt);
  } else {
    for (int k = tid; k < N; k += nt) { const float f = load_f(x + k); ss = fmaf(f, f, ss); }
  }
  const float r = rsqrtf(block_sum(ss, smem, tid, nt) / (float)N + eps);
  if (vec) {
    for (int k = tid * 8; k < N; k += nt * 8) {
      float f[8], g[8];
      load8_any(x + k, f);
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

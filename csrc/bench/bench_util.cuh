// Helpers the standalone benchmarks share (csrc/bench/event_wake.cu, ll_boundary.cu, walk_probe.cu, sm_read_bw.cu,
// l2_steady_bw.cu): the resolution of %globaltimer, a chunk read with loads in flight, a background HBM stream for the
// --load runs, and the statistics they print.
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>
#include <cuda_runtime.h>
#include "../runtime/sync.cuh"

namespace bench {

constexpr int kLoadsInFlight = 4;  // 16-byte loads a streaming thread keeps in flight

// The smallest step of %globaltimer one thread sees (its resolution: the latencies below are multiples of it).
__global__ void timer_step(uint64_t* out) {
  uint64_t prev = mpk::globaltimer_ns(), best = ~0ull;
  for (int i = 0; i < 100000; ++i) {
    const uint64_t t = mpk::globaltimer_ns();
    if (t != prev && t - prev < best) best = t - prev;
    prev = t;
  }
  *out = best;
}

// One 16-byte non-allocating load: the instruction of the linear tiles' weight loads (csrc/tasks/common.cuh
// ld_stream_v4; not included here, since the probes build standalone without the kernel's include path).
__device__ __forceinline__ int4 ld_nc_v4(const int4* p) {
  int4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// This thread's share of p[0, vecs) (threads blockDim.x apart), LOADS 16-byte non-allocating loads issued before
// any is used (as the linear tiles' weight loads), XORed into acc. The probes' kernels built on it need a one-block
// launch bound: without it ptxas aimed at full occupancy (32 registers) and used each value before issuing the next
// load, ~4 loads in flight instead of LOADS (docs/PERF.md v0.48).
template <int LOADS>
__device__ __forceinline__ void read_chunk(const int4* p, size_t vecs, int4& acc) {
  for (size_t i = threadIdx.x; i < vecs; i += (size_t)blockDim.x * LOADS) {
    int4 v[LOADS];
#pragma unroll
    for (int u = 0; u < LOADS; ++u) {
      const size_t j = i + (size_t)u * blockDim.x;
      v[u] = j < vecs ? ld_nc_v4(p + j) : make_int4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < LOADS; ++u) {
      acc.x ^= v[u].x;
      acc.y ^= v[u].y;
      acc.z ^= v[u].z;
      acc.w ^= v[u].w;
    }
  }
}

// Milliseconds per launch: launch(i) for i < warm untimed, then for warm <= i < warm + timed between two events
// (back-to-back launches, so a lower bound of each one's own time plus the launch gaps).
template <class Launch>
float ms_per_launch(const Launch& launch, int warm, int timed) {
  for (int i = 0; i < warm; ++i) launch(i);
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  cudaEventRecord(a);
  for (int i = warm; i < warm + timed; ++i) launch(i);
  cudaEventRecord(b);
  cudaEventSynchronize(b);
  float ms = 0.f;
  cudaEventElapsedTime(&ms, a, b);
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return ms / timed;
}

// Thread `lt` of `nl` streaming threads of a block reads its share `base[0, per_block)` round after round with
// 16-byte non-allocating loads (as the weight tiles do) until stop() is true; returns the loads it issued. The
// values are folded into *sink only when they equal a pattern they never hold, so the loads stay.
template <class Stop>
__device__ unsigned long long stream_hbm(const int4* base, size_t per_block, int lt, int nl, const Stop& stop,
                                         int4* sink) {
  int4 acc = make_int4(0, 0, 0, 0);
  unsigned long long loads = 0;
  for (size_t i = lt;; i += (size_t)nl * kLoadsInFlight) {
    if (stop()) break;
    if (i + (size_t)nl * kLoadsInFlight >= per_block) i = lt;
    int4 v[kLoadsInFlight];
#pragma unroll
    for (int u = 0; u < kLoadsInFlight; ++u) v[u] = ld_nc_v4(base + i + (size_t)u * nl);
#pragma unroll
    for (int u = 0; u < kLoadsInFlight; ++u) acc.x ^= v[u].x ^ v[u].w;
    loads += kLoadsInFlight;
  }
  if (acc.x == 0x12345678) *sink = acc;  // (almost) never true
  return loads;
}

// The q-quantile of v (nearest rank).
inline double pct(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, (size_t)(q * (double)(v.size() - 1) + 0.5))];
}

inline double mean(const std::vector<double>& v) {
  double t = 0;
  for (double x : v) t += x;
  return v.empty() ? 0.0 : t / (double)v.size();
}

// %globaltimer's resolution on device 0, in ns (a launch of timer_step into `scratch`, 8 bytes of device memory).
inline unsigned long long timer_resolution_ns(uint64_t* scratch) {
  timer_step<<<1, 1>>>(scratch);
  uint64_t tick = 0;
  cudaMemcpy(&tick, scratch, 8, cudaMemcpyDeviceToHost);
  return (unsigned long long)tick;
}

}  // namespace bench

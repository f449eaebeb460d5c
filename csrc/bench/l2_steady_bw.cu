// What 132 SMs read steadily from L2 and from HBM inside one launch, with 16-byte register loads (as the linear
// tiles' weight loads) and with bulk copies into shared memory (the TMA engine's 1-D form), at several depths in flight.
//
// Why (docs/PERF.md v0.48): sm_read_bw.cu put 132 SMs reading L2 only ~10% faster than HBM on an H100, but it times
// whole launches of ~10 us, whose start and end spread are a large share of them. Here each block reads its chunk
// P times within one launch and the rate comes from two pass counts: bytes x (P2 - P1) / (t(P2) - t(P1)), so the
// launch, the first pass's misses and the end spread cancel. If L2 serves far more than HBM this way, or bulk
// copies reach more than register loads, a tile whose weights were prefetched into L2 (the o_proj tiles behind
// attention at batch 8: 16.6-19.2 us for 10.8 us of bytes, v0.47) could stream faster than it does.
//
// L2: every pass reads the same chunks (132 x 256 KB = 33 MB, under the H100's 50 MB L2). HBM: every pass reads the
// next region (132 x 1 MB a pass) and launches rotate through a 4 GiB buffer.
//
// Standalone (not built by the package): nvcc -O3 -arch=sm_90a -o l2_steady_bw csrc/bench/l2_steady_bw.cu && ./l2_steady_bw
#include <cstdio>
#include <cuda_runtime.h>
#include "bench_util.cuh"

namespace {

constexpr size_t kBufferBytes = size_t(4) << 30;  // HBM passes rotate through it (many times the L2)
constexpr size_t kL2ChunkBytes = size_t(256) << 10;   // a block's chunk in the L2 runs (an o_proj tile at qwen3-8b)
constexpr size_t kHbmChunkBytes = size_t(1) << 20;    // a block's chunk per pass in the HBM runs
constexpr int kPassesShort = 2, kPassesLong = 10;     // the two pass counts of the differential timing
constexpr int kTimedLaunches = 10;
constexpr int kWarmLaunches = 2;
constexpr int kThreads = 512;  // the batch-8 and 8B kernels' worker threads
// One block an SM (the kernels' launch bound too). Without the 1, ptxas aimed at 4 blocks an SM (32 registers a
// thread) and folded each load's value before issuing the next: 2-3 loads in flight a thread instead of LOADS.
constexpr int kMinBlocks = 1;
constexpr int kVec = 16;       // bytes a register load moves
constexpr uint32_t kMaxSmem = 200u << 10;  // dynamic shared memory a bulk-copy block may use

// Each block reads its chunk of region p (p = 0 .. passes-1; region p starts p x region_stride past src) with
// LOADS 16-byte loads a thread in flight; values folded so that the loads stay.
template <int LOADS>
__global__ void __launch_bounds__(kThreads, kMinBlocks) read_loads(const int4* __restrict__ src, size_t vec_per_block,
                                                       size_t region_stride_vec, int passes, int4* sink) {
  int4 acc = make_int4(0, 0, 0, 0);
  for (int pass = 0; pass < passes; ++pass) {
    bench::read_chunk<LOADS>(src + pass * region_stride_vec + blockIdx.x * vec_per_block, vec_per_block, acc);
  }
  if (acc.x == 0x12345678) sink[threadIdx.x] = acc;  // keeps the loads; (almost) never true
}

constexpr int kMaxStages = 16;

// The same bytes by bulk copies of `copy_bytes` into `stages` shared-memory slots: thread 0 keeps every slot's copy
// in flight and reissues a slot as soon as its previous copy has landed (nobody reads the slots: this is the copy
// engine's rate, the ceiling of a bulk-copy weight stream). Warp 1 then reads one word of each slot so that the
// copies are not dead.
__global__ void __launch_bounds__(kThreads, kMinBlocks) read_bulk(const char* __restrict__ src, size_t bytes_per_block,
                                                      size_t region_stride, int passes, uint32_t copy_bytes, int stages,
                                                      int* sink) {
  extern __shared__ __align__(128) char slots[];
  __shared__ uint64_t full[kMaxStages];
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) mpk::mbar_init(&full[s], 1);
    mpk::fence_mbar_init();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    const size_t per_pass = bytes_per_block / copy_bytes;
    const size_t copies = per_pass * passes;
    for (size_t c = 0; c < copies; ++c) {
      const int s = (int)(c % stages);
      const uint32_t use = (uint32_t)(c / stages);
      if (use > 0) mpk::mbar_wait(&full[s], (use - 1) & 1, "l2_steady_bw slot");
      const size_t pass = c / per_pass, k = c % per_pass;
      const char* from = src + pass * region_stride + blockIdx.x * bytes_per_block + k * copy_bytes;
      mpk::mbar_arrive_expect_tx(&full[s], copy_bytes);
      mpk::bulk_copy_g2s(slots + (size_t)s * copy_bytes, from, copy_bytes, &full[s]);
    }
    for (int s = 0; s < stages && (size_t)s < copies; ++s) {  // the last use of each slot
      const size_t uses = (copies - s + stages - 1) / stages;
      mpk::mbar_wait(&full[s], (uint32_t)((uses - 1) & 1), "l2_steady_bw drain");
    }
  }
  __syncthreads();
  if (threadIdx.x / 32 == 1) {
    int acc = 0;
    for (int s = threadIdx.x % 32; s < stages; s += 32) acc ^= *reinterpret_cast<const int*>(slots + (size_t)s * copy_bytes);
    if (acc == 0x12345678) sink[threadIdx.x] = acc;
  }
}

struct Case {
  const char* what;
  int loads;          // 16-byte loads a thread in flight (0: bulk copies)
  uint32_t copy_kb;   // bulk: bytes a copy
  int stages;         // bulk: copies in flight
};

constexpr Case kCases[] = {
    {"loads x4", 4, 0, 0},      {"loads x8", 8, 0, 0},      {"loads x16", 16, 0, 0},
    {"bulk 4 x 16 KB", 0, 16, 4}, {"bulk 8 x 16 KB", 0, 16, 8}, {"bulk 4 x 32 KB", 0, 32, 4},
    {"bulk 6 x 32 KB", 0, 32, 6}, {"bulk 12 x 16 KB", 0, 16, 12},
    // shallow depths: a 1-2 stage weight ring's (docs/PERF.md v0.50 built one for the tiles behind attention; not run yet)
    {"bulk 1 x 32 KB", 0, 32, 1}, {"bulk 2 x 32 KB", 0, 32, 2}, {"bulk 2 x 16 KB", 0, 16, 2},
};

// read_loads at a case's depth (4, 8 or 16 loads a thread).
using LoadsKernel = void (*)(const int4*, size_t, size_t, int, int4*);
LoadsKernel loads_kernel(int loads) { return loads == 4 ? read_loads<4> : loads == 8 ? read_loads<8> : read_loads<16>; }

bool check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) std::printf("error: %s: %s\n", what, cudaGetErrorString(e));
  return e == cudaSuccess;
}

// Milliseconds per launch of `blocks` blocks, each reading `chunk` bytes per pass for `passes` passes.
float time_case(const Case& c, const char* buf, int blocks, size_t chunk, bool hbm, int passes, int* sink) {
  const size_t span = chunk * blocks, stride = hbm ? span : 0, launch_bytes = span * passes;
  const size_t rotations = hbm ? kBufferBytes / launch_bytes : 1;
  const uint32_t smem = c.copy_kb * 1024u * (uint32_t)c.stages;
  auto launch = [&](int r) {
    const char* at = buf + (r % rotations) * launch_bytes;
    if (c.loads)
      loads_kernel(c.loads)<<<blocks, kThreads>>>(reinterpret_cast<const int4*>(at), chunk / kVec, stride / kVec, passes,
                                                   reinterpret_cast<int4*>(sink));
    else
      read_bulk<<<blocks, kThreads, smem>>>(at, chunk, stride, passes, c.copy_kb * 1024u, c.stages, sink);
  };
  return bench::ms_per_launch(launch, kWarmLaunches, kTimedLaunches);
}

}  // namespace

int main() {
  int dev = 0, sms = 0;
  if (!check(cudaGetDevice(&dev), "cudaGetDevice") ||
      !check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev), "SM count"))
    return 1;
  char* buf = nullptr;
  int* sink = nullptr;
  if (!check(cudaMalloc(&buf, kBufferBytes), "cudaMalloc (4 GiB)") || !check(cudaMalloc(&sink, 1 << 16), "cudaMalloc"))
    return 1;
  cudaMemset(buf, 1, kBufferBytes);
  if (!check(cudaFuncSetAttribute(read_bulk, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)kMaxSmem),
             "max dynamic shared memory"))
    return 1;
  std::printf("%d blocks of %d threads; rate = bytes x (%d - %d passes) / (t(%d) - t(%d))\n", sms, kThreads,
              kPassesLong, kPassesShort, kPassesLong, kPassesShort);
  std::printf("%-4s %-16s %10s %12s %9s %10s\n", "src", "method", "in flight", "GB/s total", "per SM", "us a pass");
  bool ok = true;
  for (int hbm = 0; hbm <= 1 && ok; ++hbm) {
    const size_t chunk = hbm ? kHbmChunkBytes : kL2ChunkBytes;
    for (const Case& c : kCases) {
      const float t1 = time_case(c, buf, sms, chunk, hbm, kPassesShort, sink);
      const float t2 = time_case(c, buf, sms, chunk, hbm, kPassesLong, sink);
      ok = check(cudaGetLastError(), c.what);
      if (!ok) break;
      const double pass_ms = (t2 - t1) / (kPassesLong - kPassesShort);
      const double gbs = (double)chunk * sms / (pass_ms * 1e-3) / 1e9;
      const unsigned flight_kb = c.loads ? c.loads * kVec * kThreads / 1024 : c.copy_kb * c.stages;
      std::printf("%-4s %-16s %7u KB %12.0f %9.1f %10.2f\n", hbm ? "HBM" : "L2", c.what, flight_kb, gbs, gbs / sms,
                  pass_ms * 1e3);
    }
  }
  const cudaError_t e = cudaDeviceSynchronize();
  std::printf("status %s\n", cudaGetErrorString(e));
  return ok && e == cudaSuccess ? 0 : 1;
}

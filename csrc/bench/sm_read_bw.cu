// What one SM can read from HBM, and what N SMs read together (docs/PERF.md v0.24).
//
// N blocks, one per SM, each stream their own chunk of a 4 GiB buffer with 16-byte non-allocating loads
// (as the linear tiles' weight loads), LOADS_IN_FLIGHT loads issued per thread before any is used. Launches
// rotate through the buffer so every one reads from HBM, not L2. Prints GB/s in total and per block for
// N in kBlockCounts, per-block chunk sizes kChunkBytes and 256 / 512 threads; the time of an empty launch
// measured the same way is subtracted (back-to-back launches: a lower bound of the kernel's own time).
// With --l2 every launch reads the same region instead, so the chunks (up to 132 x 256 KB = 33 MB: the size of
// qwen3-8b's o_proj, which the runtime prefetches into L2 behind unsplit attention) come from L2 after the first:
// what a tile reading from L2 can reach. There the rows of few blocks take about an empty launch's time, so after
// the subtraction they are launch noise, not bandwidth (docs/PERF.md v0.30 reads the 32-132 block rows).
//
// Standalone (not built by the package): nvcc -O3 -arch=sm_90a -o sm_read_bw csrc/bench/sm_read_bw.cu && ./sm_read_bw [--l2]
#include <cstdio>
#include <cstring>
#include <cuda_runtime.h>
#include "bench_util.cuh"

namespace {

constexpr size_t kBufferBytes = size_t(4) << 30;  // several times the L2
constexpr int kTimedLaunches = 40;
constexpr int kWarmLaunches = 3;
constexpr int kBlockCounts[] = {1, 2, 4, 8, 16, 32, 64, 96, 128, 132};
constexpr size_t kChunkBytes[] = {size_t(256) << 10, size_t(1) << 20, size_t(4) << 20};
constexpr int kThreadCounts[] = {256, 512};
constexpr int kVec = 16;  // bytes per load

constexpr size_t kL2ResidentBytes = size_t(40) << 20;  // --l2 reads at most this much (H200's L2: 50 MB)
bool g_same_region = false;  // --l2: every launch reads the same chunks (L2 hits after the warm launches)

// One block an SM, as the mega-kernel's launch bound says. Without it ptxas aimed at full occupancy (32-34 registers a
// thread) and folded each load's value before issuing the next, so every column up to v0.47 (docs/PERF.md v0.24,
// v0.30, v0.39) ran with ~2-4 loads in flight a thread whatever its LOADS_IN_FLIGHT said (SASS, v0.48).
constexpr int kMaxThreads = 512, kMinBlocks = 1;  // the largest of kThreadCounts

template <int LOADS_IN_FLIGHT>
__global__ void __launch_bounds__(kMaxThreads, kMinBlocks) stream_chunks(const int4* __restrict__ src, size_t vec_per_block, int4* sink) {
  int4 acc = make_int4(0, 0, 0, 0);
  bench::read_chunk<LOADS_IN_FLIGHT>(src + blockIdx.x * vec_per_block, vec_per_block, acc);
  if (acc.x == 0x12345678) sink[threadIdx.x] = acc;  // keeps the loads; (almost) never true
}

// Milliseconds per launch of `blocks` blocks reading `chunk` bytes each.
template <int LOADS_IN_FLIGHT>
float time_launch(const int4* buf, int blocks, size_t chunk, int threads, int4* sink) {
  const size_t vec = chunk / kVec, span = vec * blocks;
  const size_t rotations = g_same_region ? 1 : (kBufferBytes / kVec) / span;
  // warm launches rotate from the buffer's start, timed ones from it again (r = i - kWarmLaunches), as before
  auto launch = [&](int i) {
    const int r = i < kWarmLaunches ? i : i - kWarmLaunches;
    stream_chunks<LOADS_IN_FLIGHT><<<blocks, threads>>>(buf + (r % rotations) * span, vec, sink);
  };
  return bench::ms_per_launch(launch, kWarmLaunches, kTimedLaunches);
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--l2") == 0) {
      g_same_region = true;
    } else {
      std::printf("error: unknown option %s (expected --l2: read the same L2-resident chunks every launch)\n", argv[i]);
      return 2;
    }
  }
  int4* buf = nullptr;
  int4* sink = nullptr;
  if (cudaMalloc(&buf, kBufferBytes) != cudaSuccess || cudaMalloc(&sink, 1 << 16) != cudaSuccess) {
    std::printf("error: could not allocate %zu bytes on the GPU\n", kBufferBytes);
    return 1;
  }
  cudaMemset(buf, 1, kBufferBytes);
  const float empty = time_launch<1>(buf, 1, kVec, 32, sink);
  std::printf("empty launch %.2f us (subtracted below); reading %s\n", empty * 1e3f,
              g_same_region ? "the same chunks every launch (L2)" : "a new region every launch (HBM)");
  for (size_t chunk : kChunkBytes)
    for (int threads : kThreadCounts) {
      std::printf("per block %zu KB, %d threads\n  N   4 loads: GB/s (total, per block) | 8 | 16   [us at 16]\n", chunk >> 10,
                  threads);
      for (int n : kBlockCounts) {
        if (g_same_region && chunk * n > kL2ResidentBytes) continue;
        const float t4 = time_launch<4>(buf, n, chunk, threads, sink), t8 = time_launch<8>(buf, n, chunk, threads, sink),
                    t16 = time_launch<16>(buf, n, chunk, threads, sink);
        auto gbs = [&](float t) { return (double)chunk * n / ((t - empty) * 1e-3) / 1e9; };
        std::printf("%4d  %7.0f %6.1f | %7.0f %6.1f | %7.0f %6.1f  [%.2f]\n", n, gbs(t4), gbs(t4) / n, gbs(t8),
                    gbs(t8) / n, gbs(t16), gbs(t16) / n, (t16 - empty) * 1e3f);
      }
    }
  const cudaError_t e = cudaDeviceSynchronize();
  std::printf("status %s\n", cudaGetErrorString(e));
  return e == cudaSuccess ? 0 : 1;
}

// Where the hardware puts the blocks of a two-blocks-per-SM cooperative launch (MPK_BLOCKS_PER_SM=2).
//
// Why: the task graph gives an op's tiles to consecutive workers round-robin (taskgraph/serialize.py
// assign_workers), so with two workers per SM a level of up to one tile per SM runs at full bandwidth only when
// any kSms consecutive workers sit on distinct SMs. csrc/runtime/worker_index.cuh pairs the blocks by %smid
// (workers w and w + kSms on one SM) so that holds whatever the hardware does; this tells what the hardware does
// (whether blockIdx.x alone would have done): how many b < kSms share an SM with b + kSms, and how many SMs hold
// two of the first kSms blocks.
//
// Standalone (not built by the package): nvcc -O3 -arch=sm_90a -o sm_pairs csrc/bench/sm_pairs.cu && ./sm_pairs
#include <cstdio>
#include <cuda_runtime.h>

constexpr int kThreads = 256;           // the mega-kernel's batch-1 worker block
constexpr int kBlocksPerSm = 2;
constexpr int kMaxSmid = 1024;           // bound of %smid values counted
constexpr int kShowBlocks = 16;          // blocks printed per half

__global__ void __launch_bounds__(kThreads, kBlocksPerSm) record_smid(int* out) {
  unsigned s;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
  if (threadIdx.x == 0) out[blockIdx.x] = (int)s;
}

int main() {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  const int grid = kBlocksPerSm * sms;
  if (sms > kMaxSmid) {
    std::printf("sm_pairs: %d SMs, expected at most %d (kMaxSmid)\n", sms, kMaxSmid);
    return 1;
  }
  int* d = nullptr;
  cudaMalloc(&d, grid * sizeof(int));
  void* args[] = {&d};
  const cudaError_t e = cudaLaunchCooperativeKernel((void*)record_smid, grid, kThreads, args, 0, 0);
  const cudaError_t s = cudaDeviceSynchronize();
  if (e != cudaSuccess || s != cudaSuccess) {
    std::printf("sm_pairs: cooperative launch of %d blocks failed: %s / %s\n", grid, cudaGetErrorString(e),
                cudaGetErrorString(s));
    return 1;
  }
  int h[2 * kMaxSmid] = {};
  cudaMemcpy(h, d, grid * sizeof(int), cudaMemcpyDeviceToHost);
  int paired = 0, doubled = 0, seen[kMaxSmid] = {};
  for (int b = 0; b < sms; ++b) {
    paired += h[b] == h[b + sms];
    doubled += seen[h[b] % kMaxSmid]++ > 0;
  }
  std::printf("sm_pairs: %d SMs, %d blocks: block b and b + %d on one SM for %d of %d; SMs holding two of blocks "
              "0..%d: %d\n", sms, grid, sms, paired, sms, sms - 1, doubled);
  std::printf("smid of blocks 0..%d:", kShowBlocks - 1);
  for (int b = 0; b < kShowBlocks; ++b) std::printf(" %d", h[b]);
  std::printf("\nsmid of blocks %d..%d:", sms, sms + kShowBlocks - 1);
  for (int b = sms; b < sms + kShowBlocks; ++b) std::printf(" %d", h[b]);
  std::printf("\n");
  cudaFree(d);
  return 0;
}

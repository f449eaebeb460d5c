// What the unsplit attention walk's loads cost one SM (docs/PERF.md v0.41).
//
// The qwen3-8b batch-1 attention tile walks one kv head's 484 cache positions (a 256-byte key row and a 256-byte
// value row each: 248 KB) on one SM in 6.1-6.6 us, ~40 GB/s, while the rest of the GPU waits and HBM idles. Two
// explanations give different fixes:
//  * each of the walk's four dependent load rounds (two blocks of 16 positions a warp, keys then values) is an HBM
//    round trip because the rows prefetched into L2 before the tile's wait were streamed past by qkv's weights;
//    then rows in L2 shorten it (the prep's idle warps prefetching them again: measured and removed, v0.42);
//  * one SM cannot have more than so many bytes in flight, so a round of 64 KB takes ~1.5 us from L2 too; then only
//    more bytes in flight (bulk copies into shared memory) do.
// This probe measures both on an otherwise idle GPU, timing inside the kernel with %globaltimer, its reads 16-byte
// asynchronous copies into shared memory (cp.async.cg: L2 only), so that a round's bytes are in flight together:
//  1. "walk": one block of 512 threads reads the rows as attention_mma_walk does (16 warps, warp w taking positions
//     w, w + 16, ...; per block of 16 a warp, lane (g, t) copies its 8 pieces of key rows g and g + 8 and waits, then
//     its 8 pieces of four value rows and waits: 64 KB an SM a round), and with each block's value copies issued
//     beside its key copies ("walk, values with keys": 128 KB a round);
//  2. "stream": the same 248 KB as one contiguous stream, 1-16 copies in flight a thread (8-128 KB an SM);
// each with the rows evicted from L2 first (HBM) and with them read into L2 by every SM first (L2).
//
// Standalone (not built by the package): nvcc -O3 -arch=sm_90a -o walk_probe csrc/bench/walk_probe.cu && ./walk_probe
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <cuda_runtime.h>
#include "bench_util.cuh"

namespace {

constexpr int kThreads = 512;                   // the 8B presets' worker threads
constexpr int kWarps = kThreads / 32;
constexpr int kPositions = 484;                 // the positions a tile walks at context ~480
constexpr int kHeadDim = 128;                   // bf16 elements of a row
constexpr int kPosStride = 8 * kHeadDim;        // elements between positions: 8 kv heads (qwen3-8b, llama3-8b)
constexpr int kBlock = 16;                      // positions of a walk block
constexpr int kChunk = 32;                      // head dims a lane quad covers with one 16-byte load a lane
constexpr int kRowVecs = kHeadDim / kChunk;     // 16-byte key loads a lane a row (ME)
constexpr int kValueVecs = kRowVecs / 2;        // 16-byte value loads a lane a row (its D / 8 dims)
constexpr size_t kFlushBytes = size_t(256) << 20;  // read by every SM to evict the rows from L2 (50-60 MB)
constexpr int kRepeats = 21;                    // launches per row of the table (the median is printed)
constexpr int kStamps = 4;                      // start, thread 0's first keys back, its first values back, end

__device__ __forceinline__ uint64_t now_ns() { return mpk::globaltimer_ns(); }

// Every SM reads the flush region once: afterwards the rows are not in L2.
__global__ void flush_l2(const int4* buf, size_t vecs, int4* sink) {
  int4 acc = make_int4(0, 0, 0, 0);
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < vecs; i += (size_t)gridDim.x * blockDim.x) {
    const int4 v = __ldcg(buf + i);
    acc.x ^= v.x;
  }
  if (acc.x == 0x12345678) *sink = acc;  // (almost) never true
}

// Every SM reads a share of the rows through L2 (.cg: L2 only, so the probe's SM finds nothing in its L1).
__global__ void warm_l2(const uint16_t* kc, const uint16_t* vc, int4* sink) {
  int4 acc = make_int4(0, 0, 0, 0);
  const int pieces = kPositions * kHeadDim * 2 / 8;  // 16-byte pieces of the key and value rows
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < pieces; i += gridDim.x * blockDim.x) {
    const int half = kPositions * kHeadDim / 8, j = i % half;
    const uint16_t* base = i < half ? kc : vc;
    const int4 v = __ldcg(reinterpret_cast<const int4*>(base + (size_t)(j / (kHeadDim / 8)) * kPosStride) +
                          j % (kHeadDim / 8));
    acc.x ^= v.x;
  }
  if (acc.x == 0x12345678) *sink = acc;
}

// One 16-byte asynchronous copy global -> shared (L2 only: .cg), and the waits: a phase's copies are all issued before
// any is waited for, so its bytes are in flight together whatever the compiler's schedule (with plain loads, ptxas
// interleaves a probe's loads with their uses; the runtime's walk issues a block's 8 key loads together).
__device__ __forceinline__ void copy16(void* smem_dst, const void* src) {
  const uint32_t dst = (uint32_t)__cvta_generic_to_shared(smem_dst);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void copies_done() {
  asm volatile("cp.async.commit_group;" ::: "memory");
  asm volatile("cp.async.wait_group 0;" ::: "memory");
}

constexpr int kPhaseBytes = kThreads * (2 * kRowVecs) * 16;  // one round of the walk: 8 pieces a lane (64 KB)

// The walk's loads (attention_mma_walk's addressing, D = 128) as copies into shared memory: per block of 16 positions
// a warp, lane (g, t) copies its 8 pieces of key rows g and g + 8, waits, then its 8 pieces of four value rows, waits
// (the runtime's walk waits for its keys' score mmas before it loads the values); VALUES_WITH_KEYS copies a block's
// keys and values together. stamps: kStamps per launch (thread 0).
template <bool VALUES_WITH_KEYS>
__global__ void __launch_bounds__(kThreads) walk(const uint16_t* kc, const uint16_t* vc, uint64_t* stamps) {
  extern __shared__ int4 stage[];  // 2 x kPhaseBytes: keys, values
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  int4* keys = stage + threadIdx.x * 2 * kRowVecs;
  int4* values = stage + kPhaseBytes / 16 + threadIdx.x * 2 * kRowVecs;
  __syncthreads();
  const uint64_t t0 = now_ns();
  const int n = (kPositions - warp + kWarps - 1) / kWarps, last = n - 1;
  auto row = [&](const uint16_t* base, int k) { return base + (size_t)(warp + min(k, last) * kWarps) * kPosStride; };
  auto copy_values = [&](int b0) {
#pragma unroll
    for (int r = 0; r < 4; ++r)
#pragma unroll
      for (int c = 0; c < kValueVecs; ++c)
        copy16(values + r * kValueVecs + c, row(vc, b0 + 2 * t + (r & 1) + (r >> 1) * 8) + g * (kHeadDim / 8) + 8 * c);
  };
  for (int b0 = 0; b0 < n; b0 += kBlock) {
#pragma unroll
    for (int c = 0; c < kRowVecs; ++c) {
      copy16(keys + 2 * c, row(kc, b0 + g) + 8 * t + c * kChunk);
      copy16(keys + 2 * c + 1, row(kc, b0 + g + 8) + 8 * t + c * kChunk);
    }
    if constexpr (VALUES_WITH_KEYS) copy_values(b0);
    copies_done();
    if (b0 == 0 && threadIdx.x == 0) stamps[1] = now_ns();
    if constexpr (!VALUES_WITH_KEYS) {
      copy_values(b0);
      copies_done();
    }
    if (b0 == 0 && threadIdx.x == 0) stamps[2] = now_ns();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    stamps[0] = t0;
    stamps[3] = now_ns();
  }
}

// The same bytes as one contiguous stream, LOADS copies in flight a thread (LOADS x 8 KB an SM) a round.
template <int LOADS>
__global__ void __launch_bounds__(kThreads) stream(const int4* src, int vecs, uint64_t* stamps) {
  extern __shared__ int4 stage[];  // LOADS x kThreads pieces
  __syncthreads();
  const uint64_t t0 = now_ns();
  for (int i = threadIdx.x; i < vecs; i += kThreads * LOADS) {
#pragma unroll
    for (int u = 0; u < LOADS; ++u) {
      const int j = i + u * kThreads;
      if (j < vecs) copy16(stage + u * kThreads + threadIdx.x, src + j);
    }
    copies_done();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    stamps[0] = t0;
    stamps[3] = now_ns();
  }
}

struct Buffers {
  uint16_t *kc = nullptr, *vc = nullptr;
  int4 *flush = nullptr, *sink = nullptr;
  uint64_t* stamps = nullptr;
  int sms = 0;
};

// Before each timed launch: the rows out of L2 (hbm) or read into it by every SM (l2).
void prepare(const Buffers& b, bool in_l2, const int4* stream_src, int stream_vecs) {
  flush_l2<<<b.sms, 512>>>(b.flush, kFlushBytes / sizeof(int4), b.sink);
  if (in_l2) {
    if (stream_src != nullptr)
      flush_l2<<<b.sms, 512>>>(stream_src, (size_t)stream_vecs, b.sink);  // reads them: now in L2
    else
      warm_l2<<<b.sms, 512>>>(b.kc, b.vc, b.sink);
  }
}

struct Times {
  double first_keys = 0, first_block = 0, total = 0;  // us from the start: medians of kRepeats launches
};

// Lets `kernel` use `bytes` of dynamic shared memory (above the 48 KB default); false with a message if it cannot.
template <class Kernel>
bool allow_smem(Kernel kernel, int bytes, const char* name) {
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes) != cudaSuccess) {
    std::printf("error: %s cannot have %d bytes of shared memory on this GPU\n", name, bytes);
    return false;
  }
  return true;
}

template <class Launch>
Times timed(const Buffers& b, bool in_l2, const int4* stream_src, int stream_vecs, Launch launch) {
  std::vector<double> keys, block, total;
  for (int r = 0; r < kRepeats; ++r) {
    prepare(b, in_l2, stream_src, stream_vecs);
    cudaMemset(b.stamps, 0, kStamps * sizeof(uint64_t));
    launch();
    if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) {
      std::printf("error: the probe's launch failed: %s\n", cudaGetErrorString(e));
      std::exit(1);
    }
    uint64_t s[kStamps];
    cudaMemcpy(s, b.stamps, sizeof(s), cudaMemcpyDeviceToHost);
    keys.push_back(s[1] ? (double)(s[1] - s[0]) * 1e-3 : 0.0);
    block.push_back(s[2] ? (double)(s[2] - s[0]) * 1e-3 : 0.0);
    total.push_back((double)(s[3] - s[0]) * 1e-3);
  }
  return {bench::pct(keys, 0.5), bench::pct(block, 0.5), bench::pct(total, 0.5)};
}

}  // namespace

int main() {
  Buffers b;
  cudaDeviceGetAttribute(&b.sms, cudaDevAttrMultiProcessorCount, 0);
  const size_t rows_bytes = (size_t)kPositions * kPosStride * sizeof(uint16_t);
  if (cudaMalloc(&b.kc, rows_bytes) != cudaSuccess || cudaMalloc(&b.vc, rows_bytes) != cudaSuccess ||
      cudaMalloc(&b.flush, kFlushBytes) != cudaSuccess || cudaMalloc(&b.sink, kThreads * sizeof(int4)) != cudaSuccess ||
      cudaMalloc(&b.stamps, kStamps * sizeof(uint64_t)) != cudaSuccess) {
    std::printf("error: could not allocate the probe's buffers (%zu MB) on the GPU\n", (2 * rows_bytes + kFlushBytes) >> 20);
    return 1;
  }
  cudaMemset(b.kc, 1, rows_bytes);
  cudaMemset(b.vc, 2, rows_bytes);
  cudaMemset(b.flush, 3, kFlushBytes);
  if (!allow_smem(walk<false>, 2 * kPhaseBytes, "walk") || !allow_smem(walk<true>, 2 * kPhaseBytes, "walk") ||
      !allow_smem(stream<8>, 8 * kThreads * 16, "stream") || !allow_smem(stream<16>, 16 * kThreads * 16, "stream"))
    return 1;
  const double walk_kb = 2.0 * kPositions * kHeadDim * sizeof(uint16_t) / 1024.0;
  uint64_t* res = nullptr;
  cudaMalloc(&res, sizeof(uint64_t));
  bench::timer_step<<<1, 1>>>(res);
  uint64_t step = 0;
  cudaMemcpy(&step, res, sizeof(step), cudaMemcpyDeviceToHost);
  std::printf("walk_probe: one block of %d threads, %d positions (%.0f KB of key and value rows, %d-element position "
              "stride), medians of %d launches; %%globaltimer step %llu ns\n",
              kThreads, kPositions, walk_kb, kPosStride, kRepeats, (unsigned long long)step);
  std::printf("%-28s %-4s %12s %14s %10s %8s\n", "reads", "from", "keys back us", "block done us", "total us", "GB/s");
  for (int in_l2 = 0; in_l2 < 2; ++in_l2) {
    const char* from = in_l2 ? "L2" : "HBM";
    const Times w = timed(b, in_l2, nullptr, 0, [&] { walk<false><<<1, kThreads, 2 * kPhaseBytes>>>(b.kc, b.vc, b.stamps); });
    std::printf("%-28s %-4s %12.2f %14.2f %10.2f %8.1f\n", "walk (values after keys)", from, w.first_keys,
                w.first_block, w.total, walk_kb * 1024 / (w.total * 1e3));
    const Times v = timed(b, in_l2, nullptr, 0, [&] { walk<true><<<1, kThreads, 2 * kPhaseBytes>>>(b.kc, b.vc, b.stamps); });
    std::printf("%-28s %-4s %12s %14.2f %10.2f %8.1f\n", "walk, values with keys", from, "-", v.first_block, v.total,
                walk_kb * 1024 / (v.total * 1e3));
  }
  // The contiguous stream reads the key region's first walk_kb (its rows are contiguous there).
  const int vecs = (int)(walk_kb * 1024 / sizeof(int4));
  const int4* src = reinterpret_cast<const int4*>(b.kc);
  for (int in_l2 = 0; in_l2 < 2; ++in_l2) {
    const char* from = in_l2 ? "L2" : "HBM";
    auto row = [&](int loads, const Times& s) {
      char name[64];
      std::snprintf(name, sizeof(name), "stream, %3d KB a round", loads * kThreads * 16 / 1024);
      std::printf("%-28s %-4s %12s %14s %10.2f %8.1f\n", name, from, "-", "-", s.total,
                  walk_kb * 1024 / (s.total * 1e3));
    };
    row(1, timed(b, in_l2, src, vecs, [&] { stream<1><<<1, kThreads, 1 * kThreads * 16>>>(src, vecs, b.stamps); }));
    row(2, timed(b, in_l2, src, vecs, [&] { stream<2><<<1, kThreads, 2 * kThreads * 16>>>(src, vecs, b.stamps); }));
    row(4, timed(b, in_l2, src, vecs, [&] { stream<4><<<1, kThreads, 4 * kThreads * 16>>>(src, vecs, b.stamps); }));
    row(8, timed(b, in_l2, src, vecs, [&] { stream<8><<<1, kThreads, 8 * kThreads * 16>>>(src, vecs, b.stamps); }));
    row(16, timed(b, in_l2, src, vecs, [&] { stream<16><<<1, kThreads, 16 * kThreads * 16>>>(src, vecs, b.stamps); }));
  }
  const cudaError_t e = cudaDeviceSynchronize();
  std::printf("status %s\n", cudaGetErrorString(e));
  return e == cudaSuccess ? 0 : 1;
}

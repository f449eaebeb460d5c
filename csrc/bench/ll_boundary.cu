// What a level boundary costs: from the last producer's write of an activation vector until every consumer SM holds
// the whole vector, with the kernel's event (fence + counter, acquire poll, block barrier, then the loads) and with
// flagged data words (no event: each 8-byte word carries its value and the round's tag, and the consumers poll the
// words themselves, as NCCL's LL protocol does between GPUs).
//
// Why: a decode layer is five dependent levels, and each boundary is latency only: the producers' fence, the signal
// reaching the waiters (csrc/bench/event_wake.cu: the last of 131 waiters 1.5-2.3 us after the signal with the HBM
// streaming), the barrier, then an L2 round trip for the vector itself. The small presets lose ~26 us a layer to
// latency beyond their bytes' time (docs/PERF.md v0.33); flagged words would drop the fence and fold the wait into the
// vector's loads. This measures the two schemes alone before either goes into the kernel.
//
// One block per SM (kBlocks), as the mega-kernel's workers. Per round, every block produces a slice of an N-element
// fp32 vector (N / kBlocks elements, rounded up) and then consumes the whole vector, as a linear level's tiles write
// their rows of x and every tile of the next level reads all of x. Rounds are separated by a barrier over all blocks
// (not timed); after it each block waits a round-dependent 0-2 us (kJitter*) before it writes, so the producers end at
// different times as a level's tiles do. Timed per round: t_last = the last producer's write (%globaltimer, read just
// before its stores) and each consumer's t_done (the whole vector loaded and summed); reported over rounds (us): the
// mean and median of every consumer's t_done - t_last, and the mean, median and 90th percentile of the last
// consumer's. The sums are checked against the round's values (a torn or stale word is an error, not a latency).
// Schemes:
//   event  the kernel's: plain stores of the slice, block barrier, fence.acq_rel.gpu + red.relaxed.gpu.add on one
//          counter (csrc/runtime/worker.cuh run_and_signal); the consumer's thread 0 waits with spin_wait_geq_gpu
//          (acquire + 32 ns sleep), a block barrier, then every thread loads its elements
//   flag   one 64-bit st.relaxed.gpu per element: (value bits, round tag); the consumer's threads load their words
//          with 64-bit ld.relaxed.gpu (single-copy atomic: value and tag arrive together) until every tag is the
//          round's, then a block barrier. No fence, no counter
//   flag+sleep  the same with a 32 ns __nanosleep between a thread's polling rounds, as the kernel's wait sleeps:
//          every waiting thread polls its words, so the polls are N words per consumer SM, not one counter
// With --load the last column is what the streaming warps read meanwhile (GB/s over all SMs): the polls' L2 traffic
// competes with the weight streams of the tiles still running at a level's end.
// The protocol runs on warps 0-3 (kProtoThreads); with --load warps 4-7 stream HBM meanwhile (16-byte
// non-allocating loads, as the weight tiles do), so the polls cross a loaded memory system as at a level's end.
// --n N: the vector's length (default 1024: qwen3-0.6b's hidden size; 2048 for qwen3-1.7b, 4096 for the 8B presets).
// The flag scheme's 64-bit relaxed store and load are the kernel's (csrc/runtime/sync.cuh, MPK_FLAG_WORDS).
//
// Standalone (not built by the package): nvcc -O3 -arch=sm_90a -o ll_boundary csrc/bench/ll_boundary.cu && ./ll_boundary [--load] [--n N]
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <cuda_runtime.h>
#include "../runtime/sync.cuh"  // the kernel's memory-ordering helpers: both schemes measure those
#include "bench_util.cuh"

namespace {

using mpk::fence_acq_rel_gpu;
using mpk::globaltimer_ns;
using mpk::ld_acquire_gpu;
using mpk::ld_relaxed_gpu_u64;
using mpk::red_add_relaxed_gpu;
using mpk::st_relaxed_gpu_u64;

constexpr int kBlocks = 132;  // one per SM on an H200
constexpr int kThreads = 256;
constexpr int kProtoThreads = 128;  // warps 0-3 produce and consume; warps 4-7 stream HBM under --load
constexpr int kProtoBarrier = 1;    // named barrier of the protocol warps (0 is __syncthreads)
constexpr int kRounds = 400;
constexpr int kMaxPerThread = 32;   // elements a consumer thread holds: N <= kProtoThreads * kMaxPerThread
constexpr int kDefaultN = 1024;
constexpr uint64_t kJitterSpanNs = 2000;                  // producers start 0-2 us after the round barrier
constexpr uint32_t kJitterPrimeBlock = 7919, kJitterPrimeRound = 104729, kJitterSteps = 1000;
constexpr uint64_t kTimeoutNs = 2000000000ull;            // 2 s: a wait that long is a bug, not a latency
constexpr size_t kLoadBytes = size_t(2) << 30;           // the streamed buffer (--load), past the L2

enum Scheme : int { kEvent, kFlag, kFlagSleep, kSchemes };
const char* const kNames[kSchemes] = {"event", "flag", "flag+sleep"};
constexpr unsigned kPollSleepNs = 32;  // flag+sleep: the kernel's MPK_SPIN_SLEEP_NS

struct Shared {
  int n;                // vector length
  float* vec;           // event scheme: n floats
  uint64_t* words;      // flag scheme: n words (value bits | tag << 32)
  uint32_t* counter;    // event scheme: the level's event
  uint32_t* ack;        // round barrier: consumers done with round r when it reaches (r + 1) * kBlocks
  uint64_t* t_write;    // [kRounds][kBlocks]
  uint64_t* t_done;     // [kRounds][kBlocks]
  uint32_t* error;      // 1 timeout, 2 wrong sum
  unsigned long long* streamed;  // --load: 16-byte loads the streaming warps issued
  const uint32_t* halt;  // the kernel waits' abort word: stays 0
  const int4* load;     // --load: the streamed buffer, nullptr without
  int4* sink;
};

__device__ __forceinline__ void proto_barrier() {
  asm volatile("bar.sync %0, %1;" ::"n"(kProtoBarrier), "n"(kProtoThreads) : "memory");
}

// Element i's value in round r: exact in fp32 (small integers and halves), so the sums are exact too.
__host__ __device__ __forceinline__ float value_of(int i, int r) { return (float)(i % 64) * 0.5f + (float)(r % 8); }

// The sum of every element's value in round r (the consumers' check).
__device__ float expected_sum(int n, int r) {
  // (i % 64) * 0.5 summed over i < n, plus n * (r % 8); computed the same way on every block
  const int full = n / 64, rest = n % 64;
  return (float)full * (63.f * 64.f / 2.f) * 0.5f + (float)(rest * (rest - 1) / 2) * 0.5f + (float)n * (float)(r % 8);
}

template <int S>
__global__ void __launch_bounds__(kThreads, 1) boundary(Shared s) {
  const int b = blockIdx.x, tid = threadIdx.x, n = s.n;
  __shared__ volatile int done_rounds;
  __shared__ float partial[kProtoThreads / 32];
  __shared__ int failed;
  if (tid == 0) { done_rounds = 0; failed = 0; }
  __syncthreads();
  if (tid >= kProtoThreads) {  // --load: stream HBM until the protocol warps are through
    if (s.load == nullptr) return;
    const size_t per_block = kLoadBytes / sizeof(int4) / kBlocks;
    atomicAdd(s.streamed, bench::stream_hbm(s.load + (size_t)b * per_block, per_block, tid - kProtoThreads,
                                            kThreads - kProtoThreads, [&] { return done_rounds >= kRounds; },
                                            s.sink + tid));
    return;
  }
  const int slice = (n + kBlocks - 1) / kBlocks, lo = b * slice, hi = min(n, lo + slice);
  const int per = (n + kProtoThreads - 1) / kProtoThreads;  // this thread's elements: tid, tid + 128, ...
  for (int r = 0; r < kRounds; ++r) {
    const uint32_t tag = (uint32_t)r + 1u;
    // the round barrier (not timed): every consumer is done with round r - 1 before anyone writes round r
    if (tid == 0) {
      const uint64_t t0 = globaltimer_ns();
      while ((int32_t)(ld_acquire_gpu(s.ack) - (uint32_t)r * kBlocks) < 0)
        if (globaltimer_ns() - t0 > kTimeoutNs) { *s.error = 1; failed = 1; break; }
      const uint32_t phase = (uint32_t)(b * kJitterPrimeBlock + r * kJitterPrimeRound) % kJitterSteps;
      const uint64_t go = globaltimer_ns() + (uint64_t)phase * kJitterSpanNs / kJitterSteps;
      while (globaltimer_ns() < go) {}
      s.t_write[(size_t)r * kBlocks + b] = globaltimer_ns();
    }
    proto_barrier();
    if (failed) break;
    // produce this block's slice
    for (int i = lo + tid; i < hi; i += kProtoThreads) {
      const float v = value_of(i, r);
      if constexpr (S == kEvent) s.vec[i] = v;
      else st_relaxed_gpu_u64(s.words + i, (uint64_t)__float_as_uint(v) | ((uint64_t)tag << 32));
    }
    if constexpr (S == kEvent) {  // the kernel's signal: barrier, fence, relaxed add
      proto_barrier();
      if (tid == 0) {
        fence_acq_rel_gpu();
        red_add_relaxed_gpu(s.counter, 1u);
      }
    }
    // consume the whole vector
    float sum = 0.f;
    if constexpr (S == kEvent) {
      if (tid == 0) {
        uint32_t seen = 0;
        if (mpk::spin_wait_geq_gpu(s.counter, tag * kBlocks, kTimeoutNs, s.halt, &seen) != 0) {
          *s.error = 1;
          failed = 1;
        }
      }
      proto_barrier();
      if (failed) break;
      float v[kMaxPerThread];
#pragma unroll
      for (int k = 0; k < kMaxPerThread; ++k) {
        const int i = tid + k * kProtoThreads;
        v[k] = k < per && i < n ? s.vec[i] : 0.f;
      }
#pragma unroll
      for (int k = 0; k < kMaxPerThread; ++k) sum += v[k];
    } else {
      uint64_t w[kMaxPerThread];
#pragma unroll
      for (int k = 0; k < kMaxPerThread; ++k) w[k] = 0;  // tag 0: never a round's (tags start at 1)
      const uint64_t t0 = globaltimer_ns();
      for (bool all = false; !all;) {
        all = true;
#pragma unroll
        for (int k = 0; k < kMaxPerThread; ++k) {
          const int i = tid + k * kProtoThreads;
          if (k < per && i < n && (uint32_t)(w[k] >> 32) != tag) w[k] = ld_relaxed_gpu_u64(s.words + i);
        }
#pragma unroll
        for (int k = 0; k < kMaxPerThread; ++k) {
          const int i = tid + k * kProtoThreads;
          if (k < per && i < n && (uint32_t)(w[k] >> 32) != tag) all = false;
        }
        if (!all && globaltimer_ns() - t0 > kTimeoutNs) { *s.error = 1; failed = 1; break; }
        if (S == kFlagSleep && !all) __nanosleep(kPollSleepNs);
      }
#pragma unroll
      for (int k = 0; k < kMaxPerThread; ++k) {
        const int i = tid + k * kProtoThreads;
        if (k < per && i < n) sum += __uint_as_float((uint32_t)w[k]);
      }
    }
    // the block's sum, checked, then the time the whole vector is in
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if ((tid & 31) == 0) partial[tid >> 5] = sum;
    proto_barrier();
    if (tid == 0) {
      float total = 0.f;
      for (int k = 0; k < kProtoThreads / 32; ++k) total += partial[k];
      s.t_done[(size_t)r * kBlocks + b] = globaltimer_ns();
      if (total != expected_sum(n, r)) *s.error = 2;
      red_add_relaxed_gpu(s.ack, 1u);  // done with round r (the next round's writers acquire it)
    }
    if (failed) break;
  }
  if (tid == 0) done_rounds = kRounds;
}

template <int S>
bool run(Shared s) {
  cudaMemset(s.counter, 0, 4);
  cudaMemset(s.ack, 0, 4);
  cudaMemset(s.error, 0, 4);
  cudaMemset(s.words, 0, sizeof(uint64_t) * (size_t)s.n);
  cudaMemset(s.streamed, 0, sizeof(unsigned long long));
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  cudaEventRecord(e0);
  boundary<S><<<kBlocks, kThreads>>>(s);
  cudaEventRecord(e1);
  if (cudaDeviceSynchronize() != cudaSuccess) {
    std::printf("%-10s  error: %s\n", kNames[S], cudaGetErrorString(cudaGetLastError()));
    return false;
  }
  float ms = 0.f;
  cudaEventElapsedTime(&ms, e0, e1);
  unsigned long long streamed = 0;
  cudaMemcpy(&streamed, s.streamed, sizeof(streamed), cudaMemcpyDeviceToHost);
  uint32_t err = 0;
  std::vector<uint64_t> wr((size_t)kRounds * kBlocks), dn((size_t)kRounds * kBlocks);
  cudaMemcpy(&err, s.error, 4, cudaMemcpyDeviceToHost);
  cudaMemcpy(wr.data(), s.t_write, wr.size() * 8, cudaMemcpyDeviceToHost);
  cudaMemcpy(dn.data(), s.t_done, dn.size() * 8, cudaMemcpyDeviceToHost);
  if (err != 0) {
    std::printf("%-10s  error: %s\n", kNames[S],
                err == 1 ? "a wait timed out after 2 s" : "a consumer's sum was not the round's (a stale or torn word)");
    return false;
  }
  std::vector<double> all, last;
  for (int r = 1; r < kRounds; ++r) {  // round 0 includes the launch's skew
    uint64_t t_last = 0;
    for (int b = 0; b < kBlocks; ++b) t_last = std::max(t_last, wr[(size_t)r * kBlocks + b]);
    double worst = -1e30;
    for (int b = 0; b < kBlocks; ++b) {
      const double d = ((double)dn[(size_t)r * kBlocks + b] - (double)t_last) * 1e-3;
      all.push_back(d);
      worst = std::max(worst, d);
    }
    last.push_back(worst);
  }
  const double gbps = ms > 0.f ? (double)streamed * sizeof(int4) / ((double)ms * 1e-3) * 1e-9 : 0.0;
  std::printf("%-10s  %8.3f  %7.3f  %9.3f  %8.3f  %8.3f  %9.0f\n", kNames[S], bench::mean(all), bench::pct(all, 0.5),
              bench::mean(last), bench::pct(last, 0.5), bench::pct(last, 0.9), gbps);
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  bool load = false;
  int n = kDefaultN;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--load") == 0) {
      load = true;
    } else if (std::strcmp(argv[i], "--n") == 0 && i + 1 < argc) {
      n = std::atoi(argv[++i]);
    } else {
      std::printf("error: unknown option %s (expected --load: other warps stream HBM meanwhile; --n N: the vector's "
                  "length, 1..%d)\n", argv[i], kProtoThreads * kMaxPerThread);
      return 2;
    }
  }
  if (n < 1 || n > kProtoThreads * kMaxPerThread) {
    std::printf("error: --n %d: expected 1..%d (%d consumer threads x %d elements)\n", n,
                kProtoThreads * kMaxPerThread, kProtoThreads, kMaxPerThread);
    return 2;
  }
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  if (sms < kBlocks) {
    std::printf("error: %d SMs, the benchmark needs %d (one block each, all resident at once)\n", sms, kBlocks);
    return 1;
  }
  Shared s{};
  s.n = n;
  uint32_t* halt = nullptr;
  int4* buf = nullptr;
  const size_t times = sizeof(uint64_t) * (size_t)kRounds * kBlocks;
  const bool ok = cudaMalloc(&s.vec, sizeof(float) * (size_t)n) == cudaSuccess &&
                  cudaMalloc(&s.words, sizeof(uint64_t) * (size_t)n) == cudaSuccess &&
                  cudaMalloc(&s.counter, 4) == cudaSuccess && cudaMalloc(&s.ack, 4) == cudaSuccess &&
                  cudaMalloc(&s.t_write, times) == cudaSuccess && cudaMalloc(&s.t_done, times) == cudaSuccess &&
                  cudaMalloc(&s.error, 4) == cudaSuccess && cudaMalloc(&halt, 4) == cudaSuccess &&
                  cudaMalloc(&s.sink, kThreads * sizeof(int4)) == cudaSuccess &&
                  cudaMalloc(&s.streamed, sizeof(unsigned long long)) == cudaSuccess &&
                  (!load || cudaMalloc(&buf, kLoadBytes) == cudaSuccess);
  if (!ok) {
    std::printf("error: could not allocate the vectors, timers and the %s buffer on the GPU\n", load ? "2 GiB" : "(no)");
    return 1;
  }
  if (load) cudaMemset(buf, 1, kLoadBytes);
  cudaMemset(halt, 0, 4);
  s.halt = halt;
  s.load = buf;
  std::printf("globaltimer step %llu ns (the means below average over it); %d blocks (producers and consumers) x %d "
              "protocol threads, vector of %d fp32, %d rounds, %s\n", bench::timer_resolution_ns(s.t_write), kBlocks,
              kProtoThreads,
              n, kRounds, load ? "other warps streaming HBM" : "no other load");
  std::printf("scheme      all mean  all p50  last mean  last p50  last p90  streamed   (us from the last producer's "
              "write; GB/s)\n");
  return run<kEvent>(s) && run<kFlag>(s) && run<kFlagSleep>(s) ? 0 : 1;
}

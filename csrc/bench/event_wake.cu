// How long after an event's last signal the SMs waiting on it see it, by polling method (docs/PERF.md v0.31 leads).
//
// Why: a level's tiles start 0.7-0.8 us apart even when every worker was idle and polling (qwen3-0.6b's o_proj
// behind the attention level, docs/PERF.md v0.31), and a level ends with its last tile, so the detection delay of
// the last waiter is paid about five times a layer. The kernel's wait (csrc/runtime/sync.cuh spin_wait_geq_gpu) is
// one acquire load at a time, so a poll leaves every round trip; this measures what that costs and what the
// alternatives would give, before any of them goes into the kernel.
//
// One block per SM (kBlocks). Block 0 signals, the others wait; kRounds rounds per method. A round: the waiters
// poll the event counter for `round + 1`; the signaller waits until every waiter acknowledged the previous round,
// spins a round-dependent 3-6 us (so the signal falls at a random phase of the waiters' polls), reads the global
// timer (t_sig) and signals as the aot worker does (fence.acq_rel.gpu, red.relaxed.gpu.add). A waiter's thread 0
// reads the timer once its method has seen the count and acquired (t_seen), and acknowledges. Reported per method
// (us, over rounds): the median of every waiter's t_seen - t_sig, the median and 90th percentile of the round's
// last waiter, and the median spread (last - first waiter).
// Methods:
//   acquire+sleep   ld.acquire.gpu, then __nanosleep(32): the kernel's spin_wait_geq_gpu (csrc/runtime/sync.cuh)
//   acquire         ld.acquire.gpu back to back
//   relaxed x1,x2,x4  the kernel's wait under -DMPK_SPIN_INFLIGHT=1/2/4 (spin_wait_geq_gpu_inflight): that many
//                   staggered relaxed polls in flight, then fence.acq_rel.gpu (x1 tells the fence's cost apart)
//   own flag        the signaller also writes each waiter's own flag (one 128-byte line each, after one fence);
//                   each waiter polls its own line with spin_wait_geq_gpu: no 131 SMs on one counter
// With --load the waiters' other warps stream HBM (16-byte non-allocating loads, as the weight tiles do) until their
// thread 0 has seen the round, so the polls cross a loaded memory system as they do at a level's end.
//
// Standalone (not built by the package): nvcc -O3 -arch=sm_90a -o event_wake csrc/bench/event_wake.cu && ./event_wake [--load]
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>
#include <cuda_runtime.h>
#include "../runtime/sync.cuh"  // the kernel's memory-ordering helpers: the bench measures those
#include "bench_util.cuh"

namespace {

using mpk::fence_acq_rel_gpu;
using mpk::globaltimer_ns;
using mpk::ld_acquire_gpu;
using mpk::ld_relaxed_gpu;
using mpk::red_add_relaxed_gpu;
using mpk::st_relaxed_gpu;

constexpr int kBlocks = 132;  // one per SM on an H200
constexpr int kThreads = 256;
constexpr int kRounds = 400;
constexpr int kFlagStride = 32;  // uint32 words between two waiters' flags: one 128-byte line each
constexpr uint64_t kSettleMinNs = 3000, kSettleSpanNs = 3000;  // the signaller's pause before a signal
constexpr uint32_t kPhasePrime = 7919, kPhaseSteps = 1000;      // spread the pauses over the span, round by round
constexpr uint64_t kTimeoutNs = 2000000000ull;                 // 2 s: a wait that long is a bug, not a latency
constexpr size_t kLoadBytes = size_t(2) << 30;                // the streamed buffer (--load), past the L2

enum Method : int { kAcquireSleep, kAcquire, kRelaxed1, kRelaxed2, kRelaxed4, kOwnFlag, kMethods };
const char* const kNames[kMethods] = {"acquire+sleep", "acquire", "relaxed x1", "relaxed x2", "relaxed x4", "own flag"};

struct Shared {
  uint32_t* counter;  // the event
  uint32_t* ack;      // waiters' acknowledgements (round r done when it reaches r * (kBlocks - 1))
  uint32_t* flags;    // own-flag method: waiter b's flag at b * kFlagStride
  uint64_t* t_sig;    // [kRounds]
  uint64_t* t_seen;   // [kRounds][kBlocks]
  uint32_t* error;    // set on a timeout
  const uint32_t* halt;  // the kernel waits' abort word: stays 0
  const int4* load;   // --load: the streamed buffer, nullptr without
  int4* sink;
};

// Thread 0 of a waiter: until *p >= target with method M (acquire when it returns), through the kernel's own waits
// where the method is one. False on timeout.
template <int M>
__device__ bool wait_for(const uint32_t* p, uint32_t target, const uint32_t* halt) {
  uint32_t seen = 0;
  if constexpr (M == kAcquireSleep || M == kOwnFlag) {
    return mpk::spin_wait_geq_gpu(p, target, kTimeoutNs, halt, &seen) == 0;
  } else if constexpr (M == kAcquire) {
    const uint64_t t0 = globaltimer_ns();
    for (uint32_t i = 0;; ++i) {
      if ((int32_t)(ld_acquire_gpu(p) - target) >= 0) return true;
      if ((i & 63) == 0 && globaltimer_ns() - t0 > kTimeoutNs) return false;
    }
  } else {
    constexpr int K = M == kRelaxed1 ? 1 : M == kRelaxed2 ? 2 : 4;
    return mpk::spin_wait_geq_gpu_inflight<K>(p, target, kTimeoutNs, halt, &seen) == 0;
  }
}

template <int M>
__global__ void __launch_bounds__(kThreads, 1) wake(Shared s) {
  const int b = blockIdx.x, tid = threadIdx.x;
  __shared__ volatile int seen_round;
  if (tid == 0) seen_round = -1;
  __syncthreads();
  if (b == 0) {  // the signaller: thread 0 only
    if (tid != 0) return;
    for (int r = 0; r < kRounds; ++r) {
      const uint64_t t0 = globaltimer_ns();
      while ((int32_t)(ld_acquire_gpu(s.ack) - (uint32_t)r * (kBlocks - 1)) < 0)
        if (globaltimer_ns() - t0 > kTimeoutNs) { *s.error = 1; return; }
      // a pause of kSettleMinNs plus a round-dependent part of kSettleSpanNs (r times a prime, mod kPhaseSteps)
      const uint64_t phase = (uint64_t)((r * kPhasePrime) % kPhaseSteps);
      const uint64_t go = globaltimer_ns() + kSettleMinNs + phase * kSettleSpanNs / kPhaseSteps;
      while (globaltimer_ns() < go) {}
      const uint64_t t = globaltimer_ns();
      fence_acq_rel_gpu();
      red_add_relaxed_gpu(s.counter, 1u);
      if constexpr (M == kOwnFlag)
        for (int w = 1; w < kBlocks; ++w) st_relaxed_gpu(s.flags + (size_t)w * kFlagStride, (uint32_t)r + 1u);
      s.t_sig[r] = t;
    }
    return;
  }
  if (tid == 0) {
    const uint32_t* p = M == kOwnFlag ? s.flags + (size_t)b * kFlagStride : s.counter;
    for (int r = 0; r < kRounds; ++r) {
      if (!wait_for<M>(p, (uint32_t)r + 1u, s.halt)) { *s.error = 2; seen_round = kRounds; return; }
      s.t_seen[(size_t)r * kBlocks + b] = globaltimer_ns();
      seen_round = r;
      red_add_relaxed_gpu(s.ack, 1u);
    }
    return;
  }
  if (s.load == nullptr) return;
  // --load: the other warps stream their share of the buffer until thread 0 has seen the last round
  const size_t per_block = kLoadBytes / sizeof(int4) / kBlocks;
  bench::stream_hbm(s.load + (size_t)b * per_block, per_block, tid - 32, kThreads - 32,
                    [&] { return seen_round >= kRounds - 1; }, s.sink + tid);
}

template <int M>
bool run(Shared s) {
  cudaMemset(s.counter, 0, 4);
  cudaMemset(s.ack, 0, 4);
  cudaMemset(s.flags, 0, sizeof(uint32_t) * kFlagStride * kBlocks);
  cudaMemset(s.error, 0, 4);
  wake<M><<<kBlocks, kThreads>>>(s);
  if (cudaDeviceSynchronize() != cudaSuccess) {
    std::printf("%-14s  error: %s\n", kNames[M], cudaGetErrorString(cudaGetLastError()));
    return false;
  }
  uint32_t err = 0;
  std::vector<uint64_t> sig(kRounds), seen((size_t)kRounds * kBlocks);
  cudaMemcpy(&err, s.error, 4, cudaMemcpyDeviceToHost);
  cudaMemcpy(sig.data(), s.t_sig, sig.size() * 8, cudaMemcpyDeviceToHost);
  cudaMemcpy(seen.data(), s.t_seen, seen.size() * 8, cudaMemcpyDeviceToHost);
  if (err != 0) {
    std::printf("%-14s  error: a %s timed out after %.1f s\n", kNames[M], err == 1 ? "signaller" : "waiter",
                kTimeoutNs * 1e-9);
    return false;
  }
  std::vector<double> all, last, spread;
  for (int r = 1; r < kRounds; ++r) {  // round 0 includes the launch's skew
    double lo = 1e30, hi = -1e30;
    for (int b = 1; b < kBlocks; ++b) {
      const double d = ((double)seen[(size_t)r * kBlocks + b] - (double)sig[r]) * 1e-3;
      all.push_back(d);
      lo = std::min(lo, d);
      hi = std::max(hi, d);
    }
    last.push_back(hi);
    spread.push_back(hi - lo);
  }
  std::printf("%-14s  %6.3f  %6.3f  %6.3f  %6.3f\n", kNames[M], bench::pct(all, 0.5), bench::pct(last, 0.5),
              bench::pct(last, 0.9), bench::pct(spread, 0.5));
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  bool load = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--load") == 0) {
      load = true;
    } else {
      std::printf("error: unknown option %s (expected --load: the waiters' other warps stream HBM meanwhile)\n",
                  argv[i]);
      return 2;
    }
  }
  Shared s{};
  uint64_t* step = nullptr;
  uint32_t* halt = nullptr;
  int4* buf = nullptr;
  bool ok = cudaMalloc(&s.counter, 4) == cudaSuccess && cudaMalloc(&s.ack, 4) == cudaSuccess &&
            cudaMalloc(&s.flags, sizeof(uint32_t) * kFlagStride * kBlocks) == cudaSuccess &&
            cudaMalloc(&s.t_sig, 8 * kRounds) == cudaSuccess &&
            cudaMalloc(&s.t_seen, 8 * (size_t)kRounds * kBlocks) == cudaSuccess &&
            cudaMalloc(&s.error, 4) == cudaSuccess && cudaMalloc(&s.sink, kThreads * sizeof(int4)) == cudaSuccess &&
            cudaMalloc(&step, 8) == cudaSuccess && cudaMalloc(&halt, 4) == cudaSuccess && (!load || cudaMalloc(&buf, kLoadBytes) == cudaSuccess);
  if (!ok) {
    std::printf("error: could not allocate the counters and the %s buffer on the GPU\n", load ? "2 GiB" : "timing");
    return 1;
  }
  if (load) cudaMemset(buf, 1, kLoadBytes);
  cudaMemset(halt, 0, 4);
  s.load = buf;
  s.halt = halt;
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  if (sms < kBlocks) {
    std::printf("error: %d SMs, the benchmark needs %d (one block each, all resident at once)\n", sms, kBlocks);
    return 1;
  }
  std::printf("globaltimer step %llu ns; %d blocks x %d threads, %d rounds, %s\n", bench::timer_resolution_ns(step),
              kBlocks, kThreads, kRounds, load ? "waiters' other warps streaming HBM" : "no other load");
  std::printf("method          all p50  last p50  last p90  spread p50   (us after the signal)\n");
  ok = run<kAcquireSleep>(s) && run<kAcquire>(s) && run<kRelaxed1>(s) && run<kRelaxed2>(s) && run<kRelaxed4>(s) &&
       run<kOwnFlag>(s);
  return ok ? 0 : 1;
}

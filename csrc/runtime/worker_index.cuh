// Which worker (task-graph list: worker_offsets / worker_tasks) a block runs.
//  * One block per SM (MPK_MIN_BLOCKS_PER_SM 1): blockIdx.x.
//  * Two (MPK_MIN_BLOCKS_PER_SM 2, a grid of two blocks per SM): the two blocks of one SM take workers w and
//    w + gridDim.x / 2. Why: an op's tiles go to consecutive workers round-robin (taskgraph/serialize.py
//    assign_workers), so any gridDim.x / 2 of them in a row then sit on distinct SMs, whatever order the hardware
//    placed the blocks in; blockIdx.x gives no such promise.
// The pairing: thread 0 counts its block in on its SM's slot; the first block of an SM takes the next w and
// publishes it (release), the second reads it (acquire, bounded wait). The last block to leave zeroes the slots
// for the next launch (a module's globals start at zero).
#pragma once
#include <stdint.h>
#include "params.cuh"
#include "sync.cuh"
#include "watchdog.cuh"

#ifndef MPK_MIN_BLOCKS_PER_SM
#define MPK_MIN_BLOCKS_PER_SM 1
#endif

namespace mpk {

constexpr int kMaxSmSlots = 256;  // > any %smid of an H100 / H200 (132 SMs enabled of 144)

#if MPK_MIN_BLOCKS_PER_SM > 1
__device__ uint32_t g_sm_blocks[kMaxSmSlots];   // blocks counted in on each SM this launch
__device__ uint32_t g_sm_worker[kMaxSmSlots];   // the SM's first worker + 1 (0: not published yet)
__device__ uint32_t g_pair_next, g_pair_left;   // next first worker; blocks that have left
#endif

__device__ __forceinline__ int& worker_index_slot() {
  __shared__ int w;
  return w;
}

// This block's worker (valid after worker_index_claim and a block barrier).
__device__ __forceinline__ int worker_index() {
#if MPK_MIN_BLOCKS_PER_SM > 1
  return worker_index_slot();
#else
  return (int)blockIdx.x;
#endif
}

#if MPK_MIN_BLOCKS_PER_SM > 1
// Thread 0 claims the block's worker; false (the error recorded) when the SM's other block never published.
__device__ inline bool worker_index_claim(const RuntimeParams& p) {
  const uint32_t s = smid() % kMaxSmSlots, half = gridDim.x / 2;
  if (atomicAdd(&g_sm_blocks[s], 1u) == 0) {
    const uint32_t w = atomicAdd(&g_pair_next, 1u);
    worker_index_slot() = (int)w;
    st_release_gpu(&g_sm_worker[s], w + 1u);
    return true;
  }
  const uint64_t t0 = globaltimer_ns();
  uint32_t v;
  while ((v = ld_acquire_gpu(&g_sm_worker[s])) == 0) {  // the SM's first block is resident: it publishes at once
    if (globaltimer_ns() - t0 > p.timeout_ns) {
      worker_index_slot() = -1;  // no worker: the error record says so, and the block runs no task
      raise_error(p.error, p.halt, kErrPairWait, -1, -1, p.step_begin, p.rank, ld_relaxed_gpu(&g_sm_blocks[s]), 2u,
                  globaltimer_ns() - t0);
      return false;
    }
    __nanosleep(100);
  }
  worker_index_slot() = (int)(v - 1u + half);
  return true;
}
#endif

// Thread 0 as its block leaves: the last block zeroes the slots (the next launch of this module starts clean).
__device__ inline void worker_index_release(int tid) {
#if MPK_MIN_BLOCKS_PER_SM > 1
  if (tid != 0) return;
  if (atomicAdd(&g_pair_left, 1u) + 1u == gridDim.x) {
    for (int s = 0; s < kMaxSmSlots; ++s) g_sm_blocks[s] = g_sm_worker[s] = 0u;
    g_pair_next = 0u;
    g_pair_left = 0u;
  }
#else
  (void)tid;
#endif
}

}  // namespace mpk

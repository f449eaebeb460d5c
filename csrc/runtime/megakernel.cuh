// The kernel entry. One block per SM (MPK_MIN_BLOCKS_PER_SM blocks where the shape asks for more): the host sizes
// the grid from the occupancy API and launches cooperatively, so every block is co-resident and no spin-wait can
// wait on an unscheduled block.
// MPK_WORKER_THREADS threads run tasks; with MPK_SCHEDULE_JIT one more warp per block exists and
// is a scheduler in the first num_sched blocks (idle elsewhere).
#pragma once
#include "worker.cuh"

#ifndef MPK_WORKER_THREADS
#define MPK_WORKER_THREADS 256
#endif
#ifndef MPK_SCHEDULE_JIT
#define MPK_SCHEDULE_JIT 0
#endif
#ifndef MPK_PARAMS_SMEM
#define MPK_PARAMS_SMEM 1  // the block's parameters from a shared-memory copy (below); 0: from global memory
#endif
#define MPK_BLOCK_THREADS (MPK_WORKER_THREADS + (MPK_SCHEDULE_JIT ? 32 : 0))
// MPK_MIN_BLOCKS_PER_SM (worker_index.cuh, KernelShape.blocks_per_sm): 2 caps the registers so that two blocks fit,
// and the host launches two workers per SM, each with its own tiles (two independent latency chains an SM).

extern "C" __global__ void __launch_bounds__(MPK_BLOCK_THREADS, MPK_MIN_BLOCKS_PER_SM)
mpk_megakernel(const mpk::RuntimeParams* __restrict__ params) {
  extern __shared__ float4 mpk_smem4[];
  float* smem = reinterpret_cast<float*>(mpk_smem4);
  __shared__ mpk::BlockState st;
  const int tid = threadIdx.x;
  // The block reads its parameters from a shared-memory copy. Why: every task's dispatch, signal and wait read
  // several fields (p.pass_doorbell, p.final_task, p.events, ...) on the critical path, and from global memory
  // those loads were the top long-scoreboard stalls of their lines (ncu; the activation loads evict the lines
  // from L1 between tasks). The copy: qwen3-8b -2.1%, qwen3-0.6b -6.9% a token (docs/PERF.md v0.10). The host
  // writes the struct once before the launch (session.py), so a copy taken at the start stays exact.
#if MPK_PARAMS_SMEM
  __shared__ __align__(16) mpk::RuntimeParams p_shared;
  static_assert(sizeof(mpk::RuntimeParams) % 4 == 0, "RuntimeParams is copied as 32-bit words");
  for (int i = tid; i < (int)(sizeof(mpk::RuntimeParams) / 4); i += MPK_BLOCK_THREADS)
    reinterpret_cast<uint32_t*>(&p_shared)[i] = reinterpret_cast<const uint32_t*>(params)[i];
  __syncthreads();  // every thread of the block (the jit scheduler warp too) sees the whole copy
  const mpk::RuntimeParams& p = p_shared;
#else
  const mpk::RuntimeParams& p = *params;
#endif
  if (blockIdx.x == 0 && tid == 0) mpk::st_relaxed_sys_u64(&p.step_end_ns[p.step_begin], mpk::globaltimer_ns());
  if (tid >= MPK_WORKER_THREADS) {  // the scheduler warp (jit only)
    if ((int)blockIdx.x < p.num_sched) mpk::scheduler_loop(p, blockIdx.x);
    return;
  }
  mpk::stream_reset(tid);  // shared memory starts undefined: no weight ring is primed yet
#if MPK_MIN_BLOCKS_PER_SM > 1
  if (tid == 0) st.failed = mpk::worker_index_claim(p) ? 0 : 1;  // this block's worker list (worker_index.cuh)
  mpk::worker_barrier(MPK_WORKER_THREADS);  // the worker index and st.failed, to every worker thread
  const bool run = !st.failed;
#else
  const bool run = true;
#endif
#if defined(MPK_ENTRY_PAD_BYTES) && MPK_ENTRY_PAD_BYTES > 0
  // Experiment only (docs/PERF.md v0.13): grows the entry's stack frame by this many bytes and changes nothing
  // else, to test whether the frame size alone slows the kernel. The volatile store keeps the array in local memory.
  volatile char entry_pad[MPK_ENTRY_PAD_BYTES];
  entry_pad[tid % MPK_ENTRY_PAD_BYTES] = 0;
#endif
  if (run) {
    if (MPK_SCHEDULE_JIT) mpk::worker_loop_jit(p, st, smem, tid, MPK_WORKER_THREADS);
    else mpk::worker_loop_aot(p, st, smem, tid, MPK_WORKER_THREADS);
  }
  mpk::worker_index_release(tid);
}

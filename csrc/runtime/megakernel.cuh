// The kernel entry. One block per SM: the host sizes the grid from the occupancy API and launches
// cooperatively, so every block is co-resident and no spin-wait can wait on an unscheduled block.
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
#define MPK_BLOCK_THREADS (MPK_WORKER_THREADS + (MPK_SCHEDULE_JIT ? 32 : 0))

extern "C" __global__ void __launch_bounds__(MPK_BLOCK_THREADS, 1)
mpk_megakernel(const mpk::RuntimeParams* __restrict__ params) {
  extern __shared__ float4 mpk_smem4[];
  float* smem = reinterpret_cast<float*>(mpk_smem4);
  __shared__ mpk::BlockState st;
  const mpk::RuntimeParams& p = *params;
  const int tid = threadIdx.x;
  if (blockIdx.x == 0 && tid == 0) mpk::st_relaxed_sys_u64(&p.step_end_ns[p.step_begin], mpk::globaltimer_ns());
  if (tid >= MPK_WORKER_THREADS) {  // the scheduler warp (jit only)
    if ((int)blockIdx.x < p.num_sched) mpk::scheduler_loop(p, blockIdx.x);
    return;
  }
  mpk::stream_reset(tid);  // shared memory starts undefined: no weight ring is primed yet
  if (MPK_SCHEDULE_JIT) mpk::worker_loop_jit(p, st, smem, tid, MPK_WORKER_THREADS);
  else mpk::worker_loop_aot(p, st, smem, tid, MPK_WORKER_THREADS);
}

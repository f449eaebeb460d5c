// The task's wait inside its body, after its first weight loads (MPK_LOAD_BEFORE_WAIT=1, a measurement variant,
// off by default; the record flag REC_FLAG_LOAD_BEFORE_WAIT, set by the host for batch-1 linear_residual tiles that
// wait on a narrow attention op: mpk_dist/runtime/prefetch_plan.py load_before_wait).
//
// Why: behind the 8B presets' unsplit batch-1 attention (8 tiles, ~16 us) every other SM waits with HBM idle, and
// neither L2 (hardly faster than HBM to stream from) nor shared memory (more of it shrinks the L1 the weight loads
// land in) could hold o_proj's bytes usefully (docs/PERF.md v0.30). Registers can: the tile's first round of weight
// loads (16 a lane at 512 threads: 128 KB, half of qwen3-8b's 256 KB o_proj tile) is issued, THEN the task waits,
// and after its event only the second round streams.
//
// How: the aot worker does not wait for a flagged task; the body's gemv_tile calls BodyWait once on every thread,
// after its first row group's weight loads and before any activation load (warps without rows: after the loop).
// BodyWait is the worker's own wait: thread 0 waits for the task's events (wait_task_events, which raises the
// timeout or halt error itself), records the ready time for the trace, and a block barrier hands its acquired view
// to every thread. A failed wait leaves the body's sums unused: run_and_signal stops before any signal.
#pragma once
#include "params.cuh"
#include "sync.cuh"
#include "task_record.cuh"

#ifndef MPK_LOAD_BEFORE_WAIT
#define MPK_LOAD_BEFORE_WAIT 0
#endif
#ifndef MPK_SCHEDULE_JIT
#define MPK_SCHEDULE_JIT 0
#endif

namespace mpk {

__device__ int wait_task_events(const RuntimeParams& p, const int32_t* rec, int s);  // worker.cuh

struct BodyWaitState {
  int failed;        // wait_task_events' result for the flagged task being run (0: ready)
  uint64_t t_ready;  // when its inputs were ready (trace)
};

__device__ __forceinline__ BodyWaitState& body_wait_state() {
  __shared__ BodyWaitState st;
  return st;
}

// True when the aot worker leaves record rec's wait to its body (the jit scheduler queues a task once it is ready).
__device__ __forceinline__ bool body_waits(const int32_t* rec) {
  return MPK_LOAD_BEFORE_WAIT && !MPK_SCHEDULE_JIT && (rec[REC_FLAGS] & REC_FLAG_LOAD_BEFORE_WAIT) != 0 &&
         rec[REC_OPCODE] == OP_LINEAR_RESIDUAL;
}

// The hook gemv_tile calls once on every thread (fused_gemv.cuh; NoWaitHook there is every other call's).
struct BodyWait {
  static constexpr bool kWaits = true;
  const RuntimeParams* p;
  const int32_t* rec;
  int s, tid, nt;
  __device__ __forceinline__ void operator()() const {
    if (tid == 0) {
      body_wait_state().failed = wait_task_events(*p, rec, s);
      body_wait_state().t_ready = globaltimer_ns();
    }
    worker_barrier(nt);  // thread 0's acquired view (and the result) to every thread
  }
};

}  // namespace mpk

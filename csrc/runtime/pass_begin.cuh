// Persistent passes (docs/SERVING.md "Persistent passes"): one launch of a P-step paged program runs
// up to P passes; the host posts pass s while the kernel runs, and step s's step_begin task first
// waits for it here.
//
// Protocol: the host writes the pass's inputs into the mapped stage, then (store order, x86 TSO)
// pass_doorbell[POSTED] = s + 1; it reads the pass's logits once the step epilogue published
// progress >= s + 1. Thread 0 of the step_begin block waits for the doorbell (system-scope acquire,
// bounded by pass_wait_ns) or a stop; then every thread copies the stage into the device input
// buffers (forced_tokens row s, start_pos, seq_slots, page_table, logit_rows), and step_begin runs
// as in any launch. Writing the device buffers here, not from the host, keeps one memory model: every
// task of step s reads them after this block's release of step_begin's event.
//
// Why the copy cannot clobber step s-1: the host posts pass s only after step s-1's final task, and
// every reader of these buffers in a step is an ancestor of that task (the interpreter's
// PersistentLaunch checks it on every post).
#pragma once
#include "params.cuh"
#include "sync.cuh"
#include "watchdog.cuh"

namespace mpk {

constexpr int kDoorbellPosted = 0;
constexpr int kDoorbellStop = 1;
constexpr int kPassCopyCols = 4;  // stage offset, buffer, words, destination words per step
constexpr unsigned kPassPollNs = 256;  // host posts arrive over PCIe/C2C: no point polling faster

// Returns false when the launch ends here: the host asked to stop (halt raised, no error) or posted
// nothing within pass_wait_ns (kErrPassWait recorded). Every worker thread calls it.
__device__ bool pass_begin(const RuntimeParams& p, int task, int s, int tid, int nt) {
  __shared__ int go;
  if (tid == 0) {
    go = 1;
    const uint64_t t0 = globaltimer_ns();
    for (;;) {
      if (ld_acquire_sys(&p.pass_doorbell[kDoorbellStop]) != 0) {
        atom_add_relaxed_gpu(p.halt, 1u);  // a stop, not an error: every block leaves its wait
        go = 0;
        break;
      }
      const uint32_t posted = ld_acquire_sys(&p.pass_doorbell[kDoorbellPosted]);
      if ((int32_t)(posted - (uint32_t)(s + 1)) >= 0) break;
      const uint64_t waited = globaltimer_ns() - t0;
      if (waited > p.pass_wait_ns) {
        raise_error(p.error, p.halt, kErrPassWait, task, -1, s, p.rank, posted, (uint32_t)(s + 1), waited);
        go = 0;
        break;
      }
      if (ld_relaxed_gpu(p.halt) != 0) { go = 0; break; }  // another block failed
      __nanosleep(kPassPollNs);
    }
  }
  worker_barrier(nt);
  if (!go) return false;
  // Each thread's own acquire of the doorbell orders its stage reads after the host's writes; the
  // stage is read at system scope (no L1 line of an earlier pass can answer).
  (void)ld_acquire_sys(&p.pass_doorbell[kDoorbellPosted]);
  for (int c = 0; c < p.num_pass_copies; ++c) {
    const int32_t* row = p.pass_copies + (size_t)c * kPassCopyCols;
    const int32_t* src = p.pass_stage + row[0];
    int32_t* dst = reinterpret_cast<int32_t*>(p.buf_base[row[1]]) + (size_t)row[3] * s;
    for (int i = tid; i < row[2]; i += nt) dst[i] = (int32_t)ld_relaxed_sys(reinterpret_cast<const uint32_t*>(src + i));
  }
  return true;
}

// A wait of step s that timed out while the host has not posted pass s yet is not a stall: the
// whole kernel idles between passes, and the watchdog clock restarts.
__device__ __forceinline__ bool pass_not_posted(const RuntimeParams& p, int s) {
  return p.pass_doorbell != nullptr && (int32_t)(ld_acquire_sys(&p.pass_doorbell[kDoorbellPosted]) - (uint32_t)(s + 1)) < 0
         && ld_acquire_sys(&p.pass_doorbell[kDoorbellStop]) == 0;
}

}  // namespace mpk

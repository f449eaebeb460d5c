// Step epilogue, run by the block that executed argmax_select of step s (the "final task"), after
// the task and before it signals: mark sequences that produced a stop id, dump logits if asked,
// stamp the step's end time, publish progress to the host (mapped pinned memory, system-scope
// release) and decide whether the run ends here (max tokens, every sequence stopped, last step).
// Token feeding is the graph's own step_begin task (forced_tokens rows hold the prompt and any
// teacher-forced ids), so this only observes. Mirrors StepBackend.generate (backends/base.py).
#pragma once
#include "params.cuh"
#include "sync.cuh"

namespace mpk {

// Returns true when the run ends after step s (the caller raises the halt flag).
__device__ bool step_epilogue(const RuntimeParams& p, int s, int tid, int nt) {
  const int gen = s - (p.prompt_len - 1);  // index of the generated token this step produced
  const int B = p.batch;
  if (gen >= 0) {
    for (int b = tid; b < B; b += nt)
      for (int i = 0; i < p.num_stop; ++i)
        if (p.next_token[b] == p.stop_ids[i]) p.done[b] = 1;
    if (p.logits_dump != nullptr) {
      const size_t n = (size_t)B * p.vocab;
      float* dst = p.logits_dump + (size_t)gen * n;
      for (size_t i = tid; i < n; i += nt) dst[i] = p.logits[i];
    }
  }
  worker_barrier(nt);
  __shared__ int stop;
  if (tid == 0) {
    bool end = gen >= p.max_new_tokens - 1 || s + 1 >= p.step_end;
    if (gen >= 0 && p.stop_on_done) {
      bool all_done = true;
      for (int b = 0; b < B; ++b) all_done = all_done && p.done[b] != 0;
      end = end || all_done;
    }
    st_relaxed_sys_u64(&p.step_end_ns[s + 1], globaltimer_ns());
    fence_acq_rel_sys();  // token_out row s (written by this block's argmax_select) and the stamp first
    st_release_sys(&p.progress[0], (uint32_t)(s + 1));  // the host streams tokens up to row s
    stop = end;
  }
  worker_barrier(nt);
  return stop != 0;
}

}  // namespace mpk

// Phase marks: a task body stamps up to kTraceMarks points of its run (thread 0; right after a block
// barrier, the point every thread has got to, else thread 0's own progress); the worker writes them into the task's trace record as ns after
// its inputs were ready (TraceRecord::mark_ns, 0 where the body set none). Why: the trace gives one run
// time per task, and inside a fused tile (prep, walk, merge, ticket) that number does not say which
// part to work on. Two shared-memory words and a timer read per mark: cheap enough to stay on.
#pragma once
#include <stdint.h>
#include "params.cuh"
#include "sync.cuh"

namespace mpk {

__device__ __forceinline__ uint64_t* trace_marks() {
  __shared__ uint64_t marks[kTraceMarks];
  return marks;
}

// Thread 0 before the body (the same thread reads them back: no barrier needed).
__device__ __forceinline__ void trace_marks_clear(int tid) {
  if (tid == 0)
    for (int k = 0; k < kTraceMarks; ++k) trace_marks()[k] = 0;
}

__device__ __forceinline__ void trace_mark(int k, int tid) {
  if (tid == 0) trace_marks()[k] = globaltimer_ns();
}

}  // namespace mpk

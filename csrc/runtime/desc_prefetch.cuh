// Descriptor prefetch (MPK_DESC_PREFETCH=1): while thread 0 spins on a task's events, warp 1
// pulls the rest of that task's descriptors (argument pointers, parameters, signal rows and the
// signalled events' rows) and the NEXT task's row and wait rows into L1, so the run and signal
// phases -- and the next wait -- read them at L1 latency instead of one dependent L2 round trip
// each (the trace shows ~4.7 us for a 32-element add task: mostly such round trips).
// Only prefetch hints and plain loads of read-only tables: no effect on any result.
#pragma once
#include "abi_generated.h"
#include "params.cuh"

#ifndef MPK_DESC_PREFETCH
#define MPK_DESC_PREFETCH 0
#endif

namespace mpk {

constexpr int kDescWarpFirstThread = 32;  // warp 1: warp 0 holds thread 0, the one that waits
constexpr int kIntsPerLine = 32;          // 128-byte L1 lines of int32 / 16 lines of 8-byte pointers

__device__ __forceinline__ void prefetch_l1(const void* ptr) { asm volatile("prefetch.global.L1 [%0];" ::"l"(ptr)); }

// Lane `lane` of warp 1 touches the lines of one int32 range [begin, end) of `table` (row width w).
__device__ __forceinline__ void prefetch_rows(const int32_t* table, int begin, int end, int w, int lane) {
  for (int i = begin * w + lane * kIntsPerLine; i < end * w; i += 32 * kIntsPerLine) prefetch_l1(table + i);
}

// Called by every worker thread before the wait of `task`; `next` points at the following entry of
// this worker's static task list (nullptr: none, or unknown as in the jit schedule).
__device__ __forceinline__ void prefetch_descriptors(const RuntimeParams& p, int task, const int32_t* next_entry,
                                                     int tid) {
  if (!MPK_DESC_PREFETCH || tid < kDescWarpFirstThread || tid >= kDescWarpFirstThread + 32) return;
  const int lane = tid - kDescWarpFirstThread;
  const int32_t* row = p.tasks + (size_t)task * TASK_NUM_COLS;
  const int a0 = row[TASK_COL_ARG_BEGIN], a1 = row[TASK_COL_ARG_END];
  for (int i = a0 + lane * 16; i < a1; i += 32 * 16) prefetch_l1(p.arg_addr + i);  // 8-byte entries
  prefetch_rows(p.params, row[TASK_COL_PARAM_BEGIN], row[TASK_COL_PARAM_END], 1, lane);
  const int s0 = row[TASK_COL_SIGNAL_BEGIN], s1 = row[TASK_COL_SIGNAL_END];
  for (int k = s0 + lane; k < s1; k += 32) {  // the signal rows and their events' scope/trigger rows
    const int e = p.signals[(size_t)k * SIGNAL_NUM_COLS + SIGNAL_COL_EVENT];
    prefetch_l1(p.event_tab + (size_t)e * EVENT_NUM_COLS);
  }
  if (next_entry == nullptr) return;
  const int next = *next_entry;
  const int32_t* nrow = p.tasks + (size_t)next * TASK_NUM_COLS;
  if (lane == 0) prefetch_l1(nrow);
  const int w0 = nrow[TASK_COL_WAIT_BEGIN], w1 = nrow[TASK_COL_WAIT_END];
  for (int k = w0 + lane; k < w1; k += 32) {  // the next wait's rows and its events' rows
    const int e = p.waits[(size_t)k * WAIT_NUM_COLS + WAIT_COL_EVENT];
    prefetch_l1(p.event_tab + (size_t)e * EVENT_NUM_COLS);
  }
}

}  // namespace mpk

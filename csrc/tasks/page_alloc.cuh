// page_alloc (mpk_dist/taskgraph/tasks/page_alloc.py): the paged KV cache's page allocator, one task
// per step right after step_begin (docs/SERVING.md "The device free list"). State in device buffers:
// free_pages [NP] (a stack, entries [0, num_free) free), num_free [1], table [MB, MP] (-1 = none),
// used [MB] (pages each slot holds), owner [NP] (slot of each page, -1 = free). Per pass:
//  1. slots with release[s] != 0 push their pages (column order) and clear their rows, slot order;
//  2. each slot pops pages (top of the stack first) until it holds its highest position in the pass
//     + 1 in pages, slot order.
// The same rule as the CPU reference and serving.pages.PagePool, so every TP rank computes the same
// page ids from the same inputs without talking. One block: thread 0 plans the stack positions of
// every slot from shared memory (serial over MB <= 256 slots, so the order is the rule's), then all
// threads move the pages of (slot, column) pairs in parallel; each page goes to one known place, so
// no atomics on global memory are needed.
//
// Memory: everything read here was written by the previous step's page_alloc (ordered through
// step_begin's wait on the previous step's final task) or by the host before the launch; every
// reader of the table this step waits on this task's signal. Inside the block, worker barriers order
// the phases (a page pushed in phase 3 may be popped in phase 4 by another thread).
//
// Faults return a PageFault whose code is a watchdog ErrorCode (kErrPagesExhausted: the stack runs
// dry; kErrPageRelease: a release of a slot holding no pages or of a page it does not own, i.e. a
// page released twice; kErrPageTableFull: a slot past its page-table row). The dispatch case records
// it in the error record; the host names it (mpk_dist/runtime/diagnosis.py).
#pragma once
#include <limits.h>
#include "common.cuh"
#include "watchdog.cuh"

namespace mpk {

struct PageFault {
  uint32_t code;     // kErrNone or a page ErrorCode
  int slot;          // the slot concerned (the record's event_id)
  int seen;          // empty: free pages; release: the page id (-1: none held); too long: pages needed
  int expected;      // empty: pages needed; release: the page's owner (-1: free); too long: MP
};

// Shared scratch: a header (fault code, slot, seen, expected, first bad (slot, column) index), then
// need [MB], held [MB], push [MB], pop [MB], token slots [B], token positions [B].
constexpr int kPageHeaderWords = 8;  // tasks/page_alloc.py HEADER_WORDS
constexpr int kPageFaultBadAt = 4;   // header word: flattened index of the first bad table entry

// int32 words of shared memory the body uses (tables.smem_bytes reserves them).
__device__ __forceinline__ int page_alloc_smem_words(int B, int MB) { return kPageHeaderWords + 4 * MB + 2 * B; }

// The fault of table entry i = s * MP + j (page pg) found in a parallel phase: released slot s does
// not own pg, or popped page pg is still owned.
__device__ __forceinline__ PageFault page_entry_fault(const int32_t* owner, int NP, int s, int pg) {
  return PageFault{kErrPageRelease, s, pg, (pg >= 0 && pg < NP) ? owner[pg] : -1};
}

// Phase 2 on thread 0: stack positions per slot (push: first free-stack index of a released slot's
// pages, -1 = kept; pop: stack height before its pops, -1 = none), in slot order. Returns the fault
// of the first slot that cannot be served; *nf is the stack height after the pass.
__device__ PageFault page_plan(const int32_t* release, const int32_t* table, const int32_t* owner, const int* need,
                               const int* held, int* push, int* pop, int* nf, int MB, int MP, int NP) {
  int top = *nf;
  for (int s = 0; s < MB; ++s) {
    push[s] = -1;
    if (release[s] == 0) continue;
    if (held[s] == 0) return PageFault{kErrPageRelease, s, -1, -1};  // nothing to release: released twice
    if (top + held[s] > NP) return page_entry_fault(owner, NP, s, table[(size_t)s * MP]);  // more than exist
    push[s] = top;
    top += held[s];
  }
  for (int s = 0; s < MB; ++s) {
    pop[s] = -1;
    const int have = push[s] >= 0 ? 0 : held[s];
    if (need[s] > MP) return PageFault{kErrPageTableFull, s, need[s], MP};
    if (need[s] - have > top) return PageFault{kErrPagesExhausted, s, top, need[s] - have};
    if (need[s] > have) {
      pop[s] = top;
      top -= need[s] - have;
    }
  }
  *nf = top;
  return PageFault{kErrNone, -1, 0, 0};
}

__device__ __forceinline__ PageFault page_fault_of(const int* hdr) {
  return PageFault{(uint32_t)hdr[0], hdr[1], hdr[2], hdr[3]};
}

// The whole task on the worker threads; the result is the same on every thread (read from shared
// memory after a barrier). `sm`: page_alloc_smem_words(B, MB) words of shared memory.
__device__ PageFault page_alloc(const int32_t* release, const int32_t* pos, const int32_t* slots, int32_t* free_pages,
                                int32_t* num_free, int32_t* table, int32_t* used, int32_t* owner, int B, int MB, int MP,
                                int NP, int P, int* sm, int tid, int nt) {
  int* hdr = sm;
  int* need = sm + kPageHeaderWords;
  int* held = need + MB;
  int* push = held + MB;
  int* pop = push + MB;
  int* tslot = pop + MB;
  int* tpos = tslot + B;
  if (tid == 0) {
    hdr[0] = kErrNone;
    hdr[kPageFaultBadAt] = INT_MAX;
  }
  for (int b = tid; b < B; b += nt) {
    tslot[b] = slots[b];
    tpos[b] = pos[b];
  }
  for (int s = tid; s < MB; s += nt) held[s] = used[s];
  worker_barrier(nt);  // tokens and counts staged
  // 1. pages each slot needs after the pass: its highest position + 1, in pages (0: no token)
  for (int s = tid; s < MB; s += nt) {
    int last = -1;
    for (int b = 0; b < B; ++b)
      if (tslot[b] == s && tpos[b] > last) last = tpos[b];
    need[s] = last < 0 ? 0 : last / P + 1;
  }
  worker_barrier(nt);  // every slot's need is in
  // 2. the plan, in slot order (thread 0 alone: the order is the rule)
  int nf = 0;
  if (tid == 0) {
    nf = *num_free;
    const PageFault f = page_plan(release, table, owner, need, held, push, pop, &nf, MB, MP, NP);
    hdr[0] = (int)f.code;
    hdr[1] = f.slot;
    hdr[2] = f.seen;
    hdr[3] = f.expected;
  }
  worker_barrier(nt);  // the plan (or its fault) is visible to every thread
  if (hdr[0] != kErrNone) return page_fault_of(hdr);
  // 3. releases: page j of released slot s to stack index push[s] + j
  for (int i = tid; i < MB * MP; i += nt) {
    const int s = i / MP, j = i - s * MP;
    if (push[s] < 0 || j >= held[s]) continue;
    const int pg = table[i];
    if (pg < 0 || pg >= NP || owner[pg] != s) {
      atom_min_shared(&hdr[kPageFaultBadAt], i);  // the first bad entry wins: the same report every run
      continue;
    }
    free_pages[push[s] + j] = pg;
    owner[pg] = -1;
    table[i] = -1;
  }
  worker_barrier(nt);  // pushed pages and cleared owners are visible to the poppers
  if (hdr[kPageFaultBadAt] != INT_MAX) {
    const int i = hdr[kPageFaultBadAt];
    return page_entry_fault(owner, NP, i / MP, table[i]);
  }
  // 4. allocations: column j >= have of slot s takes stack index pop[s] - 1 - (j - have)
  for (int i = tid; i < MB * MP; i += nt) {
    const int s = i / MP, j = i - s * MP;
    const int have = push[s] >= 0 ? 0 : held[s];
    if (pop[s] < 0 || j < have || j >= need[s]) continue;
    const int pg = free_pages[pop[s] - 1 - (j - have)];
    if (pg < 0 || pg >= NP || owner[pg] != -1) {  // a page on the stack twice, or a corrupt stack
      atom_min_shared(&hdr[kPageFaultBadAt], i);
      continue;
    }
    owner[pg] = s;
    table[i] = pg;
  }
  for (int s = tid; s < MB; s += nt) {
    if (pop[s] >= 0) used[s] = need[s];
    else if (push[s] >= 0) used[s] = 0;
  }
  if (tid == 0) *num_free = nf;
  worker_barrier(nt);  // every report is in before anyone reads the verdict
  if (hdr[kPageFaultBadAt] != INT_MAX) {
    const int i = hdr[kPageFaultBadAt], s = i / MP, j = i - s * MP;
    const int have = push[s] >= 0 ? 0 : held[s];
    return page_entry_fault(owner, NP, s, free_pages[pop[s] - 1 - (j - have)]);
  }
  return PageFault{kErrNone, -1, 0, 0};
}

}  // namespace mpk

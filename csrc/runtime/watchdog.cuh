// Watchdog: what a timed-out spin-wait leaves for the host, and how every block learns to exit.
//
// The error record lives in mapped pinned host memory so the host can read it while (or after) the
// kernel runs. The first block to fail claims it with a CAS on `code`; it then fills the fields and
// publishes them with a system-scope release on `valid`. Every block polls the abort flag (device
// memory) inside its spin-waits and between tasks, so one failure makes the whole grid exit.
#pragma once
#include <stdint.h>
#include "sync.cuh"

namespace mpk {

__device__ __forceinline__ int worker_index();  // worker_index.cuh: the worker a block runs

enum ErrorCode : uint32_t {
  kErrNone = 0,
  kErrTimeout = 1,      // a wait on an event did not complete in time
  kErrQueueFull = 2,    // a jit worker queue overflowed (a runtime bug, never a user error)
  kErrBadTask = 3,      // a task id or kind out of range (corrupt task table)
  kErrInjected = 4,     // raised on purpose by the fault-injection test hook
  kErrPassWait = 5,     // persistent passes: the host posted no pass for step_begin within pass_wait_ns
  // page_alloc (tasks/page_alloc.cuh): event_id holds the slot, seen / expected the numbers below
  kErrPagesExhausted = 6,  // the free-page stack ran dry (seen: free pages, expected: pages needed)
  kErrPageRelease = 7,     // a page released twice (seen: page id, -1 = none held; expected: its owner)
  kErrPageTableFull = 8,   // a slot's position is past its page-table row (seen: pages needed, expected: MP)
  // flagged words (csrc/tasks/flag_words.cuh): event_id holds the element of the task's input whose word stayed
  // behind, seen / expected its tag and the step's
  kErrFlagWait = 9,
  kErrPairWait = 10,  // two blocks per SM (worker_index.cuh): an SM's other block never published its worker
};

// Layout mirrored by mpk_dist/runtime/params.py (ERROR_FIELDS); the generated source static_asserts it.
struct ErrorRecord {
  uint32_t code;      // ErrorCode; claimed by the first failing block with a CAS
  uint32_t valid;     // 1 once every field below is written (system-scope release)
  int32_t task_id;    // the task that was waiting (or -1)
  int32_t event_id;   // the event it waited on (or -1)
  int32_t step;       // decode step of the wait
  int32_t sm_id;      // %smid of the waiting block
  int32_t worker;     // worker (worker_index.cuh) of the waiting block
  int32_t rank;       // TP rank of this kernel
  uint32_t seen;      // the counter value last read
  uint32_t expected;  // the threshold it waited for
  uint64_t elapsed_ns;
  // A wait on a system-scope event (signalled by every rank): the first rank whose signal tally
  // for that event is short, read from its symmetric region (-1: none short, or a local event).
  int32_t peer;
  uint32_t peer_sent;      // the signals that rank had sent for the event
  uint32_t peer_expected;  // the signals it should have sent by the waited step
  uint32_t pad0;
};

// Who a timed-out wait on a peer-signalled event is waiting for (see find_short_peer, worker.cuh).
struct PeerShortfall {
  int32_t peer = -1;
  uint32_t sent = 0;
  uint32_t expected = 0;
};

// Record the first failure and raise the abort flag. Called by ONE thread of the failing block.
__device__ inline void raise_error(ErrorRecord* rec, uint32_t* halt, uint32_t code, int task_id, int event_id,
                                   int step, int rank, uint32_t seen, uint32_t expected, uint64_t elapsed_ns,
                                   PeerShortfall peer = PeerShortfall()) {
  if (atom_cas_acq_rel_sys(&rec->code, kErrNone, code) == kErrNone) {
    rec->task_id = task_id;
    rec->event_id = event_id;
    rec->step = step;
    rec->sm_id = (int32_t)smid();
    rec->worker = (int32_t)worker_index();
    rec->rank = rank;
    rec->seen = seen;
    rec->expected = expected;
    rec->elapsed_ns = elapsed_ns;
    rec->peer = peer.peer;
    rec->peer_sent = peer.sent;
    rec->peer_expected = peer.expected;
    st_release_sys(&rec->valid, 1u);  // release: the fields above are visible to the host first
  }
  // Relaxed is enough for the flag: it only tells other blocks to stop; they read nothing we wrote.
  atom_add_relaxed_gpu(halt, 1u);
}

}  // namespace mpk

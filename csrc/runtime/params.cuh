// RuntimeParams: what the persistent kernel reads. The task graph itself is the ABI's tables
// (mpk_dist/taskgraph/abi.py, copied to the device as is); the rest is runtime state owned by
// mpk_dist/runtime (buffer pointers, jit queues, step control, watchdog, trace).
// Layout mirrored by mpk_dist/runtime/params.py (PARAM_FIELDS); the generated source
// static_asserts every offset against it, so a mismatch fails the build, never a run.
#pragma once
#include <stdint.h>
#include "task_record.cuh"
#include "watchdog.cuh"

namespace mpk {

constexpr int kTraceMarks = 6;  // phase marks a task body may set (trace_mark, worker.cuh)

// One trace record per executed task (56 bytes); written by thread 0 of the worker block.
// start_ns: the worker turned to the task (aot: before its waits; jit: before the queue pop);
// wait_ns: until its inputs were ready; run_ns: from then to the end of its signals.
struct TraceRecord {
  uint32_t task_id;
  uint32_t step;
  uint64_t start_ns;
  uint32_t wait_ns;  // turning to the task -> its inputs ready (includes prep_ns)
  uint32_t run_ns;   // inputs ready -> signalled (includes post_ns)
  uint32_t prep_ns;  // turning to the task -> its weight prefetch and descriptor prefetch issued (aot)
  uint32_t post_ns;  // body done -> barrier, step epilogue, signals (and a ring drain) done
  uint32_t mark_ns[kTraceMarks];  // inputs ready -> the body's phase mark k (0: the body set none)
};

struct RuntimeParams {
  // ---- the ABI tables (int32 unless noted), exactly as the task-graph compiler wrote them ----
  const int32_t* tasks;           // [T, TASK_NUM_COLS]
  const int32_t* event_tab;       // [E, EVENT_NUM_COLS]
  const int32_t* waits;           // [NW, WAIT_NUM_COLS]
  const int32_t* signals;         // [NS, SIGNAL_NUM_COLS]
  const int32_t* args;            // [NA, ARG_NUM_COLS]
  const int32_t* params;          // [NP]
  const int64_t* buffers;         // [NB, BUFFER_NUM_COLS] (int64)
  const int32_t* worker_offsets;  // [W + 1]
  const int32_t* worker_tasks;    // [T]
  // ---- memory ---------------------------------------------------------------------------
  const uint64_t* buf_base;       // [NB] device address of buffer b on this rank (0 = none)
  const uint64_t* peer_base;      // [WORLD, NB] buffer b on rank r (symmetric buffers; remote args)
  const uint64_t* peer_events;    // [WORLD] address of rank r's event counters (start of its symmetric region)
  const int32_t* peer_quota;      // [E] SIG_ALL_RANKS signallers of event e per step on ONE rank (watchdog)
  uint32_t* events;               // [2E] this rank's counters, then its signal tallies (zeroed before a
                                  //      generation): events[E + e] = ALL_RANKS signals this rank sent to e
  // ---- jit scheduling (built by mpk_dist/runtime/tables.py) -----------------------------
  const int32_t* dep_ptr;         // [E + 1] waits on event e: dep_task/dep_offset[dep_ptr[e]..]
  const int32_t* dep_task;        // [NW]
  const int32_t* dep_offset;      // [NW] the wait's STEP_OFFSET
  uint32_t* launched;             // [T]  steps for which task t was queued (claimed by CAS)
  uint32_t* queues;               // [W, queue_cap, 4] worker rings: (seq, task, step, -)
  uint32_t* queue_tail;           // [W]
  uint32_t* sched_queues;         // [num_sched, sched_cap, 4] scheduler rings: (seq, event, step, -)
  uint32_t* sched_tail;           // [num_sched]
  // ---- step control -------------------------------------------------------------------------
  const int32_t* next_token;      // [B] written by argmax_select
  const int32_t* token_out;       // [MAX_STEPS, B] written by argmax_select (mapped pinned)
  const float* logits;            // [B, V] this rank's logits of the current step
  const int32_t* stop_ids;        // [num_stop]
  int32_t* done;                  // [B] 1 once a sequence produced a stop id
  float* logits_dump;             // [max_new, B, V] or nullptr
  uint64_t* step_end_ns;          // [MAX_STEPS + 1] mapped pinned: [0] start, [s+1] end of step s
  uint32_t* progress;             // [2] mapped pinned: [0] steps finished, [1] steps begun (unused)
  uint32_t* halt;                 // [1] device: > 0 makes every block exit (stop or error)
  ErrorRecord* error;             // mapped pinned
  TraceRecord* trace;             // [W, trace_cap] or nullptr
  uint32_t* trace_len;            // [W]
  // ---- persistent passes (pass_begin.cuh; all null unless the host serves passes into one launch) ----
  const uint32_t* pass_doorbell;  // [2] mapped pinned: [0] passes posted by the host, [1] stop (non-zero)
  const int32_t* pass_stage;      // mapped pinned int32 words: the posted pass's inputs
  const int32_t* pass_copies;     // [num_pass_copies, PASS_COPY_COLS]: stage word offset, buffer, words,
                                  //     destination words added per step (forced_tokens row s)
  // ---- task records (task_record.cuh, built by mpk_dist/runtime/task_records.py) ---------------
  const int32_t* records;         // [T, REC_WORDS] in aot worker order: records[i] describes worker_tasks[i]
  const int32_t* task_rec;        // [T] the record row of task t (jit)
  // ---- scalars ------------------------------------------------------------------------------
  uint64_t timeout_ns;
  uint64_t pass_wait_ns;           // how long step_begin waits for the host to post its pass
  int32_t num_tasks, num_events, num_workers, num_buffers;
  int32_t world, rank;
  int32_t final_task;             // the argmax_select task; its block runs the step epilogue
  int32_t batch, vocab;
  int32_t prompt_len;             // steps 0..prompt_len-1 feed the prompt; later ones generate
  int32_t max_new_tokens;
  int32_t num_stop;
  int32_t stop_on_done;           // 0 under teacher forcing (run all max_new_tokens steps)
  int32_t step_begin, step_end;   // steps [step_begin, step_end) run in this launch
  int32_t queue_cap, sched_cap, num_sched;
  int32_t trace_cap;
  int32_t inject_hang_task;       // test hook: this task never signals (-1 = off)
  int32_t abi_version;
  int32_t trace_from;             // trace records only for steps >= trace_from
  int32_t num_pass_copies;
};

}  // namespace mpk

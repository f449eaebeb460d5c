// The persistent worker loop: one worker block per SM, in one of two schedules.
//  * aot: each block walks its static list (worker_tasks) for every step and waits on each
//    task's events itself with bounded spin-waits; no scheduler involved.
//  * jit: scheduler warps (one extra warp in each of the first num_sched blocks) receive completed
//    (event, step) pairs, check each dependent task's waits and push ready tasks onto the queue
//    of the block that owns the task (tasks[t, WORKER]); workers pop and run.
// Both share run_and_signal(): run -> barrier -> [epilogue] -> signal.
#pragma once
#include "dispatch.cuh"
#include "params.cuh"
#include "pass_begin.cuh"
#include "step.cuh"
#include "sync.cuh"
#include "task_record.cuh"
#include "watchdog.cuh"
#include "worker_index.cuh"

namespace mpk {

struct BlockState {  // shared memory, written by thread 0, read by all after a worker barrier
  int failed;
  int task;
  int step;
};

// Threshold of wait row `wait_row` at step s: (s + 1 + offset) * triggers (0 when <= 0). `mult`
// (optional) receives s + 1 + offset, the number of steps' worth of signals the wait needs.
__device__ __forceinline__ uint32_t wait_target(const RuntimeParams& p, int wait_row, int s, int* event,
                                                int* mult_out = nullptr) {
  const int32_t* w = p.waits + (size_t)wait_row * WAIT_NUM_COLS;
  const int e = w[WAIT_COL_EVENT];
  *event = e;
  const int mult = s + 1 + w[WAIT_COL_STEP_OFFSET];
  if (mult_out != nullptr) *mult_out = mult;
  return mult <= 0 ? 0u : (uint32_t)mult * (uint32_t)p.event_tab[(size_t)e * EVENT_NUM_COLS + EVENT_COL_TRIGGERS];
}

__device__ __forceinline__ bool event_is_system(const RuntimeParams& p, int e) {
  return p.event_tab[(size_t)e * EVENT_NUM_COLS + EVENT_COL_SCOPE] == EV_SCOPE_SYSTEM;
}

// After a timed-out wait on event e needing `mult` steps' worth of signals: the first rank whose
// tally of ALL_RANKS signals to e (events[E + e] in ITS symmetric region, read through the peer
// table) is short of mult * peer_quota[e]; another rank is preferred over this one. The tallies are
// diagnostic (relaxed); by the time a wait has timed out, anything sent long ago is visible.
__device__ PeerShortfall find_short_peer(const RuntimeParams& p, int e, int mult) {
  PeerShortfall out;
  if (p.peer_quota == nullptr || mult <= 0 || !event_is_system(p, e)) return out;
  const uint32_t need = (uint32_t)mult * (uint32_t)p.peer_quota[e];
  if (need == 0) return out;
  for (int r = 0; r < p.world; ++r) {
    const uint32_t* tally = reinterpret_cast<const uint32_t*>(p.peer_events[r]) + p.num_events + e;
    const uint32_t sent = ld_relaxed_sys(tally);
    if ((int32_t)(sent - need) < 0 && (out.peer < 0 || out.peer == p.rank)) {
      out.peer = r;
      out.sent = sent;
      out.expected = need;
    }
  }
  return out;
}

// True when the final task (argmax_select) of step s - 1 has signalled its first event.
__device__ bool previous_step_done(const RuntimeParams& p, int s) {
  const int32_t* row = p.tasks + (size_t)p.final_task * TASK_NUM_COLS;
  if (row[TASK_COL_SIGNAL_BEGIN] == row[TASK_COL_SIGNAL_END]) return true;
  const int e = p.signals[(size_t)row[TASK_COL_SIGNAL_BEGIN] * SIGNAL_NUM_COLS + SIGNAL_COL_EVENT];
  const uint32_t trig = (uint32_t)p.event_tab[(size_t)e * EVENT_NUM_COLS + EVENT_COL_TRIGGERS];
  return (int32_t)(ld_relaxed_gpu(&p.events[e]) - (uint32_t)s * trig) >= 0;
}

// Thread 0: wait until event e reaches `target` (`mult` steps' worth of signals) for `task` at step s.
// 0 = ready, 1 = timed out (recorded), 2 = halt.
__device__ int wait_event(const RuntimeParams& p, int task, int e, int mult, uint32_t target, bool sys, int s) {
  if (target == 0) return 0;  // threshold <= 0: met at once (host-initialised state)
  uint32_t seen = 0;
  const uint64_t t0 = globaltimer_ns();
  int r;
  for (int round = 0;; ++round) {
    // acquire (gpu or sys scope): pairs with the signallers' release adds on this counter
    r = sys ? spin_wait_geq_sys(&p.events[e], target, p.timeout_ns, p.halt, &seen)
            : spin_wait_geq_gpu(&p.events[e], target, p.timeout_ns, p.halt, &seen);
    // A worker that ran ahead into step s while step s-1 is still unfinished is not where the
    // stall is: give the workers of the earlier step a few rounds to report it.
    if (r == 1 && pass_not_posted(p, s)) { round = -1; continue; }  // idle host: not a stall (pass_begin.cuh)
    if (r != 1 || round >= 3 || s == 0 || previous_step_done(p, s)) break;
  }
  if (r == 1)
    raise_error(p.error, p.halt, kErrTimeout, task, e, s, p.rank, seen, target, globaltimer_ns() - t0,
                find_short_peer(p, e, mult));
  return r;
}

// Thread 0: wait for every event of the task of record `rec` at step s (its waits from the record,
// or from the tables when it has more than a record holds). 0 = ready, 1 = timed out, 2 = halt.
__device__ int wait_task_events(const RuntimeParams& p, const int32_t* rec, int s) {
  const int task = rec[REC_TASK];
  if (rec[REC_FLAGS] & REC_FLAG_WAITS_INLINE) {
    for (int k = 0; k < rec[REC_NWAITS]; ++k) {
      const int32_t* w = rec + REC_WAITS + k * REC_WAIT_COLS;  // event, step offset, triggers, scope
      const int mult = s + 1 + w[1];
      const uint32_t target = mult <= 0 ? 0u : (uint32_t)mult * (uint32_t)w[2];
      if (const int r = wait_event(p, task, w[0], mult, target, w[3] == EV_SCOPE_SYSTEM, s)) return r;
    }
    return 0;
  }
  const int32_t* row = p.tasks + (size_t)task * TASK_NUM_COLS;
  for (int k = row[TASK_COL_WAIT_BEGIN]; k < row[TASK_COL_WAIT_END]; ++k) {
    int e, mult;
    const uint32_t target = wait_target(p, k, s, &e, &mult);
    if (const int r = wait_event(p, task, e, mult, target, event_is_system(p, e), s)) return r;
  }
  return 0;
}

// True when every wait of `task` at step s is met (jit scheduler; acquire loads).
__device__ bool task_ready(const RuntimeParams& p, int task, int s) {
  const int32_t* row = p.tasks + (size_t)task * TASK_NUM_COLS;
  for (int k = row[TASK_COL_WAIT_BEGIN]; k < row[TASK_COL_WAIT_END]; ++k) {
    int e;
    const uint32_t target = wait_target(p, k, s, &e);
    if (target == 0) continue;
    const uint32_t v = event_is_system(p, e) ? ld_acquire_sys(&p.events[e]) : ld_acquire_gpu(&p.events[e]);
    if ((int32_t)(v - target) < 0) return false;
  }
  return true;
}

// t0: turned to the task; t_prep: prefetches issued (== t0 where there are none); t_ready: inputs
// ready; t_body: body done (before the barrier, epilogue and signals); now: all of it done.
__device__ __forceinline__ void trace_record(const RuntimeParams& p, int& n, int task, int s, uint64_t t0,
                                             uint64_t t_prep, uint64_t t_ready, uint64_t t_body) {
  if (p.trace != nullptr && n < p.trace_cap) {
    const uint64_t now = globaltimer_ns();
    TraceRecord r{(uint32_t)task, (uint32_t)s, t0, (uint32_t)(t_ready - t0), (uint32_t)(now - t_ready),
                  (uint32_t)(t_prep - t0), (uint32_t)(now - t_body), {}};
    for (int k = 0; k < kTraceMarks; ++k) {
      const uint64_t m = trace_marks()[k];
      r.mark_ns[k] = m > t_ready ? (uint32_t)(m - t_ready) : 0u;
    }
    p.trace[(size_t)worker_index() * p.trace_cap + n] = r;
  }
  ++n;
}

// Push (a, b) into a ring of `cap` 4-word slots whose claim counter is `tail` (multi-producer).
__device__ __forceinline__ void ring_push(uint32_t* q, uint32_t* tail, int cap, uint32_t a, uint32_t b) {
  const uint32_t idx = atom_add_relaxed_gpu(tail, 1u);  // claim a slot; ordering comes from the release
  uint32_t* slot = q + (size_t)(idx % (uint32_t)cap) * 4;
  slot[1] = a;
  slot[2] = b;
  st_release_gpu(&slot[0], idx + 1u);  // release: the payload is visible before the sequence number
}

// Pop slot `head` of a ring (single consumer): 0 ok, 1 timeout, 2 halt.
__device__ __forceinline__ int ring_pop(const RuntimeParams& p, uint32_t* q, int cap, uint32_t head, uint32_t& a,
                                        uint32_t& b) {
  uint32_t* slot = q + (size_t)(head % (uint32_t)cap) * 4;
  uint32_t seen;
  const int r = spin_wait_geq_gpu(&slot[0], head + 1u, p.timeout_ns, p.halt, &seen);  // acquire the slot
  if (r == 0) { a = slot[1]; b = slot[2]; }
  return r;
}

// One signal of a finished task: +1 on event e (this rank's counter, at gpu or system scope, or every
// rank's); returns this rank's counter before the add (kNeedOld: the jit schedule), else 0. The caller
// fenced the block's writes first (fence.acq_rel of the signal's scope).
template <bool kNeedOld>
__device__ __forceinline__ uint32_t signal_event(const RuntimeParams& p, int e, int kind) {
  if (kind == SIG_KIND_ALL_RANKS) {
    uint32_t old = 0;
    for (int r = 0; r < p.world; ++r) {  // release at system scope on every rank's counter
      const uint32_t o = atom_add_release_sys(reinterpret_cast<uint32_t*>(p.peer_events[r]) + e, 1u);
      if (r == p.rank) old = o;
    }
    // Diagnostic tally in this rank's region (peers read it when their wait on e times out, to
    // name the rank whose signals are missing); after the releases, so it never over-reports.
    red_add_relaxed_sys(&p.events[p.num_events + e], 1u);
    return old;
  }
  if (!kNeedOld) {  // fence + relaxed add = release (sync.cuh); no wait for the add's round trip
    if (kind == SIG_KIND_SYSTEM) red_add_relaxed_sys(&p.events[e], 1u);
    else red_add_relaxed_gpu(&p.events[e], 1u);
    return 0;
  }
  if (kind == SIG_KIND_SYSTEM) return atom_add_release_sys(&p.events[e], 1u);
  return atom_add_release_gpu(&p.events[e], 1u);  // release: waiters acquire this counter
}

// MPK_POST_FENCE_MARK k >= 0 (a measurement build; -1, none, by default): every task stamps trace mark k when the
// fence after its body is done, so the trace splits its post (post_ns) into the fence and the signals. Pick a mark
// the bodies of interest leave unset (the unsplit attention tile sets 0, 1, 4 and 5; a GEMV tile none without
// MPK_GEMV_MARKS). Why: the unsplit attention tile's post is 1.6-1.8 us against the linear tiles' 0.74
// (docs/PERF.md v0.39), with one signal each.
#ifndef MPK_POST_FENCE_MARK
#define MPK_POST_FENCE_MARK -1
#endif

// Run a ready task on all worker threads, then publish its completion (signals). The final task's
// block runs the step epilogue first; when the run ends there, it raises the halt flag.
template <bool kJit>
__device__ bool run_and_signal(const RuntimeParams& p, const int32_t* rec, int s, float* smem, int tid, int nt,
                               uint64_t* t_body) {
  const int task = rec[REC_TASK];
  // Persistent passes: step_begin first waits for the host's pass s and copies it in (pass_begin.cuh).
  if (p.pass_doorbell != nullptr && rec[REC_OPCODE] == OP_STEP_BEGIN && !pass_begin(p, task, s, tid, nt))
    return false;
  trace_marks_clear(tid);  // a body that sets no mark leaves 0 in the record
  if (!run_task(p, rec, s, smem, tid, nt)) {
    if (tid == 0) raise_error(p.error, p.halt, kErrBadTask, task, -1, s, p.rank, 0, 0, 0);
    return false;
  }
  worker_barrier(nt);  // every thread's output writes precede thread 0's release below
  if (tid == 0) *t_body = globaltimer_ns();  // trace: the body is done on every thread
  bool end = false;
  if (task == p.final_task) end = step_epilogue(p, s, tid, nt);
  // An early stop (EOS, max tokens) does not signal, so no task of the next step can start; at the
  // launch's last step the signal still goes out (the next launch's step_begin waits on it).
  const bool early = end && s + 1 < p.step_end;
  if (tid == 0 && end) atom_add_relaxed_gpu(p.halt, 1u);  // a stop, not an error: no error record
  if (tid == 0 && !early && task != p.inject_hang_task) {
    // The record's signals (event, kind, triggers), or the tables' rows for a task with more.
    const bool inl = (rec[REC_FLAGS] & REC_FLAG_SIGNALS_INLINE) != 0;
    const int32_t* row = p.tasks + (size_t)task * TASK_NUM_COLS;
    const int k0 = inl ? 0 : row[TASK_COL_SIGNAL_BEGIN], k1 = inl ? rec[REC_NSIGNALS] : row[TASK_COL_SIGNAL_END];
    // Cumulativity: the block's writes (seen by thread 0 through the barrier) before every add;
    // system scope when any store went to a peer or a peer (or the host) will acquire.
    bool sys = (rec[REC_FLAGS] & REC_FLAG_SIG_SYS) != 0;
    if (sys) fence_acq_rel_sys();
    else fence_acq_rel_gpu();
#if MPK_POST_FENCE_MARK >= 0
    trace_mark(MPK_POST_FENCE_MARK, tid);  // trace: the fence is done (the signals follow): splits the post
#endif
    for (int k = k0; k < k1; ++k) {
      int e, kind;
      if (inl) {
        e = rec[REC_SIGNALS + k * REC_SIGNAL_COLS];
        kind = rec[REC_SIGNALS + k * REC_SIGNAL_COLS + 1];
      } else {
        e = p.signals[(size_t)k * SIGNAL_NUM_COLS + SIGNAL_COL_EVENT];
        kind = p.signals[(size_t)k * SIGNAL_NUM_COLS + SIGNAL_COL_TARGET] == SIG_ALL_RANKS ? SIG_KIND_ALL_RANKS
               : event_is_system(p, e)                                                    ? SIG_KIND_SYSTEM
                                                                                           : SIG_KIND_LOCAL;
      }
      const uint32_t old = signal_event<kJit>(p, e, kind);
      if (kJit) {
        const uint32_t trig = (uint32_t)p.event_tab[(size_t)e * EVENT_NUM_COLS + EVENT_COL_TRIGGERS];
        if (old + 1u == (uint32_t)(s + 1) * trig) {  // this add completed the event for step s (own rank)
          const int sch = e % p.num_sched;
          ring_push(p.sched_queues + (size_t)sch * p.sched_cap * 4, &p.sched_tail[sch], p.sched_cap, (uint32_t)e,
                    (uint32_t)s);
        }
      }
    }
  }
  return true;
}

// ---- ahead-of-time schedule ----------------------------------------------------------------
// Warp 1 copies record i of the worker order into `dst` (cp.async, 16 bytes a lane); the copy lands
// while the block works on the current task; record_fetch_wait + a block barrier publish it.
__device__ __forceinline__ void record_fetch(const RuntimeParams& p, int i, int32_t* dst, int tid) {
  const int lane = tid - kRecordFirstThread;
  if (lane >= 0 && lane < kRecordLanes) cp_async16(dst + 4 * lane, p.records + (size_t)i * REC_WORDS + 4 * lane);
}
__device__ __forceinline__ void record_fetch_wait(int tid) {
  const int lane = tid - kRecordFirstThread;
  if (lane >= 0 && lane < kRecordLanes) cp_async_wait_all();
}

__device__ void worker_loop_aot(const RuntimeParams& p, BlockState& st, float* smem, int tid, int nt) {
  // Two record slots: the current task's, and the next one's arriving during the current wait.
  __shared__ __align__(16) int32_t recs[2][REC_WORDS];
  const int w = worker_index();
  const int begin = p.worker_offsets[w], end = p.worker_offsets[w + 1];
  int ntrace = 0, slot = 0;
  if (begin < end) record_fetch(p, begin, recs[0], tid);
  record_fetch_wait(tid);
  worker_barrier(nt);
  for (int s = p.step_begin; s < p.step_end && begin < end; ++s) {
    bool stop = false;
    for (int i = begin; i < end; ++i) {
      const int32_t* rec = recs[slot];
      const int task = rec[REC_TASK];
      const uint64_t t0 = globaltimer_ns();
      prefetch_task(p, rec, rec[REC_PREFETCH], tid, nt);  // weights stream in while we wait for the inputs
      record_fetch(p, i + 1 < end ? i + 1 : begin, recs[slot ^ 1], tid);  // the next task (next step: the first)
      if (rec[REC_PREFETCH_NEXT] != 0) {
        // The host planned the next task's weights here (prefetch_plan.py hoist_ahead): this task waits on
        // a narrow producer, so its wait is the idle time the next linear tile's bytes can use.
        record_fetch_wait(tid);
        worker_barrier(nt);  // the next record is visible to every thread
        prefetch_task(p, recs[slot ^ 1], rec[REC_PREFETCH_NEXT], tid, nt);
      }
      const uint64_t t_prep = globaltimer_ns();
      if (tid == 0) st.failed = wait_task_events(p, rec, s);
      worker_barrier(nt);  // hands thread 0's acquired view to every worker thread
      if (st.failed) { stop = true; break; }
      const uint64_t t_ready = globaltimer_ns();
      uint64_t t_body = 0;
      if (!run_and_signal<false>(p, rec, s, smem, tid, nt, &t_body)) { stop = true; break; }
      if (tid == 0) stream_drain();  // a ring primed for this task but not streamed from (weight_stream.cuh)
      if (tid == 0 && s >= p.trace_from) trace_record(p, ntrace, task, s, t0, t_prep, t_ready, t_body);
      record_fetch_wait(tid);  // the next record is in shared memory before the barrier publishes it
      worker_barrier(nt);  // st and this slot are rewritten for the next task
      slot ^= 1;
    }
    if (stop) break;
  }
  record_fetch_wait(tid);  // no copy into shared memory outlives the block
  if (tid == 0 && p.trace_len != nullptr) p.trace_len[w] = (uint32_t)ntrace;
}

// ---- just-in-time schedule -----------------------------------------------------------------
// Queue task t for every step up to s whose instance is not queued yet (claimed by CAS on
// launched[t], so racing schedulers queue each (task, step) once and in step order).
__device__ void queue_up_to(const RuntimeParams& p, int t, int s) {
  uint32_t k = ld_relaxed_gpu(&p.launched[t]);
  while ((int)k <= s && (int)k < p.step_end) {
    const uint32_t prev = atomicCAS(&p.launched[t], k, k + 1u);
    if (prev == k) {
      const int w = p.tasks[(size_t)t * TASK_NUM_COLS + TASK_COL_WORKER];
      ring_push(p.queues + (size_t)w * p.queue_cap * 4, &p.queue_tail[w], p.queue_cap, (uint32_t)t, k);
      ++k;
    } else {
      k = prev;
    }
  }
}

// Scheduler warp. Lane 0 pops (event, step) messages; all 32 lanes then check the event's waiting
// tasks in parallel (each lane with its own acquire loads, and its own release pushes onto worker
// rings; the CAS in queue_up_to keeps each (task, step) queued once). Block 0's scheduler first
// seeds the tasks ready at step_begin, also spread over the lanes.
__device__ void scheduler_loop(const RuntimeParams& p, int sch) {
  const int lane = threadIdx.x & 31;
  uint32_t* q = p.sched_queues + (size_t)sch * p.sched_cap * 4;
  if (sch == 0)
    for (int t = lane; t < p.num_tasks; t += 32)
      if (task_ready(p, t, p.step_begin)) queue_up_to(p, t, p.step_begin);
  for (uint32_t head = 0;; ++head) {
    uint32_t e = 0, s = 0;
    int r = 0;
    if (lane == 0) r = ring_pop(p, q, p.sched_cap, head, e, s);
    r = __shfl_sync(0xffffffffu, r, 0);
    e = __shfl_sync(0xffffffffu, e, 0);
    s = __shfl_sync(0xffffffffu, s, 0);
    if (r == 1) { --head; continue; }  // idle is no error for a scheduler: workers' watchdogs report
    if (r != 0) return;                // halt: end of run or an error elsewhere
    for (int i = p.dep_ptr[e] + lane; i < p.dep_ptr[e + 1]; i += 32) {
      const int t = p.dep_task[i], st = (int)s - p.dep_offset[i];  // offset -1: the next step's task
      if (st < p.step_end && task_ready(p, t, st)) queue_up_to(p, t, st);
    }
    __syncwarp();
  }
}

// For an error report: the first task of worker w at step s (or up to s + extra) with an unmet wait.
__device__ void diagnose_worker(const RuntimeParams& p, int w, int s, int extra, int& task, int& event,
                                uint32_t& seen, uint32_t& target, int& at_step) {
  for (int step = s; step <= s + extra; ++step)
    for (int i = p.worker_offsets[w]; i < p.worker_offsets[w + 1]; ++i) {
      const int t = p.worker_tasks[i];
      const int32_t* row = p.tasks + (size_t)t * TASK_NUM_COLS;
      for (int k = row[TASK_COL_WAIT_BEGIN]; k < row[TASK_COL_WAIT_END]; ++k) {
        int e;
        const uint32_t want = wait_target(p, k, step, &e);
        const uint32_t have = ld_relaxed_gpu(&p.events[e]);
        if ((int32_t)(have - want) < 0) { task = t; event = e; seen = have; target = want; at_step = step; return; }
      }
    }
  task = -1; event = -1; seen = 0; target = 0; at_step = s;
}

__device__ void worker_loop_jit(const RuntimeParams& p, BlockState& st, float* smem, int tid, int nt) {
  const int w = worker_index();
  uint32_t* q = p.queues + (size_t)w * p.queue_cap * 4;
  int ntrace = 0, last_step = p.step_begin;
  for (uint32_t head = 0;; ++head) {
    const uint64_t t0 = globaltimer_ns();
    if (tid == 0) {
      uint32_t t = 0, s = 0;
      int r, rounds = 0;
      // A timeout is reported only when one of this worker's own tasks has an unmet wait; the first
      // round looks at its current step only, so the workers stuck where the stall is report first
      // (a worker with nothing left to run keeps waiting for the halt flag).
      while ((r = ring_pop(p, q, p.queue_cap, head, t, s)) == 1) {
        int task, event, at_step;
        uint32_t seen, target;
        diagnose_worker(p, w, last_step, rounds++ > 0 ? 1 : 0, task, event, seen, target, at_step);
        if (task >= 0) {
          raise_error(p.error, p.halt, kErrTimeout, task, event, at_step, p.rank, seen, target, p.timeout_ns);
          break;
        }
      }
      st.failed = r != 0;
      st.task = (int)t;
      st.step = (int)s;
    }
    worker_barrier(nt);  // thread 0 acquired the slot; the barrier passes the view on
    if (st.failed) break;
    const int task = st.task, s = st.step;
    last_step = s;
    const uint64_t t_ready = globaltimer_ns();  // a queued task is ready: no prefetch-before-wait here
    uint64_t t_body = 0;
    // The record in global memory: its loads are independent of each other (no shared-memory copy
    // here: a popped task runs at once).
    const int32_t* rec = p.records + (size_t)p.task_rec[task] * REC_WORDS;
    if (!run_and_signal<true>(p, rec, s, smem, tid, nt, &t_body)) break;
    if (tid == 0 && s >= p.trace_from) trace_record(p, ntrace, task, s, t0, t0, t_ready, t_body);
    worker_barrier(nt);
  }
  if (tid == 0 && p.trace_len != nullptr) p.trace_len[w] = (uint32_t)ntrace;
}

}  // namespace mpk

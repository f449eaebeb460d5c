"""Turn a watchdog record into a message that says who waited on what, and why it never came.

Causes, in order of preference:

1. the record names a peer (the kernel found that rank's tally for the waited system-scope event
   short: csrc/runtime/worker.cuh find_short_peer);
2. at tp > 1, the ranks' tallies (read from every region on the host) show a peer behind this rank:
   the first peer-signalled event, in task order, that some peer has not signalled as often as
   due by the step while this rank has. This covers a rank whose first timeout was on a LOCAL event
   downstream of the missing communication (e.g. the norm waiting on the all-reduce's output);
3. the root cause in this rank's own counters: the first producer whose inputs were met at the
   step but whose event stayed short (it ran, or could run, but never signalled).
"""

from __future__ import annotations

import numpy as np

from mpk_dist.runtime.comm_layout import peer_quota
from mpk_dist.runtime.params import ERROR_CODES
from mpk_dist.taskgraph.abi import EVENT_COLS, TASK_COLS, WAIT_COLS
from mpk_dist.taskgraph.tasks.page_alloc import FAULT_NAMES, fault_message


def error_message(sess) -> str | None:
    """The last launch's watchdog record of session ``sess`` as one message (None: no record)."""
    r = sess.error_record()
    if r.code == 0:
        return None
    cg = sess.cg
    task = cg.task_label(r.task_id) if 0 <= r.task_id < cg.num_tasks else f"task {r.task_id}"
    if r.code == 5:  # kErrPassWait (pass_begin.cuh): the host, not a task, is what it waited on
        return (f"mega-kernel (persistent passes): {task} of pass {r.step} on rank {r.rank} waited "
                f"{r.elapsed_ns / 1e9:.2f} s for the host to post it (posted {r.seen}); the host must post each pass "
                "or stop the launch within pass_wait_s")
    if r.code in FAULT_NAMES:  # page_alloc (tasks/page_alloc.cuh): event_id is the slot
        as_int = lambda v: int(np.array(v, np.uint32).view(np.int32))  # noqa: E731 - the record's words are unsigned
        return (f"mega-kernel ({ERROR_CODES[r.code]}): {task} at step {r.step} on rank {r.rank}: "
                + fault_message(r.code, r.event_id, as_int(r.seen), as_int(r.expected)))
    if r.code == 10:  # kErrPairWait (csrc/runtime/worker_index.cuh): seen = blocks counted in on that SM
        return (f"mega-kernel ({ERROR_CODES[10]}): a block on SM {r.sm_id} (rank {r.rank}) waited "
                f"{r.elapsed_ns / 1e9:.2f} s for the other block of its SM to publish its worker ({r.seen} block(s) "
                f"counted in, expected {r.expected}): the launch did not put two blocks on every SM; run with "
                "MPK_BLOCKS_PER_SM=1 (the default)")
    if r.code == 9:  # kErrFlagWait (csrc/runtime/dispatch.cuh flag_gather): event_id is the input element
        return flag_wait_message(cg, task, r)
    if 0 <= r.event_id < len(cg.meta["events"]):
        event = f"event {r.event_id} '{cg.meta['events'][r.event_id]}' (signalled by {producers(cg, r.event_id)})"
    else:
        event = f"event {r.event_id}"
    return (f"mega-kernel watchdog ({ERROR_CODES.get(r.code, r.code)}): {task} (task {r.task_id}) waited on {event} "
            f"at step {r.step} on SM {r.sm_id} (worker {r.worker}, rank {r.rank}): expected counter >= {r.expected}, "
            f"got {r.seen} after {r.elapsed_ns / 1e9:.2f} s; {cause(sess, r)} (raise --timeout if a step is "
            "legitimately slower)")


def flag_wait_message(cg, task: str, r) -> str:
    """A polling norm tile's flagged word that never got its step's tag (mpk_dist.taskgraph.flag_words): which copy,
    which element, which tag it held, and the ops that write that copy."""
    from mpk_dist.taskgraph.flag_words import PRODUCER_TWINS, copy_writers, twin_buffers

    tasks, bufs, ops = cg.arrays["tasks"], cg.meta["buffers"], cg.meta["ops"]
    fids = set()
    if 0 <= r.task_id < cg.num_tasks:  # the copies the task reads (not one it writes)
        kind = ops[int(tasks[r.task_id, TASK_COLS["OP_INDEX"]])]["kind"]
        fids = {f for tw, f in twin_buffers(cg, r.task_id).items() if tw != PRODUCER_TWINS.get(kind)}
    copies = sorted(bufs[f]["name"] for f in fids)
    writers = sorted({ops[oi]["name"] for f, w in copy_writers(cg).items() if f in fids for oi in w})
    copy = f"buffer {' / '.join(repr(c) for c in copies)}" if copies else "its input's flagged copy"
    held = "no step's (never written)" if r.seen == 0 else f"step {r.seen - 1}'s"
    by = f"written by {', '.join(writers)}" if writers else "whose writer is unknown"
    return (f"mega-kernel watchdog ({ERROR_CODES[9]}): {task} (task {r.task_id}) waited {r.elapsed_ns / 1e9:.2f} s at "
            f"step {r.step} on SM {r.sm_id} (worker {r.worker}, rank {r.rank}) for element {r.event_id} of {copy}: its "
            f"word held the tag of {held}, expected step {r.expected - 1}'s; {by}, which did not write it at that step "
            "(it stalled, failed, or never ran: see its own tasks) (raise --timeout if a step is legitimately slower)")


def cause(sess, r) -> str:
    """Why the wait of record ``r`` stayed short (see the module docstring for the order)."""
    cg = sess.cg
    if sess.world > 1 and 0 <= r.peer < sess.world and r.peer != sess.rank:
        return (f"waiting on peer rank {r.peer}: it sent {r.peer_sent} of the {r.peer_expected} signals of event "
                f"{r.event_id} due by step {r.step} (that rank stalled, died or timed out first; see its error)")
    if sess.world > 1 and r.peer == sess.rank:
        # The short tally is this rank's own: the cause is upstream of its own push, in its counters.
        return (f"waiting on this rank itself: it sent {r.peer_sent} of the {r.peer_expected} signals of event "
                f"{r.event_id} due by step {r.step}; {root_cause(cg, sess.counters(), r.step)}")
    if sess.world > 1:
        tallies = [sess.tallies_of(q) for q in range(sess.world)]
        lag = lagging_peer(cg, tallies, sess.rank, r.step)
        if lag is not None:
            q, e, have, need = lag
            return (f"waiting on peer rank {q}: it sent {have} of the {need} signals of event {e} "
                    f"'{cg.meta['events'][e]}' due by step {r.step} while this rank sent all of its own "
                    "(that rank stalled, died or timed out first; see its error)")
    return root_cause(cg, sess.counters(), r.step)


def first_signaller(cg) -> np.ndarray:
    """int64 [E]: the lowest task id that signals each event (task order = a topological order)."""
    tasks, sig = cg.arrays["tasks"], cg.arrays["signals"]
    E = cg.arrays["events"].shape[0]
    owner = np.repeat(np.arange(tasks.shape[0]), tasks[:, TASK_COLS["SIGNAL_END"]] - tasks[:, TASK_COLS["SIGNAL_BEGIN"]])
    first = np.full(E, np.iinfo(np.int64).max, np.int64)
    np.minimum.at(first, sig[:, 0].astype(np.int64), owner)
    return first


def lagging_peer(cg, tallies: list[np.ndarray | None], rank: int, step: int) -> tuple[int, int, int, int] | None:
    """(peer, event, its tally, due) for the first peer-signalled event (task order) that a peer has
    signalled fewer than (step + 1) x quota times while ``rank`` has not; None when no peer is behind
    this rank (or the tallies cannot be read)."""
    mine = tallies[rank]
    if mine is None:
        return None
    quota = peer_quota(cg).astype(np.int64)
    due = (step + 1) * quota
    for e in np.argsort(first_signaller(cg), kind="stable"):
        if quota[e] == 0:
            continue
        if mine[e] < due[e]:
            return None  # this rank itself has not got this far: no peer is behind it
        for q, t in enumerate(tallies):
            if q != rank and t is not None and t[e] < due[e]:
                return q, int(e), int(t[e]), int(due[e])
    return None


def root_cause(cg, ctr: np.ndarray, step: int) -> str:
    """From the final counters ``ctr``: the first event (task order) incomplete at ``step`` although
    its producer had all its inputs, i.e. a producer that ran (or could run) but never signalled."""
    tasks, waits, sig = cg.arrays["tasks"], cg.arrays["waits"], cg.arrays["signals"]
    trig = cg.arrays["events"][:, EVENT_COLS["TRIGGERS"]].astype(np.int64)

    def met(t: int) -> bool:
        rows = waits[tasks[t, TASK_COLS["WAIT_BEGIN"]]:tasks[t, TASK_COLS["WAIT_END"]]]
        return all(ctr[e] >= (step + 1 + o) * trig[e] for e, o in rows[:, [WAIT_COLS["EVENT"], WAIT_COLS["STEP_OFFSET"]]])

    for t in range(tasks.shape[0]):
        for e in sig[tasks[t, TASK_COLS["SIGNAL_BEGIN"]]:tasks[t, TASK_COLS["SIGNAL_END"]], 0]:
            if ctr[e] < (step + 1) * trig[e] and met(t):
                return (f"root cause: {cg.task_label(t)} (task {t}) had all its inputs at step {step} but event {e} "
                        f"'{cg.meta['events'][e]}' stopped at {ctr[e]} of {(step + 1) * trig[e]}")
    return "no producer with ready inputs left the event short (a wait on a later step?)"


def producers(cg, event: int) -> str:
    """Labels of the tasks that signal ``event`` (for error messages)."""
    tasks, sig = cg.arrays["tasks"], cg.arrays["signals"]
    out = []
    for t in range(tasks.shape[0]):
        if event in sig[tasks[t, TASK_COLS["SIGNAL_BEGIN"]]:tasks[t, TASK_COLS["SIGNAL_END"]], 0]:
            out.append(f"task {t}")
    return ", ".join(out[:4]) + (" ..." if len(out) > 4 else "") if out else "no task"

"""Exposed communication per decode step, from the kernel's trace records.

A trace record gives, per executed task, when its worker turned to it (``start_ns``), how long it
waited for its inputs (``wait_ns``) and ran (``run_ns``). A task "waits on communication" when one
of its waits is a system-scope event (signalled by every rank: the all-reduce reduce tiles, the
token selection after the all-gather). Per step s (window [step_end_ns[s], step_end_ns[s+1]]), the
exposed communication is the time during which at least one SM of the rank sits in such a wait;
its share is that time over the step's length. The union over SMs and the share are computed by
mpk_dist.bench.trace.exposed_comm_share (the cluster work's trace helper), fed with the comm waits
as communication events and the step's two boundaries as zero-length markers that fix its span.

The group's figure is the worst rank's: Σ exposed / Σ step length over the profiled steps.
"""

from __future__ import annotations

import numpy as np

from mpk_dist.taskgraph.abi import EV_SCOPE_SYSTEM, EVENT_COLS, TASK_COLS, WAIT_COLS

COMM_WAIT = "comm_wait"
BOUNDARY = "step_boundary"


def comm_wait_tasks(cg) -> np.ndarray:
    """bool [T]: tasks with at least one wait on a system-scope (peer-signalled) event."""
    tasks, waits, events = cg.arrays["tasks"], cg.arrays["waits"], cg.arrays["events"]
    system = events[:, EVENT_COLS["SCOPE"]] == EV_SCOPE_SYSTEM
    on_sys = system[waits[:, WAIT_COLS["EVENT"]]] if len(waits) else np.zeros(0, bool)
    out = np.zeros(tasks.shape[0], bool)
    for t in range(tasks.shape[0]):
        b, e = tasks[t, TASK_COLS["WAIT_BEGIN"]], tasks[t, TASK_COLS["WAIT_END"]]
        out[t] = bool(on_sys[b:e].any())
    return out


def step_exposure(records: list[np.ndarray], is_comm: np.ndarray, step_end_ns, steps: range, rank: int = 0) -> list[dict]:
    """Per step of ``steps``: {'step', 'step_us', 'exposed_us', 'share'} for one rank.

    ``records``: per worker, TraceRecord arrays (mpk_dist.runtime.params.TRACE_DTYPE);
    ``step_end_ns[s]``: start of step s, ``step_end_ns[s + 1]``: its end (device clock).
    """
    from mpk_dist.bench.trace import TraceEvent, exposed_comm_share

    by_step: dict[int, list] = {s: [] for s in steps}
    for recs in records:
        for r in recs:
            s = int(r["step"])
            if s in by_step and is_comm[int(r["task_id"])] and int(r["wait_ns"]) > 0:
                by_step[s].append((int(r["start_ns"]), int(r["start_ns"]) + int(r["wait_ns"])))
    out = []
    for s in steps:
        lo, hi = int(step_end_ns[s]), int(step_end_ns[s + 1])
        if hi <= lo:
            continue
        evs = [TraceEvent(BOUNDARY, lo / 1e3, 0.0, -1, rank, None, BOUNDARY),
               TraceEvent(BOUNDARY, hi / 1e3, 0.0, -1, rank, None, BOUNDARY)]
        for a, b in by_step[s]:
            a, b = max(a, lo), min(b, hi)  # a wait may start in the previous step (run-ahead)
            if b > a:
                evs.append(TraceEvent(COMM_WAIT, a / 1e3, (b - a) / 1e3, 0, rank, None, COMM_WAIT))
        share = exposed_comm_share(evs, comm=lambda op: op == COMM_WAIT)
        out.append({"step": s, "step_us": (hi - lo) / 1e3, "exposed_us": share * (hi - lo) / 1e3, "share": share})
    return out


def summarize(per_rank: list[list[dict]]) -> dict:
    """The group's figures: worst rank's share over all profiled steps, and per-rank shares."""
    shares = []
    for rows in per_rank:
        total = sum(r["step_us"] for r in rows)
        shares.append(sum(r["exposed_us"] for r in rows) / total if total > 0 else float("nan"))
    finite = [x for x in shares if x == x]
    rows0 = per_rank[0] if per_rank else []
    return {
        "exposed_comm_share": max(finite) if finite else None,
        "exposed_comm_share_by_rank": shares,
        "exposed_comm_us_per_step": (sum(r["exposed_us"] for r in rows0) / len(rows0)) if rows0 else None,
        "profiled_steps": len(rows0),
    }


def profiled_steps(trace_from: int, done_steps: int, trace_cap: int, max_tasks_per_worker: int) -> range:
    """Steps whose records are complete on every worker: from ``trace_from`` until the run's end or
    the trace capacity (each worker records at most ``max_tasks_per_worker`` tasks per step)."""
    if trace_cap <= 0 or max_tasks_per_worker <= 0:
        return range(0)
    return range(trace_from, min(done_steps, trace_from + trace_cap // max_tasks_per_worker))

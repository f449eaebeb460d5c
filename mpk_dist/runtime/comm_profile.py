"""Exposed communication per decode step, from the kernel's trace records.

A trace record gives, per executed task, when its worker turned to it (``start_ns``), how long it
waited for its inputs (``wait_ns``) and ran (``run_ns``). A task "waits on communication" when one
of its waits is a system-scope event (signalled by every rank: the all-reduce reduce tiles, the
token selection after the all-gather). Per step s (window [step_end_ns[s], step_end_ns[s+1]]), the
exposed communication is the time during which at least one SM of the rank sits in such a wait
(the union of those waits, clipped to the window); its share is that time over the step's length.
This is the definition of mpk_dist.bench.trace.exposed_comm_share (the cluster work's trace helper)
with the comm waits as communication events and no compute cover; the tests check the two agree.
It is computed here with numpy (a qwen3-0.6b tp-2 run leaves ~0.5 M records per rank per call).

The group's figure is the worst rank's: Σ exposed / Σ step length over the profiled steps.
"""

from __future__ import annotations

import numpy as np

from mpk_dist.runtime.params import TRACE_DTYPE
from mpk_dist.taskgraph.abi import EV_SCOPE_SYSTEM, EVENT_COLS, TASK_COLS, WAIT_COLS


def comm_wait_tasks(cg) -> np.ndarray:
    """bool [T]: tasks with at least one wait on a system-scope (peer-signalled) event."""
    tasks, waits, events = cg.arrays["tasks"], cg.arrays["waits"], cg.arrays["events"]
    system = events[:, EVENT_COLS["SCOPE"]] == EV_SCOPE_SYSTEM
    n = tasks[:, TASK_COLS["WAIT_END"]] - tasks[:, TASK_COLS["WAIT_BEGIN"]]
    owner = np.repeat(np.arange(tasks.shape[0]), n)  # wait rows are stored task by task
    out = np.zeros(tasks.shape[0], bool)
    out[owner[system[waits[:, WAIT_COLS["EVENT"]]]]] = True
    return out


def step_exposure(records: list[np.ndarray], is_comm: np.ndarray, step_end_ns, steps: range) -> list[dict]:
    """Per step of ``steps``: {'step', 'step_us', 'exposed_us', 'share'} for one rank.

    ``records``: per worker, TraceRecord arrays (mpk_dist.runtime.params.TRACE_DTYPE);
    ``step_end_ns[s]``: start of step s, ``step_end_ns[s + 1]``: its end (device clock).
    """
    if len(steps) == 0:
        return []
    ends = np.asarray(step_end_ns, np.int64)
    a, b, s = comm_waits(records, is_comm, ends, steps)
    # Windows are disjoint and in step order, so the clipped waits of step s all lie before those of
    # step s + 1: one global sweep in start order gives every step's union length.
    order = np.argsort(a, kind="stable")
    a, b, s = a[order], b[order], s[order]
    covered = np.concatenate([[np.iinfo(np.int64).min], np.maximum.accumulate(b)[:-1]]) if len(b) else b
    part = np.maximum(0, b - np.maximum(a, covered)).astype(np.float64)
    exposed = np.bincount(s - steps.start, weights=part, minlength=len(steps))
    out = []
    for i, st in enumerate(steps):
        lo, hi = int(ends[st]), int(ends[st + 1])
        if hi > lo:
            out.append({"step": st, "step_us": (hi - lo) / 1e3, "exposed_us": exposed[i] / 1e3,
                        "share": float(exposed[i]) / (hi - lo)})
    return out


def comm_waits(records: list[np.ndarray], is_comm: np.ndarray, ends: np.ndarray, steps: range):
    """(start, end, step) int64 arrays of the comm waits of ``steps``, clipped to their step's window
    (a worker may turn to a task of step s before step s began: run-ahead)."""
    recs = [r for r in records if len(r)]
    allr = np.concatenate(recs) if recs else np.zeros(0, TRACE_DTYPE)
    st, task = allr["step"].astype(np.int64), allr["task_id"].astype(np.int64)
    keep = (st >= steps.start) & (st < steps.stop) & (allr["wait_ns"] > 0) & (task < len(is_comm))
    keep[keep] &= is_comm[task[keep]]
    a = allr["start_ns"][keep].astype(np.int64)
    b, s = a + allr["wait_ns"][keep].astype(np.int64), st[keep]
    a, b = np.maximum(a, ends[s]), np.minimum(b, ends[s + 1])
    ok = b > a
    return a[ok], b[ok], s[ok]


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

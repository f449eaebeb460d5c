"""CPU tests of the exposed-communication figure (mpk_dist.runtime.comm_profile) on synthetic records."""

from __future__ import annotations

import numpy as np
import pytest

from mpk_dist.models.presets import get_preset
from mpk_dist.runtime import comm_profile as cp
from mpk_dist.runtime.params import TRACE_DTYPE
from mpk_dist.taskgraph.compiler import compile_rank_programs
from mpk_dist.taskgraph.tasks import BY_OPCODE


def recs(rows) -> np.ndarray:
    """TraceRecord array from (task, step, start_ns, wait_ns, run_ns) rows (no prep/post times)."""
    return np.array([tuple(r) + (0,) * (len(TRACE_DTYPE.names) - len(r)) for r in rows], dtype=TRACE_DTYPE)


def test_comm_waits_are_the_reduce_and_select_tasks():
    cg = compile_rank_programs(get_preset("tiny"), tp=2, batch=1, sms=8, max_seq_len=16)[0]
    mask = cp.comm_wait_tasks(cg)
    kinds = {BY_OPCODE[int(op)].name for op in cg.arrays["tasks"][mask, 0]}
    assert kinds == {"allreduce_reduce", "argmax_select"}
    tp1 = compile_rank_programs(get_preset("tiny"), tp=1, batch=1, sms=8, max_seq_len=16)[0]
    only = {BY_OPCODE[int(op)].name for op in tp1.arrays["tasks"][cp.comm_wait_tasks(tp1), 0]}
    assert only == {"argmax_select"}, "at tp 1 only the (one-rank) all-gather is still a system event"


def test_exposure_is_the_union_of_comm_waits_per_step():
    is_comm = np.array([True, False])
    step_end = [0, 1000, 2000]
    w0 = recs([(0, 0, 100, 200, 10), (1, 0, 300, 500, 10), (0, 1, 900, 300, 10)])  # a non-comm wait is ignored
    w1 = recs([(0, 0, 200, 300, 10), (1, 1, 1100, 800, 10)])
    rows = cp.step_exposure([w0, w1], is_comm, step_end, range(0, 2))
    # step 0: [100, 300] U [200, 500] = 400 ns of 1000; step 1: [900, 1200] clipped to [1000, 1200]
    assert [r["share"] for r in rows] == pytest.approx([0.4, 0.2])
    assert [r["exposed_us"] for r in rows] == pytest.approx([0.4, 0.2])
    other = cp.step_exposure([recs([(0, 0, 0, 1000, 1)])], is_comm, step_end, range(0, 1))
    s = cp.summarize([rows, other])
    assert s["exposed_comm_share_by_rank"] == pytest.approx([0.3, 1.0])
    assert s["exposed_comm_share"] == pytest.approx(1.0), "the group reports its worst rank"
    assert s["profiled_steps"] == 2 and s["exposed_comm_us_per_step"] == pytest.approx(0.3)


def test_profiled_steps_stop_where_the_trace_is_full():
    assert cp.profiled_steps(5, 100, trace_cap=40, max_tasks_per_worker=10) == range(5, 9)
    assert cp.profiled_steps(5, 7, trace_cap=40, max_tasks_per_worker=10) == range(5, 7)
    assert cp.profiled_steps(0, 7, trace_cap=0, max_tasks_per_worker=10) == range(0)


def test_numpy_sweep_equals_the_bench_trace_helper():
    """The vectorised union equals mpk_dist.bench.trace.exposed_comm_share (the cluster work's
    definition: comm time not covered by compute, over the span) on random overlapping waits, with
    the step's boundaries as zero-length markers that fix the span."""
    from mpk_dist.bench.trace import TraceEvent, exposed_comm_share

    rng = np.random.default_rng(0)
    ends = np.cumsum(rng.integers(500, 5000, 9)).tolist()
    ends = [0] + ends
    n_tasks = 40
    is_comm = rng.random(n_tasks) < 0.5
    workers = []
    for w in range(6):
        rows = []
        for s in range(len(ends) - 1):
            for _ in range(rng.integers(0, 6)):
                start = int(rng.integers(ends[s] - 300, ends[s + 1]))  # some start before the step (run-ahead)
                rows.append((int(rng.integers(n_tasks)), s, max(start, 0), int(rng.integers(0, 2000)), 5))
        workers.append(recs(sorted(rows, key=lambda r: (r[1], r[2]))))
    got = cp.step_exposure(workers, is_comm, ends, range(0, len(ends) - 1))
    for row in got:
        s, lo, hi = row["step"], ends[row["step"]], ends[row["step"] + 1]
        evs = [TraceEvent("b", lo / 1e3, 0.0, -1, 0, None, "boundary"), TraceEvent("b", hi / 1e3, 0.0, -1, 0, None, "boundary")]
        for r in np.concatenate(workers):
            a, b = max(int(r["start_ns"]), lo), min(int(r["start_ns"]) + int(r["wait_ns"]), hi)
            if int(r["step"]) == s and is_comm[int(r["task_id"])] and b > a:
                evs.append(TraceEvent("w", a / 1e3, (b - a) / 1e3, 0, 0, None, "comm_wait"))
        assert row["share"] == pytest.approx(exposed_comm_share(evs, comm=lambda op: op == "comm_wait"), abs=1e-9), s
    assert any(row["share"] > 0 for row in got)

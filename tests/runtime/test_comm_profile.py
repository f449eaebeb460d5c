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
    """TraceRecord array from (task, step, start_ns, wait_ns, run_ns) rows."""
    return np.array([tuple(r) for r in rows], dtype=TRACE_DTYPE)


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
    other = cp.step_exposure([recs([(0, 0, 0, 1000, 1)])], is_comm, step_end, range(0, 1), rank=1)
    s = cp.summarize([rows, other])
    assert s["exposed_comm_share_by_rank"] == pytest.approx([0.3, 1.0])
    assert s["exposed_comm_share"] == pytest.approx(1.0), "the group reports its worst rank"
    assert s["profiled_steps"] == 2 and s["exposed_comm_us_per_step"] == pytest.approx(0.3)


def test_profiled_steps_stop_where_the_trace_is_full():
    assert cp.profiled_steps(5, 100, trace_cap=40, max_tasks_per_worker=10) == range(5, 9)
    assert cp.profiled_steps(5, 7, trace_cap=40, max_tasks_per_worker=10) == range(5, 7)
    assert cp.profiled_steps(0, 7, trace_cap=0, max_tasks_per_worker=10) == range(0)

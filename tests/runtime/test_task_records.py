"""CPU tests of the task records (mpk_dist/runtime/task_records.py, csrc/runtime/task_record.cuh): every
field of every record equals what the kernel used to read through the ABI tables (waits with their
events' triggers and scopes, signals with their kinds, argument addresses and dtypes, parameters, the
planned prefetch), rows follow the aot worker order, a task with more waits or signals than a record
holds falls back to the tables, and the host constants equal the CUDA header's."""

from __future__ import annotations

import re

import numpy as np
import pytest

from mpk_dist.errors import InputError
from mpk_dist.models.presets import get_preset
from mpk_dist.runtime import task_records as R
from mpk_dist.runtime.build import CSRC
from mpk_dist.runtime.params import layout_asserts
from mpk_dist.taskgraph.abi import (ARG_COLS, BUFFER_COLS, EV_SCOPE_SYSTEM, EVENT_COLS, SIG_ALL_RANKS, SIGNAL_COLS,
                                    TASK_COLS, WAIT_COLS)
from mpk_dist.taskgraph.compiler import compile_rank_programs


def _program(name: str, tp: int, rank: int = 0, batch: int = 1):
    return compile_rank_programs(get_preset(name), tp=tp, batch=batch, sms=16, max_seq_len=32, fuse=True)[rank]


def _addrs(cg) -> np.ndarray:
    """Distinct fake 64-bit addresses per argument row (high words non-zero), 0 for absent ones."""
    n = cg.arrays["args"].shape[0]
    a = (np.arange(n, dtype=np.uint64) * np.uint64(4096)) + np.uint64(0x7F12_0000_0000)
    a[cg.arrays["args"][:, ARG_COLS["BUFFER"]] < 0] = 0
    return a.view(np.int64)


def _reference(cg, t: int, addrs: np.ndarray, plan) -> dict:
    """What the kernel read for task t through the tables (worker.cuh / task_view.cuh before records)."""
    A, row = cg.arrays, cg.arrays["tasks"][t]
    ev = A["events"]
    waits = [(int(A["waits"][k, WAIT_COLS["EVENT"]]), int(A["waits"][k, WAIT_COLS["STEP_OFFSET"]]))
             for k in range(row[TASK_COLS["WAIT_BEGIN"]], row[TASK_COLS["WAIT_END"]])]
    signals = []
    for k in range(row[TASK_COLS["SIGNAL_BEGIN"]], row[TASK_COLS["SIGNAL_END"]]):
        e, tgt = int(A["signals"][k, SIGNAL_COLS["EVENT"]]), int(A["signals"][k, SIGNAL_COLS["TARGET"]])
        kind = 2 if tgt == SIG_ALL_RANKS else 1 if ev[e, EVENT_COLS["SCOPE"]] == EV_SCOPE_SYSTEM else 0
        signals.append((e, kind, int(ev[e, EVENT_COLS["TRIGGERS"]])))
    args = list(range(row[TASK_COLS["ARG_BEGIN"]], row[TASK_COLS["ARG_END"]]))
    dtypes = [int(A["buffers"][A["args"][k, ARG_COLS["BUFFER"]], BUFFER_COLS["DTYPE"]])
              if A["args"][k, ARG_COLS["BUFFER"]] >= 0 else -1 for k in args]
    return {"opcode": int(row[TASK_COLS["OPCODE"]]),
            "waits": [(e, o, int(ev[e, EVENT_COLS["TRIGGERS"]]), int(ev[e, EVENT_COLS["SCOPE"]])) for e, o in waits],
            "signals": signals, "sys": any(k != 0 for _, k, _ in signals),
            "addrs": [int(addrs[k]) for k in args], "dtypes": dtypes,
            "params": [int(v) for v in A["params"][row[TASK_COLS["PARAM_BEGIN"]]:row[TASK_COLS["PARAM_END"]]]],
            "prefetch": -1 if plan is None else int(plan[t])}


def _decode(rec: np.ndarray, n_args: int, n_params: int) -> dict:
    w = [tuple(int(v) for v in rec[R.REC_WAITS + 4 * k: R.REC_WAITS + 4 * k + 4]) for k in range(rec[R.REC_NWAITS])]
    g = [tuple(int(v) for v in rec[R.REC_SIGNALS + 3 * k: R.REC_SIGNALS + 3 * k + 3])
         for k in range(rec[R.REC_NSIGNALS])]
    addrs = rec[R.REC_ARGS: R.REC_ARGS + 2 * R.REC_MAX_ARGS].copy().view(np.int64)[:n_args]
    return {"opcode": int(rec[R.REC_OPCODE]), "waits": w, "signals": g, "sys": bool(rec[R.REC_FLAGS] & R.FLAG_SIG_SYS),
            "addrs": [int(a) for a in addrs], "dtypes": [int(d) for d in rec[R.REC_DTYPES: R.REC_DTYPES + n_args]],
            "params": [int(v) for v in rec[R.REC_PARAMS: R.REC_PARAMS + n_params]], "prefetch": int(rec[R.REC_PREFETCH])}


@pytest.mark.parametrize("name,tp,rank", [("tiny", 1, 0), ("tiny", 2, 1), ("tiny-llama", 4, 3)])
def test_every_record_equals_the_tables(name, tp, rank):
    cg = _program(name, tp, rank)
    addrs = _addrs(cg)
    T = cg.arrays["tasks"].shape[0]
    plan = np.arange(T, dtype=np.int32) * 7 - 3  # any per-task values: they must land in the right rows
    recs, task_rec = R.build_records(cg, addrs, plan)
    assert recs.shape == (T, R.REC_WORDS) and recs.dtype == np.int32
    # worker order: row i is worker_tasks[i]; task_rec inverts it
    assert np.array_equal(recs[:, R.REC_TASK], cg.arrays["worker_tasks"])
    assert np.array_equal(recs[task_rec, R.REC_TASK], np.arange(T))
    sys_seen = False
    for t in range(T):
        row = cg.arrays["tasks"][t]
        ref = _reference(cg, t, addrs, plan)
        rec = recs[task_rec[t]]
        assert rec[R.REC_FLAGS] & R.FLAG_WAITS_INLINE and rec[R.REC_FLAGS] & R.FLAG_SIGNALS_INLINE
        got = _decode(rec, row[TASK_COLS["ARG_END"]] - row[TASK_COLS["ARG_BEGIN"]],
                      row[TASK_COLS["PARAM_END"]] - row[TASK_COLS["PARAM_BEGIN"]])
        assert got == ref, f"task {t} ({cg.task_label(t)})"
        sys_seen |= got["sys"]
    assert sys_seen, "every program has system-scope signals (peers, or the events the host and the next launch see)"


def test_tasks_beyond_the_record_read_the_tables():
    cg = _program("tiny", 1)
    A = cg.arrays
    tasks = A["tasks"].copy()
    t = int(np.argmax(tasks[:, TASK_COLS["WAIT_END"]] - tasks[:, TASK_COLS["WAIT_BEGIN"]] > 0))
    # give task t five waits (repeat its first wait row) and five signals, at the end of the tables
    w0, s0 = tasks[t, TASK_COLS["WAIT_BEGIN"]], tasks[t, TASK_COLS["SIGNAL_BEGIN"]]
    A["waits"] = np.concatenate([A["waits"], np.repeat(A["waits"][w0:w0 + 1], 5, axis=0)])
    A["signals"] = np.concatenate([A["signals"], np.repeat(A["signals"][s0:s0 + 1], 5, axis=0)])
    tasks[t, TASK_COLS["WAIT_BEGIN"]], tasks[t, TASK_COLS["WAIT_END"]] = len(A["waits"]) - 5, len(A["waits"])
    tasks[t, TASK_COLS["SIGNAL_BEGIN"]], tasks[t, TASK_COLS["SIGNAL_END"]] = len(A["signals"]) - 5, len(A["signals"])
    A["tasks"] = tasks
    recs, task_rec = R.build_records(cg, _addrs(cg))
    rec = recs[task_rec[t]]
    assert not rec[R.REC_FLAGS] & (R.FLAG_WAITS_INLINE | R.FLAG_SIGNALS_INLINE)
    assert rec[R.REC_NWAITS] == 0 and rec[R.REC_NSIGNALS] == 0 and rec[R.REC_PREFETCH] == -1
    others = np.delete(recs, task_rec[t], axis=0)
    assert (others[:, R.REC_FLAGS] & R.FLAG_WAITS_INLINE).all()


def test_refuses_a_worker_order_that_is_not_a_permutation():
    cg = _program("tiny", 1)
    cg.arrays["worker_tasks"] = cg.arrays["worker_tasks"].copy()
    cg.arrays["worker_tasks"][0] = cg.arrays["worker_tasks"][1]
    with pytest.raises(InputError, match="every task once"):
        R.build_records(cg, _addrs(cg))


def test_host_constants_equal_the_cuda_header():
    text = (CSRC / "runtime" / "task_record.cuh").read_text()
    cuda = {m.group(1): int(m.group(2)) for m in re.finditer(r"constexpr int (\w+) = (\d+);", text)}
    for name, value in R.CONSTANTS.items():
        assert cuda[R._CUDA_NAME.get(name, name)] == value, name
    assert R.REC_WORDS * 4 % 16 == 0 and (R.REC_ARGS * 4) % 8 == 0  # 16-byte copies, aligned 64-bit addresses
    assert R.REC_PARAMS + R.REC_MAX_PARAMS <= R.REC_WORDS
    assert 'static_assert(mpk::REC_WORDS == 96' in layout_asserts()

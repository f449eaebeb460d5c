"""Task records (csrc/runtime/task_record.cuh): one 384-byte row per task with its waits, signals,
argument pointers and dtypes, parameters and planned prefetch, resolved here from the ABI tables so
a worker reads a task's descriptors in one round trip (and from shared memory in the aot schedule)
instead of chains of dependent table loads.

Rows follow the aot worker order (``records[i]`` describes ``worker_tasks[i]``); ``task_rec[t]`` is
the row of task t. Built with numpy over all tasks at once (a qwen3-8b rank has ~20k tasks; this is
part of every warm start).
"""

from __future__ import annotations

import numpy as np

from mpk_dist.errors import InputError
from mpk_dist.taskgraph.abi import (ARG_COLS, BUFFER_COLS, EV_SCOPE_SYSTEM, EVENT_COLS, SIG_ALL_RANKS, SIGNAL_COLS,
                                    TASK_COLS, WAIT_COLS)

REC_WORDS = 96
REC_TASK, REC_OPCODE, REC_FLAGS, REC_PREFETCH, REC_NWAITS, REC_NSIGNALS = 0, 1, 2, 3, 4, 5
REC_PREFETCH_NEXT = 6
REC_WAITS, REC_WAIT_COLS, REC_MAX_WAITS = 8, 4, 4
REC_SIGNALS, REC_SIGNAL_COLS, REC_MAX_SIGNALS = 24, 3, 4
REC_ARGS, REC_MAX_ARGS = 36, 12
REC_DTYPES = 60
REC_PARAMS, REC_MAX_PARAMS = 72, 16
FLAG_SIG_SYS, FLAG_WAITS_INLINE, FLAG_SIGNALS_INLINE, FLAG_BULK_PREFETCH, FLAG_STAGE_KV = 1, 2, 4, 8, 16
SIG_KIND_LOCAL, SIG_KIND_SYSTEM, SIG_KIND_ALL_RANKS = 0, 1, 2

CONSTANTS = {name: value for name, value in globals().items()
             if name.startswith(("REC_", "FLAG_", "SIG_KIND_")) and isinstance(value, int)}
"""Every layout constant, checked against task_record.cuh in the generated source (``layout_asserts``)."""
_CUDA_NAME = {"FLAG_SIG_SYS": "REC_FLAG_SIG_SYS", "FLAG_WAITS_INLINE": "REC_FLAG_WAITS_INLINE",
              "FLAG_SIGNALS_INLINE": "REC_FLAG_SIGNALS_INLINE", "FLAG_BULK_PREFETCH": "REC_FLAG_BULK_PREFETCH",
              "FLAG_STAGE_KV": "REC_FLAG_STAGE_KV"}


def layout_asserts() -> list[str]:
    """static_asserts tying task_record.cuh's constants to these."""
    return [f'static_assert(mpk::{_CUDA_NAME.get(n, n)} == {v}, "task record {n}: host layout differs");'
            for n, v in CONSTANTS.items()]


def _span(begin: np.ndarray, end: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(row index begin + k clipped into range, mask k < end - begin) for every task."""
    idx = begin + k
    return np.where(idx < end, idx, 0), idx < end


def build_records(cg, arg_addr: np.ndarray, prefetch: np.ndarray | None = None, prefetch_next: np.ndarray | None = None,
                  bulk_prefetch: bool = False, stage_kv: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(records int32 [T, REC_WORDS] in worker order, task_rec int32 [T]) of program ``cg``.

    ``arg_addr``: uint64 [NA], each argument row resolved to its device address (0: absent);
    ``prefetch``: int32 [T] planned prefetch bytes per task (None: -1, the MPK_PREFETCH_KB cap);
    ``prefetch_next``: int32 [T] bytes of the task's aot successor to prefetch during its wait (None: 0,
    prefetch_plan.hoist_ahead); ``bulk_prefetch``: every record's prefetches by bulk copies; ``stage_kv``: the
    split-KV tiles stage their cache rows in shared memory (the launch must have
    lowering_attention.kv_stage_smem_bytes)."""
    tasks, A = cg.arrays["tasks"], cg.arrays
    T = tasks.shape[0]
    order = A["worker_tasks"].astype(np.int64)
    if order.shape[0] != T or not np.array_equal(np.sort(order), np.arange(T)):
        raise InputError("task records: expected the aot worker lists to hold every task once")
    col = lambda name: tasks[:, TASK_COLS[name]].astype(np.int64)  # noqa: E731
    nargs, nparams = col("ARG_END") - col("ARG_BEGIN"), col("PARAM_END") - col("PARAM_BEGIN")
    if T and (nargs.max() > REC_MAX_ARGS or nparams.max() > REC_MAX_PARAMS):
        raise InputError(f"task records: expected <= {REC_MAX_ARGS} arguments and <= {REC_MAX_PARAMS} parameters "
                         f"per task, got {nargs.max()} and {nparams.max()} (raise the record size)")
    rec = np.zeros((T, REC_WORDS), dtype=np.int32)  # indexed by task here, reordered at the end
    rec[:, REC_TASK] = np.arange(T)
    rec[:, REC_OPCODE] = col("OPCODE")
    rec[:, REC_PREFETCH] = -1 if prefetch is None else prefetch
    rec[:, REC_PREFETCH_NEXT] = 0 if prefetch_next is None else prefetch_next
    ev = A["events"]
    trig, scope = ev[:, EVENT_COLS["TRIGGERS"]], ev[:, EVENT_COLS["SCOPE"]]
    flags = np.full(T, FLAG_BULK_PREFETCH if bulk_prefetch else 0, dtype=np.int32)
    if stage_kv:
        from mpk_dist.taskgraph.lowering_attention import KV_STAGE_KINDS
        from mpk_dist.taskgraph.tasks import BY_NAME

        staging = np.isin(col("OPCODE"), [BY_NAME[k].opcode for k in KV_STAGE_KINDS])
        flags |= np.where(staging, FLAG_STAGE_KV, 0).astype(np.int32)

    # The waits a record holds: the task's wait rows less those its body replaces by polling a flagged copy
    # (cg.meta["skip_waits"], taskgraph.flag_words; aot only: the jit scheduler reads the tables).
    keep = np.ones(A["waits"].shape[0], dtype=bool)
    keep[np.asarray(cg.meta.get("skip_waits", []), dtype=np.int64)] = False
    kept_rows = np.flatnonzero(keep)
    before = np.concatenate([[0], np.cumsum(keep)])  # kept rows before each wait row
    wb, we = col("WAIT_BEGIN"), col("WAIT_END")
    nw = before[we] - before[wb]
    inline = nw <= REC_MAX_WAITS
    flags |= np.where(inline, FLAG_WAITS_INLINE, 0).astype(np.int32)
    rec[:, REC_NWAITS] = np.where(inline, nw, 0)
    for k in range(REC_MAX_WAITS):
        ok = inline & (k < nw)
        idx = kept_rows[np.where(ok, before[wb] + k, 0)] if len(kept_rows) else np.zeros(T, np.int64)
        e = A["waits"][idx, WAIT_COLS["EVENT"]]
        base = REC_WAITS + k * REC_WAIT_COLS
        rec[:, base] = np.where(ok, e, 0)
        rec[:, base + 1] = np.where(ok, A["waits"][idx, WAIT_COLS["STEP_OFFSET"]], 0)
        rec[:, base + 2] = np.where(ok, trig[e], 0)
        rec[:, base + 3] = np.where(ok, scope[e], 0)

    sb, se = col("SIGNAL_BEGIN"), col("SIGNAL_END")
    ns = se - sb
    inline = ns <= REC_MAX_SIGNALS
    flags |= np.where(inline, FLAG_SIGNALS_INLINE, 0).astype(np.int32)
    rec[:, REC_NSIGNALS] = np.where(inline, ns, 0)
    sys = np.zeros(T, dtype=bool)
    for k in range(int(ns.max()) if T else 0):
        idx, ok = _span(sb, se, k)
        e = A["signals"][idx, SIGNAL_COLS["EVENT"]]
        kind = np.where(A["signals"][idx, SIGNAL_COLS["TARGET"]] == SIG_ALL_RANKS, SIG_KIND_ALL_RANKS,
                        np.where(scope[e] == EV_SCOPE_SYSTEM, SIG_KIND_SYSTEM, SIG_KIND_LOCAL))
        sys |= ok & (kind != SIG_KIND_LOCAL)
        if k < REC_MAX_SIGNALS:
            put = ok & inline
            base = REC_SIGNALS + k * REC_SIGNAL_COLS
            rec[:, base] = np.where(put, e, 0)
            rec[:, base + 1] = np.where(put, kind, 0)
            rec[:, base + 2] = np.where(put, trig[e], 0)
    flags |= np.where(sys, FLAG_SIG_SYS, 0).astype(np.int32)
    rec[:, REC_FLAGS] = flags

    ab, ae = col("ARG_BEGIN"), col("ARG_END")
    addr32 = np.ascontiguousarray(arg_addr).view(np.int32).reshape(-1, 2)  # 64-bit addresses as little-endian words
    buf = A["args"][:, ARG_COLS["BUFFER"]].astype(np.int64)
    dt = np.where(buf >= 0, A["buffers"][np.maximum(buf, 0), BUFFER_COLS["DTYPE"]], -1).astype(np.int32)
    for i in range(REC_MAX_ARGS):
        idx, ok = _span(ab, ae, i)
        rec[:, REC_ARGS + 2 * i] = np.where(ok, addr32[idx, 0], 0)
        rec[:, REC_ARGS + 2 * i + 1] = np.where(ok, addr32[idx, 1], 0)
        rec[:, REC_DTYPES + i] = np.where(ok, dt[idx], -1)
    pb, pe = col("PARAM_BEGIN"), col("PARAM_END")
    for i in range(REC_MAX_PARAMS):
        idx, ok = _span(pb, pe, i)
        rec[:, REC_PARAMS + i] = np.where(ok, A["params"][idx] if len(A["params"]) else 0, 0)

    task_rec = np.empty(T, dtype=np.int32)
    task_rec[order] = np.arange(T, dtype=np.int32)
    return np.ascontiguousarray(rec[order]), task_rec

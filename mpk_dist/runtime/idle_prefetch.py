"""L2 prefetch of the coming linear levels' weights by the workers an attention level leaves idle.

At batch 1 an attention level moves almost no bytes (qwen3-8b: ~0.5 MB in ~17 us; docs/PERF.md v0.17), so
HBM idles for the whole level, while the linear levels after it each pay a ramp and a tail around their
weight stream. An attention op has fewer tiles than the kernel has workers (128 split tiles on 132 SMs), so
a few workers run none of it: their next task (the carrier) starts waiting as soon as their tile of the
level before ends, i.e. when the attention level starts. Each carrier issues bulk L2 prefetches (the
copy engine, fire and forget: the SM's load pipeline stays free) of an equal share of the weights of the
linear ops that follow, in op order, whole ops while they fit in ``budget`` bytes (qwen3-0.6b: o_proj,
gate_up, down and the next layer's qkv, 31.5 MB; qwen3-8b: o_proj, 33.5 MB). Those levels then read their
weights from L2.

Why not the consumers' own prefetches: an o_proj tile's worker reaches that tile only after its own
attention tile, too late to pull 256 KB before the level ends (v0.14: the whole-tile plan moved o_proj by
nothing and slowed the attention by ~1.5 us), and hoisting it into the attention tile's wait puts 128
SMs' prefetches in front of the attention's own loads (v0.14: 5.140 vs 5.042 ms).

The result is per task: up to ``MAX_SPANS`` (address, bytes) pairs, which ``task_records.build_records``
writes into the record (REC_SPAN_ADDR_SLOT, REC_SPAN_BYTES); the aot worker issues them before the task's
wait (csrc/runtime/worker.cuh). aot only: the jit schedule has no fixed carrier. Off unless
MPK_IDLE_PREFETCH_MB is set (mpk_dist.runtime.megakernel_backend).
"""

from __future__ import annotations

import numpy as np

from mpk_dist.errors import InputError
from mpk_dist.runtime.tables import LINEAR_KINDS, weight_block_bytes
from mpk_dist.taskgraph.abi import SIGNAL_COLS, TASK_COLS, WAIT_COLS
from mpk_dist.taskgraph.tasks import BY_NAME, BY_OPCODE

MAX_SPANS = 4
"""Spans one record carries (csrc/runtime/task_record.cuh REC_MAX_SPANS)."""

ATTENTION_KINDS = ("attention", "attention_prep", "attention_split", "attention_split_prep")
"""Levels that move few bytes: their idle workers prefetch for the linear levels after them."""

SPAN_ALIGN = 128
"""Shares are cut at L2-line boundaries (a bulk prefetch needs 16-byte alignment; lines are 128 bytes)."""


def _weight_arg(kind) -> int:
    return [a.name for a in kind.args].index("W")


def _op_weight_range(cg, tiles: np.ndarray, arg_addr: np.ndarray) -> tuple[int, int] | None:
    """(first address, bytes) of the weights of one linear op's tiles, or None when their blocks do not
    form one contiguous range (a span describes one range)."""
    tasks = cg.arrays["tasks"]
    blocks = []
    for t in tiles.tolist():
        kind = BY_OPCODE[int(tasks[t, TASK_COLS["OPCODE"]])]
        row = int(tasks[t, TASK_COLS["ARG_BEGIN"]]) + _weight_arg(kind)
        blocks.append((int(arg_addr[row]), weight_block_bytes(cg, t)))
    blocks.sort()
    if not blocks or blocks[0][0] == 0:
        return None
    for (a, n), (b, _) in zip(blocks, blocks[1:]):
        if a + n != b:
            return None
    return blocks[0][0], blocks[-1][0] + blocks[-1][1] - blocks[0][0]


def _signalling_ops(cg) -> np.ndarray:
    """Per event: the op index of its (first) signalling task, -1 if none."""
    tasks, sig = cg.arrays["tasks"], cg.arrays["signals"]
    out = np.full(cg.arrays["events"].shape[0], -1, np.int64)
    owner = np.repeat(np.arange(tasks.shape[0]), tasks[:, TASK_COLS["SIGNAL_END"]] - tasks[:, TASK_COLS["SIGNAL_BEGIN"]])
    ev = sig[:, SIGNAL_COLS["EVENT"]]
    out[ev[::-1]] = tasks[owner[::-1], TASK_COLS["OP_INDEX"]]
    return out


def _producers(cg, tiles: np.ndarray, sig_op: np.ndarray) -> set[int]:
    """The ops whose tasks signal what ``tiles`` wait on in their own step."""
    tasks, waits = cg.arrays["tasks"], cg.arrays["waits"]
    out = set()
    for t in tiles.tolist():
        for k in range(int(tasks[t, TASK_COLS["WAIT_BEGIN"]]), int(tasks[t, TASK_COLS["WAIT_END"]])):
            if int(waits[k, WAIT_COLS["STEP_OFFSET"]]) == 0:
                op = int(sig_op[int(waits[k, WAIT_COLS["EVENT"]])])
                if op >= 0:
                    out.add(op)
    return out


def _shares(start: int, nbytes: int, k: int) -> list[tuple[int, int]]:
    """``k`` consecutive (address, bytes) pieces of [start, start + nbytes), cut at SPAN_ALIGN lines."""
    cuts = [start] + [start + (nbytes * i // k) // SPAN_ALIGN * SPAN_ALIGN for i in range(1, k)] + [start + nbytes]
    return [(a, b - a) for a, b in zip(cuts, cuts[1:])]


def idle_spans(cg, arg_addr: np.ndarray, budget: int) -> np.ndarray:
    """int64 [T, MAX_SPANS, 2]: per task the (address, bytes) spans it prefetches into L2 before its aot wait
    (bytes 0: none). For every attention op: the linear ops after it (before the next attention op), whole
    ops in order while their weights sum to <= ``budget`` bytes and at most MAX_SPANS of them, cut into one
    equal share per carrier. A carrier is the next task of a worker that runs no tile of the attention op
    and whose previous task belongs to one of the attention op's producers (so its wait starts with the
    attention level). ``arg_addr``: uint64 [NA] argument addresses (task_records.build_records')."""
    if budget < 0:
        raise InputError(f"idle prefetch budget: expected >= 0 bytes, got {budget}")
    tasks = cg.arrays["tasks"]
    T = tasks.shape[0]
    spans = np.zeros((T, MAX_SPANS, 2), np.int64)
    if budget == 0 or T == 0:
        return spans
    opcode, op_index, worker = (tasks[:, TASK_COLS[c]].astype(np.int64) for c in ("OPCODE", "OP_INDEX", "WORKER"))
    attn_codes = [BY_NAME[k].opcode for k in ATTENTION_KINDS]
    linear_codes = [BY_NAME[k].opcode for k in LINEAR_KINDS]
    ops = sorted(set(op_index.tolist()))
    op_code = {op: int(opcode[np.argmax(op_index == op)]) for op in ops}
    offs, lst = cg.arrays["worker_offsets"], cg.arrays["worker_tasks"]
    W = len(offs) - 1
    sig_op = _signalling_ops(cg)
    for pos, a in enumerate(ops):
        if op_code[a] not in attn_codes:
            continue
        ranges, used = [], 0
        for b in ops[pos + 1:]:
            if op_code[b] in attn_codes or len(ranges) == MAX_SPANS:
                break
            if op_code[b] not in linear_codes:
                continue
            rng = _op_weight_range(cg, np.nonzero(op_index == b)[0], arg_addr)
            if rng is None or used + rng[1] > budget:
                break
            ranges.append(rng)
            used += rng[1]
        if not ranges:
            continue
        tiles = np.nonzero(op_index == a)[0]
        producers = _producers(cg, tiles, sig_op)
        busy = set(worker[tiles].tolist())
        carriers = []
        for w in range(W):
            if w in busy:
                continue
            order = lst[int(offs[w]):int(offs[w + 1])].tolist()
            for prev, t in zip(order, order[1:]):
                if op_index[t] > a:
                    if op_index[prev] in producers:
                        carriers.append(t)
                    break
        if not carriers:
            continue
        for start, nbytes in ranges:
            for (addr, n), t in zip(_shares(start, nbytes, len(carriers)), carriers):
                k = int(np.argmin(spans[t, :, 1] > 0))  # the carrier's first free span
                if spans[t, k, 1] > 0:
                    raise InputError(f"idle prefetch: task {t} carries more than {MAX_SPANS} spans")
                spans[t, k] = (addr, n)
    return spans


def describe(spans: np.ndarray) -> str:
    """One line: carriers, spans and bytes per step."""
    carriers = int((spans[:, :, 1] > 0).any(axis=1).sum())
    return (f"idle-worker L2 prefetch: {carriers} carrier tasks, {int((spans[:, :, 1] > 0).sum())} spans, "
            f"{int(spans[:, :, 1].sum()) / 1e6:.1f} MB per step")

"""How many weight bytes each linear tile pulls into L2 before it waits on its inputs.

A worker issues an L2 prefetch of its next task's weights and then spins on that task's input
events. Most linear ops follow another full-width linear: their wait is short, and prefetching whole
tiles there (132 tiles of up to ~1.6 MB, more than the L2) only evicts lines before they are used,
so those tasks keep the kernel's small default cap (``MPK_PREFETCH_KB``). A linear that waits on a
NARROW op (few tasks: an unfused rms_norm, or unsplit attention's 8 tiles, which run for tens of
microseconds on a handful of SMs) leaves every other SM idle for that long; its whole weight block fits
in L2 and can be in L2 by the time the inputs arrive. This module marks those tasks.

Behind attention in a batch-1 program nothing is planned (NO_PLAN_BEHIND_ATTENTION_MAX_BATCH): measured on an H200
(docs/PERF.md v0.30) the whole-tile o_proj plan behind the 8B presets' 8 unsplit tiles cost 0.5-0.6% a token. The
tiles' 16-byte loads read L2 no faster than HBM when every SM reads: on an H100, 132 SMs read 3.1-3.3 TB/s from L2
by loads (32-128 KB in flight an SM) against 3.2 TB/s from HBM, and only bulk copies into shared memory read L2
faster, 6.0-7.6 TB/s (csrc/bench/l2_steady_bw.cu, docs/PERF.md v0.49). So o_proj ran ~9.3 us either way (the trace's
figure), and the prefetch traffic slowed the latency-bound attention walk beside it. Streaming those whole-block
tiles through a 2-stage bulk-copy ring instead measured 11% slower a token at qwen3-8b (v0.50). Batches 2-4
(16-32 unsplit tiles) keep the plan (batch 2 measured even without it).

Split-KV attention (64-72 tiles for qwen3-8b at context 512) is deliberately NOT narrow: planning the
o_proj tiles behind it measured slower (docs/PERF.md v0.14: qwen3-8b 5.042 vs 5.008 ms, the attention
level 19.5-20.4 vs 18.0-18.7 us: the 33.5 MB of prefetches slow the attention's own loads more than
they speed up o_proj).

A tile whose own worker runs one of those narrow producers earlier in its list gets 0 (no prefetch):
that worker reaches the tile when its input is (nearly) ready, so there is nothing to hide and issuing
the prefetch only delays the level's last tile (the v0.4 trace: the 8 attention workers started their
o_proj tile 3.9 us after their attention, and the o_proj level ended 5.5 us after its first tile).

The plan is a per-task int32 array (bytes, 0 for none, or -1 for "the kernel's default cap") that the session
puts into the task records (``task_records.build_records``: REC_PREFETCH); it depends on the device (L2 size, workers),
so it is made at load time, not by the task-graph compiler.
"""

from __future__ import annotations

import numpy as np

from mpk_dist.runtime.tables import LINEAR_KINDS, weight_block_bytes
from mpk_dist.taskgraph.abi import EVENT_COLS, SIGNAL_COLS, TASK_COLS, WAIT_COLS
from mpk_dist.taskgraph.tasks import BY_NAME

NARROW_FRACTION = 0.25
"""An input event with fewer signallers per step than this share of the workers marks a long wait."""

L2_SHARE = 0.7
"""Share of the L2 one op's whole-tile prefetches may fill (the rest: activations, the KV cache)."""

NO_PLAN_BEHIND_ATTENTION_MAX_BATCH = 1
"""Programs of up to this many sequences plan nothing behind an attention op: their tiles keep the kernel's default
cap. Measured (docs/PERF.md v0.30): behind qwen3-8b's and llama3-8b's 8 unsplit batch-1 attention tiles the o_proj
plan cost 0.5-0.6% a token (4.639 / 4.643 vs 4.609 / 4.614 ms without it; llama3-8b 4.448 / 4.456 vs 4.422 / 4.429),
o_proj ran ~9.3 us either way (132 SMs read 5.0 TB/s from L2 against 4.2-4.7 from HBM, csrc/bench/sm_read_bw.cu
--l2: L2 is hardly faster to stream from), and the prefetches slowed the latency-bound attention tiles beside them.
Batches 2-4 (16-32 unsplit tiles, narrow too) keep the plan: at qwen3-8b batch 2 it measured even (5.708 / 5.668 ms
with it, 5.713 / 5.645 without), batches 3-4 were not measured without it."""

ATTENTION_KINDS = ("attention", "attention_prep", "attention_split", "attention_split_prep", "attention_merge",
                   "paged_attention")
"""The task kinds of an attention op (NO_PLAN_BEHIND_ATTENTION_MAX_BATCH)."""


def _waits(cg, task: int) -> set[int]:
    """The events ``task`` waits on in its own step."""
    row, waits = cg.arrays["tasks"][task], cg.arrays["waits"]
    w = waits[int(row[TASK_COLS["WAIT_BEGIN"]]):int(row[TASK_COLS["WAIT_END"]])]
    return {int(e) for e, off in zip(w[:, WAIT_COLS["EVENT"]], w[:, WAIT_COLS["STEP_OFFSET"]]) if int(off) == 0}


def _narrow_events(cg, task: int, workers: int) -> set[int]:
    """The events with few signallers that ``task`` waits on in its own step."""
    events = cg.arrays["events"]
    return {e for e in _waits(cg, task) if 0 < int(events[e, EVENT_COLS["TRIGGERS"]]) < NARROW_FRACTION * workers}


def _worker_pairs(cg):
    """(task, the next task in its aot worker list) for every worker list of ``cg``."""
    offs, lst = cg.arrays["worker_offsets"], cg.arrays["worker_tasks"]
    for w in range(len(offs) - 1):
        order = lst[int(offs[w]):int(offs[w + 1])].tolist()
        yield from zip(order, order[1:])


def _signals(cg, task: int) -> set[int]:
    row = cg.arrays["tasks"][task]
    sig = cg.arrays["signals"][int(row[TASK_COLS["SIGNAL_BEGIN"]]):int(row[TASK_COLS["SIGNAL_END"]])]
    return {int(e) for e in sig[:, SIGNAL_COLS["EVENT"]]}


def _producer_first(cg, waits: dict[int, set[int]]) -> set[int]:
    """The tasks of ``waits`` ({task: events it waits on}) whose own aot worker list has, before them, a task that
    signals one of those events (their input is ready when the worker reaches them). One pass per worker list."""
    offs, lst = cg.arrays["worker_offsets"], cg.arrays["worker_tasks"]
    out: set[int] = set()
    for w in range(len(offs) - 1):
        signalled: set[int] = set()
        for t in lst[int(offs[w]):int(offs[w + 1])].tolist():
            if t in waits and waits[t] & signalled:
                out.add(t)
            signalled |= _signals(cg, t)
    return out


def _attention_events(cg) -> set[int]:
    """The events an attention-kind task signals."""
    tasks = cg.arrays["tasks"]
    kinds = {BY_NAME[k].opcode for k in ATTENTION_KINDS}
    out: set[int] = set()
    for t in np.flatnonzero(np.isin(tasks[:, TASK_COLS["OPCODE"]], list(kinds))).tolist():
        out |= _signals(cg, t)
    return out


def _linear_tiles_by_op(cg) -> dict[int, list[int]]:
    """{op index: its tiles} of every linear op of ``cg``, tiles in task order."""
    tasks = cg.arrays["tasks"]
    opcodes = {BY_NAME[k].opcode for k in LINEAR_KINDS}
    by_op: dict[int, list[int]] = {}
    for t in range(tasks.shape[0]):
        if int(tasks[t, TASK_COLS["OPCODE"]]) in opcodes:
            by_op.setdefault(int(tasks[t, TASK_COLS["OP_INDEX"]]), []).append(t)
    return by_op


def _narrow_tiles(cg, workers: int, l2_bytes: int,
                  behind_attention: bool = False) -> dict[int, tuple[int, set[int]]]:
    """{task: (bytes, narrow events)} for every tile of a linear op that waits on a narrow op: its whole
    weight block, or an equal share of ``L2_SHARE * l2_bytes`` when the op's blocks together exceed it.
    An attention op is not counted as narrow in programs of up to NO_PLAN_BEHIND_ATTENTION_MAX_BATCH sequences
    unless ``behind_attention`` (MPK_PLAN_BEHIND_ATTENTION)."""
    small = int(cg.meta["batch"]) <= NO_PLAN_BEHIND_ATTENTION_MAX_BATCH
    skip = _attention_events(cg) if small and not behind_attention else set()
    budget = int(L2_SHARE * l2_bytes)
    out = {}
    for tiles in _linear_tiles_by_op(cg).values():
        narrow = _narrow_events(cg, tiles[0], workers) - skip
        if narrow:
            share = budget // len(tiles)
            out.update({t: (min(weight_block_bytes(cg, t), share), narrow) for t in tiles})
    return out


def _behind_attention_bytes(cg, workers: int, plan: np.ndarray, nbytes: int) -> np.ndarray:
    """``plan`` with every tile of a linear op that waits on a narrow attention op in a program of up to
    NO_PLAN_BEHIND_ATTENTION_MAX_BATCH sequences (their tiles otherwise keep the kernel's cap, -1) set to ``nbytes``
    (at most its weight block), or 0 where its own worker runs the attention first (as prefetch_plan's rule).
    MPK_PREFETCH_BEHIND_ATTENTION_KB. Why: behind the 8B presets' 8 unsplit batch-1 tiles the 124 o_proj tiles'
    64 KB caps (~8 MB) go to HBM as the attention level starts, and the walk's first key round trip takes 2.2-3.0 us
    there against ~0.8 us on an idle HBM (docs/PERF.md v0.40); o_proj streams at the HBM's rate whether its head is
    in L2 or not (L2 is hardly faster, v0.30), so 0 may shorten the attention level at no cost to o_proj."""
    if int(cg.meta["batch"]) > NO_PLAN_BEHIND_ATTENTION_MAX_BATCH:
        return plan
    attention = _attention_events(cg)
    waiting = {}
    for tiles in _linear_tiles_by_op(cg).values():
        narrow = _narrow_events(cg, tiles[0], workers) & attention
        if narrow:
            waiting.update({t: narrow for t in tiles})
    first = _producer_first(cg, waiting)
    out = plan.copy()
    for t in waiting:
        out[t] = 0 if t in first else min(nbytes, weight_block_bytes(cg, t))
    return out


# MPK_PREFETCH_LEVEL_KB's default (KB), per batch, where a cap other than the kernel's 64 KB measured faster in the
# same process at tp 1 with tensor-core linears: qwen3-8b batch 8 at 192 KB, -1.3% (H200, v0.28), -0.7% (H200,
# v0.29), -1.1% and -1.1% (H100, v0.41: tune_sweep 6.764 / 6.761 vs 6.834 / 6.844 ms, bench 6.759 vs 6.832). Since
# v0.47's shorter norm prologue, 96 KB (H100, tune_sweep in one process: 6.441 / 6.446 ms vs 6.470 / 6.478 at 192,
# 128 KB 6.451 / 6.450, 48 KB 6.548 / 6.541, 320 KB 6.632 / 6.639, 0 KB 6.755 / 6.755; not measured on an H200).
# Batches 4 and 16 measured slower at 192 KB (v0.28), so no other batch has an entry.
TUNED_LEVEL_KB = {8: 96}


def default_level_kb(batch: int, world_size: int, linear_mma: bool) -> int | None:
    """MPK_PREFETCH_LEVEL_KB's value when the variable is unset: TUNED_LEVEL_KB's entry for ``batch`` in a one-GPU
    program with tensor-core linears (where it was measured), else None (the kernel's compiled cap)."""
    if world_size != 1 or not linear_mma:
        return None
    return TUNED_LEVEL_KB.get(batch)


def prefetch_plan(cg, workers: int, l2_bytes: int, level_bytes: int | None = None,
                  behind_attention: bool = False) -> np.ndarray:
    """Per task: L2 prefetch bytes before its waits (>= 0), or -1 for the kernel's default cap.

    Tiles of a linear op that waits on a narrow op get their whole weight block, or an equal share of
    ``L2_SHARE * l2_bytes`` when the op's blocks together exceed it (0 when their own worker runs one
    of the narrow producers first). ``level_bytes`` (MPK_PREFETCH_LEVEL_KB): every other linear tile's
    bytes instead of the kernel's compiled cap, so one binary can be measured at several caps; every
    other task gets -1. ``behind_attention`` (MPK_PLAN_BEHIND_ATTENTION): plan behind a narrow attention op
    in batch-1 programs too (NO_PLAN_BEHIND_ATTENTION_MAX_BATCH).
    """
    return _plan_of(cg, _narrow_tiles(cg, workers, l2_bytes, behind_attention), level_bytes)


def prefetch_next(cg, workers: int, l2_bytes: int, next_bytes: int, plan: np.ndarray,
                  ahead: np.ndarray | None = None) -> np.ndarray:
    """``ahead`` (per task: bytes of the next task in its aot worker list prefetched during its wait,
    REC_PREFETCH_NEXT; None: none yet) with, for every tile of a linear op that waits on a narrow op (a
    batch-1 attention op included), up to ``next_bytes`` of its worker's next task where that is a linear
    tile of the level right after it (one that waits on the op's signals; MPK_PREFETCH_NEXT_KB).
    Why: behind the 8B presets' 8 unsplit batch-1 attention tiles every other SM waits ~15 us with HBM idle,
    and the level after o_proj (the gate|up projection, 201 MB a layer) is the largest; on a GPU whose L2
    reads much faster than its HBM (an H100: ~3.05 TB/s from HBM, while v0.24 measured 5.0 TB/s from L2 on
    the same die in an H200) the head of each gate|up tile could be in L2 before its level starts.
    The next tiles' bytes of one waiting op together stay within ``L2_SHARE * l2_bytes`` less what ``plan``
    already puts into L2 for that op; a task that already prefetches ahead (hoist_ahead) keeps its bytes."""
    if next_bytes < 0:
        raise ValueError(f"next_bytes: expected >= 0, got {next_bytes}")
    tasks = cg.arrays["tasks"]
    out = np.zeros(tasks.shape[0], np.int32) if ahead is None else ahead.astype(np.int32, copy=True)
    if next_bytes == 0:
        return out
    linear = {BY_NAME[k].opcode for k in LINEAR_KINDS}
    nxt = dict(_worker_pairs(cg))
    budget = int(L2_SHARE * l2_bytes)
    for tiles in _linear_tiles_by_op(cg).values():
        if not _narrow_events(cg, tiles[0], workers):
            continue
        room = budget - sum(max(0, int(plan[t])) for t in tiles)
        share = max(0, room) // len(tiles)
        signalled = set().union(*(_signals(cg, t) for t in tiles))
        for t in tiles:
            n = nxt.get(t)
            # only a tile of the level right after this op (it waits on this op's signals): a later level's head
            # would be streamed past by that level before it is read
            if (n is not None and int(tasks[n, TASK_COLS["OPCODE"]]) in linear and out[t] == 0
                    and _waits(cg, n) & signalled):
                out[t] = min(next_bytes, weight_block_bytes(cg, n), share)
    return out


def _plan_of(cg, tiles: dict[int, tuple[int, set[int]]], level_bytes: int | None = None) -> np.ndarray:
    """prefetch_plan's array from ``_narrow_tiles``' result (``level_bytes``: see prefetch_plan)."""
    tasks = cg.arrays["tasks"]
    plan = np.full(tasks.shape[0], -1, np.int32)
    if level_bytes is not None:
        linear = np.isin(tasks[:, TASK_COLS["OPCODE"]], [BY_NAME[k].opcode for k in LINEAR_KINDS])
        plan[linear] = level_bytes
    first = _producer_first(cg, {t: narrow for t, (_, narrow) in tiles.items()})
    for t, (nbytes, _) in tiles.items():
        plan[t] = 0 if t in first else nbytes
    return plan


def hoist_ahead(cg, workers: int, l2_bytes: int, level_bytes: int | None = None,
                behind_attention: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(plan, ahead): ``prefetch_plan`` with the narrow-waiting tiles' prefetch moved one task earlier
    on their aot worker where that earlier task is not a linear (an attention or other narrow task:
    its wait is idle HBM time, where a linear predecessor's is its own weight stream). ``ahead[t]``:
    bytes of the next task in t's worker list that t's worker prefetches during t's wait
    (REC_PREFETCH_NEXT); the hoisted tile's own plan becomes 0. A tile whose worker runs a narrow
    producer right before it (0 in ``prefetch_plan``) gets its bytes this way too. aot only: the jit
    schedule has no fixed predecessor. ``behind_attention``: as in prefetch_plan."""
    tasks = cg.arrays["tasks"]
    tiles = _narrow_tiles(cg, workers, l2_bytes, behind_attention)
    plan = _plan_of(cg, tiles, level_bytes)
    ahead = np.zeros(tasks.shape[0], np.int32)
    linear_ops = {BY_NAME[k].opcode for k in LINEAR_KINDS}
    for prev, t in _worker_pairs(cg):
        if t in tiles and int(tasks[prev, TASK_COLS["OPCODE"]]) not in linear_ops:
            ahead[prev], plan[t] = tiles[t][0], 0
    return plan, ahead


def plan_tables(cg, workers: int, l2_bytes: int, level_bytes: int | None = None, hoist: bool = False,
                behind_attention: bool = False, next_bytes: int = 0,
                behind_attention_bytes: int | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """(plan, ahead or None) as a session's task records take them (REC_PREFETCH, REC_PREFETCH_NEXT): prefetch_plan,
    or hoist_ahead with ``hoist`` (MPK_PREFETCH_AHEAD), then prefetch_next's bytes with ``next_bytes`` > 0
    (MPK_PREFETCH_NEXT_KB); ``behind_attention``: MPK_PLAN_BEHIND_ATTENTION; ``behind_attention_bytes`` (not None):
    the batch-1 tiles behind attention get that many bytes instead of the kernel's cap
    (MPK_PREFETCH_BEHIND_ATTENTION_KB, _behind_attention_bytes; not with ``behind_attention``, which plans them)."""
    if behind_attention and behind_attention_bytes is not None:
        raise ValueError("behind_attention and behind_attention_bytes: expected at most one (both plan the tiles "
                         "behind batch-1 attention)")
    if hoist:
        plan, ahead = hoist_ahead(cg, workers, l2_bytes, level_bytes, behind_attention=behind_attention)
    else:
        plan, ahead = prefetch_plan(cg, workers, l2_bytes, level_bytes, behind_attention=behind_attention), None
    if behind_attention_bytes is not None:
        plan = _behind_attention_bytes(cg, workers, plan, behind_attention_bytes)
    if next_bytes > 0:
        ahead = prefetch_next(cg, workers, l2_bytes, next_bytes, plan, ahead)
    return plan, ahead


def describe(cg, plan: np.ndarray, ahead: np.ndarray | None = None) -> str:
    """One line: how many tasks of how many ops get a planned prefetch, its total size, how many tiles
    skip it (their worker ran the producer) and, with ``ahead`` (hoist_ahead), how many have it issued
    during their predecessor's wait."""
    marked = np.nonzero(plan > 0)[0]
    ops = {int(cg.arrays["tasks"][t, TASK_COLS["OP_INDEX"]]) for t in marked}
    hoisted = 0 if ahead is None else int((ahead > 0).sum())
    line = (f"whole-tile L2 prefetch: {len(marked)} tasks of {len(ops)} ops, {int(plan[marked].sum()) / 1e6:.1f} MB per "
            f"step; {int((plan == 0).sum()) - hoisted} tiles none (their worker runs the producer first)")
    if ahead is not None:
        line += f"; {hoisted} tiles ({int(ahead.sum()) / 1e6:.1f} MB) issued during the previous task's wait"
    return line

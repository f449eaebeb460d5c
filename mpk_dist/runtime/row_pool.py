"""Row pools: the last rows of every tile of a wide batch-1 linear level, summed by whichever tile is free first.

A wide level's tiles (qwen3-8b's gate|up, down and o_proj: 128 tiles on 132 SMs) start together but stream at
different rates, so they end 5-8 us apart at gate|up on an H100 while the median tile runs at the level's byte rate
(docs/PERF.md v0.39); once fewer than ~110 SMs still stream, the HBM is no longer full. With a pool, each tile sums
its static rows, then claims chunks of the pooled rows (the last ``rows`` of each tile of the op) from a counter
until none is left (csrc/tasks/row_pool.cuh). Each row is still one warp's sum in the same order: the same bits.

This module decides which ops pool and writes what the task records carry (REC_POOL_*, task_records.py). An op
pools only when its tiles can reach each other's rows from their own pointers and nobody waits on a single tile:

* a ``linear_residual`` or ``norm_linear_silu`` op of batch 1 with no optional argument (flagged copies, the folded
  down projection, a second output: the pooled rows write the plain output only);
* uniform tiles: the same parameters, the same buffers, tile i's weight rows, output and residual columns at the
  first tile's moved by i tiles, the same input;
* one event that every tile signals and nothing else (its trigger count is the op's tiles), so each consumer
  waits for the whole level, which includes every pooled row;
* for a pair tile, the normalised row and the tile's sums fit the launch's shared memory (the pool reuses the
  row the static part staged).

A session takes it as a record-level switch (MPK_ROW_POOL=<percent of each tile's rows>; the same binary).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mpk_dist.taskgraph.abi import ARG_COLS, EVENT_COLS, SIGNAL_COLS, TASK_COLS
from mpk_dist.taskgraph.tasks import BY_NAME, BY_OPCODE

POOL_KINDS = ("linear_residual", "norm_linear_silu")
"""Task kinds whose tiles can pool rows (their CUDA bodies call the pool loops)."""

PAIR_KINDS = ("norm_linear_silu",)
"""Of those, the kinds whose tile is a gate half and an up half: a chunk is one column (two rows) a warp pair."""

STAGE_SCRATCH_BYTES = 64 * 4
"""fused_gemv.cuh kStageOffset floats: the block-reduction scratch before the staged rows."""

PAIR_ALIGN = 16
"""norm_linear_silu.cuh kPairAlign: the pair sums start this aligned after the staged rows."""

MAX_PERCENT = 90
"""The largest pooled share of a tile's rows MPK_ROW_POOL accepts (a tile keeps some static rows)."""


@dataclass
class RowPoolPlan:
    """Per task (int32 [T]): ``tiles`` of its pooled op (0: not pooled), its ``tile`` index there, the pooled
    ``rows`` at the end of each tile (a pair tile: columns of each half) and its op's ``counter`` index (-1: none);
    ``ops``: how many ops pool (counters to allocate)."""

    tiles: np.ndarray
    tile: np.ndarray
    rows: np.ndarray
    counter: np.ndarray
    ops: int

    def describe(self) -> str:
        """One line: pooled ops, tiles and rows."""
        pooled = self.tiles > 0
        return (f"row pool: {self.ops} ops, {int(pooled.sum())} tiles, "
                f"{int(self.rows[pooled].sum())} pooled rows (pair tiles: columns)")


def chunk_rows(kind: str, worker_threads: int) -> int:
    """Rows of one claimed chunk: one a warp, or one column a warp of each half of a pair tile (row_pool.cuh
    pool_chunk_rows)."""
    return worker_threads // 64 if kind in PAIR_KINDS else worker_threads // 32


def _arg(cg, task: int, kind, name: str) -> tuple[int, int]:
    """(buffer, element offset) of argument ``name`` of ``task`` (buffer < 0: absent)."""
    row = cg.arrays["args"][int(cg.arrays["tasks"][task, TASK_COLS["ARG_BEGIN"]]) + kind.arg_index(name)]
    return int(row[ARG_COLS["BUFFER"]]), int(row[ARG_COLS["OFFSET"]])


def _params(cg, task: int) -> np.ndarray:
    row = cg.arrays["tasks"][task]
    return cg.arrays["params"][int(row[TASK_COLS["PARAM_BEGIN"]]):int(row[TASK_COLS["PARAM_END"]])]


def _signals(cg, task: int) -> np.ndarray:
    row = cg.arrays["tasks"][task]
    return cg.arrays["signals"][int(row[TASK_COLS["SIGNAL_BEGIN"]]):int(row[TASK_COLS["SIGNAL_END"]]),
                                SIGNAL_COLS["EVENT"]]


def _uniform_order(cg, tiles: list[int], kind) -> list[int] | None:
    """The op's tiles ordered by their rows when they are uniform (see the module doc), else None."""
    pair = kind.name in PAIR_KINDS
    p0 = _params(cg, tiles[0])
    if any(not np.array_equal(_params(cg, t), p0) for t in tiles[1:]):
        return None
    named = {spec.name: int(v) for spec, v in zip(kind.params, p0)}
    if named["BATCH"] != 1:
        return None
    n = named["N_TILE"] // 2 if pair else named["N_TILE"]
    for spec in kind.args:
        if spec.optional and any(_arg(cg, t, kind, spec.name)[0] >= 0 for t in tiles):
            return None
    order = sorted(tiles, key=lambda t: _arg(cg, t, kind, "W")[1])
    # argument -> elements between consecutive tiles' bases
    steps = {"W": n * named["K"], "Y": n, "X": 0}
    steps.update({"RESIDUAL": n} if not pair else {"NORM_W": 0})
    for name, step in steps.items():
        buf0, off0 = _arg(cg, order[0], kind, name)
        for i, t in enumerate(order):
            if _arg(cg, t, kind, name) != (buf0, off0 + i * step):
                return None
    return order


def _whole_level_event(cg, tiles: list[int]) -> bool:
    """Every tile signals exactly one event, the same one, and nothing else signals it."""
    events = {tuple(_signals(cg, t).tolist()) for t in tiles}
    if len(events) != 1:
        return False
    (sig,) = events
    return len(sig) == 1 and int(cg.arrays["events"][sig[0], EVENT_COLS["TRIGGERS"]]) == len(tiles)


def _pair_fits(named: dict, smem_bytes: int) -> bool:
    """The pair tile's staged row and its sums fit below ``smem_bytes`` (norm_linear_silu.cuh pair_buffer)."""
    after_rows = -(-(STAGE_SCRATCH_BYTES + 2 * named["K"]) // PAIR_ALIGN) * PAIR_ALIGN
    return after_rows + 2 * named["N_TILE"] <= smem_bytes


def row_pool_plan(cg, worker_threads: int, percent: int, smem_bytes: int) -> RowPoolPlan:
    """Which tiles pool how many rows: ``percent`` of each eligible op's tile rows (a pair tile: of its columns),
    rounded down to whole chunks (chunk_rows; an op whose share is less than a chunk does not pool), always fewer
    than the tile's rows.
    ``smem_bytes``: the launch's dynamic shared memory below any weight ring."""
    if not 0 <= percent <= MAX_PERCENT:
        raise ValueError(f"percent: expected 0..{MAX_PERCENT}, got {percent}")
    tasks = cg.arrays["tasks"]
    T = tasks.shape[0]
    plan = RowPoolPlan(np.zeros(T, np.int32), np.zeros(T, np.int32), np.zeros(T, np.int32),
                       np.full(T, -1, np.int32), 0)
    if percent == 0:
        return plan
    codes = {BY_NAME[k].opcode for k in POOL_KINDS}
    by_op: dict[int, list[int]] = {}
    for t in np.flatnonzero(np.isin(tasks[:, TASK_COLS["OPCODE"]], list(codes))).tolist():
        by_op.setdefault(int(tasks[t, TASK_COLS["OP_INDEX"]]), []).append(t)
    for tiles in by_op.values():
        kind = BY_OPCODE[int(tasks[tiles[0], TASK_COLS["OPCODE"]])]
        if len(tiles) < 2 or not _whole_level_event(cg, tiles):
            continue
        order = _uniform_order(cg, tiles, kind)
        if order is None:
            continue
        named = {spec.name: int(v) for spec, v in zip(kind.params, _params(cg, tiles[0]))}
        pair = kind.name in PAIR_KINDS
        if pair and not _pair_fits(named, smem_bytes):
            continue
        n = named["N_TILE"] // 2 if pair else named["N_TILE"]
        chunk = chunk_rows(kind.name, worker_threads)
        k = min(n * percent // 100 // chunk, (n - 1) // chunk)
        if k < 1:
            continue
        idx = np.asarray(order)
        plan.tiles[idx] = len(order)
        plan.tile[idx] = np.arange(len(order))
        plan.rows[idx] = k * chunk
        plan.counter[idx] = plan.ops
        plan.ops += 1
    return plan

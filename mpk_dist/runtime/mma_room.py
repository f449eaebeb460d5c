"""Shared memory the tensor-core linear tiles' split-K partials need, worked out from the program's tiles.

csrc/tasks/linear_mma.cuh ``mma_slices`` picks, at run time, how many split-K slices S a tile takes: the balanced
choice (the fewest chunks on the busiest warp) among the slice counts whose partials fit the launch's dynamic
shared memory above the bytes the tile keeps there (its staged operand rows, a pair tile's sums). The launch used
to leave a fixed ``tables.MMA_PARTIAL_PAIRS_PER_WARP`` partials a warp above the largest staged rows, more than
some programs' tiles take: qwen3-8b batch 8 needs 24 KB (3 pairs a warp), not 32. Why it matters: the SM splits
its 256 KB between shared memory and L1 in steps (100, 132, 164 ... KB of shared memory), and a launch a few KB
over a step costs the L1 32 KB (docs/PERF.md v0.45: the silu epilogue's batch-8 program, 3 KB more than the
default's, crossed the 100 KB step and every level slowed).

``partial_room`` mirrors ``mma_slices`` (same arithmetic, integer division as in C) for every tensor-core tile at
the launch size the fixed room gives, and returns the least room that keeps each tile's choices: the same slices,
so the same sums in the same order (the same bits), and the partials where they were (above the operand rows, or
over them after a barrier), so the same barriers, in less shared memory.
"""

from __future__ import annotations

import numpy as np

from mpk_dist.runtime.tables import MMA_PARTIAL_BYTES
from mpk_dist.taskgraph.fusion import STAGE_OFFSET_BYTES, pair_offset

MMA_UNIT_ROWS = 8
"""Weight rows of one warp unit (the n of an m16n8k16 tile; linear_mma.cuh ``units = (n_tile + 7) / 8``)."""
MMA_CHUNK = 32
"""Elements of K one chunk covers (linear_mma.cuh ``chunks = (K + 31) / 32``)."""
MMA_MAX_SLICES = 16
"""Largest split-K tried (``kMmaMaxSlices``)."""
MMA_PARTIAL_ALIGN = 16
"""Slack ``mma_slices`` adds to a need (``kMmaPartialAlign``: the partials' float4 alignment)."""


def partial_bytes(units: int, slices: int) -> int:
    """Bytes of the split-K partials of ``units`` warp units in ``slices`` slices (``mma_partial_bytes``)."""
    return units * slices * MMA_PARTIAL_BYTES


def mma_slices(K: int, n_tile: int, nwarps: int, unroll: int, reserved: int, over_ok: bool, dyn: int) -> int:
    """The split-K slices csrc/tasks/linear_mma.cuh ``mma_slices`` (balanced, the default) picks for a tile with
    ``dyn`` bytes of dynamic shared memory below the ring, ``reserved`` of them the tile's own; 0: the scalar tile."""
    units, chunks = -(-n_tile // MMA_UNIT_ROWS), -(-K // MMA_CHUNK)
    S, best = 1, -(-units // nwarps) * chunks
    s = 2
    while s <= MMA_MAX_SLICES and s <= nwarps and chunks // s >= unroll:
        need = partial_bytes(units, s) + MMA_PARTIAL_ALIGN
        if need > dyn or ((units * s > nwarps or not over_ok) and reserved + need > dyn):
            break  # more slices need more room
        cost = -(-(units * s) // nwarps) * -(-chunks // s)
        if cost < best:
            best, S = cost, s
        s <<= 1
    return S if 2 * min(units * S, nwarps) >= nwarps else 0


def over_operand(n_tile: int, reserved: int, S: int, dyn: int) -> bool:
    """Whether ``gemv_mma_tile`` writes the tile's S-slice partials over its operand rows (after a barrier that
    waits for every warp to finish reading them) because they do not fit above them."""
    units = -(-n_tile // MMA_UNIT_ROWS)
    return S > 1 and reserved + partial_bytes(units, S) + MMA_PARTIAL_ALIGN > dyn


def tile_room(n_tile: int, nwarps: int, reserved: int, over_ok: bool, S: int, dyn_fixed: int) -> int:
    """Dynamic shared memory a tile needs to take S slices as it did at ``dyn_fixed`` (0 for one slice or none):
    its partials above its reserved bytes, or, where they went over the operand rows at ``dyn_fixed`` already
    (one pair a warp at most), only their own size. Keeping that choice keeps the tile's barriers as they were."""
    if S <= 1:
        return 0
    units = -(-n_tile // MMA_UNIT_ROWS)
    need = partial_bytes(units, S) + MMA_PARTIAL_ALIGN
    over = over_operand(n_tile, reserved, S, dyn_fixed)
    return need if over and units * S <= nwarps and over_ok else reserved + need


def mma_tiles(cg) -> list[tuple[int, int, int, bool]]:
    """The distinct (K, n_tile, reserved bytes, over_ok) of program ``cg``'s tiles that may run on tensor cores
    (the linear kinds with at least 2 rows; csrc: ``gemv_fused`` and ``linear``), reserved as their CUDA bodies
    pass it: a staged prologue's rows (norm_linear, silu_linear), those and the pair sums (norm_linear_silu, whose
    partials never go over them), nothing for a plain linear or linear_residual (x read from global memory)."""
    from mpk_dist.taskgraph.tasks import kind_params

    out = set()
    for kind in ("linear", "linear_residual", "norm_linear", "silu_linear", "norm_linear_silu"):
        p = kind_params(cg, kind, "BATCH", "K", "N_TILE")
        if p is None:
            continue
        for B, K, n in np.unique(np.stack(p, axis=1), axis=0).tolist():
            if B < 2:
                continue
            staged = STAGE_OFFSET_BYTES + 2 * B * K if kind in ("norm_linear", "silu_linear", "norm_linear_silu") else 0
            if kind == "norm_linear_silu":  # its gate|up sums after the staged rows (fusion.pair_offset)
                out.add((K, n, max(staged, pair_offset(B, K) + 2 * B * n), False))
            else:
                out.add((K, n, staged, True))
    return sorted(out)


def partial_room(cg, worker_threads: int, unroll: int, dyn_fixed: int) -> int:
    """The least dynamic shared memory (bytes below the ring) with which every tensor-core tile of ``cg`` takes
    the slices it takes at ``dyn_fixed`` (the launch the fixed per-warp room gives): 0 when none needs partials
    above what the other task bodies already ask for."""
    nwarps = worker_threads // 32
    room = 0
    for K, n, reserved, over_ok in mma_tiles(cg):
        if reserved > dyn_fixed:
            continue  # the prologue does not stage here: the body takes its per-element path, no tensor cores
        S = mma_slices(K, n, nwarps, unroll, reserved, over_ok, dyn_fixed)
        room = max(room, tile_room(n, nwarps, reserved, over_ok, S, dyn_fixed))
    return room

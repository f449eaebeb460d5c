"""Lower bounds of the cost model, for branch and bound inside a kernel-graph depth.

Every bound here is at most the cost ``cost.py`` gives any graph it bounds, at any counts the
search may choose, and none looks at an abstract expression: they use shapes, the layout, the
configured counts and the target's output *shape* only, so they cut the same graphs with and
without pruning. A cut drops only graphs that cost more than a verified one (strictly more: a
graph that ties with the best verified one is kept, since the ranking breaks ties by text).

* ``layout_lower_bound``: a custom op of a layout costs at least what reading its input tiles
  costs (``custom_op_cost`` with no outputs, no loop-independent extras), minimised over the
  grid and loop counts of ``blocksearch.count_choices``; the last kernel op also writes the
  target's shape, and only counts at which an output can have that shape are considered.
* ``rest_lower_bound``: what the ops still to come cost at least: one sync point, reading every
  tensor nobody read yet and writing the output, at full device bandwidth; when only one op is
  left, the cheapest layout (or library op) that reads all of those tensors.
"""

from __future__ import annotations

import math
from itertools import combinations

from mpk_dist.superopt import blocksearch as B
from mpk_dist.superopt.cost import H200
from mpk_dist.superopt.ugraph import DTYPE_BYTES, _numel


def _bytes(shape: tuple) -> int:
    return _numel(shape) * DTYPE_BYTES


def _sym_size(layout, infos: dict) -> dict:
    return {s: x for n in layout.inputs for s, x in zip(infos[n].syms, infos[n].shape) if s}


def _admissible(layout, sizes: dict, sym_size: dict, out_shape: tuple | None) -> bool:
    """Can an output of a custom op at these grid counts have ``out_shape`` (None: any)?

    With one grid axis over symbol g and count c: an output dim that carries g has the full
    extent of g (tile x c), so g's extent must be one of the target's dims; an output without g
    gets a leading STACK dim of extent c, which must be the target's first dim. (More grid axes:
    not restricted, which only lowers the bound.)"""
    if out_shape is None or len(layout.grid_syms) != 1:
        return True
    (g,) = layout.grid_syms
    return sym_size[g] in out_shape or (len(out_shape) > 0 and sizes[g] == out_shape[0])


def layout_lower_bound(layout, infos: dict, config, out_shape: tuple | None, m=H200) -> float:
    """Least cost (µs) of any custom op of ``layout`` over ``infos`` at the configured counts;
    ``out_shape``: the last kernel op's output shape (the target's), None for other ops.
    math.inf when no count is valid (the layout has no options)."""
    sym_size = _sym_size(layout, infos)
    if B.representative_sizes(layout, infos, sym_size, config) is None:
        return math.inf  # blocksearch enumerates nothing for it
    st = B.Structure(layout, (), (), ())
    grids, loops = B.count_choices(st, infos, config)
    if layout.loop_sym and not loops:
        return math.inf
    out_b = _bytes(out_shape) if out_shape is not None else 0
    best = math.inf
    for g in grids:
        if not _admissible(layout, g, sym_size, out_shape):
            continue
        parts = _tile_parts(layout, infos, g, m)  # the same for every loop count
        for n in loops or [1]:
            best = min(best, _tile_cost(layout, infos, g, n, out_b, m, parts))
    return best


def _tile_parts(layout, infos: dict, grid: dict, m) -> tuple:
    """What ``_tile_cost`` reads of the inputs at ``grid``, for any loop count: the block
    count, the inputs' device bytes and tile bytes (ints), and the tiles the loop splits."""
    blocks = 1
    for c in grid.values():
        blocks *= c
    dram, per_block, fill, looped = 0, 0, 0, []
    for n in layout.inputs:
        info = infos[n]
        whole = _bytes(info.shape)
        tile_shape = B._tile(info, grid)
        tile = _bytes(tile_shape)
        reps = blocks * _numel(tile_shape) // max(1, _numel(info.shape))
        dram += whole if (reps <= 1 or whole <= m.l2_bytes) else whole * reps
        per_block += tile
        if layout.loop_sym is not None and layout.loop_sym in info.syms:
            looped.append(tile)
        else:
            fill += tile
    return blocks, dram, per_block, fill, tuple(looped)


def _tile_cost(layout, infos: dict, grid: dict, loop_count: int, out_b: int, m,
               parts: tuple | None = None) -> float:
    """``custom_op_cost``'s formula for the inputs alone (plus ``out_b`` output bytes).
    ``parts``: ``_tile_parts`` at ``grid`` when the caller has it (every sum is of ints, so
    hoisting it out of the loop counts changes no float; since the fourteenth session, when
    the rest bounds moved to the pool workers)."""
    blocks, dram, per_block, fill, looped = parts or _tile_parts(layout, infos, grid, m)
    dram += out_b
    per_block += out_b // blocks
    fill += sum(t // loop_count for t in looped)
    waves = math.ceil(blocks / m.sm_count)
    block_us = (per_block + fill) / m.sm_bytes_per_us + \
        (loop_count if layout.loop_sym else 1) * m.loop_iter_us
    return m.sync_us + max(dram / m.hbm_bytes_per_us, waves * block_us)


class RestBound:
    """``rest_lower_bound`` with its per-layout bounds memoized (by tensor shapes and symbols)."""

    def __init__(self, config, out_shape: tuple, m=H200) -> None:
        self.config, self.out_shape, self.m = config, out_shape, m
        self.memo: dict = {}

    def layout(self, layout, infos: dict, final: bool) -> float:
        """``layout_lower_bound`` memoized by the layout and its inputs' shapes and symbols."""
        key = (layout.grid_syms, layout.loop_sym, final,
               tuple((infos[n].shape, infos[n].syms) for n in layout.inputs))
        hit = self.memo.get(key)
        if hit is None:
            hit = self.memo[key] = layout_lower_bound(
                layout, infos, self.config, self.out_shape if final else None, self.m)
        return hit

    def rest(self, tensors: dict, dangling: set, budget: int) -> float:
        """Least cost of ``budget`` (>= 1) more kernel ops that read every tensor of
        ``dangling`` and write the output. One op left: the cheapest custom-op layout over a
        subset of ``tensors`` holding ``dangling``, or a library op on ``dangling``; more: a sync
        point plus the bytes at full device bandwidth."""
        m = self.m
        io = sum(_bytes(tensors[n].shape) for n in dangling) + _bytes(self.out_shape)
        floor = m.sync_us + io / m.hbm_bytes_per_us
        if budget > 1:
            return floor
        key = (tuple(sorted((n, tensors[n].shape, tensors[n].syms, n in dangling)
                            for n in tensors)),)
        hit = self.memo.get(key)
        if hit is not None:
            return hit
        best = floor if len(dangling) <= 2 else math.inf  # a library op reads two tensors
        others = [n for n in tensors if n not in dangling]
        for r in range(0, self.config.max_custom_inputs - len(dangling) + 1):
            for extra in combinations(others, r):
                subset = tuple(n for n in tensors if n in dangling or n in extra)
                if not subset:
                    continue
                for lay in B.layouts(subset, tensors, self.config.max_grid_dims):
                    best = min(best, self.layout(lay, tensors, True))
        self.memo[key] = best
        return best

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
* ``move_bound``: the best-first key of a listed move (its cost plus the rest bound of what it
  leaves unread), and ``first_op_keys``, the same keys of a layout's first ops computed on the
  pool worker that listed them (moved here from ``kernelsearch`` in the fifteenth session: they
  are bounds, and the pool imports them without the kernel search).
"""

from __future__ import annotations

import math
from itertools import combinations

from mpk_dist.superopt import blocksearch as B
from mpk_dist.superopt.context import Context
from mpk_dist.superopt.cost import H200
from mpk_dist.superopt.ugraph import DTYPE_BYTES, TensorInfo, _numel


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

    def floor(self, tensors: dict, dangling: set) -> float:
        """Least cost of any kernel ops after this point that read ``dangling`` and write the
        output: one sync point plus those bytes at full device bandwidth."""
        io = sum(_bytes(tensors[n].shape) for n in dangling) + _bytes(self.out_shape)
        return self.m.sync_us + io / self.m.hbm_bytes_per_us

    def rest(self, tensors: dict, dangling: set, budget: int) -> float:
        """Least cost of ``budget`` (>= 1) more kernel ops that read every tensor of
        ``dangling`` and write the output. One op left: the cheapest custom-op layout over a
        subset of ``tensors`` holding ``dangling``, or a library op on ``dangling``; more: a sync
        point plus the bytes at full device bandwidth."""
        floor = self.floor(tensors, dangling)
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


def move_bound(lower: RestBound, inputs: dict, out_shape: tuple, tensors: dict, args: tuple,
               cost: float, new: dict, dangling: set, budget: int, spent: float,
               memo: dict | None = None) -> float:
    """``KernelSearch._move_bound`` of a move reading ``args`` at ``cost`` and making ``new``
    ({name: TensorInfo}, shapes and symbols only); ``inputs``: the target's input infos."""
    # The move may complete the graph (no op follows) only if it leaves no input unread:
    # ``_record`` drops a graph that ignores an input, and a move whose result is the
    # target's is never extended, so such a move adds nothing either way.
    unread_inputs = any(n in inputs and n not in args for n in dangling)
    if not unread_inputs and any(i.shape == out_shape for i in new.values()):
        return spent + cost
    key = (frozenset(args), tuple((i.shape, i.syms) for i in new.values()))
    rest = memo.get(key) if memo is not None else None
    if rest is None:
        left = (dangling - set(args)) | set(new)
        rest = lower.rest({**tensors, **new}, left, budget - 1)
        if memo is not None:
            memo[key] = rest
    return spent + cost + rest


def first_op_keys(ctx: Context, subset: tuple, options: list, budget: int, state: dict) -> list:
    """The best-first keys (``KernelSearch._move_bound``) of the options of one layout of
    ``subset`` (``catalog.layout_options``) as first ops of a level with ``budget`` ops left:
    the kernel tensors are the target's inputs, none read yet, nothing spent. Computed on the
    pool worker that listed them; ``state``: that process's ``RestBound`` and rest memos, kept
    across its listings as ``_best_first`` keeps one memo per level, for one search: the state
    of another search (another target or config) is dropped first.
    NOTE: a pool worker is forked with its parent's ``state``; a test had called the pool's task
    in the parent for qk_norm_rope, and a later search's workers keyed silu_mul_linear's first
    ops with qk_norm_rope's bounds (1,585 of 2,114 first ops cut in the full test suite)."""
    t = ctx.target
    if state.get("target") is not t or state.get("config") != ctx.config:
        state.clear()
    if "lower" not in state:
        state["target"], state["config"] = t, ctx.config
        state["inputs"] = input_infos(t)
        state["out_shape"] = t.graph.nodes[t.out_node].shape
        state["lower"] = RestBound(ctx.config, state["out_shape"])
    inputs, out_shape = state["inputs"], state["out_shape"]
    memo = state.setdefault(budget, {})
    dangling = set(inputs)
    keys = []
    for st, _, cost, shapes in options:
        new = {n: TensorInfo(shape, syms, None)
               for n, (shape, syms) in zip(out_names(0, len(st.outputs)), shapes)}
        keys.append(move_bound(state["lower"], inputs, out_shape, inputs, subset, cost, new,
                               dangling, budget, 0.0, memo))
    return keys


def out_names(n_ops: int, n: int) -> tuple:
    """Kernel names of the ``n`` outputs of the op at position ``n_ops``: t3, t3_1, ..."""
    return tuple(f"t{n_ops}" + ("" if k == 0 else f"_{k}") for k in range(n))


def input_infos(target) -> dict:
    """{input name: TensorInfo (shape, symbols, abstract expression)} of the target's inputs:
    the kernel tensors a search starts from."""
    g = target.graph
    return {n.attrs["name"]: TensorInfo(n.shape, target.syms[i], target.exprs[i])
            for i, n in enumerate(g.nodes) if n.op == "input"}

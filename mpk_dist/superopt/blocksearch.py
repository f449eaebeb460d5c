"""Enumeration of block graphs for one set of custom-op inputs.

A *layout* names the index symbols the grid axes split and the symbol the for-loop splits; it
fixes every input's imap and fmap (a tensor is split where it carries the symbol, replicated or
loop-invariant where it does not). For each layout the body ops (run per iteration, each must
depend on the loop) and post ops (after the loop) are enumerated depth-first up to
``max_block_ops``, in canonical order: a new op either uses the previous op's result or has a
larger key than the previous op (a neighbour rule: a graph can still come out in several op
orders). Every new tensor's abstract expression goes through the pruning oracle. The last custom
op of a kernel graph is enumerated by ``blockmemo`` instead (each graph once, equivalent
prefixes merged); ``enumerate_layout`` picks the enumerator. Tile sizes do not change which
graphs are valid, so structures are enumerated once per layout and then instantiated for every
grid and loop count (``instantiate``); the cost model picks the counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product

from mpk_dist.superopt import expr as E
from mpk_dist.superopt.context import Context
from mpk_dist.superopt.inference import candidate_ops, infer, intern
from mpk_dist.superopt.ugraph import (STACK, Accumulator, BlockGraph, BlockInput, BlockOp,
                                      BlockOutput, TensorInfo)


@dataclass(frozen=True)
class Layout:
    """Kernel input names, grid symbols (one per axis) and the loop symbol (or None)."""

    inputs: tuple
    grid_syms: tuple
    loop_sym: str | None


@dataclass(frozen=True)
class Structure:
    """A complete block graph without counts: ops as (kind, arg locals, attrs items)."""

    layout: Layout
    body: tuple
    post: tuple
    outputs: tuple      # local names written to device memory

    def __reduce__(self):
        # pickled as a constructor call: pool workers hand back listings of up to ~2·10^6
        # structures, and the default (a fresh state dict per object) pickled to more bytes
        return Structure, (self.layout, self.body, self.post, self.outputs)


def _dim_of(syms: tuple, s) -> int | None | bool:
    """Index of symbol s in syms; None if absent; False if it occurs twice (no valid split)."""
    hits = [d for d, x in enumerate(syms) if x == s]
    return False if len(hits) > 1 else (hits[0] if hits else None)


def layouts(names: tuple, infos: dict, max_grid_dims: int):
    """Every layout of the inputs ``names``: grid symbol tuples x loop symbol."""
    syms = sorted({s for n in names for s in infos[n].syms if s is not None})
    grids = [()]
    for k in range(1, max_grid_dims + 1):
        grids += [g for g in product(syms, repeat=k) if len(set(g)) == k and list(g) == sorted(g)]
    for g in grids:
        for loop in [None, *syms]:
            if loop in g:
                continue
            maps = [_dim_of(infos[n].syms, s) for n in names for s in (*g, loop) if s]
            if any(m is False for m in maps):
                continue
            yield Layout(names, g, loop)


def _counts_for(ext: int, options: tuple) -> list:
    return [c for c in options if ext % c == 0 and ext // c >= 1]


def _tile(info: TensorInfo, splits: dict) -> tuple:
    return tuple(s // splits.get(sym, 1) if sym else s for s, sym in zip(info.shape, info.syms))


class _Builder:
    """Mutable DFS state for one layout at representative counts."""

    def __init__(self, ctx: Context, layout: Layout, infos: dict, sizes: dict,
                 max_outputs: int, early_bound: bool = True) -> None:
        self.ctx, self.layout = ctx, layout
        self.max_outputs = max_outputs
        self.early_bound = early_bound
        grid_split = {s: sizes[s] for s in layout.grid_syms}
        loop = layout.loop_sym
        self.locals: list = []          # [(name, info, phase, loop_dep)]
        for k, n in enumerate(layout.inputs):
            info = infos[n]
            block = TensorInfo(_tile(info, grid_split), info.syms, info.expr)
            dep = loop is not None and loop in info.syms
            tile = TensorInfo(_tile(block, {loop: sizes[loop]}) if dep else block.shape,
                              info.syms, info.expr)
            self.locals.append((f"i{k}", intern(tile if dep else block), "in", dep))
        self.loop_count = sizes[loop] if loop else 1
        self.results: list = []

    def run(self) -> list:
        if self.layout.loop_sym is None:
            self._post([], [], None, None)
        else:
            self._body([], None)
        return self.results

    # -- body -------------------------------------------------------------------------------
    def _dangling(self, ops: list) -> tuple[set, set]:
        """(inputs nobody reads, sinks): the tensors the remaining ops must still consume.

        A sink is a body or post tensor nobody reads; a body tensor read after the loop through
        its accumulator (``a<k>`` of ``b<k>``) is not a sink.
        """
        used = {a for _, args, _ in ops for a in args}
        unused_in = {x[0] for x in self.locals if x[2] == "in" and x[0] not in used}
        sinks = {x[0] for x in self.locals if x[2] != "in" and x[0] not in used
                 and not (x[2] == "body" and "a" + x[0][1:] in used)}
        return unused_in, sinks

    def _fits(self, unused_in: int, sinks: int, left: int) -> bool:
        """Sound bound: can ``left`` more ops still consume every dangling tensor?

        Every input must be read and at most ``max_outputs`` sinks may remain (outputs). An op
        reads at most two tensors, so it consumes at most two unread inputs, and it creates one
        tensor, so it lowers the count of dangling tensors by at most one. A prefix that fails
        this has no complete extension, so dropping it never drops a graph (in both modes).
        """
        return max((unused_in + 1) // 2, unused_in + sinks - self.max_outputs) <= left

    def _slack(self, ops: list) -> bool:
        unused_in, sinks = self._dangling(ops)
        return self._fits(len(unused_in), len(sinks), self.ctx.config.max_block_ops - len(ops))

    def _body(self, body: list, prev) -> None:
        if self.ctx.timed_out() or not self._slack(body):
            return
        if body:
            self._post(body, [], None, None)
        if len(body) >= self.ctx.config.max_block_ops:
            return
        avail = [x for x in self.locals if x[2] in ("in", "body")]
        for kind, args, attrs, info, key in self._candidates(avail, prev, body):
            if not any(avail[i][3] for i in args):
                continue  # body ops must depend on the loop
            name = f"b{len(body)}"
            self.locals.append((name, info, "body", True))
            body.append((kind, tuple(avail[i][0] for i in args), tuple(sorted(attrs.items()))))
            self._body(body, (key, len(avail)))
            body.pop()
            self.locals.pop()

    # -- post -------------------------------------------------------------------------------
    def _accs(self) -> list:
        loop, out = self.layout.loop_sym, []
        for name, info, phase, dep in self.locals:
            if phase == "body" and loop not in info.syms:
                e = E.mk_sum(self.loop_count, info.expr)
                out.append((f"a{name[1:]}", intern(TensorInfo(info.shape, info.syms, e)), "acc",
                            False))
        return out

    def _post(self, body: list, post: list, prev, base) -> None:
        if self.ctx.timed_out():
            return
        if not self._slack(body + post):
            return
        if base is None:  # entering the post phase: invariant inputs and surviving accumulators
            accs = self._accs()
            used = {a for _, args, _ in body for a in args}
            exits = {a[0] for a in accs}
            if any(x[2] == "body" and x[0] not in used and "a" + x[0][1:] not in exits
                   for x in self.locals):
                return  # a body sink that cannot leave the loop is dead
            if any(x[2] == "in" and x[3] and x[0] not in used for x in self.locals):
                return  # a loop-dependent input the body did not read can never be read now
            base = [x for x in self.locals if x[2] == "in" and not x[3]]
            base += [a for a in accs if self.ctx.keep(a[1].expr)]
        avail = base + [x for x in self.locals if x[2] == "post"]
        self._finish(body, post, avail)
        if len(body) + len(post) >= self.ctx.config.max_block_ops:
            return
        for kind, args, attrs, info, key in self._candidates(avail, prev, body + post):
            name = f"p{len(post)}"
            self.locals.append((name, info, "post", False))
            post.append((kind, tuple(avail[i][0] for i in args), tuple(sorted(attrs.items()))))
            self._post(body, post, (key, len(avail)), base)
            post.pop()
            self.locals.pop()

    def _candidates(self, avail: list, prev, ops: list):
        """Valid, canonical, non-redundant, unpruned ops on ``avail`` (``ops``: the prefix).

        NOTE: the dangling-tensor bound (``_fits``) of the extended prefix is checked before the
        op is inferred and counted: the same bound the child would fail at once, applied earlier
        (it depends on names only), so it changes the counters, never the graphs found.
        """
        infos = [x[1] for x in avail]
        seen = {x[1].expr for x in self.locals}
        chains = [p for p, _ in self.ctx.target.chains]
        unused_in, sinks = self._dangling(ops)
        left = self.ctx.config.max_block_ops - len(ops) - 1
        if not self.early_bound:  # tests: the bound applied only where the child checks it
            unused_in, sinks, left = set(), set(), self.ctx.config.max_block_ops
        # what reading each local consumes: itself, or for an accumulator its body tensor
        consumes = [("b" + x[0][1:]) if x[2] == "acc" else x[0] for x in avail]
        dangling = unused_in | sinks
        # dangling tensors the next op itself must consume (it consumes at most two)
        need = len(unused_in) + len(sinks) + 1 - self.max_outputs - left
        if need > 2:
            return
        newest = {i for i, c in enumerate(consumes) if c in dangling} if need > 0 else None
        for kind, args, attrs, akey in candidate_ops(infos, chains, newest):
            key = (kind, args, akey)
            if prev is not None:
                prev_key, prev_n = prev
                if prev_n not in args and key <= prev_key:
                    continue  # canonical order: independent ops appear sorted by key
            read = {consumes[i] for i in args}
            if not self._fits(len(unused_in - read), len(sinks - read) + 1, left):
                continue
            info = infer(kind, [infos[i] for i in args], attrs)
            if info is None or info.expr in seen or not self.ctx.keep(info.expr):
                continue
            yield kind, args, attrs, info, key

    def _finish(self, body: list, post: list, avail: list) -> None:
        """Record the current graph if every tensor is used and it has >= 2 ops."""
        if len(body) + len(post) < 2:
            return
        used = {a for _, args, _ in body + post for a in args}
        names = [x[0] for x in self.locals]
        if any(n not in used for n in names if n.startswith("i")):
            return
        outputs = []
        for name, info, phase, dep in self.locals:
            if phase == "body" and name not in used:
                acc = "a" + name[1:]
                if acc in used:
                    continue  # read after the loop through its accumulator
                if acc not in {a[0] for a in avail}:
                    return  # a body sink must leave the loop through an accumulator
                outputs.append(acc)
            elif phase == "post" and name not in used:
                outputs.append(name)
        if not outputs or len(outputs) > self.max_outputs:
            return
        self.results.append(Structure(self.layout, tuple(body), tuple(post), tuple(outputs)))


def representative_sizes(layout: Layout, infos: dict, sym_size: dict, config) -> dict | None:
    """The smallest configured count for every split symbol (None if some has no count)."""
    sizes = {}
    for s in layout.grid_syms:
        c = _counts_for(sym_size[s], config.grid_counts)
        if not c:
            return None
        sizes[s] = c[0]
    if layout.loop_sym:
        c = _counts_for(sym_size[layout.loop_sym] // sizes.get(layout.loop_sym, 1),
                        config.loop_counts)
        if not c:
            return None
        sizes[layout.loop_sym] = c[0]
    return sizes


def enumerate_layout(ctx: Context, layout: Layout, infos: dict, final: bool = False,
                     early_bound: bool = True, dedup: bool | None = None,
                     share: bool | None = None, keep=None, part=None) -> list:
    """All complete structures of one layout (see module docstring).

    ``final``: the op will be the last kernel op, so it has exactly one output (the target);
    with ``dedup`` (default: ``ctx.config.dedup``, True) its block graphs come from
    ``blockmemo.MemoEnumerator``: each graph once, in canonical order, only those whose output
    can be the target's (``FinalFilter``). ``dedup=False`` (and every non-final op) grows prefixes
    one by one (``_Builder``), which may produce a graph in several op orders.
    ``early_bound=False`` checks the dangling-tensor bound only on entering a prefix instead of
    before inferring each op (the same structures, more work; tests compare the two).
    ``share`` (default: a last op with ``dedup`` and without pruning): the layout is enumerated
    once per input shapes with opaque inputs and tested per concrete inputs (``blockshare``; the
    same structures, tests compare the two).
    ``keep``: None, or a callable on a structure's outputs ((shape, syms) of each kernel output
    at the representative counts, as ``catalog.cost_key`` has them) that may drop the
    structures it returns False for before they are put in canonical order (the deduplicating
    enumerator of a non-last op only; the other paths return everything).
    ``part``: None, or (j, n): the deduplicating enumerator of a non-last op lists only its
    j-th of n parts, as (Structure, position) pairs (``blockmemo.MemoEnumerator.structures``);
    the enumeration itself is the whole one, and its counters are added by part 0 only, so
    that the n parts together count what the whole listing counts.
    """
    sym_size = {}
    for n in layout.inputs:
        for s, x in zip(infos[n].syms, infos[n].shape):
            if s:
                sym_size[s] = x
    sizes = representative_sizes(layout, infos, sym_size, ctx.config)
    if sizes is None:
        return []
    outs = 1 if final else ctx.config.max_block_outputs
    dedup = ctx.config.dedup if dedup is None else dedup
    if share is None:
        share = final and dedup and not ctx.config.prune
    if part is not None and (final or share or not dedup):
        raise ValueError("enumerate_layout: part is for the deduplicating enumerator of a non-last op")
    if share:
        from mpk_dist.superopt.blockshare import shared_final_structures

        return shared_final_structures(ctx, layout, infos, sizes, sym_size)
    if dedup:
        from mpk_dist.superopt.blockmemo import FinalFilter, MemoEnumerator

        explored = ctx.counts["explored"]
        enum = MemoEnumerator(ctx, layout, infos, sizes, outs,
                              FinalFilter(ctx.target, layout, sym_size) if final else None)
        # compact completions, expanded one graph at a time (blockmemo.MemoEnumerator.__init__)
        graphs = map(enum.ops_of, enum.completions())
        if part is not None and part[0] != 0:
            ctx.counts["explored"] = explored  # part 0 counts the enumeration (``part``)
        for key, n in (("deduplicated", enum.deduplicated), ("states", enum.states),
                       ("mismatched", enum.mismatched)):
            if part is None or part[0] == 0:
                ctx.counts[key] = ctx.counts.get(key, 0) + n
        if ctx.timed_out():
            # NOTE: the only caller (``catalog.layout_options``) checks the deadline before it
            # takes the first structure, so it lists nothing from a layout that ran into the
            # deadline; putting that layout's partial graphs in canonical order first kept pool
            # workers (and the main process waiting for them) up to ~75 s past the deadline
            # (qk_norm_rope's first-op layouts of Q, eighteenth session).
            return []
        keep_tiles = None  # ``keep`` is for non-last ops only (docstring)
        if keep is not None and not final:
            grid = tuple((s, sizes[s]) for s in layout.grid_syms)
            keep_tiles = lambda outs: keep(tuple(  # noqa: E731
                kernel_output(shape, syms, grid)[1:] for shape, syms in outs))
        return enum.structures(graphs, keep_tiles, part)
    return _Builder(ctx, layout, infos, sizes, outs, early_bound).run()


class _Invalid(Exception):
    """An op of a structure is not valid at the requested counts."""


def instantiate(st: Structure, sizes: dict, infos: dict, out_names: tuple, origin_of):
    """The BlockGraph of ``st`` at concrete counts and {kernel output name: TensorInfo}.

    Returns (None, None) when some op is invalid at these counts (e.g. a tile dim of 1 that
    would broadcast). ``origin_of`` None: shapes only (no expressions, no origins), for costing.
    """
    try:
        return _instantiate(st, sizes, infos, out_names, origin_of)
    except _Invalid:
        return None, None


_INPUTS_MEMO: dict = {}


def _block_inputs(lay: Layout, sizes: dict, infos: dict) -> tuple:
    """(grid, loop, BlockInputs, {local: per-iteration TensorInfo}) of ``lay``'s inputs at
    ``sizes``: a function of the layout, the counts of its symbols and the inputs' infos, shared
    by every structure of the layout (the count search instantiates each structure at several
    counts, and the input part was ~1/4 of an instantiation)."""
    grid = tuple((s, sizes[s]) for s in lay.grid_syms)
    loop = (lay.loop_sym, sizes[lay.loop_sym]) if lay.loop_sym else None
    ins = tuple(infos[n] for n in lay.inputs)
    key = (lay, grid, loop, ins)
    hit = _INPUTS_MEMO.get(key)
    if hit is not None:
        return hit
    env, inputs = {}, []
    for k, (n, info) in enumerate(zip(lay.inputs, ins)):
        tile = _tile(info, dict(grid))
        imap = tuple(_dim_of(info.syms, s) for s in lay.grid_syms)
        fmap = _dim_of(info.syms, lay.loop_sym) if loop else None
        inputs.append(BlockInput(n, f"i{k}", imap, fmap, tile))
        shape = _tile(TensorInfo(tile, info.syms, info.expr), {lay.loop_sym: loop[1]}) \
            if fmap is not None else tile
        env[f"i{k}"] = TensorInfo(shape, info.syms, info.expr)
    if len(_INPUTS_MEMO) > 100_000:  # bound memory on long searches
        _INPUTS_MEMO.clear()
    hit = _INPUTS_MEMO[key] = (grid, loop, tuple(inputs), env)
    return hit


def _instantiate(st: Structure, sizes: dict, infos: dict, out_names: tuple, origin_of):
    lay = st.layout
    grid, loop, inputs, env = _block_inputs(lay, sizes, infos)
    env = dict(env)
    body = _ops(st.body, "b", env, origin_of)
    accs = []
    for k, (_, _, _) in enumerate(st.body):
        acc = f"a{k}"
        if any(acc in args for _, args, _ in st.post) or acc in st.outputs:
            src = env[f"b{k}"]
            e = E.mk_sum(loop[1], src.expr) if origin_of else None
            info = TensorInfo(src.shape, src.syms, e)
            env[acc] = info
            accs.append(Accumulator(f"b{k}", acc, "sum", info))
    post = _ops(st.post, "p", env, origin_of)
    outputs, kinfos = [], {}
    for local, name in zip(st.outputs, out_names):
        info = env[local]
        omap, shape, syms = kernel_output(info.shape, info.syms, grid)
        outputs.append(BlockOutput(local, name, omap))
        kinfos[name] = TensorInfo(shape, syms, info.expr)
    bg = BlockGraph(grid, loop, inputs, body, tuple(accs), post, tuple(outputs))
    return bg, kinfos


def kernel_output(shape: tuple, syms: tuple, grid: tuple) -> tuple:
    """(omap, shape, syms) of the kernel tensor a block tensor of tile ``shape`` / ``syms``
    writes under ``grid`` ((symbol, count) per axis): a dim that carries an axis's symbol is
    concatenated along (its extent times the count), an axis whose symbol it lacks stacks a new
    leading dim (STACK, symbol ``s#``)."""
    omap, shape, stack = [], list(shape), []
    for s, c in grid:
        d = _dim_of(syms, s)
        if d is None:
            omap.append(STACK)
            stack.append((c, f"{s}#"))
        else:
            omap.append(d)
            shape[d] *= c
    return (tuple(omap), tuple(c for c, _ in stack) + tuple(shape),
            tuple(s for _, s in stack) + tuple(syms))


def _ops(spec: tuple, prefix: str, env: dict, origin_of) -> tuple:
    out = []
    for k, (kind, args, attrs) in enumerate(spec):
        info = infer(kind, [env[a] for a in args], dict(attrs), exprs=origin_of is not None)
        if info is None:
            raise _Invalid(kind)
        name = f"{prefix}{k}"
        env[name] = info
        origin = origin_of(info.expr) if origin_of else ""
        out.append(BlockOp(kind, args, name, info, attrs, origin))
    return tuple(out)


def count_choices(st: Structure, infos: dict, config) -> tuple[list, list]:
    """Grid count assignments and loop counts of the configured options valid for ``st``."""
    sym_size = {s: x for n in st.layout.inputs for s, x in zip(infos[n].syms, infos[n].shape) if s}
    per = [[(s, c) for c in _counts_for(sym_size[s], config.grid_counts)]
           for s in st.layout.grid_syms]
    grids = [dict(combo) for combo in product(*per)]
    loops = _counts_for(sym_size[st.layout.loop_sym], config.loop_counts) \
        if st.layout.loop_sym else []
    return grids, loops

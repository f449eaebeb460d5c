"""Custom-op options of the kernel search: block graphs per input subset and layout, costed.

``BlockCatalog`` lists, for a set of kernel tensors a custom op may read, every block graph of
every layout (``blocksearch.enumerate_layout``) at its cheapest grid and loop counts
(``best_counts``), memoized per subset and per layout. Layouts are enumerated and costed on a
``fork`` process pool when there is one (``processes`` > 1), either all of a subset's layouts at
once (``options``) or only the ones the kernel search asks for (``prefetch`` then
``layout_options``: a layout whose cost bound cannot beat a verified graph is never enumerated).
"""

from __future__ import annotations

import heapq
import itertools
import math
import multiprocessing
import time
from collections import OrderedDict
from dataclasses import replace

from mpk_dist.superopt import blocksearch as B
from mpk_dist.superopt.bounds import _tile_cost, first_op_keys
from mpk_dist.superopt.context import Context
from mpk_dist.superopt.cost import H200, custom_op_cost
from mpk_dist.superopt.inference import infer, is_stack_sym
from mpk_dist.superopt.ugraph import DTYPE_BYTES, TensorInfo, _numel


def _listing_key(final: bool, subset: tuple, infos: dict, k: int | None = None) -> tuple:
    """The catalog's key of ``subset``'s options (``k`` None) or of its layout ``k``'s listing."""
    head = (final, *((n, infos[n]) for n in subset))
    return head if k is None else (*head, k)


# -- worker side of the process pool ------------------------------------------------------------
_WORKER_CTX: Context | None = None
_WORKER_KEYS: dict = {}  # the worker's state for ``bounds.first_op_keys``


def _init_worker(target, config, deadline) -> None:
    global _WORKER_CTX
    _WORKER_CTX = Context(target, config, deadline)


def _layout_task(args):
    """A layout's listing on a pool worker: ((options, keys), the worker's counters); with a
    ``part``, ((options, keys, positions), counters) of that part (``merge_parts``)."""
    layout, infos, final, limit, keyed, part = args
    ctx = _WORKER_CTX
    before = ctx.stats()
    listed = layout_options(ctx, layout, infos, final, limit) if part is None else \
        layout_options(ctx, layout, infos, final, limit, part)
    options = listed if part is None else listed[0]
    keys = None
    if keyed is not None:
        keys = (keyed, first_op_keys(ctx, tuple(infos), options, keyed, _WORKER_KEYS))
    after = ctx.stats()
    delta = {k: after[k] - before.get(k, 0) for k in after}
    return ((options, keys) if part is None else (options, keys, listed[1])), delta


def merge_parts(results: list) -> tuple:
    """(options, keys) of a whole listing from its parts' (options, keys, positions), part 0
    first (``BlockCatalog``'s split listings). Each part is sorted by (structure, position in
    the enumeration) and the whole listing is in that order (``MemoEnumerator.structures``), so
    a merge by that pair gives every option of the whole listing at its place; keys (``None``
    or (budget, one per option)) follow their options."""
    def stream(p: int, options: list, keyed, positions: list):
        keys = keyed[1] if keyed is not None else itertools.repeat(None)
        for o, key, i in zip(options, keys, positions):
            st = o[0]
            yield (st.body, st.post, st.outputs, i), o, key

    merged = list(heapq.merge(*(stream(p, *r) for p, r in enumerate(results)), key=lambda x: x[0]))
    options = [o for _, o, _ in merged]
    keyed = results[0][1] if results else None
    keys = None if keyed is None else (keyed[0], [k for _, _, k in merged])
    return options, keys


class _Split:
    """The pool tasks of one listing's parts, answering as one task (``ready``, ``wait``,
    ``get``) with the merged listing (``merge_parts``) and the sum of the parts' counters."""

    def __init__(self, tasks: list) -> None:
        self.tasks = tasks

    def ready(self) -> bool:
        return all(t.ready() for t in self.tasks)

    def wait(self, timeout: float | None = None) -> None:
        for t in self.tasks:
            if not t.ready():
                t.wait(timeout)
                return

    def get(self, timeout: float | None = None):
        end = None if timeout is None else time.monotonic() + timeout
        got = [t.get(None if end is None else max(0.0, end - time.monotonic())) for t in self.tasks]
        delta: dict = {}
        for _, d in got:
            for k, v in d.items():
                delta[k] = delta.get(k, 0) + v
        return merge_parts([r for r, _ in got]), delta


def layout_options(ctx: Context, layout, infos: dict, final: bool, limit=None, part=None):
    """[(Structure, sizes, cost_us, ((shape, syms) of each output))] of one layout over ``infos``,
    in enumeration order: its structures (``blocksearch.enumerate_layout``), each at its cheapest
    counts (``best_counts``; computed once per ``cost_key``); as the last kernel op (``final``) only those whose output can have the
    target's shape. Runs in a worker process when the catalog has a pool, so the costing is
    spread over the cores with the enumeration (it took as long as the enumeration).
    ``limit``: None, or (µs, output reads) from ``KernelSearch``: structures whose
    ``bytes_lower_bound`` exceeds the µs are neither costed nor listed (``list_limit`` says why
    none of them can be part of a graph that beats or ties the verified one).
    ``part``: None, or (j, n) (a non-last op; ``BlockCatalog``'s split listings): the options
    of the j-th of n parts of the enumeration (``blocksearch.enumerate_layout``) and the
    enumeration position of each, as (options, positions), for ``merge_parts``. Every option is
    costed alone (``best_counts`` through ``cost_key``'s memo gives every structure of a key
    the same counts), so a part lists exactly the whole listing's options of its structures."""
    options = []
    positions = None if part is None else []
    out_shape = ctx.target.graph.nodes[ctx.target.out_node].shape
    rep = _rep_sizes(layout, infos, ctx.config)
    table = None if rep is None else KeyTable(layout, infos, rep)
    memo: dict = {}
    floors: dict = {}  # best_counts' input-tile floors of this layout's counts
    in_bytes = sum(_numel(infos[n].shape) for n in layout.inputs) * DTYPE_BYTES
    keep, early = None, [0]
    if limit is not None and not final:
        # the test below on a structure's outputs, applied by the enumerator before the
        # structure is put in canonical order and keyed (~half of first-op structures of the
        # unpruned attention_decode search are over the limit once a graph is verified)
        def keep(outs: tuple) -> bool:
            ok = bytes_lower_bound(layout, in_bytes, outs, limit[1]) <= limit[0]
            early[0] += not ok
            return ok
    for item in B.enumerate_layout(ctx, layout, infos, final, keep=keep, part=part):
        st, at = (item, None) if part is None else item
        if ctx.timed_out():
            # NOTE: nothing of a listing that the deadline stops is kept, as nothing of an
            # enumeration it stops (``blocksearch.enumerate_layout``): no caller takes a move
            # after the deadline, and a partial listing was pickled, unpickled and merged past
            # it (qk_norm_rope's Q, "none" in 2 parts: 963,667 options, 28 s in the main
            # process's call, the 240 s run ended at 274 s; each part reaches this loop sooner
            # than one whole listing did, twenty-second session)
            return [] if part is None else ([], [])
        if final and not _may_have_shape(st, infos, out_shape, ctx.config, rep):
            ctx.counts["shape_skipped"] = ctx.counts.get("shape_skipped", 0) + 1
            continue
        key = cost_key(st, infos, rep, table)
        if limit is not None and key is not None and \
                bytes_lower_bound(layout, in_bytes, key[2], limit[1]) > limit[0]:
            ctx.counts["over_limit"] = ctx.counts.get("over_limit", 0) + 1
            continue
        best = memo.get(key, False) if key is not None else False
        if best is False:
            best = best_counts(ctx, st, infos, floors)
            if best is not None and best[1] != math.inf:
                best = (*best, _out_shapes(st, best[0], infos))
            if key is not None:
                memo[key] = best
        else:
            ctx.counts["costs_shared"] = ctx.counts.get("costs_shared", 0) + 1
        if best is not None and best[1] != math.inf:
            options.append((st, *best))
            if positions is not None:
                positions.append(at)
    if early[0]:
        ctx.counts["over_limit"] = ctx.counts.get("over_limit", 0) + early[0]
    return options if part is None else (options, positions)


def bytes_lower_bound(layout, in_bytes: int, outs: tuple, out_reads: int, m=H200) -> float:
    """A lower bound (µs) of a custom op's cost plus, when ``out_reads`` is 2, the part of the
    next op's cost that reads its outputs: a sync point plus ``in_bytes`` (its inputs, whole) and
    ``out_reads`` times its outputs' least bytes at full device bandwidth. ``outs``: the outputs'
    (shape, syms) at the layout's representative counts (``cost_key``'s last item).

    Why it bounds ``custom_op_cost`` at every count ``best_counts`` may pick: the cost is a sync
    point plus at least device bytes / bandwidth, and the device bytes count every input at least
    whole and every output whole. An output dim that carries a grid symbol once is that symbol's
    full extent, a dim with no symbol or an unsplit one has the same extent at every count, and a
    STACK dim's extent is the grid count, whose representative (``representative_sizes``) is the
    smallest configured one (``count_choices`` draws from the same list). Any other dim (a grid
    symbol that occurs twice: one of its dims stays a tile, and shrinks as the count grows; the
    loop symbol) may be smaller at other counts, so such an output counts 0 bytes here (found by
    tests/superopt/test_bounds.py: (n, n) from sum(Kt) + sum(V))."""
    split = set(layout.grid_syms) | {layout.loop_sym}
    out_b = 0
    for shape, syms in outs:
        if all(s is None or is_stack_sym(s) or s not in split or
               (s in layout.grid_syms and syms.count(s) == 1) for s in syms):
            out_b += _numel(shape) * DTYPE_BYTES
    return m.sync_us + (in_bytes + out_reads * out_b) / m.hbm_bytes_per_us


def _instantiate(st, sizes: dict, infos: dict):
    """(block graph, infos of its outputs, their names) of ``st`` at ``sizes``, the outputs named
    ``@0``, ``@1``, ... (shape-only uses: no kernel graph to name them in)."""
    names = tuple(f"@{k}" for k in range(len(st.outputs)))
    bg, kinfos = B.instantiate(st, sizes, infos, names, None)
    return bg, kinfos, names


def _out_shapes(st, sizes: dict, infos: dict) -> tuple:
    """((shape, syms) of each output) of ``st`` at ``sizes`` (the same for every structure with
    its ``cost_key``, as the cost is)."""
    _, kinfos, names = _instantiate(st, sizes, infos)
    return tuple((kinfos[n].shape, kinfos[n].syms) for n in names)


def _rep_sizes(layout, infos: dict, config):
    """The representative grid and loop counts of ``layout`` over ``infos`` (blocksearch.representative_sizes)."""
    sym_size = {s: x for n in layout.inputs for s, x in zip(infos[n].syms, infos[n].shape) if s}
    return B.representative_sizes(layout, infos, sym_size, config)


def cost_key(st, infos: dict, rep: dict | None, table: "KeyTable | None" = None):
    """What ``best_counts`` of ``st`` depends on, from its shapes at the representative counts
    ``rep``: every op's kind, attributes, operand and result shapes and symbols (a multiset), the
    accumulators' and the outputs' shapes and symbols (STACK included). None when ``rep`` is None
    or the structure is invalid there. ``table``: a ``KeyTable`` of ``st``'s layout, ``infos``
    and ``rep``, shared by the structures of one listing (``layout_options``), or None.

    Why two structures of one layout with the same key get the same counts and cost: a tile dim
    that carries index symbol s has extent tile(s) (the full extent over the grid and loop splits
    of s) at every count, and a dim without a symbol has the same extent at every count (inputs'
    dims are tiles, and matmul, broadcasting, chains and sums keep or drop dims or reduce them to
    1, never resize them otherwise), so every shape at every count is a function of the shapes
    and symbols at ``rep``; an op's validity (``infer``) is a function of
    its kind, attributes and operand shapes; shared memory is the sum of the non-chain tensors'
    and accumulators' sizes and the cost reads only the inputs (the layout's), the outputs'
    shapes, the grid and the loop count (``cost.custom_op_cost``). So ``instantiate`` is valid
    at the same counts for both, with the same shared memory and output shapes, hence the same
    ``best_counts`` (tests/superopt/test_catalog.py compares on every structure of a space)."""
    if rep is None:
        return None
    if table is None:
        table = KeyTable(st.layout, infos, rep)
    return table.key(st)


class KeyTable:
    """``cost_key`` of the structures of one layout over ``infos`` at counts ``rep``, without
    instantiating them: the key is the one ``blocksearch.instantiate`` at ``rep`` gives (block
    inputs as ``_block_inputs`` makes them, each op's result type by shape-only ``infer``, an
    accumulator of ``b<k>`` where the post ops or the outputs read ``a<k>``, outputs through
    ``kernel_output``), with each op's result type looked up per (kind, attrs, operand types).

    NOTE: ``layout_options`` keys every structure it lists (1.9 M for qk_norm_rope's first-op
    layout "none" of Q, unpruned); through ``instantiate`` (a BlockGraph, a BlockOp and a
    TensorInfo per op) that was most of the costing phase, 99 s of that listing's 264 s on one
    core (eighteenth session). tests/superopt/test_catalog.py compares with the instantiated
    key on every structure of a space."""

    def __init__(self, layout, infos: dict, rep: dict) -> None:
        grid, _, inputs, env = B._block_inputs(layout, rep, infos)
        self.grid = grid
        # what ``infer`` sees of an input (its per-iteration tile) and what the key holds of it
        # (its block tile: ``cost_key`` keyed inputs by ``BlockInput.tile``)
        self.env = {local: (info.shape, info.syms) for local, info in env.items()}
        self.shown = {b.local: (b.tile, infos[b.name].syms) for b in inputs}
        self.results: dict = {}   # (kind, attrs, operand types) -> result type, None: invalid
        self.outs: dict = {}      # output's block type -> its kernel type

    def _result(self, kind: str, attrs: tuple, types: tuple):
        k = (kind, attrs, types)
        hit = self.results.get(k, False)
        if hit is False:
            r = infer(kind, [TensorInfo(s, y, None) for s, y in types], dict(attrs),
                      exprs=False)
            hit = self.results[k] = None if r is None else (r.shape, r.syms)
        return hit

    def _phase(self, spec: tuple, prefix: str, env: dict, shown: dict, items: dict) -> bool:
        """Add the ops ``spec`` (named ``prefix``0, 1, ...) to ``env`` / ``shown`` and count
        their key items in ``items``; False when one is invalid."""
        result = self._result
        for k, (kind, args, attrs) in enumerate(spec):
            r = result(kind, attrs, tuple(env[a] for a in args))
            if r is None:
                return False
            env[f"{prefix}{k}"] = shown[f"{prefix}{k}"] = r
            item = (kind, attrs, tuple(shown[a] for a in args), r)
            items[item] = items.get(item, 0) + 1
        return True

    def key(self, st):
        """``cost_key(st, infos, rep)`` of a structure of this table's layout."""
        env, shown, items = dict(self.env), dict(self.shown), {}
        if not self._phase(st.body, "b", env, shown, items):
            return None
        read = {a for _, args, _ in st.post for a in args}
        accs = []
        for k in range(len(st.body)):
            acc = f"a{k}"
            if acc in read or acc in st.outputs:
                env[acc] = shown[acc] = env[f"b{k}"]
                accs.append(acc)
        if not self._phase(st.post, "p", env, shown, items):
            return None
        outs = []
        for local in st.outputs:
            t = env[local]
            o = self.outs.get(t)
            if o is None:
                o = self.outs[t] = B.kernel_output(t[0], t[1], self.grid)[1:]
            outs.append(o)
        return (frozenset(items.items()), tuple(sorted(repr(shown[a]) for a in accs)),
                tuple(outs))


def best_counts(ctx: Context, st, infos: dict, floors: dict | None = None):
    """(sizes, cost) of the cheapest counts of structure ``st``: grid counts first (each at the
    smallest loop count whose tiles fit in shared memory), then the larger loop counts for the
    best grid; None when no count is valid.

    ``floors``: None (every count is costed), or a dict shared by the structures of one layout
    over the same ``infos`` (``layout_options`` passes one per listing): the input-tile floor of
    each (grid, loop count), ``bounds._tile_cost`` without outputs, which depends on the layout
    and the counts only. ``custom_op_cost`` at those counts is at least the floor (the same
    formula with the outputs' bytes added, each term monotone, also in floating point; an
    infeasible count costs inf), so a grid whose least floor over the loop counts exceeds a cost
    already found, or a larger loop count whose floor is not below the best cost, cannot be
    chosen; it is not instantiated. Grids are tried in order of their floors; the pick is still
    the least (cost, grid index) of all grids, i.e. the same (sizes, cost) as without floors
    (tests/superopt/test_catalog.py compares on every structure of a space). Since the eleventh
    session (second part): the count search was ~37% of the first-op listing's CPU time in the
    unpruned attention_decode search.
    NOTE: greedy; cost is close to separable in the two. Shared memory per block falls as the
    loop count grows (fmap'd tiles shrink), so a grid is costed at its first feasible loop
    count: costing every grid at the smallest loop count only dropped every option of a long
    reduction (silu*mul->linear at K=12288: the W tile of 2 iterations alone exceeds 227 KB)."""
    grids, loops = B.count_choices(st, infos, ctx.config)
    loop_sym = st.layout.loop_sym
    if loop_sym and not loops:
        return None
    names = tuple(f"@{k}" for k in range(len(st.outputs)))

    def cost(sizes):
        """Cost, or inf; None when the counts make an op invalid (smaller tiles stay invalid)."""
        bg, kinfos = B.instantiate(st, sizes, infos, names, None)
        return None if bg is None else custom_op_cost(bg, {**infos, **kinfos})["time_us"]

    def first_fit(g: dict):
        for n in loops or [None]:
            sizes = {**g, loop_sym: n} if loop_sym else dict(g)
            c = cost(sizes)
            if c is None or c != math.inf:
                return (math.inf if c is None else c), sizes
        return math.inf, sizes  # no loop count fits

    if floors is None:
        scored = [(*first_fit(g), i) for i, g in enumerate(grids)]
    else:
        def floor(g: dict, n) -> float:
            key = (tuple(sorted(g.items())), n)
            f = floors.get(key)
            if f is None:
                f = floors[key] = _tile_cost(st.layout, infos, g, n if loop_sym else 1, 0, H200)
            return f

        least = sorted((min(floor(g, n) for n in loops or [None]), i)
                       for i, g in enumerate(grids))
        scored, found = [], math.inf
        for f, i in least:
            if f > found:
                break  # this grid and every later one cost more than a grid already costed
            c, sizes = first_fit(grids[i])
            scored.append((c, sizes, i))
            found = min(found, c)
    if not scored:
        return None
    c, sizes, i = min(scored, key=lambda x: (x[0], x[2]))
    best = (sizes, c)
    rest = loops[loops.index(sizes[loop_sym]) + 1:] if loop_sym else []
    for n in rest:
        if floors is not None and floor(grids[i], n) >= best[1]:
            continue  # costs at least best[1]: not cheaper
        c = cost({**grids[i], loop_sym: n})
        if c is not None and c < best[1]:
            best = ({**grids[i], loop_sym: n}, c)
    return best


class BlockCatalog:
    """Custom-op options per input subset and layout, memoized; layouts run on a process pool.

    Options are kept per layout (``layout_options``: enumeration order), so that the kernel
    search can list the options of one layout of a subset without the others (a layout whose
    cost bound is above the verified cost is never enumerated); ``options`` concatenates them.
    An option's canonical key is (layout index, position in its layout), not its cost rank.

    ``max_listings``: None (unbounded), or how many layout lists (``lays``) and how many layout
    listings (``per_layout``) are kept, each least recently used first (the lanes' catalogs:
    one listing per concrete first-op output, see ``LANE_LISTINGS``). A listing dropped and
    asked for again is computed again from the same layout and inputs, so it is the same list;
    only counters differ (``listing_evictions``, and what the new enumeration counts)."""

    def __init__(self, ctx: Context, processes: int, max_listings: int | None = None) -> None:
        self.ctx = ctx
        self.processes = processes
        self.max_listings = max_listings
        self.memo: dict = {}       # (final, subset infos) -> every layout's options, by cost
        self.lays: OrderedDict = OrderedDict()        # subset infos -> layouts
        self.per_layout: OrderedDict = OrderedDict()  # (final, subset infos, layout index) -> options
        self.pending: dict = {}    # the same key -> AsyncResult of a pool task
        self.limits: dict = {}     # the same key -> the limit it was listed under (None: none)
        self.keyed: dict = {}      # the same key -> (budget, first-op keys) from the pool
        # unpruned first ops over target inputs, listed once per renaming class (``_rep``):
        self.reps: dict = {}       # class -> (representative subset, its infos, its members)
        self.served: dict = {}     # representative's listing key -> members not served yet
        self.held: dict = {}       # representative's listing key -> options kept for members
        self.pool = None

    # unpruned first-op layouts without grid or loop symbol are listed in parts on the pool
    # (``parts``; False: one task each, as before the twenty-second session, for the test)
    split = True

    def __enter__(self):
        if self.processes > 1:
            mp = multiprocessing.get_context("fork")
            self.pool = mp.Pool(self.processes, _init_worker,
                                (self.ctx.target, self.ctx.config, self.ctx.deadline))
        return self

    def __exit__(self, *exc) -> None:
        if self.pool is not None:
            self.pool.terminate()
            self.pool.join()

    def layouts(self, subset: tuple, infos: dict) -> list:
        """The layouts of a custom op over ``subset`` (``blocksearch.layouts``), memoized."""
        key = tuple((n, infos[n]) for n in subset)
        hit = self.lays.get(key)
        if hit is None:
            hit = self.lays[key] = list(B.layouts(subset, infos, self.ctx.config.max_grid_dims))
            self._bound(self.lays)
        elif self.max_listings is not None:
            self.lays.move_to_end(key)
        return hit

    def _bound(self, table: OrderedDict) -> None:
        """Drop ``table``'s least recently used entries beyond ``max_listings`` (the newest
        always stays); a dropped layout listing takes its limit and pool keys with it."""
        if self.max_listings is None:
            return
        counts = self.ctx.counts
        while len(table) > max(1, self.max_listings):
            old, _ = table.popitem(last=False)
            if table is self.per_layout and old not in self.pending:
                self.limits.pop(old, None)
                self.keyed.pop(old, None)
            counts["listing_evictions"] = counts.get("listing_evictions", 0) + 1

    def options(self, subset: tuple, infos: dict, final: bool = False) -> list:
        """[(Structure, sizes, cost_us, output shapes, (layout index, position))] for custom ops
        reading exactly ``subset``, best first; ``final``: for the last kernel op (one output)."""
        key = _listing_key(final, subset, infos)
        if key not in self.memo:
            ks = range(len(self.layouts(subset, infos)))
            self.prefetch(subset, ks, infos, final)
            out = [(*o, (k, j)) for k in ks
                   for j, o in enumerate(self.layout_options(subset, k, infos, final))]
            out.sort(key=lambda o: o[2])
            self.memo[key] = out
        return self.memo[key]

    def prefetch(self, subset: tuple, ks, infos: dict, final: bool, limit=None,
                 keyed: int | None = None) -> None:
        """Start the enumeration of layouts ``ks`` of ``subset`` on the pool (no-op without);
        ``limit``: as ``layout_options``; ``keyed``: None, or the budget of a level whose first
        ops these are: the worker computes their best-first keys too (``keys``)."""
        if self.pool is None:
            return
        rep = self._rep(final, subset, infos)
        if rep is not None and rep[0] != subset:
            self.prefetch(rep[0], ks, rep[1], final, limit, keyed)  # members are renamed copies
            return
        sub = {n: infos[n] for n in subset}
        lays = self.layouts(subset, infos)
        for k in ks:
            key = _listing_key(final, subset, infos, k)
            if key not in self.per_layout and key not in self.pending:
                args = (lays[k], sub, final, limit, keyed)
                n = self.parts(lays[k], final, limit)
                if n == 1:
                    self.pending[key] = self.pool.apply_async(_layout_task, ((*args, None),))
                else:
                    self.pending[key] = _Split([self.pool.apply_async(_layout_task, ((*args, (j, n)),))
                                                for j in range(n)])
                    self.ctx.counts["listings_split"] = self.ctx.counts.get("listings_split", 0) + 1
                self.limits[key] = limit

    def parts(self, layout, final: bool, limit) -> int:
        """How many pool tasks list ``layout`` (``prefetch``): one per pool process for a first
        op's layout without grid or loop symbol in an unpruned search's canonical phase (no
        ``limit``), else 1 (and always 1 with ``split`` False, as before the twenty-second
        session). Each task enumerates the whole layout and puts only its part of the block
        graphs in canonical order and costs them (``layout_options``' ``part``); the main process
        merges the parts (``merge_parts``), so the listing is the one a single task makes.

        NOTE: such a layout (every block op sees whole tensors) lists the most block graphs:
        qk_norm_rope's Q, layout "none", 1.9 M first ops in ~190 s of one pool worker, then
        ~35 s to pickle and unpickle, while Q's six other layouts came back within ~30-90 s
        (nineteenth to twenty-first sessions); the main process waited for it alone. Its
        enumeration (the part every task repeats) was ~60-70 s of the ~190 s; canonical orders,
        sorting, costing and pickling are spread over the parts. The pruned search and the
        last op's listings are not split."""
        config = self.ctx.config
        if not self.split or self.pool is None or final or limit is not None or config.prune \
                or not config.dedup or layout.grid_syms or layout.loop_sym is not None:
            return 1
        return self.processes

    def keys(self, subset: tuple, k: int, infos: dict, budget: int):
        """The first-op keys the pool computed for layout ``k`` of ``subset`` at ``budget``
        (``bounds.first_op_keys``, one per option of ``layout_options``), or None."""
        hit = self.keyed.get(_listing_key(False, subset, infos, k))
        return hit[1] if hit is not None and hit[0] == budget else None

    def release(self, subset: tuple, infos: dict, final: bool, k: int | None = None) -> None:
        """Forget the listings of layout ``k`` of ``subset`` (every layout when None) and the
        subset's ``options``: the caller asks for them no more (the unpruned search's first-op
        listings took gigabytes of the main process)."""
        if k is None:
            self.memo.pop(_listing_key(final, subset, infos), None)
        rep = self._rep(final, subset, infos)
        for j in (range(len(self.layouts(subset, infos))) if k is None else (k,)):
            key = _listing_key(final, subset, infos, j)
            if rep is not None and rep[0] == subset and self._left(key, rep) \
                    and key in self.per_layout:
                # a representative's listing stays until its members are served from it
                self.held[key] = (self.per_layout[key], self.limits.get(key), self.keyed.get(key))
            self.per_layout.pop(key, None)
            self.limits.pop(key, None)
            self.keyed.pop(key, None)
        self.ctx.counts["listings_released"] = self.ctx.counts.get("listings_released", 0) + 1

    def ready(self, subset: tuple, k: int, infos: dict, final: bool, limit=None) -> bool:
        """Would ``layout_options(subset, k, infos, final, limit)`` answer without waiting: its
        listing (or, for a renamed member, its representative's) is memoized under a covering
        limit, or its pool task is done? False when it would wait for the pool or list in this
        process."""
        key = _listing_key(final, subset, infos, k)
        if key in self.per_layout and _covers(self.limits.get(key), limit):
            return True
        rep = self._rep(final, subset, infos)
        if rep is not None and rep[0] != subset:
            held = self.held.get(_listing_key(final, rep[0], rep[1], k))
            if held is not None and _covers(held[1], limit):
                return True
            return self.ready(rep[0], k, rep[1], final, limit)
        task = self.pending.get(key)
        return task is not None and _covers(self.limits.get(key), limit) and task.ready()

    def pending_task(self, subset: tuple, k: int, infos: dict, final: bool):
        """The pool task that lists layout ``k`` of ``subset`` (its representative's for a
        renamed member), or None when none is in flight."""
        rep = self._rep(final, subset, infos)
        if rep is not None and rep[0] != subset:
            subset, infos = rep[0], rep[1]
        return self.pending.get(_listing_key(final, subset, infos, k))

    def in_flight(self) -> int:
        """Pool tasks of prefetched layouts not finished yet (0 without a pool): one per layout,
        one per part of a split one (``parts``), so that the callers' limits count workers."""
        return sum(sum(not t.ready() for t in task.tasks) if isinstance(task, _Split)
                   else not task.ready() for task in self.pending.values())

    def layout_options(self, subset: tuple, k: int, infos: dict, final: bool,
                       limit=None) -> list:
        """``layout_options`` of layout ``k`` of ``subset`` (memoized; from the pool when
        prefetched). ``limit``: as ``layout_options``; a memoized listing serves a request when
        it was made without a limit or with a limit of the same output reads that is at least
        the requested one (it then holds every structure the request would list, and maybe more,
        which the caller's own keys cut)."""
        key = _listing_key(final, subset, infos, k)
        hit = self.per_layout.get(key)
        if hit is not None and _covers(self.limits.get(key), limit):
            if self.max_listings is not None:
                self.per_layout.move_to_end(key)
            return hit
        rep = self._rep(final, subset, infos)
        if rep is not None and rep[0] != subset:
            return self._renamed(subset, k, infos, final, limit, key, rep)
        sub = {n: infos[n] for n in subset}
        task = self.pending.pop(key, None)
        if task is not None and _covers(self.limits.get(key), limit):
            (hit, keys), delta = self.ctx.pool_result(task, f"layout {k} of {subset}")
            self.ctx.add_remote(delta)
            if keys is not None:
                self.keyed[key] = keys  # (budget, keys): aligned with ``hit``
        else:
            hit = layout_options(self.ctx, self.layouts(subset, infos)[k], sub, final, limit)
            self.limits[key] = limit
            self.keyed.pop(key, None)
        self.per_layout[key] = hit
        if self.max_listings is not None:
            self.per_layout.move_to_end(key)  # a listing made again under a new limit is new
            self._bound(self.per_layout)
        return hit

    def _rep(self, final: bool, subset: tuple, infos: dict):
        """(representative subset, its infos, members) of ``subset``'s renaming class, or None.

        Unpruned, a first op over target inputs only (each input's expression is the atom of its
        own name) is listed once per class of subsets that are position-wise renamings of one
        another: the same shape and index symbols at every position (qk_norm_rope's (G,), (C,),
        (S,), or (Q, G), (Q, C), (Q, S); silu_mul_linear's (A,), (B,)). The other members get the
        representative's listing with the layout's input names replaced (``_renamed``).

        Why that is the member's own listing: the enumeration looks at the inputs' shapes and
        symbols (validity, tiles, the dangling-tensor bound) and, unpruned, at expressions only
        to tell equal ones apart (no recomputation, merging nodes). A bijective renaming of input
        atoms maps equal expressions to equal ones and unequal to unequal (the axioms are closed
        under substitution, the assumption ``blockshare`` makes too), so every decision is the
        same and the structures are the same, in the same order; costs, output shapes and the
        first ops' best-first keys depend on shapes only. Not with pruning (the oracle tells G
        from C), not for last ops (the target's test tells them apart) and not for inputs made by
        an earlier op (their expressions are not atoms)."""
        if final or self.ctx.config.prune:
            return None
        if not all(infos[n].expr == ("v", n) for n in subset):
            return None
        cls = tuple((infos[n].shape, infos[n].syms) for n in subset)
        hit = self.reps.get(cls)
        if hit is None:
            hit = self.reps[cls] = (subset, {n: infos[n] for n in subset}, _members(self.ctx, cls))
        return hit

    def _left(self, rkey: tuple, rep) -> set:
        """The members of ``rep``'s class not served yet from the representative's listing
        ``rkey`` (one layout's)."""
        left = self.served.get(rkey)
        if left is None:
            left = self.served[rkey] = {m for m in rep[2] if m != rep[0]}
        return left

    def _renamed(self, subset: tuple, k: int, infos: dict, final: bool, limit, key, rep) -> list:
        """Layout ``k`` of the member ``subset`` from its representative's listing (``_rep``)."""
        rsub, rinfos, members = rep
        rkey = _listing_key(final, rsub, rinfos, k)
        left = self._left(rkey, rep)
        held = self.held.get(rkey)
        if held is not None and _covers(held[1], limit):
            base, have, keyed = held
        else:
            base = self.layout_options(rsub, k, rinfos, final, limit)
            have, keyed = self.limits.get(rkey), self.keyed.get(rkey)
        lay = self.layouts(subset, infos)[k]
        hit = [(replace(st, layout=lay), *rest) for st, *rest in base]
        self.limits[key] = have
        if keyed is not None:
            self.keyed[key] = keyed  # the same values: keys depend on shapes (``_rep``)
        self.per_layout[key] = hit
        left.discard(subset)
        if not left:
            self.held.pop(rkey, None)  # every member served: the representative's copy goes
        counts = self.ctx.counts
        counts["listings_renamed"] = counts.get("listings_renamed", 0) + 1
        if self.max_listings is not None:
            self._bound(self.per_layout)
        return hit


def _members(ctx: Context, cls: tuple) -> list:
    """Every subset of the target's inputs (in input order, as the kernel search forms them) with
    the shapes and symbols ``cls`` position by position."""
    from itertools import combinations

    from mpk_dist.superopt.bounds import input_infos

    infos = input_infos(ctx.target)
    return [s for s in combinations(list(infos), len(cls))
            if tuple((infos[n].shape, infos[n].syms) for n in s) == cls]


def _covers(have, want) -> bool:
    """Does a listing made under limit ``have`` hold every structure one under ``want`` would?"""
    if have is None:
        return True
    return want is not None and have[1] == want[1] and have[0] >= want[0]


def _may_have_shape(st, infos: dict, shape: tuple, config, rep: dict | None = False) -> bool:
    """False when the custom op of ``st`` writes a tensor of another shape than ``shape`` at
    every grid and loop count, so as the last kernel op it can never produce the target.

    NOTE: an output dim carrying a grid symbol is tile x count = the full extent, the others are
    unsplit or 1 (the loop symbol never reaches an accumulator or post op), so without STACK dims
    the output shape does not depend on the counts: checking it at the representative counts is
    the same shape test ``KernelSearch`` applies to the last op, done before the costing. A
    STACK dim's extent is a grid count, so such outputs are kept for the full check.
    ``rep``: the layout's representative counts when the caller has them (``_rep_sizes``; False:
    computed here).
    """
    sizes = _rep_sizes(st.layout, infos, config) if rep is False else rep
    if sizes is None:
        return True
    _, kinfos, _ = _instantiate(st, sizes, infos)
    if kinfos is None:
        return True
    for info in kinfos.values():
        if any(is_stack_sym(s) for s in info.syms) or info.shape == shape:
            return True
    return False

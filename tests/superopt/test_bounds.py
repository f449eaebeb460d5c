"""bounds: the cost lower bounds the kernel search cuts with are below every cost they bound, and
branch and bound inside a depth keeps the cheapest verified graph."""

import itertools
import math
import time

from mpk_dist.superopt import blocksearch as B
from mpk_dist.superopt.bounds import RestBound, input_infos
from mpk_dist.superopt.context import Context, SearchConfig
from mpk_dist.superopt.catalog import BlockCatalog
from mpk_dist.superopt.kernelsearch import KernelSearch
from mpk_dist.superopt.patterns import build
from mpk_dist.superopt.search import _rank
from mpk_dist.superopt.target import analyze
from mpk_dist.superopt.ugraph import DTYPE_BYTES
from mpk_dist.superopt.verify import verify

SHAPE = {"H": 4, "D": 64, "S": 256}
EPS = 1e-9


def _setup(block_ops: int, prune: bool):
    g = build("attention_decode", SHAPE)
    target = analyze(g)
    config = SearchConfig(max_kernel_ops=2, max_block_ops=block_ops, prune=prune)
    ctx = Context(target, config, time.monotonic() + 120)
    out_shape = target.graph.nodes[target.out_node].shape
    return g, ctx, out_shape


def test_layout_bound_is_below_every_option():
    """Every custom-op option (every input subset, last op or not) costs at least its layout's
    bound; for the last op, options whose output has the target's shape (the only ones the
    kernel search keeps)."""
    _, ctx, out_shape = _setup(3, prune=False)
    infos = input_infos(ctx.target)
    lower = RestBound(ctx.config, out_shape)
    checked = 0
    with BlockCatalog(ctx, 1) as cat:
        for r in (1, 2, 3):
            for subset in itertools.combinations(infos, r):
                for final in (False, True):
                    for st, sizes, cost, *_ in cat.options(subset, infos, final):
                        _, kinfos = B.instantiate(st, sizes, infos, ("o",), None)
                        if final and kinfos["o"].shape != out_shape:
                            continue
                        assert lower.layout(st.layout, infos, final) <= cost + EPS, (st, sizes)
                        checked += 1
    assert checked > 1000


def test_rest_bound_is_below_every_complete_graph():
    """For every two-op graph of the space (no cost bound), the first op's cost plus the bound of
    what it leaves is at most the graph's cost. (Pruned, to stay fast: the bounds look at shapes
    only, so pruning changes which graphs are checked, not the check.)"""
    _, ctx, out_shape = _setup(4, prune=True)
    lower = RestBound(ctx.config, out_shape)
    with BlockCatalog(ctx, 1) as cat:
        found = KernelSearch(ctx, cat).run(2)
    two = [u for u in found.values() if len(u.kernel_ops) == 2]
    assert len(two) > 20
    for ug in two:
        first = ug.kernel_ops[0]
        tensors = {n: ug.tensors[n] for n in (*ug.inputs, *first.outputs)}
        left = {n for n in tensors if n not in first.inputs}
        c1 = _op_cost(ug, 0)
        assert c1 + lower.rest(tensors, left, 1) <= ug.cost["time_us"] + EPS, ug
        assert c1 + lower.rest(tensors, left, 2) <= ug.cost["time_us"] + EPS, ug


def _memo_verify(g):
    """A verifier of µGraphs against ``g`` (3 trials) that remembers each graph's verdict."""
    status: dict = {}

    def check(ug):
        if ug.key() not in status:
            status[ug.key()] = verify(ug, g, 3)
        return status[ug.key()]

    return check


def _op_cost(ug, k: int) -> float:
    from mpk_dist.superopt.cost import custom_op_cost, prim_op_cost

    op = ug.kernel_ops[k]
    if op.is_custom:
        return custom_op_cost(op.block, ug.tensors)["time_us"]
    return prim_op_cost([ug.tensors[i].shape for i in op.inputs],
                        ug.tensors[op.outputs[0]].shape)["time_us"]


def test_branch_and_bound_in_a_depth_keeps_the_best():
    """Depth 2 with in-depth verification and cuts returns, as its cheapest verified graph, the
    cheapest graph of the whole depth-2 space that verifies (listed without any cost bound)."""
    g, ctx, _ = _setup(4, prune=True)
    check = _memo_verify(g)
    with BlockCatalog(ctx, 2) as cat:
        everything = KernelSearch(ctx, cat).run(2)
        bnb = KernelSearch(ctx, cat, verify=check)
        cut = bnb.run(2)
    assert not ctx.timed_out()
    best = next(u for u in _rank(everything) if check(u))
    assert bnb.bound == best.cost["time_us"] < math.inf
    assert best.key() in cut
    assert len(cut) < len(everything)  # the bound cut something


class _Probe(KernelSearch):
    """Records, for every complete two-op graph, the best-first keys of its first op: the
    move's bound and the bound of the layout item it was listed under."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.first = None
        self.pairs: list = []

    def _build(self, tensors, n_ops, last, move):
        if not last:
            dangling = set(tensors)
            key = self._move_bound(tensors, move, dangling, 2, 0.0)
            lay = -math.inf  # library ops are not listed under a layout
            if move[0] == "c":
                subset, st = move[1], move[4]
                rest = self._item_rest(tensors, subset, dangling, 2)
                lay = self.lower.layout(st.layout, tensors, False) + rest
            self.first = (key, lay)
        return super()._build(tensors, n_ops, last, move)

    def _record(self, tensors, ops, out):
        n = len(self.candidates)
        super()._record(tensors, ops, out)
        if len(self.candidates) > n and len(ops) == 2:
            self.pairs.append((*self.first, list(self.candidates.values())[-1]))


def _small_unpruned():
    # silu*mul->matmul at tiny shapes and 2 block ops: the unpruned depth-2 space in ~4 s; its
    # best graph has two kernel ops (the one-op graph needs 3 block ops)
    g = build("silu_mul_linear", {"M": 2, "I": 64, "N": 32})
    target = analyze(g)
    config = SearchConfig(max_kernel_ops=2, max_block_ops=2, prune=False)
    return g, Context(target, config, time.monotonic() + 120)


def test_best_first_keys_are_below_every_complete_graph():
    """Unpruned depth 2 (every graph of up to two ops, canonical order): the key a first op gets
    in the best-first order (its cost plus the rest bound, or its cost alone when it may
    complete the graph, which needs every input read) and the key of its layout's item are at
    most the cost of every complete graph through it.
    With ``shorter_searched`` (depth 1 searched first, as ``search._depths`` runs it) a layout
    over every input gets a sync point and the output's bytes as its rest instead of 0 (a graph
    that completes after it alone is a depth-1 graph); still at most every two-op graph's cost."""
    for shorter in (False, True):
        _, ctx = _small_unpruned()
        with BlockCatalog(ctx, 1) as cat:
            probe = _Probe(ctx, cat, shorter_searched=shorter)
            probe.run(2)
        assert not ctx.timed_out()
        assert len(probe.pairs) > 5
        assert any(lay > -math.inf for _, lay, _ in probe.pairs)  # custom first ops checked
        for key, lay, ug in probe.pairs:
            assert key <= ug.cost["time_us"] + EPS, ug
            assert lay <= ug.cost["time_us"] + EPS, ug
        whole = probe._item_rest(dict(probe.inputs), tuple(probe.inputs), set(probe.inputs), 2)
        assert whole == (probe.lower.floor({}, set()) if shorter else 0.0) and \
            (whole > 2.0) == shorter


def test_unpruned_switch_to_best_first_keeps_the_best():
    """Unpruned depth 2: the search starts without a bound (canonical order), verifies its first
    graph in the middle of the level, then lists the remaining moves best-first, layout by
    layout, and cuts; it returns the cheapest verifying graph of the uncut space (the plain
    enumeration, no verification, no cuts). With a process pool as well, and with the keys of
    ``shorter_searched`` (this space has no one-op graph: it needs 3 block ops).""" 
    g, ctx = _small_unpruned()
    check = _memo_verify(g)
    with BlockCatalog(ctx, 1) as cat:
        everything = KernelSearch(ctx, cat).run(2)
    best = next(u for u in _rank(everything) if check(u))
    for procs, shorter in ((1, False), (2, False), (1, True), (2, True)):
        with BlockCatalog(ctx, procs) as cat:
            bnb = KernelSearch(ctx, cat, verify=check, shorter_searched=shorter)
            cut = bnb.run(2)
        assert not ctx.timed_out()
        assert bnb.bound == best.cost["time_us"] < math.inf
        assert best.key() in cut
        assert len(cut) < len(everything)


def test_unpruned_lanes_keep_the_best():
    """Unpruned depth 2 with the last ops on lane processes (lanes.py) returns the cheapest
    verifying graph of the plain enumeration, as in one process, and records the same complete
    graphs cheaper than it."""
    from mpk_dist.superopt.lanes import Lanes

    g, ctx = _small_unpruned()
    check = _memo_verify(g)
    with BlockCatalog(ctx, 1) as cat:
        everything = KernelSearch(ctx, cat).run(2)
    best = next(u for u in _rank(everything) if check(u))
    with BlockCatalog(ctx, 2) as cat:
        lanes = Lanes(ctx, 2)
        try:
            bnb = KernelSearch(ctx, cat, verify=check, lanes=lanes)
            cut = bnb.run(2)
        finally:
            lanes.close()
    assert not ctx.timed_out()
    assert ctx.counts["lane_handoffs"] > 10
    assert ctx.counts["pool_keys"] > 0  # best-first keys of first ops came from the pool
    assert bnb.bound == best.cost["time_us"] < math.inf
    assert best.key() in cut
    cheaper = {k for k, u in everything.items() if u.cost["time_us"] <= bnb.bound}
    assert cheaper <= set(cut)


def test_listing_limit_is_below_every_move_key():
    """Unpruned, every first-op option of every input subset: with the verified cost set to the
    option's own best-first key, ``_list_limit`` keeps it (its ``bytes_lower_bound`` is within
    the limit), so the catalog never drops a move the best-first order could take."""
    from mpk_dist.superopt.catalog import bytes_lower_bound, cost_key, _rep_sizes

    _, ctx, _ = _setup(3, prune=False)
    infos = input_infos(ctx.target)
    dangling = set(infos)
    checked = 0
    with BlockCatalog(ctx, 1) as cat:
        ks = KernelSearch(ctx, cat)
        for r in (1, 2, 3):
            for subset in itertools.combinations(infos, r):
                for move in ks._options(infos, subset, None, False, 0):
                    st = move[4]
                    key = ks._move_bound(infos, move, dangling, 2, 0.0)
                    if key == math.inf:
                        continue  # no complete graph through it (never taken)
                    ks.bound = key
                    limit = ks._list_limit(infos, subset, dangling, 0.0)
                    ck = cost_key(st, infos, _rep_sizes(st.layout, infos, ctx.config))
                    if ck is None:
                        continue  # the catalog applies no limit to it either
                    in_b = sum(math.prod(infos[n].shape) for n in subset) * DTYPE_BYTES
                    assert bytes_lower_bound(st.layout, in_b, ck[2], limit[1]) <= limit[0], (st, key)
                    checked += 1
    assert checked > 1000


def test_first_op_keys_from_the_pool_equal_the_main_process_keys():
    """Unpruned, every first-op layout of every input subset listed on a pool with ``keyed``:
    the keys the worker computed (``bounds.first_op_keys``) are the main process's
    ``_move_bound`` of the same moves, float for float, at budgets 2 and 3, and a listing made
    without ``keyed`` (or asked for at another budget) has none."""
    _, ctx, _ = _setup(3, prune=False)
    infos = input_infos(ctx.target)
    dangling = set(infos)
    checked = 0
    with BlockCatalog(ctx, 2) as cat:
        ks = KernelSearch(ctx, cat)
        for r in (1, 2, 3):
            for subset in itertools.combinations(infos, r):
                n = len(cat.layouts(subset, infos))
                budget = 2 + r % 2
                cat.prefetch(subset, range(0, n, 2), infos, False, None, budget)
                cat.prefetch(subset, range(1, n, 2), infos, False)
                for k in range(n):
                    moves = list(ks._options(infos, subset, None, False, 0, k))
                    keys = cat.keys(subset, k, infos, budget)
                    assert (keys is None) == (k % 2 == 1)
                    if keys is None:
                        continue
                    assert cat.keys(subset, k, infos, budget + 1) is None
                    for move in moves:
                        assert keys[move[6][3]] == ks._move_bound(infos, move, dangling, budget,
                                                                  0.0)
                        checked += 1
    assert checked > 1000


def test_first_op_keys_drop_another_searchs_state():
    """``bounds.first_op_keys`` keeps its ``RestBound`` and memos in a per-process state (a pool
    worker's, forked from its parent): keys computed after another search's (another target)
    are the keys computed with a fresh state, not the other target's bounds."""
    from mpk_dist.superopt.bounds import first_op_keys
    from mpk_dist.superopt.catalog import layout_options

    def keys_of(target, state):
        ctx = Context(target, SearchConfig(max_kernel_ops=2, max_block_ops=2, prune=False),
                      time.monotonic() + 60)
        infos = input_infos(target)
        subset = tuple(infos)[:1]
        lay = next(iter(B.layouts(subset, infos, 1)))
        options = layout_options(ctx, lay, {n: infos[n] for n in subset}, False)
        return first_op_keys(ctx, subset, options, 2, state)

    silu = analyze(build("silu_mul_linear", {"M": 2, "I": 64, "N": 32}))
    other = analyze(build("qk_norm_rope", {"H": 4, "D": 16}))
    state: dict = {}
    keys_of(other, state)
    after_other = keys_of(silu, state)
    fresh = keys_of(silu, {})
    assert len(fresh) > 10 and after_other == fresh

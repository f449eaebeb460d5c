"""catalog: a subset's options listed layout by layout (on the pool or not) are its options."""

import itertools
import math
import time

from mpk_dist.superopt.catalog import BlockCatalog
from mpk_dist.superopt.context import Context, SearchConfig
from mpk_dist.superopt.bounds import input_infos
from mpk_dist.superopt.patterns import build
from mpk_dist.superopt.target import analyze


def _listing(cat, subset, infos, final, order):
    """{(layout index, position): (structure, sizes, cost)} from layout_options, asking for the
    layouts in ``order`` (some prefetched on the pool first)."""
    cat.prefetch(subset, order[::2], infos, final)
    out = {}
    for k in order:
        for j, o in enumerate(cat.layout_options(subset, k, infos, final)):
            out[(k, j)] = o
    return out


def test_layout_by_layout_listing_gives_the_subset_options():
    target = analyze(build("silu_mul_linear", {"M": 2, "I": 64, "N": 32}))
    ctx = Context(target, SearchConfig(max_block_ops=3, prune=False), time.monotonic() + 120)
    infos = input_infos(target)
    subset = tuple(infos)
    with BlockCatalog(ctx, 1) as cat:
        whole = {final: cat.options(subset, infos, final) for final in (False, True)}
    for procs in (1, 2):
        for final in (False, True):
            with BlockCatalog(ctx, procs) as cat:
                n = len(cat.layouts(subset, infos))
                listed = _listing(cat, subset, infos, final, list(range(n))[::-1])
            assert {key: o for *o, key in whole[final]} == {k: list(v) for k, v in listed.items()}
            costs = [o[2] for o in whole[final]]
            assert costs == sorted(costs) and len(costs) > (0 if final else 100)


def test_shared_costs_equal_the_costs_of_each_structure():
    """``layout_options`` costs a structure once per ``cost_key`` and reuses the counts and cost
    for the others with that key: the same options as costing every structure on its own
    (attention at small shapes, single inputs and all three, unpruned, 3 block ops, first and
    last op)."""
    from mpk_dist.superopt import blocksearch as B
    from mpk_dist.superopt.catalog import best_counts, layout_options

    target = analyze(build("attention_decode", {"H": 2, "D": 16, "S": 64}))
    ctx = Context(target, SearchConfig(max_block_ops=3, prune=False), time.monotonic() + 120)
    infos = input_infos(target)
    shared = 0
    for r in (1, 3):
        for subset in itertools.combinations(infos, r):
            for final in (False, True):
                for lay in B.layouts(subset, infos, 1):
                    before = ctx.counts.get("costs_shared", 0)
                    got = layout_options(ctx, lay, infos, final)
                    shared += ctx.counts.get("costs_shared", 0) - before
                    want = []
                    for st in [o[0] for o in got] if final else \
                            B.enumerate_layout(ctx, lay, infos, final):
                        best = best_counts(ctx, st, infos)
                        if best is not None and best[1] != math.inf:
                            _, kinfos = B.instantiate(st, best[0], infos, ("a", "b"), None)
                            outs = tuple((kinfos[n].shape, kinfos[n].syms) for n in kinfos)
                            want.append((st, best[0], best[1], outs))
                    assert got == want, (subset, lay, final)
    assert shared > 1000, shared


def test_count_search_with_floors_picks_the_same_counts_and_instantiates_less():
    """``best_counts`` with a layout's shared input-tile floors (as ``layout_options`` calls it)
    gives the same (sizes, cost) as costing every count, on every structure of every layout of
    single inputs, pairs and all three (attention at H=4 D=128 S=512: grid counts 2..256, loop
    counts 2..64), first and last op, and instantiates fewer counts; every floor is at most
    ``custom_op_cost`` at its counts."""
    from mpk_dist.superopt import blocksearch as B
    from mpk_dist.superopt import catalog as C

    target = analyze(build("attention_decode", {"H": 4, "D": 128, "S": 512}))
    ctx = Context(target, SearchConfig(max_block_ops=2, prune=False), time.monotonic() + 300)
    infos = input_infos(target)
    calls = {"plain": 0, "floors": 0}
    checked = 0
    real = B.instantiate

    def counting(which):
        def inst(*a, **k):
            calls[which] += 1
            return real(*a, **k)
        return inst

    try:
        for r in (1, 2, 3):
            for subset in itertools.combinations(infos, r):
                for final in (False, True):
                    for lay in B.layouts(subset, infos, 1):
                        floors: dict = {}
                        for st in B.enumerate_layout(ctx, lay, infos, final):
                            B.instantiate = counting("plain")
                            want = C.best_counts(ctx, st, infos)
                            B.instantiate = counting("floors")
                            got = C.best_counts(ctx, st, infos, floors)
                            B.instantiate = real
                            assert got == want, (subset, lay, st)
                            checked += 1
                        for (grid, n), f in floors.items():
                            sizes = dict(grid)
                            if lay.loop_sym:
                                sizes[lay.loop_sym] = n
                            for st in B.enumerate_layout(ctx, lay, infos, final)[:3]:
                                bg, kinfos = real(st, sizes, infos, ("@0", "@1"), None)
                                if bg is not None:
                                    cost = C.custom_op_cost(bg, {**infos, **kinfos})["time_us"]
                                    assert f <= cost, (lay, sizes, f, cost)
    finally:
        B.instantiate = real
    assert checked > 1000, checked
    assert calls["floors"] < 0.8 * calls["plain"], calls


def test_a_lost_worker_result_is_a_clear_error_not_a_hang():
    """Context.pool_result (the catalog's and the lanes' waits on worker processes): the result when it comes,
    an error naming what was waited on when the worker's task never completes; the wait is bounded by the
    deadline plus the grace."""
    import multiprocessing

    import pytest

    from mpk_dist.errors import MpkError
    from mpk_dist.superopt import context as C

    target = analyze(build("silu_mul_linear", {"M": 2, "I": 64, "N": 32}))
    ctx = Context(target, SearchConfig(max_block_ops=3, prune=False), time.monotonic() + 5)
    waits = []

    class Task:
        def __init__(self, value):
            self.value = value

        def get(self, timeout=None):
            waits.append(timeout)
            if self.value is None:
                raise multiprocessing.TimeoutError
            return self.value

    assert ctx.pool_result(Task(("options", {})), "layout 0") == ("options", {})
    with pytest.raises(MpkError, match=r"superopt: layout 3 of \('X',\): expected the worker process's result"):
        ctx.pool_result(Task(None), "layout 3 of ('X',)")
    assert all(w is not None and w <= 5 + C.POOL_GRACE_S for w in waits), waits


def test_listing_limit_applied_by_the_enumerator_lists_the_same_options(monkeypatch):
    """Under a listing limit, ``layout_options`` lets the enumerator drop structures whose outputs
    put them over the limit before they are put in canonical order (``enumerate_layout(keep=)``);
    the options listed and the ``over_limit`` count are those of the check on ``cost_key``'s
    outputs alone (the first-op layouts of Q and of (Kt, V) for attention at small shapes, 3
    block ops, limits that cut most of them, about half and none, output reads 1 and 2)."""
    from mpk_dist.superopt import blocksearch as B
    from mpk_dist.superopt import catalog as C

    target = analyze(build("attention_decode", {"H": 4, "D": 64, "S": 256}))
    config = SearchConfig(max_kernel_ops=2, max_block_ops=3, prune=False)
    infos = input_infos(target)
    plain = B.enumerate_layout

    def listings(early: bool) -> tuple:
        ctx = Context(target, config, time.monotonic() + 900)
        with monkeypatch.context() as m:
            if not early:
                m.setattr(B, "enumerate_layout",
                          lambda *a, keep=None, **k: plain(*a, **k))
            out = [C.layout_options(ctx, lay, infos, False, (us, reads))
                   for subset in (("Q",), ("Kt", "V")) for lay in B.layouts(subset, infos, 1)
                   for us in (2.0003, 2.02, 100.0) for reads in (1, 2)]
        return out, ctx.counts.get("over_limit", 0)

    early, early_over = listings(True)
    late, late_over = listings(False)
    assert early == late and early_over == late_over
    assert early_over > 1000 and sum(map(len, early)) > 1000


def test_a_bounded_catalog_lists_the_same_options():
    """``max_listings`` (the lanes' catalogs): with room for one listing and one layout list,
    every request of a sequence that comes back to evicted subsets (last ops over inputs and
    first-op-like tensors, unpruned, as a lane asks) gets the listing an unbounded catalog gives,
    and the catalog holds one of each at the end."""
    from mpk_dist.superopt.inference import infer

    target = analyze(build("rmsnorm_linear", {"M": 2, "K": 64, "N": 32}))
    infos = dict(input_infos(target))
    infos["t0"] = infer("mul", [infos["X"], infos["G"]], {})
    infos["t1"] = infer("mul", [infos["X"], infos["X"]], {})
    infos["t2"] = infer("div", [infos["X"], infos["G"]], {})
    config = SearchConfig(max_kernel_ops=2, max_block_ops=4, prune=False)
    asks = [("t0", "t1", "W"), ("t2", "t1", "W"), ("t0", "t1", "W")]

    ctx = Context(target, config, time.monotonic() + 120)  # one context: signatures built once

    def run(max_listings):
        cat = BlockCatalog(ctx, 1, max_listings=max_listings)
        out = [[cat.layout_options(s, k, infos, True) for k in range(len(cat.layouts(s, infos)))]
               for s in asks]
        return out, ctx.counts.get("listing_evictions", 0), cat

    free, free_evictions, free_cat = run(None)
    tight, tight_evictions, tight_cat = run(1)
    assert tight == free and sum(len(x) for lists in free for x in lists) > 0
    assert free_evictions == 0 and len(free_cat.per_layout) > 2
    assert tight_evictions > 0
    assert len(tight_cat.per_layout) == 1 and len(tight_cat.lays) == 1


def test_renamed_subsets_list_what_their_own_enumeration_lists():
    """Unpruned first ops over target inputs are listed once per renaming class: (B,) and
    (B, W) of silu_mul_linear get (A,)'s and (A, W)'s listings with B for A, which equal their own
    enumeration (``catalog.layout_options`` on a fresh context), on the pool too, with the pool's
    first-op keys; a representative released before its members still serves them without a new
    enumeration; with pruning nothing is shared."""
    from mpk_dist.superopt import blocksearch as B
    from mpk_dist.superopt.bounds import first_op_keys
    from mpk_dist.superopt.catalog import layout_options

    target = analyze(build("silu_mul_linear", {"M": 2, "I": 64, "N": 32}))
    infos = input_infos(target)
    config = SearchConfig(max_block_ops=3, prune=False)
    pairs = ((("A",), ("B",)), (("A", "W"), ("B", "W")))

    def own(subset, k):
        ctx = Context(target, config, time.monotonic() + 120)
        lay = list(B.layouts(subset, infos, 1))[k]
        sub = {n: infos[n] for n in subset}
        opts = layout_options(ctx, lay, sub, False)
        return opts, first_op_keys(ctx, subset, opts, 2, {})

    for procs in (1, 2):
        ctx = Context(target, config, time.monotonic() + 120)
        with BlockCatalog(ctx, procs) as cat:
            for rep, member in pairs:
                n = len(cat.layouts(rep, infos))
                cat.prefetch(rep, range(n), infos, False, None, 2)
                for k in range(n):
                    cat.layout_options(rep, k, infos, False)
                total = 0
                for k in range(n):
                    opts, keys = own(member, k)
                    assert cat.layout_options(member, k, infos, False) == opts
                    total += len(opts)
                    if procs > 1:
                        assert cat.keys(member, k, infos, 2) == keys
                assert total > 0
        assert ctx.counts["listings_renamed"] == sum(len(cat.layouts(m, infos)) for _, m in pairs)

    ctx = Context(target, config, time.monotonic() + 120)
    cat = BlockCatalog(ctx, 1)
    listed = [cat.layout_options(("A",), k, infos, False) for k in range(len(cat.layouts(("A",), infos)))]
    cat.release(("A",), infos, False)
    explored = ctx.counts["explored"]
    served = [cat.layout_options(("B",), k, infos, False) for k in range(len(listed))]
    assert ctx.counts["explored"] == explored and not cat.held  # from the held copy, then dropped
    assert [[o[1:] for o in x] for x in served] == [[o[1:] for o in x] for x in listed]

    pruned = Context(target, SearchConfig(max_block_ops=3, prune=True), time.monotonic() + 120)
    cat = BlockCatalog(pruned, 1)
    cat.layout_options(("A",), 0, infos, False)
    cat.layout_options(("B",), 0, infos, False)
    assert "listings_renamed" not in pruned.counts


def _instantiated_key(st, infos, rep):
    """``cost_key`` as it was computed before ``KeyTable``: from the block graph instantiated at
    the representative counts (the reference the table must reproduce)."""
    from collections import Counter

    from mpk_dist.superopt.catalog import _instantiate

    bg, kinfos, names = _instantiate(st, rep, infos)
    if bg is None:
        return None
    sh = {b.local: (b.tile, infos[b.name].syms) for b in bg.inputs}
    sh.update({x.out: (x.info.shape, x.info.syms) for x in (*bg.body, *bg.accs, *bg.post)})
    ops = Counter((op.kind, op.attrs, tuple(sh[a] for a in op.inputs), sh[op.out])
                  for op in bg.ops())
    return (frozenset(ops.items()), tuple(sorted(repr(sh[a.out]) for a in bg.accs)),
            tuple((kinfos[n].shape, kinfos[n].syms) for n in names))


def test_cost_key_from_the_key_table_is_the_instantiated_key(monkeypatch, count_calls):
    """``cost_key`` through a listing's ``KeyTable`` is the key of the block graph instantiated
    at the representative counts, on every structure of every layout of every input subset of
    single inputs and all inputs of qk_norm_rope (H=4, D=16; loop layouts with body ops and
    accumulators, grids, STACK outputs) and every input subset of attention (3 block ops,
    unpruned, first ops); and
    ``layout_options`` instantiates a structure only to cost it (``_out_shapes``, once per
    distinct key), not to key it (it instantiated every structure it listed)."""
    from mpk_dist.superopt import blocksearch as B
    from mpk_dist.superopt import catalog as C

    checked = 0
    for pattern, shape, sizes in (("qk_norm_rope", {"H": 4, "D": 16}, (1, 5)),
                                  ("attention_decode", {"H": 2, "D": 16, "S": 64}, (1, 2, 3))):
        target = analyze(build(pattern, shape))
        ctx = Context(target, SearchConfig(max_block_ops=3, prune=False), time.monotonic() + 120)
        infos = input_infos(target)
        for r in sizes:
            for subset in itertools.combinations(infos, r):
                for lay in B.layouts(subset, infos, 1):
                    rep = C._rep_sizes(lay, infos, ctx.config)
                    if rep is None:
                        continue
                    table = C.KeyTable(lay, infos, rep)
                    for st in B.enumerate_layout(ctx, lay, infos, False):
                        assert C.cost_key(st, infos, rep, table) == \
                            _instantiated_key(st, infos, rep), (lay, st)
                        checked += 1
    assert checked > 50000, checked

    target = analyze(build("attention_decode", {"H": 2, "D": 16, "S": 64}))
    ctx = Context(target, SearchConfig(max_block_ops=3, prune=False), time.monotonic() + 120)
    infos = input_infos(target)
    calls, real = count_calls(C, "_instantiate")
    lay = B.Layout(tuple(infos), ("n",), "k")
    opts = C.layout_options(ctx, lay, infos, False)
    rep = C._rep_sizes(lay, infos, ctx.config)
    monkeypatch.setattr(C, "_instantiate", real)
    keys = {_instantiated_key(o[0], infos, rep) for o in opts}
    assert 0 < calls[0] <= len(keys) < len(opts), (len(opts), len(keys), calls)


def test_listed_structures_share_their_ops_and_pickle_small():
    """The structures of a first-op listing share their ops and output lists (one object per
    distinct value), pickle as constructor calls, and come back equal and still shared: qk_norm_rope
    (H=4, D=16), 3 block ops, unpruned, layout "none" of (Q,) and (Q, G) (2,059 and 7,467
    options). A pool worker hands a listing back pickled (Q's first-op layout "none" at decode
    shapes: 1.9 M options). Bytes per option: 49 and 53 now, 60 and 64 with the dataclass's
    default pickling, 108 and 115 with an op tuple per structure."""
    import pickle

    from mpk_dist.superopt import blocksearch as B
    from mpk_dist.superopt.catalog import layout_options

    target = analyze(build("qk_norm_rope", {"H": 4, "D": 16}))
    infos = input_infos(target)
    ctx = Context(target, SearchConfig(max_block_ops=3, prune=False), time.monotonic() + 120)

    def shared(opts) -> bool:
        ops = [op for o in opts for op in o[0].body + o[0].post]
        outs = [o[0].outputs for o in opts]
        return len({id(x) for x in ops}) == len(set(ops)) and \
            len({id(x) for x in outs}) == len(set(outs))

    for subset in (("Q",), ("Q", "G")):
        opts = layout_options(ctx, B.Layout(subset, (), None), infos, False)
        blob = pickle.dumps(opts, protocol=pickle.HIGHEST_PROTOCOL)
        back = pickle.loads(blob)
        assert len(opts) > 2000 and back == opts and shared(opts) and shared(back)
        assert len(blob) < 56 * len(opts), len(blob) / len(opts)


def test_split_listing_merges_to_the_whole_listing(monkeypatch):
    """An unpruned first op's layout without grid or loop symbol (qk_norm_rope's Q, layout
    "none") listed in parts on a pool of 2 (``BlockCatalog.parts``) gives the listing and the
    best-first keys of one task (``split = False``): the same options in the same order; each
    part lists a proper share of them (in-process, with 3 parts too: ``merge_parts``)."""
    from mpk_dist.superopt import catalog as C

    target = analyze(build("qk_norm_rope", {"H": 4, "D": 16}))
    ctx = Context(target, SearchConfig(max_kernel_ops=2, max_block_ops=3, prune=False),
                  time.monotonic() + 120)
    infos = input_infos(target)
    subset = ("Q",)
    got = {}
    for split in (True, False):
        monkeypatch.setattr(BlockCatalog, "split", split)
        with BlockCatalog(ctx, 2) as cat:
            lays = cat.layouts(subset, infos)
            k = next(i for i, lay in enumerate(lays) if not lay.grid_syms and lay.loop_sym is None)
            assert [cat.parts(lay, False, None) for lay in lays].count(2) == (1 if split else 0)
            # the other layouts first: the parts run on workers that listed other things before
            others = [i for i in range(len(lays)) if i != k]
            cat.prefetch(subset, others, infos, False)
            before = ctx.counts.get("listings_split", 0)
            cat.prefetch(subset, [k], infos, False, keyed=2)
            assert ctx.counts.get("listings_split", 0) - before == split
            got[split] = (cat.layout_options(subset, k, infos, False), cat.keys(subset, k, infos, 2),
                          [cat.layout_options(subset, i, infos, False) for i in others])
    assert got[True] == got[False]
    whole, keys, _ = got[False]
    assert len(whole) > 1000 and keys is not None and len(keys) == len(whole)

    monkeypatch.setattr(C, "_WORKER_CTX", ctx)
    one = C._layout_task((lays[k], {"Q": infos["Q"]}, False, None, 2, None))[1]
    for n in (2, 3):
        tasks = [C._layout_task((lays[k], {"Q": infos["Q"]}, False, None, 2, (j, n))) for j in range(n)]
        parts = [r for r, _ in tasks]
        for key in ("explored", "states", "deduplicated"):  # the enumeration counted once
            assert sum(d.get(key, 0) for _, d in tasks) == one[key] > 0, key
        assert sum(len(p[0]) for p in parts) == len(whole)
        assert all(0 < len(p[0]) < len(whole) for p in parts)
        assert C.merge_parts(parts) == (whole, (2, keys))

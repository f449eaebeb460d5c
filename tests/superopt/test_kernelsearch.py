"""Kernel-graph search: the early shape check of last custom ops drops only impossible ones."""

import math
import time
from collections import deque

from mpk_dist.superopt import blocksearch as B
from mpk_dist.superopt.context import Context, SearchConfig
from mpk_dist.superopt.catalog import _may_have_shape
from mpk_dist.superopt.bounds import input_infos
from mpk_dist.superopt.patterns import build
from mpk_dist.superopt.target import analyze


def test_shape_check_drops_only_structures_that_never_have_the_target_shape():
    target = analyze(build("attention_decode", {"H": 4, "D": 64, "S": 256}))
    config = SearchConfig(max_kernel_ops=1, max_block_ops=3, prune=False, max_grid_dims=2)
    ctx = Context(target, config, time.monotonic() + 60)
    infos = input_infos(target)
    out_shape = target.graph.nodes[target.out_node].shape
    dropped = kept = 0
    for lay in B.layouts(tuple(infos), infos, config.max_grid_dims):
        for st in B.enumerate_layout(ctx, lay, infos, final=True, dedup=False):
            if _may_have_shape(st, infos, out_shape, config):
                kept += 1
                continue
            dropped += 1
            grids, loops = B.count_choices(st, infos, config)
            for grid in grids:
                for loop in (loops or [None]):
                    sizes = {**grid, **({lay.loop_sym: loop} if loop else {})}
                    _, kinfos = B.instantiate(st, sizes, infos, ("@0",), None)
                    assert kinfos is None or kinfos["@0"].shape != out_shape, (st, sizes)
    assert dropped > 0 and kept > 0


def _last_op_options(K: int, N: int):
    from mpk_dist.superopt.catalog import BlockCatalog

    target = analyze(build("silu_mul_linear", {"M": 1, "I": K, "N": N}))
    ctx = Context(target, SearchConfig(max_block_ops=4), time.monotonic() + 60)
    infos = input_infos(target)
    return BlockCatalog(ctx, 1).options(tuple(infos), infos, final=True), infos


def test_long_reduction_keeps_the_one_op_graph_at_a_loop_count_that_fits():
    """qwen3-8b's down projection (K=12288, N=4096): at the smallest loop count (2) no grid's W tile
    fits in shared memory, and grid counts used to be costed only there, so the one-custom-op
    silu*mul->matmul had no option at all and the search fell back to custom + matmul (which the
    code generator does not lower). Each grid is now costed at its first loop count that fits."""
    from mpk_dist.superopt.cost import custom_op_cost
    from mpk_dist.superopt.ugraph import SMEM_LIMIT

    options, infos = _last_op_options(12288, 4096)
    assert options, "no one-custom-op silu*mul->matmul at K=12288"
    st, sizes, cost, *_ = options[0]
    assert cost < 2 * 2.0 + 12288 * 4096 * 2 / 4.3e6  # beats custom + library matmul (2 syncs + W)
    loop_sym = st.layout.loop_sym
    assert loop_sym and sizes[loop_sym] > 2  # the smallest loop count does not fit
    bg, kinfos = B.instantiate(st, sizes, infos, ("@0",), None)
    assert bg.smem_bytes() <= SMEM_LIMIT
    assert custom_op_cost(bg, {**infos, **kinfos})["time_us"] == cost
    small = {**sizes, loop_sym: 2}
    bg2, kinfos2 = B.instantiate(st, small, infos, ("@0",), None)
    assert bg2.smem_bytes() > SMEM_LIMIT  # the cause: at loop count 2 the tiles do not fit



def test_released_first_op_listings_change_nothing(monkeypatch):
    """Depth 2 of 2, pruned and unpruned, in canonical order (no bound) and best-first (the
    bound of the cheapest graph): the catalog drops each first-op listing once its moves are
    taken over (``KernelSearch._release``). The search finds the same graphs with the same
    counters as with every listing kept, and the catalog holds no first-op listing at the end."""
    from mpk_dist.superopt.catalog import BlockCatalog
    from mpk_dist.superopt.kernelsearch import KernelSearch

    target = analyze(build("silu_mul_linear", {"M": 2, "I": 64, "N": 32}))

    def search(prune: bool, bound: float, release: bool):
        if not release:
            monkeypatch.setattr(BlockCatalog, "release", lambda self, *a, **k: None)
        ctx = Context(target, SearchConfig(max_kernel_ops=2, max_block_ops=2, prune=prune),
                      time.monotonic() + 120)
        with BlockCatalog(ctx, 1) as cat:
            found = KernelSearch(ctx, cat, bound).run(2)
            first = [k for k in cat.per_layout if not k[0]]
        monkeypatch.undo()
        assert not ctx.timed_out()
        counts = {k: v for k, v in ctx.stats().items() if k != "listings_released"}
        return found, counts, first, ctx.counts.get("listings_released", 0)

    best = min(u.cost["time_us"] for u in search(False, float("inf"), True)[0].values())
    for prune, bound in ((True, float("inf")), (False, float("inf")), (False, best)):
        found, counts, first, released = search(prune, bound, True)
        found0, counts0, first0, _ = search(prune, bound, False)
        assert sorted(found) == sorted(found0) and len(found) > 0
        assert counts == counts0
        assert first == [] and len(first0) > 0 and released > 0



def test_unpruned_canonical_phase_takes_moves_layout_by_layout(monkeypatch):
    """Unpruned depth 2 in canonical order (no bound): with ``KernelSearch.by_layout`` a
    subset's first custom op is taken before the subset's last layout is listed (before: after
    all of them), and the search finds the same complete graphs, with one process and two. With
    verification the switch to best-first comes while layouts are still unlisted (they become
    layout items of ``_best_first``), and the search returns the cheapest accepted graph."""
    from mpk_dist.superopt.catalog import BlockCatalog
    from mpk_dist.superopt.kernelsearch import KernelSearch
    from mpk_dist.superopt.search import _rank
    from mpk_dist.superopt.verify import verify

    g = build("silu_mul_linear", {"M": 2, "I": 64, "N": 32})
    target = analyze(g)
    config = SearchConfig(max_kernel_ops=2, max_block_ops=2, prune=False)
    status: dict = {}

    def check(ug) -> bool:
        if ug.key() not in status:
            status[ug.key()] = verify(ug, g, 3)
        return status[ug.key()]

    def search(by_layout: bool, procs: int, check=None):
        events: list = []
        listed, take, best_first = (BlockCatalog.layout_options, KernelSearch._take,
                                    KernelSearch._best_first)

        def logged_listing(self, subset, k, infos, final, limit=None):
            if not final:
                events.append(("list", subset, k, len(self.layouts(subset, infos))))
            return listed(self, subset, k, infos, final, limit)

        def logged_take(self, tensors, ops, move, budget, spent):
            if move is not None and not ops and move[0].kind == "custom":
                events.append(("take", move[0].inputs))
            return take(self, tensors, ops, move, budget, spent)

        def logged_best_first(self, tensors, ops, prev, dangling, budget, spent, items):
            items = list(items)
            events.append(("switch", sum(1 for i in items if i[0] == "L")))
            return best_first(self, tensors, ops, prev, dangling, budget, spent, items)

        with monkeypatch.context() as m:
            m.setattr(KernelSearch, "by_layout", by_layout)
            m.setattr(BlockCatalog, "layout_options", logged_listing)
            m.setattr(KernelSearch, "_take", logged_take)
            m.setattr(KernelSearch, "_best_first", logged_best_first)
            ctx = Context(target, config, time.monotonic() + 120)
            with BlockCatalog(ctx, procs) as cat:
                ks = KernelSearch(ctx, cat, verify=check)
                found = ks.run(2)
        assert not ctx.timed_out()
        return found, events, ks.bound

    old, old_events, _ = search(False, 1)
    assert len(old) > 0 and _early(old_events) == 0
    for procs in (1, 2):
        new, new_events, _ = search(True, procs)
        assert sorted(new) == sorted(old)
        assert _early(new_events) > 0
    # accepting only graphs whose first op is custom puts the switch inside a subset's layouts
    # (library first ops come before every subset); the cuts keep the cheapest accepted graph
    # for any acceptance test

    def custom_first(ug) -> bool:
        return ug.kernel_ops[0].kind == "custom" and check(ug)

    best = next(u for u in _rank(old) if custom_first(u))
    _, events, bound = search(True, 2, custom_first)
    assert bound == best.cost["time_us"]
    assert any(e[0] == "switch" and e[1] > 0 for e in events)  # unlisted layouts at the switch


def _early(events) -> int:
    """First ops taken over a subset some of whose layouts were listed, but not all."""
    seen, n = {}, 0
    for e in events:
        if e[0] == "list":
            seen.setdefault(e[1], (set(), e[3]))[0].add(e[2])
        elif e[0] == "take" and e[1] in seen and len(seen[e[1]][0]) < seen[e[1]][1]:
            n += 1
    return n


def test_unpruned_depth_prefetches_the_next_depths_first_listing(monkeypatch):
    """Unpruned with a pool, depth 1 starts depth 2's first first-op listing on one worker
    (``KernelSearch._prefetch_next_depth``: the pool sat idle while depth 1's last op ran in the
    main process); depth 2 then lists it first, and both depths find the same complete graphs
    as without the prefetch and as in one process."""
    from mpk_dist.superopt.catalog import BlockCatalog, _listing_key
    from mpk_dist.superopt.kernelsearch import KernelSearch

    target = analyze(build("silu_mul_linear", {"M": 2, "I": 64, "N": 32}))
    config = SearchConfig(max_kernel_ops=2, max_block_ops=2, prune=False)
    listed = BlockCatalog.layout_options

    def depths(prefetch: bool, procs: int):
        first: list = []

        def logged(self, subset, k, infos, final, limit=None):
            if not final and not first:
                first.append(_listing_key(final, subset, infos, k))
            return listed(self, subset, k, infos, final, limit)

        with monkeypatch.context() as m:
            m.setattr(KernelSearch, "prefetch_next", prefetch)
            m.setattr(BlockCatalog, "layout_options", logged)
            ctx = Context(target, config, time.monotonic() + 120)
            with BlockCatalog(ctx, procs) as cat:
                one = KernelSearch(ctx, cat).run(1)
                early = set(cat.pending)
                two = KernelSearch(ctx, cat).run(2)
        assert not ctx.timed_out()
        return sorted(one), sorted(two), early, first, ctx.counts.get("next_depth_prefetched", 0)

    one, two, early, first, n = depths(True, 2)
    assert two and n == 1 and early == set(first)  # the one depth 2 listed first
    for off in (depths(False, 2), depths(True, 1)):
        assert off[:2] == (one, two) and off[4] == 0


FIRST_OP_CASES = [("qk_norm_rope", {"H": 4, "D": 16}, True, ("G",)),
                  ("silu_mul_linear", {"M": 2, "I": 64, "N": 32}, False, ("A", "B"))]
"""(pattern, shape, whether its library first ops are taken, the subset whose custom first ops are sampled)."""


def _sampled_first_ops(ks, tensors: dict, subset: tuple, library_firsts: bool, every: int) -> list:
    """First-op moves of ``ks``: its library ops (when ``library_firsts``), every ``every``-th custom op of each
    layout of ``subset``, and every one-output two-op structure (silu(A) * B among them)."""
    firsts = list(ks._moves(tensors, [], None, False, set(), 0.0, custom=False)) if library_firsts else []
    for k in range(len(ks.catalog.layouts(subset, tensors))):
        opts = list(ks._options(tensors, subset, None, False, 0, k))
        firsts += [m for j, m in enumerate(opts) if not j % every or
                   len(m[4].outputs) == 1 and len(m[4].body) + len(m[4].post) == 2]
    return firsts


def test_last_op_library_ops_kept_per_tensor_types():
    """The last op's pre-defined ops after first ops of qk_norm_rope (H=4, D=16: its library
    first ops and custom ones over G) and of silu_mul_linear (custom first ops over (A, B),
    after which matmul(t0, W) completes the graph), unpruned: the same candidate ops, the same
    moves (ops, new tensors, keys, costs) in the same order and the same ``explored`` count as
    the former filter (every candidate op shape-inferred after each first op, kept here as
    ``_EveryLibraryOp``), with the shape-only inference run once per tuple of tensor types
    instead of once per first op."""
    from mpk_dist.superopt import kernelsearch as K
    from mpk_dist.superopt.catalog import BlockCatalog
    from mpk_dist.superopt.inference import candidate_ops

    class _EveryLibraryOp(K.KernelSearch):
        def _library_ops(self, infos, last):
            chains = [p for p, _ in self.ctx.target.chains]
            for kind, args, attrs, akey in candidate_ops(infos, chains):
                if last:
                    shape = K.infer(kind, [infos[i] for i in args], attrs, exprs=False)
                    if shape is None or shape.shape != self.out_shape:
                        continue
                yield kind, args, attrs, akey

    real, calls = K.infer, [0]

    def counted(kind, args, attrs, exprs=True):
        calls[0] += not exprs
        return real(kind, args, attrs, exprs)

    completed = firsts_n = 0
    for name, shape, library_firsts, subset in FIRST_OP_CASES:
        target = analyze(build(name, shape))
        config = SearchConfig(max_kernel_ops=2, max_block_ops=3, prune=False)
        results = []
        for cls in (K.KernelSearch, _EveryLibraryOp):
            ctx = Context(target, config, time.monotonic() + 120)
            ks = cls(ctx, BlockCatalog(ctx, 1))
            tensors = dict(ks.inputs)
            firsts = _sampled_first_ops(ks, tensors, subset, library_firsts, 50)
            K.infer, calls[0] = counted, 0
            try:
                got = []
                for m in firsts:
                    built = ks._build(tensors, 0, False, m)
                    if built is None:
                        continue  # its result repeats an input's expression
                    op, new, key, cost = built
                    t2 = {**tensors, **new}
                    dangling = {n for n in t2 if n not in op.inputs}
                    cands = [(kd, a, sorted(at.items()), ak)
                             for kd, a, at, ak in ks._library_ops(list(t2.values()), True)]
                    moves = [(o.kind, o.inputs, o.outputs, o.attrs, o.origin, n, k, c)
                             for o, n, k, c in ks._moves(t2, [op], (key, set(new)), True,
                                                         dangling, cost, custom=False)]
                    got.append((cands, moves))
            finally:
                K.infer = real
            results.append((got, ctx.counts["explored"], calls[0], len(firsts)))
        (new, e_new, c_new, n), (ref, e_ref, c_ref, _) = results
        assert new == ref and e_new == e_ref, name
        assert c_new * 10 < c_ref, (name, c_new, c_ref)
        completed += sum(len(m) for _, m in new)
        firsts_n += n
    assert firsts_n > 100 and completed > 0, (firsts_n, completed)


def _slowed_listing(first: tuple, in_main: list | None = None):
    """``catalog.layout_options`` with the first layout of subset ``first`` (a non-last op)
    taking 2 s more; ``in_main``: a list that gets each layout listed in this process (calls in
    forked pool workers append to their own copy)."""
    import os

    from mpk_dist.superopt import catalog as C

    listing, main = C.layout_options, os.getpid()

    def slow(ctx, layout, infos, final, limit=None, *part):
        if in_main is not None and os.getpid() == main:
            in_main.append(layout)
        if not final and tuple(infos) == first and \
                layout == next(iter(C.B.layouts(first, infos, 1))):
            time.sleep(2.0)  # runs in the pool worker (forked after the patch)
        return listing(ctx, layout, infos, final, limit, *part)

    return slow


def test_unpruned_canonical_phase_takes_ready_layouts_first(monkeypatch):
    """Unpruned depth 2's first ops in canonical order (no bound) with a pool, the first
    subset's layout 0 listed slowly (a pool worker sleeps 2 s in it): with ``ready_first`` the
    moves of that subset's other layouts come while layout 0 is still on the pool (before:
    layout 0 first, the main process waiting), and the same moves come, in another order, as
    in order with two processes and with one (so the search below them is the same)."""
    from mpk_dist.superopt import catalog as C
    from mpk_dist.superopt.kernelsearch import KernelSearch

    target = analyze(build("silu_mul_linear", {"M": 2, "I": 64, "N": 32}))
    config = SearchConfig(max_kernel_ops=2, max_block_ops=2, prune=False)
    first = ("A",)
    slow = _slowed_listing(first)

    def first_ops(ready_first: bool, procs: int):
        with monkeypatch.context() as m:
            m.setattr(C, "layout_options", slow)
            m.setattr(KernelSearch, "ready_first", ready_first)
            m.setattr(KernelSearch, "ready_subsets", ready_first)
            # layout 0 has no grid or loop symbol: split (``BlockCatalog.parts``), its two slow
            # parts would hold both workers and the other layouts could not be back first
            m.setattr(C.BlockCatalog, "split", False)
            ctx = Context(target, config, time.monotonic() + 120)
            with C.BlockCatalog(ctx, procs) as cat:
                ks = KernelSearch(ctx, cat)
                tensors = dict(ks.inputs)
                moves = list(ks._ordered(tensors, [], None, set(tensors), 2, 0.0))
        assert not ctx.timed_out()
        keys = [mv[6] if mv[0] == "c" else mv[2] for mv in moves]
        layouts = [k[2] for k in keys if k[0] == "c" and k[1] == first]
        return keys, layouts, ctx.counts.get("layouts_ready_first", 0), \
            ctx.counts.get("subsets_ready_first", 0)

    old, old_layouts, n_old, s_old = first_ops(False, 2)
    new, new_layouts, n_new, s_new = first_ops(True, 2)
    assert len(old) > 1000 and n_old == s_old == 0 and old_layouts[0] == 0
    assert new_layouts[0] != 0 and n_new > 0 and new != old
    # while layout 0 is still on the pool, later subsets' listings are back and go first
    # (``ready_subsets``): their moves come before layout 0's
    assert s_new > 0 and new.index(next(k for k in new if k[0] == "c" and k[1] != first)) < \
        new.index(next(k for k in new if k[0] == "c" and k[1] == first and k[2] == 0))
    assert sorted(new) == sorted(old)  # the same moves, in another order
    one, _, n_one, s_one = first_ops(True, 1)
    assert one == old and n_one == s_one == 0  # without a pool: in order, as before


def test_unpruned_best_first_phase_defers_a_layout_still_on_the_pool(monkeypatch):
    """Unpruned depth 2's first ops best-first (a verified cost set, so no canonical phase) with
    a pool, the first subset's layout 0 listed slowly (a pool worker sleeps 2 s in it): with
    ``defer_listings`` that layout is put aside while the items after it go on, and its moves
    come later than in key order (before: the main process waited for it); the same moves come
    as without deferral and as with one process (in key order, nothing deferred). A layout
    that is neither listed nor on the pool when its turn comes (past ``_prefetch_ahead``'s limit
    of tasks in flight) goes to the pool too: with deferral the main process lists nothing
    itself (before: every such layout, one at a time)."""
    from mpk_dist.superopt import catalog as C
    from mpk_dist.superopt.kernelsearch import KernelSearch

    target = analyze(build("silu_mul_linear", {"M": 2, "I": 64, "N": 32}))
    config = SearchConfig(max_kernel_ops=2, max_block_ops=2, prune=False)
    first = ("A",)
    in_main: list = []
    slow = _slowed_listing(first, in_main)

    def first_ops(defer: bool, procs: int):
        with monkeypatch.context() as m:
            m.setattr(C, "layout_options", slow)
            m.setattr(KernelSearch, "defer_listings", defer)
            m.setattr(C.BlockCatalog, "split", False)  # as the test above
            ctx = Context(target, config, time.monotonic() + 120)
            with C.BlockCatalog(ctx, procs) as cat:
                ks = KernelSearch(ctx, cat)
                ks.bound = 100.0  # a verified graph far above every key: nothing is cut
                tensors = dict(ks.inputs)
                moves = list(ks._ordered(tensors, [], None, set(tensors), 2, 0.0))
        assert not ctx.timed_out()
        keys = [mv[6] if mv[0] == "c" else mv[2] for mv in moves]
        slow_at = next(i for i, k in enumerate(keys) if k[0] == "c" and k[1] == first and
                       k[2] == 0)
        listed_here = len(in_main)
        in_main.clear()
        return keys, slow_at, ctx.counts.get("layouts_deferred", 0), listed_here

    old, old_at, n_old, here_old = first_ops(False, 2)
    new, new_at, n_new, here_new = first_ops(True, 2)
    assert len(old) > 1000 and n_old == 0
    assert n_new > 0 and new_at > old_at + 100, (n_new, new_at, old_at)
    assert here_old > 0 and here_new == 0, (here_old, here_new)
    assert sorted(new) == sorted(old)  # the same moves, in another order
    one, one_at, n_one, _ = first_ops(True, 1)
    assert one == old and n_one == 0  # without a pool: in key order, as before


def test_unpruned_canonical_phase_prefetches_before_the_library_moves():
    """Unpruned depth 2 with a pool: when the canonical phase hands over its first (library)
    move, the first subset's layouts are already on the pool (before: only once the subset came
    up, after every library move), and the moves are the same as without a pool."""
    from mpk_dist.superopt.catalog import BlockCatalog, _listing_key
    from mpk_dist.superopt.kernelsearch import KernelSearch

    target = analyze(build("silu_mul_linear", {"M": 2, "I": 64, "N": 32}))
    config = SearchConfig(max_kernel_ops=2, max_block_ops=2, prune=False)
    got = []
    for procs in (2, 1):
        ctx = Context(target, config, time.monotonic() + 120)
        with BlockCatalog(ctx, procs) as cat:
            ks = KernelSearch(ctx, cat)
            tensors = dict(ks.inputs)
            moves = ks._ordered(tensors, [], None, set(tensors), 2, 0.0)
            first = next(moves)
            assert first[0] == "p"  # a library move
            early = {key for key in cat.pending
                     if key[:2] == _listing_key(False, ("A",), tensors)}
            got.append(([first] + list(moves), early))
    (two, early), (one, none) = got
    assert len(early) >= 2 and not none
    key = lambda m: m[6] if m[0] == "c" else m[2]  # noqa: E731
    assert sorted(map(key, two)) == sorted(map(key, one))


def test_last_op_library_ops_gated_by_stripped_fingerprint():
    """The last op's pre-defined ops after first ops of qk_norm_rope (H=4, D=16: its library
    first ops and a sample of custom ones over G) and of silu_mul_linear (custom first ops over
    (A, B), after which matmul(t0, W) completes the graph), unpruned: with the fingerprint gate
    (``KernelSearch._may_be_output``) the same moves in the same order and the same ``explored``
    as with every expression built (``output_gate = False``), with at least 10x fewer
    expressions built, and some graphs completed (the gate lets the target through)."""
    from mpk_dist.superopt import kernelsearch as K
    from mpk_dist.superopt.catalog import BlockCatalog

    real, calls = K.infer, [0]

    def counted(kind, args, attrs, exprs=True):
        calls[0] += exprs
        return real(kind, args, attrs, exprs)

    class _Ungated(K.KernelSearch):
        output_gate = False

    completed = 0
    for name, shape, library_firsts, subset in FIRST_OP_CASES:
        target = analyze(build(name, shape))
        config = SearchConfig(max_kernel_ops=2, max_block_ops=3, prune=False)
        results = []
        for cls in (K.KernelSearch, _Ungated):
            ctx = Context(target, config, time.monotonic() + 120)
            ks = cls(ctx, BlockCatalog(ctx, 1))
            tensors = dict(ks.inputs)
            firsts = _sampled_first_ops(ks, tensors, subset, library_firsts, 40)
            built = [b for m in firsts if (b := ks._build(tensors, 0, False, m)) is not None]
            K.infer, calls[0] = counted, 0
            try:
                got = []
                for op, new, key, cost in built:
                    t2 = {**tensors, **new}
                    dangling = {n for n in t2 if n not in op.inputs}
                    got.append([(o.kind, o.inputs, o.outputs, o.attrs, o.origin, n, k, c)
                                for o, n, k, c in ks._moves(t2, [op], (key, set(new)), True,
                                                            dangling, cost, custom=False)])
            finally:
                K.infer = real
            results.append((got, ctx.counts["explored"], calls[0]))
        (new, e_new, c_new), (ref, e_ref, c_ref) = results
        assert new == ref and e_new == e_ref, name
        assert c_new * 10 < c_ref, (name, c_new, c_ref)
        completed += sum(map(len, new))
    assert completed > 0


def test_least_layout_bound_kept_per_tensor_types():
    """``_subsets`` after first ops of qk_norm_rope (H=4, D=16: library first ops and a sample
    of custom ones over G) with the last op next: the same subsets and least layout bounds, in
    the same order, under a bound that cuts some of them, as with the bound computed every
    time (``least_memo = False``), with at least 5x fewer ``blocksearch.layouts`` calls."""
    from mpk_dist.superopt import kernelsearch as K
    from mpk_dist.superopt.catalog import BlockCatalog

    real, calls = B.layouts, [0]

    def counted(*a):
        calls[0] += 1
        return real(*a)

    class _EveryTime(K.KernelSearch):
        least_memo = False

    target = analyze(build("qk_norm_rope", {"H": 4, "D": 16}))
    config = SearchConfig(max_kernel_ops=2, max_block_ops=3, prune=False)
    results = []
    for cls in (K.KernelSearch, _EveryTime):
        ctx = Context(target, config, time.monotonic() + 120)
        ks = cls(ctx, BlockCatalog(ctx, 1))
        tensors = dict(ks.inputs)
        firsts = list(ks._moves(tensors, [], None, False, set(), 0.0, custom=False))
        for k in range(len(ks.catalog.layouts(("G",), tensors))):
            firsts += list(ks._options(tensors, ("G",), None, False, 0, k))[::40]
        built = [b for m in firsts if (b := ks._build(tensors, 0, False, m)) is not None]
        B.layouts, calls[0] = counted, 0
        try:
            got, bound = [], math.inf
            for _ in range(2):  # no bound, then the median of what the first pass yielded
                ks.bound = bound
                for op, new, key, cost in built:
                    t2 = {**tensors, **new}
                    must = {n for n in t2 if n not in op.inputs}
                    got.append(list(ks._subsets(t2, list(t2), (key, set(new)), True, must,
                                                cost)))
                totals = sorted(c + least for (_, _, _, c), subs in zip(built, got)
                                for _, least in subs)
                bound = totals[len(totals) // 2]
        finally:
            B.layouts = real
        results.append((got, calls[0]))
    (new, c_new), (ref, c_ref) = results
    assert new == ref
    assert sum(map(len, ref[:len(ref) // 2])) > sum(map(len, ref[len(ref) // 2:])) > 0
    assert c_new * 5 < c_ref, (c_new, c_ref)


class _LateTask:
    """A pool task that comes back ``after`` seconds from now."""

    def __init__(self, after: float) -> None:
        self.at = time.monotonic() + after

    def ready(self) -> bool:
        return time.monotonic() >= self.at

    def wait(self, timeout: float) -> None:
        time.sleep(max(0.0, min(timeout, self.at - time.monotonic())))


class _Catalog:
    """The catalog calls ``_ready_layout`` makes: subsets with ``n`` layouts, the listings in
    ``back`` ready, every other one on the pool until ``late`` comes back."""

    def __init__(self, n: dict, back: set, late: _LateTask) -> None:
        self.n, self.back, self.late, self.prefetched = n, back, late, []

    def layouts(self, subset, tensors):
        return list(range(self.n[subset]))

    def ready(self, subset, k, tensors, final):
        return (subset, k) in self.back or self.late.ready()

    def pending_task(self, subset, k, tensors, final):
        return self.late

    def prefetch(self, subset, ks, tensors, final):
        self.prefetched.append((subset, list(ks)))


def test_ready_layout_expands_a_later_subset_whose_listing_is_back():
    """Unpruned canonical phase: the front layout item's listing is on the pool and no other
    layout item is ready, but a later subset's layout is back: that subset becomes its layout
    items in place (as its own turn would make them, and it leaves ``upcoming``) and its ready
    layout goes first, the waiting item back at the front (before: the main process waited for
    the front listing, 182 s for qk_norm_rope's Q "none" on 2 cores)."""
    from mpk_dist.superopt.kernelsearch import KernelSearch

    def take(ready_subsets: bool):
        late = _LateTask(2.0)
        cat = _Catalog({("Q",): 2, ("Q", "G"): 3, ("G",): 2}, {(("Q", "G"), 1)}, late)
        ks = KernelSearch.__new__(KernelSearch)
        ks.catalog, ks.lanes, ks.ready_subsets = cat, None, ready_subsets
        ks.ctx = Context(analyze(build("silu_mul_linear", {"M": 2, "I": 64, "N": 32})),
                         SearchConfig(prune=False), time.monotonic() + 60)
        pending = deque([("s", ("G",), 0.0), ("s", ("Q", "G"), 0.0)])
        upcoming = deque([("G",), ("Q", "G")])
        t0 = time.monotonic()
        item = ks._ready_layout(("L", ("Q",), 0), pending, {}, upcoming)
        return item, list(pending), list(upcoming), cat.prefetched, time.monotonic() - t0, \
            ks.ctx.counts.get("subsets_ready_first", 0)

    item, pending, upcoming, prefetched, took, n = take(True)
    assert item == ("L", ("Q", "G"), 1) and took < 1.0 and n == 1
    assert pending == [("L", ("Q",), 0), ("s", ("G",), 0.0),
                       ("L", ("Q", "G"), 0), ("L", ("Q", "G"), 2)]
    assert upcoming == [("G",)] and prefetched == [(("Q", "G"), [0, 1, 2])]
    item, pending, upcoming, _, took, n = take(False)
    assert item == ("L", ("Q",), 0) and took > 1.5 and n == 0   # as before: it waited
    assert pending == [("s", ("G",), 0.0), ("s", ("Q", "G"), 0.0)] and len(upcoming) == 2

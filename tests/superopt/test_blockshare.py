"""blockshare: a last custom op enumerated once per input shapes (opaque inputs) and tested per
concrete inputs gives exactly the block graphs the concrete enumerator gives (unpruned), when
the inputs include tensors a first kernel op made (issue 7, item 4)."""

import time

import numpy as np

from mpk_dist.superopt import blocksearch as B
from mpk_dist.superopt.blockmemo import FinalFilter
from mpk_dist.superopt.blockshare import _concrete_verdict
from mpk_dist.superopt.context import Context, SearchConfig
from mpk_dist.superopt.inference import candidate_ops, infer
from mpk_dist.superopt.bounds import input_infos
from mpk_dist.superopt.patterns import build
from mpk_dist.superopt.expr import to_text
from mpk_dist.superopt.target import analyze
from mpk_dist.superopt.ugraph import TensorInfo


def _first_op_tensors(target, infos: dict) -> dict:
    """{name: TensorInfo} of every library op over the inputs (as a first kernel op makes)."""
    names = list(infos)
    chains = [p for p, _ in target.chains]
    out = {}
    for kind, args, attrs, _ in candidate_ops([infos[n] for n in names], chains):
        info = infer(kind, [infos[names[i]] for i in args], attrs)
        if info is not None and info.expr not in {i.expr for i in (*infos.values(), *out.values())}:
            out[f"t{len(out)}"] = info
    return out


def _setup(ops: int):
    target = analyze(build("rmsnorm_linear", {"M": 2, "K": 64, "N": 32}))
    infos = input_infos(target)
    made = _first_op_tensors(target, infos)
    config = SearchConfig(max_kernel_ops=2, max_block_ops=ops, prune=False)
    return target, {**infos, **made}, config


def _named(infos: dict, text: str) -> str:
    return next(n for n, i in infos.items() if to_text(i.expr) == text)


def test_shared_last_op_equals_the_concrete_enumeration():
    """Per layout (grid over n, loop over k or none), the same structures in the same order;
    the three subsets share one enumeration per layout (same shapes, different expressions)."""
    target, infos, config = _setup(4)
    gx, ginv, xx = _named(infos, "G*X"), _named(infos, "inv(G)*X"), _named(infos, "X*X")
    shared = Context(target, config, time.monotonic() + 120)
    kept = 0
    for subset in ((gx, xx, "W"), (ginv, xx, "W"), ("X", gx, "W")):
        for lay in B.layouts(subset, infos, 1):
            if lay.grid_syms != ("n",) or lay.loop_sym not in (None, "k"):
                continue
            old = B.enumerate_layout(Context(target, config, time.monotonic() + 60), lay, infos,
                                     final=True, share=False)
            new = B.enumerate_layout(shared, lay, infos, final=True, share=True)
            assert new == old, (lay, new[:2], old[:2])
            kept += len(new)
    counts = shared.counts
    assert kept > 0 and counts["mismatched"] > 0
    assert counts["shared_built"] == 2 and counts["shared_reused"] == 4  # X, G*X: same shape


def test_concrete_test_applies_no_recomputation():
    """An abstract graph whose op repeats a concrete input's expression is dropped."""
    target, infos, config = _setup(2)
    gx = _named(infos, "G*X")
    lay = B.Layout(("X", "G", gx), ("m",), None)
    st = B.Structure(lay, (), (("mul", ("i0", "i1"), ()), ("add", ("p0", "i2"), ())), ("p1",))
    sym_size = {s: x for n in lay.inputs for s, x in zip(infos[n].syms, infos[n].shape) if s}
    sizes = B.representative_sizes(lay, infos, sym_size, config)
    assert _concrete_verdict(st, sizes, infos, FinalFilter(target, lay, sym_size)) == "repeats"
    # with an opaque third input the same graph repeats nothing
    opaque = {**infos, gx: TensorInfo(infos[gx].shape, infos[gx].syms, ("v", "@2"))}
    assert _concrete_verdict(st, sizes, opaque, FinalFilter(target, lay, sym_size)) == \
        "mismatched"


def test_last_op_results_by_recipe_give_the_same_graphs(monkeypatch):
    """A signature names each last op's result by its recipe (``MemoEnumerator._leaf``: no
    expression built to confirm a fingerprint match); routing those results through the node
    matching of every other tensor (``_new``, ``_acc``) gives the same graphs per layout and the
    same structures for concrete inputs. The matching merges some results (fewer output nodes),
    so the test sees the two paths differ in their nodes."""
    from mpk_dist.superopt.blockmemo import MemoEnumerator, canonical_order
    from mpk_dist.superopt.blockshare import SharedFinal

    target, infos, config = _setup(4)
    gx, xx = _named(infos, "G*X"), _named(infos, "X*X")

    def build(lay, sizes, sym_size):
        ctx = Context(target, config, time.monotonic() + 60)
        sf = SharedFinal(ctx, lay, infos, sizes, sym_size)
        graphs = sorted(canonical_order(ops) for ops in sf.graphs())
        return sf, graphs, sf.structures(ctx, lay, infos, sizes, sym_size)

    merged = compared = 0
    for lay in B.layouts((gx, xx, "W"), infos, 1):
        sym_size = {s: x for n in lay.inputs for s, x in zip(infos[n].syms, infos[n].shape) if s}
        sizes = B.representative_sizes(lay, infos, sym_size, config)
        if sizes is None:
            continue
        new, new_graphs, new_st = build(lay, sizes, sym_size)
        with monkeypatch.context() as m:
            m.setattr(MemoEnumerator, "_leaf", MemoEnumerator._new)
            m.setattr(MemoEnumerator, "_leaf_acc", MemoEnumerator._acc)
            old, old_graphs, old_st = build(lay, sizes, sym_size)
        assert new_graphs == old_graphs and new.n_graphs == old.n_graphs, lay
        assert new_st == old_st, lay
        assert (new.states, new.deduplicated) == (old.states, old.deduplicated)
        merged += new.n_outputs - old.n_outputs
        compared += len(new_graphs)
    assert compared > 100 and merged > 0


def test_a_tiny_signature_cache_gives_the_same_structures(monkeypatch):
    """With ``SIGNATURE_CACHE_BYTES`` below any signature's size, every new signature evicts the
    previous one and a later request rebuilds it: the structures of every layout of three input
    sets (two of them share signatures) are those of an unbounded cache, and only the counters
    say signatures were dropped and built again."""
    from mpk_dist.superopt import blockshare

    target, infos, config = _setup(3)
    gx, ginv, xx = _named(infos, "G*X"), _named(infos, "inv(G)*X"), _named(infos, "X*X")
    subsets = ((gx, xx, "W"), ("X", gx, "W"), (ginv, xx, "W"), ("X", gx, "W"))

    def run():
        ctx = Context(target, config, time.monotonic() + 120)
        out = [B.enumerate_layout(ctx, lay, infos, final=True, share=True)
               for subset in subsets for lay in B.layouts(subset, infos, 1)]
        return out, ctx.counts, ctx.__dict__["_shared_final"]

    free, free_counts, free_cache = run()
    assert "signature_evictions" not in free_counts and free_cache.nbytes > 0
    with monkeypatch.context() as m:
        m.setattr(blockshare, "SIGNATURE_CACHE_BYTES", 1)
        tiny, tiny_counts, tiny_cache = run()
    assert tiny == free and sum(map(len, tiny)) > 0
    assert tiny_counts["signature_evictions"] > 0 and tiny_counts["signature_rebuilds"] > 0
    assert len(tiny_cache.entries) == 1  # the newest signature stays
    assert tiny_counts["shared_built"] > free_counts["shared_built"]
    assert tiny_counts["shared_built"] == free_counts["shared_built"] + \
        tiny_counts["signature_rebuilds"]


def test_inputs_with_equal_stripped_fingerprints_reuse_the_cheap_test():
    """``SharedFinal.passing``: an input set whose stripped fingerprints equal an earlier one's (here
    G*X and sum8(G*X), which differ only in a reduction size) reuses the cheap test's result, and
    every layout's structures and failure counts equal those of a fresh context."""
    from mpk_dist.superopt import expr as E

    target, infos, config = _setup(4)
    gx, xx = _named(infos, "G*X"), _named(infos, "X*X")
    infos = {**infos, "s8": TensorInfo(infos[gx].shape, infos[gx].syms, E.mk_sum(8, infos[gx].expr))}
    shared = Context(target, config, time.monotonic() + 120)
    kept = 0
    for subset in ((gx, xx, "W"), ("s8", xx, "W")):
        for lay in B.layouts(subset, infos, 1):
            if lay.grid_syms != ("n",) or lay.loop_sym not in (None, "k"):
                continue
            fresh = Context(target, config, time.monotonic() + 60)
            want = B.enumerate_layout(fresh, lay, infos, final=True, share=True)
            before = shared.counts.get("mismatched", 0)
            got = B.enumerate_layout(shared, lay, infos, final=True, share=True)
            assert got == want
            assert shared.counts.get("mismatched", 0) - before == fresh.counts["mismatched"]
            kept += len(got)
    assert kept > 0 and shared.counts["stripped_reused"] == 2 and shared.counts["stripped_tested"] == 2


def _all_layouts_against_concrete(target, infos, config, subsets):
    """enumerate_layout with and without ``blockshare`` over every layout of ``subsets``: equal
    lists per layout; returns (layouts compared, graphs kept, the shared context's counters)."""
    shared = Context(target, config, time.monotonic() + 300)
    n_lay = kept = 0
    for subset in subsets:
        for lay in B.layouts(subset, infos, config.max_grid_dims):
            old = B.enumerate_layout(Context(target, config, time.monotonic() + 120), lay, infos,
                                     final=True, share=False)
            new = B.enumerate_layout(shared, lay, infos, final=True, share=True)
            assert new == old, (lay, new[:2], old[:2])
            n_lay += 1
            kept += len(new)
    return n_lay, kept, shared.counts


def test_layouts_that_differ_in_extents_share_one_enumeration():
    """``Family``: layouts of one input set whose tiles differ only in their extents (no grid,
    grid over m, grid over n: rms_norm->matmul at M=8, K=64, N=32) are enumerated once, with
    generic extents; every layout's structures equal the concrete enumerator's, and fewer
    signatures are built than layouts asked (each family once)."""
    from mpk_dist.superopt import blockshare

    target = analyze(build("rmsnorm_linear", {"M": 8, "K": 64, "N": 32}))
    infos = input_infos(target)
    infos = {**infos, **_first_op_tensors(target, infos)}
    config = SearchConfig(max_kernel_ops=2, max_block_ops=4, prune=False)
    gx, xx = _named(infos, "G*X"), _named(infos, "X*X")
    subsets = ((gx, xx, "W"), ("X", "G", "W"), (gx, "W"))
    n_lay, kept, counts = _all_layouts_against_concrete(target, infos, config, subsets)
    assert kept > 0 and n_lay >= 12
    # families: the same enumeration serves several layouts of one input set
    fams = {}
    for subset in subsets:
        for lay in B.layouts(subset, infos, 1):
            sym_size = {s: x for n in lay.inputs for s, x in zip(infos[n].syms, infos[n].shape) if s}
            sizes = B.representative_sizes(lay, infos, sym_size, config)
            if sizes is not None:
                fam = blockshare.Family(Context(target, config, time.monotonic() + 60), lay,
                                        infos, sizes, sym_size)
                fams[fam.cache_key(infos, lay.inputs)] = len(fam.members)
    assert max(fams.values()) >= 3  # none, grid m, grid n
    assert counts["shared_built"] == len(fams) < n_lay


def test_generic_extents_keep_a_loop_and_two_grid_dims():
    """The same comparison with a loop over k and two grid dims (``max_grid_dims=2``), at 3 block
    ops: families whose members split two symbols."""
    target = analyze(build("rmsnorm_linear", {"M": 8, "K": 64, "N": 32}))
    infos = input_infos(target)
    infos = {**infos, **_first_op_tensors(target, infos)}
    config = SearchConfig(max_kernel_ops=2, max_block_ops=3, prune=False, max_grid_dims=2)
    gx, xx = _named(infos, "G*X"), _named(infos, "X*X")
    n_lay, kept, counts = _all_layouts_against_concrete(
        target, infos, config, ((gx, xx, "W"), ("X", "G", "W")))
    assert kept > 0 and counts["shared_built"] < n_lay


def test_a_signature_that_cannot_reach_the_target_shape_is_not_enumerated():
    """qk_norm_rope (H=4, D=16): a last op over G, C, S, R and a tensor without Q's head dim (as
    after sum(Q) over the heads) has no tensor of the target's shape; the signature is marked
    unreachable without an enumeration (0 states) and every layout lists nothing, as the
    concrete enumerator does; with the head dim present (Q*Q) the signature is enumerated."""
    from mpk_dist.superopt import expr as E

    target = analyze(build("qk_norm_rope", {"H": 4, "D": 16}))
    infos = dict(input_infos(target))
    q = infos["Q"]
    infos["t0"] = TensorInfo((1, 16), (None, q.syms[1]), E.mk_sum(4, q.expr))
    infos["t1"] = TensorInfo(q.shape, q.syms, E.mk_mul([q.expr, q.expr]))
    config = SearchConfig(max_kernel_ops=2, max_block_ops=4, prune=False)
    n_lay, kept, counts = _all_layouts_against_concrete(
        target, infos, config, (("G", "C", "S", "R", "t0"),))
    assert n_lay > 0 and kept == 0
    assert counts["shared_unreachable"] == counts["shared_built"] > 0
    assert counts.get("states", 0) == 0
    n_lay, kept, counts = _all_layouts_against_concrete(
        target, infos, config, (("G", "C", "S", "R", "t1"),))
    # (the loop over m cannot give a (4, 16) output: unreachable too; the others are enumerated)
    assert counts["states"] > 0 and counts["shared_unreachable"] < counts["shared_built"]


def test_input_sets_that_are_permutations_by_shape_share_a_signature():
    """qk_norm_rope (H=4, D=16), 4 block ops: the input sets (C, S, R, Q) and (n, C, S, R) with
    n = rms_norm(Q, G) of Q's shape list their inputs in another order; the signature lists them
    by symbols (``_order``), so the second set reuses the first one's enumeration, and every
    layout of both equals the concrete enumerator's (the second keeps the rope's graphs: the
    input positions renamed back)."""
    target = analyze(build("qk_norm_rope", {"H": 4, "D": 16}))
    infos = dict(input_infos(target))
    q = infos["Q"]
    infos["n"] = TensorInfo(q.shape, q.syms, target.exprs[13])  # rms_norm(Q, G)
    config = SearchConfig(max_kernel_ops=2, max_block_ops=4, prune=False)
    subsets = (("C", "S", "R", "Q"), ("n", "C", "S", "R"))
    n_lay, kept, counts = _all_layouts_against_concrete(target, infos, config, subsets)
    assert kept > 0
    first = _all_layouts_against_concrete(target, infos, config, subsets[:1])[2]
    assert counts["shared_built"] == first["shared_built"]  # the second set builds nothing
    assert counts["shared_reused"] == n_lay - first["shared_built"] > 0


def test_a_signature_that_runs_into_the_deadline_keeps_nothing():
    """A signature whose enumeration the deadline stops holds no graphs (its tables and sieve
    are not built: ~30 s of the lanes past the deadline in the eighteenth session) and lists
    nothing, as the concrete enumerator's layout listing (``catalog.layout_options`` checks the
    deadline before its first structure) and as before."""
    from mpk_dist.superopt.blockshare import SharedFinal
    from mpk_dist.superopt.catalog import layout_options

    target, infos, config = _setup(4)
    gx, xx = _named(infos, "G*X"), _named(infos, "X*X")
    lay = next(lay for lay in B.layouts((gx, xx, "W"), infos, 1)
               if lay.grid_syms == ("n",) and lay.loop_sym == "k")
    sym_size = {s: x for n in lay.inputs for s, x in zip(infos[n].syms, infos[n].shape) if s}
    sizes = B.representative_sizes(lay, infos, sym_size, config)

    class Late(Context):
        after, calls = 10**9, 0

        def timed_out(self) -> bool:
            self.calls += 1
            return self.calls > self.after

    full = Late(target, config, 0.0)
    whole = SharedFinal(full, lay, infos, sizes, sym_size)
    assert whole.complete and whole.n_graphs > 0
    late = Late(target, config, 0.0)
    late.after = full.calls // 2
    part = SharedFinal(late, lay, infos, sizes, sym_size)
    assert not part.complete and part.states > 0
    assert part.n_graphs == 0 and not part.n_outputs and not len(part.sids)
    ctx = Late(target, config, 0.0)
    ctx.after = full.calls // 2
    assert layout_options(ctx, lay, infos, True) == []  # the shared path (unpruned last op)


def test_a_signature_keeps_its_graphs_as_arrays_in_the_enumerations_order():
    """``SharedFinal`` keeps its graphs as int32 arrays of descriptor ids (``_store``), not as
    ``{output node: [op tuple]}``: qk_norm_rope (H=4, D=16), 4 block ops, (Q, G, C, S, R) without a
    grid (6,720 graphs): ``graphs()`` gives the enumerator's op tuples grouped by output node, each
    group and the groups in the order of enumeration, the nodes grouped by stripped structure
    (``sid_nodes``) are a permutation of them, and the graphs' arrays take less than a quarter of
    the bytes of the dict, its lists and op tuples (``sys.getsizeof``), and the descriptors'
    heads and rows of ints less than a third of the descriptor tuples' (outer tuples only)."""
    import sys

    from mpk_dist.superopt.blockmemo import MemoEnumerator
    from mpk_dist.superopt.blockshare import Family, SharedFinal, _output_node

    target = analyze(build("qk_norm_rope", {"H": 4, "D": 16}))
    infos = dict(input_infos(target))
    config = SearchConfig(max_kernel_ops=2, max_block_ops=4, prune=False)
    lay = next(lay for lay in B.layouts(("Q", "G", "C", "S", "R"), infos, 1) if not lay.grid_syms
               and lay.loop_sym is None)
    sym_size = {s: x for n in lay.inputs for s, x in zip(infos[n].syms, infos[n].shape) if s}
    sizes = B.representative_sizes(lay, infos, sym_size, config)
    ctx = Context(target, config, time.monotonic() + 60)
    sf = SharedFinal(ctx, lay, infos, sizes, sym_size)
    fam = Family(ctx, lay, infos, sizes, sym_size)
    enum = MemoEnumerator(ctx, fam.alay, fam.ainfos, fam.asizes, 1, fam.accept(target))
    by_out: dict = {}
    for ops in map(enum.ops_of, enum.completions()):
        by_out.setdefault(_output_node(ops, enum.acc_of), []).append(ops)
    want = [ops for group in by_out.values() for ops in group]
    assert list(sf.graphs()) == want and sf.n_graphs == len(want) == 6720
    assert sf.n_outputs == len(by_out) and sorted(sf.sid_nodes.tolist()) == list(range(len(by_out)))
    assert sf.ops.dtype == np.int32 and sf.graph_at.dtype == np.int32
    assert len(sf.desc_head) == len({id(d) for ops in want for d in ops})  # the used ones only
    dicts = sys.getsizeof(by_out) + sum(sys.getsizeof(g) + sum(map(sys.getsizeof, g))
                                        for g in by_out.values())
    arrays = sf.ops.nbytes + sf.graph_at.nbytes + sf.node_at.nbytes
    assert arrays < dicts / 4, (arrays, dicts)
    # the descriptors as heads and rows of ints: fewer bytes than their tuples' outer objects
    tuples = sum(sys.getsizeof(d) for d in {id(d): d for ops in want for d in ops}.values())
    assert sf.desc_head.nbytes + sf.desc_ints.nbytes < tuples / 3
    assert len(sf.heads) < len(sf.desc_head) / 10


def test_the_signature_cache_drops_the_cheapest_to_rebuild_per_byte(monkeypatch):
    """``SignatureCache`` over the bound drops the signature with the lowest credit (its last
    use's clock plus its states per byte), not the least recently used one: a 1-byte signature
    whose enumeration had 300,000 states (a no-graph family) outlives two 60-byte ones of 1,000
    states put after it, one of which goes; a later hit refreshes a credit, and an unreachable
    signature (0 states) is the first to go."""
    from types import SimpleNamespace

    from mpk_dist.superopt import blockshare

    monkeypatch.setattr(blockshare, "SIGNATURE_CACHE_BYTES", 100)
    sig = lambda nbytes, states: SimpleNamespace(nbytes=nbytes, states=states)  # noqa: E731
    cache = blockshare.SignatureCache(SimpleNamespace(counts={}))
    cache.put("tiny", sig(1, 300_000))
    cache.put("a", sig(60, 1_000))
    cache.put("b", sig(60, 1_000))  # 121 bytes: "a" (lowest credit, older of the two) goes
    assert list(cache.entries) == ["tiny", "b"] and cache.nbytes == 61
    assert cache.ctx.counts["signature_evictions"] == 1
    cache.get("b")
    cache.put("u", sig(2, 0))  # unreachable: credit = clock
    cache.put("c", sig(38, 600))  # 101 bytes: "u" (credit = clock) goes, 99 left
    assert list(cache.entries) == ["tiny", "b", "c"] and cache.ctx.counts["signature_evictions"] == 2
    cache.put("a", sig(60, 1_000))  # built again: a rebuild; "b" and "c" go, "tiny" stays
    assert list(cache.entries) == ["tiny", "a"] and cache.ctx.counts["signature_rebuilds"] == 1

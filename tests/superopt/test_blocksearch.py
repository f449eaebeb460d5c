"""Block-graph enumeration: the early dangling-tensor bound changes the work, not the graphs."""

import time

import pytest

from mpk_dist.superopt import blocksearch as B
from mpk_dist.superopt.context import Context, SearchConfig
from mpk_dist.superopt.bounds import input_infos
from mpk_dist.superopt.patterns import build
from mpk_dist.superopt.target import analyze


def _enumerate(target, names, prune: bool, final: bool, early: bool, block_ops: int = 3):
    config = SearchConfig(max_kernel_ops=1, max_block_ops=block_ops, prune=prune)
    ctx = Context(target, config, time.monotonic() + 60)
    infos = input_infos(target)
    out = []
    for lay in B.layouts(names, infos, 1):
        out += [(lay, s.body, s.post, s.outputs)
                for s in B.enumerate_layout(ctx, lay, infos, final, early_bound=early, dedup=False)]
    return out, ctx.counts["explored"]


@pytest.mark.parametrize("pattern, shape", [
    ("rmsnorm_linear", {"M": 4, "K": 512, "N": 256}),
    ("attention_decode", {"H": 4, "D": 64, "S": 256}),
])
@pytest.mark.parametrize("final", [True, False])
def test_early_bound_finds_the_same_structures(pattern, shape, final):
    target = analyze(build(pattern, shape))
    names = tuple(target.graph.input_names())
    for prune in (False, True):
        late, late_n = _enumerate(target, names, prune, final, early=False)
        early, early_n = _enumerate(target, names, prune, final, early=True)
        assert early == late and len(set(early)) == len(early)
        assert early and early_n < late_n


def test_every_structure_reads_all_inputs_and_has_few_outputs():
    target = analyze(build("silu_mul_linear", {"M": 2, "I": 64, "N": 32}))
    names = tuple(target.graph.input_names())
    structs, _ = _enumerate(target, names, prune=False, final=True, early=True)
    assert structs
    for lay, body, post, outputs in structs:
        read = {a for _, args, _ in body + post for a in args}
        assert {f"i{k}" for k in range(len(names))} <= read, (lay, body, post)
        assert len(outputs) == 1


class _Forgetful(dict):
    """A memo that never hits (the uncached path)."""

    def get(self, key, default=None):
        return default

    def __setitem__(self, key, value) -> None:
        pass


def test_instantiate_with_its_memos_equals_the_uncached_path(monkeypatch):
    """``instantiate`` shares the inputs' part per layout and counts (``_block_inputs``) and
    memoizes shape-only inference (``inference._SHAPE_MEMO``); every structure of attention's
    first-op layouts at every grid and loop count gives the same block graph and output infos
    as without both memos, shapes only and with expressions."""
    from mpk_dist.superopt import inference

    target = analyze(build("attention_decode", {"H": 4, "D": 64, "S": 256}))
    config = SearchConfig(max_kernel_ops=2, max_block_ops=3, prune=False)
    infos = input_infos(target)
    cases = []
    for names in (("Q",), ("Kt", "V")):
        for lay in B.layouts(names, infos, 1):
            ctx = Context(target, config, time.monotonic() + 60)
            for st in B.enumerate_layout(ctx, lay, infos, False)[::5]:
                grids, loops = B.count_choices(st, infos, config)
                for g in grids:
                    for n in loops or [None]:
                        cases.append((st, {**g, lay.loop_sym: n} if n else dict(g)))
    assert len(cases) > 2000
    outs = ("@0", "@1")

    def run(origin_of):
        return [B.instantiate(st, sizes, infos, outs[:len(st.outputs)], origin_of)
                for st, sizes in cases]

    cached = [run(None), run(None), run(target.origin_of)]  # fills the memos, then hits them
    monkeypatch.setattr(B, "_INPUTS_MEMO", _Forgetful())
    monkeypatch.setattr(inference, "_SHAPE_MEMO", _Forgetful())
    plain = [run(None), run(None), run(target.origin_of)]
    assert cached == plain
    assert all(bg is not None for bg, _ in plain[0][:10])


class _LateContext(Context):
    """A context whose deadline passes at its ``after``-th ``timed_out`` call."""

    after = 10**9
    calls = 0

    def timed_out(self) -> bool:
        self.calls += 1
        return self.calls > self.after


def test_a_layout_that_runs_into_the_deadline_lists_nothing(monkeypatch):
    """A first-op layout whose enumeration the deadline stops lists nothing, as before (the
    catalog checked the deadline before its first structure), and its partial graphs are no
    longer put in canonical order (``MemoEnumerator.structures``: up to ~75 s past the deadline
    for qk_norm_rope's layouts of Q)."""
    from mpk_dist.superopt.blockmemo import MemoEnumerator
    from mpk_dist.superopt.catalog import layout_options

    target = analyze(build("rmsnorm_linear", {"M": 4, "K": 512, "N": 256}))
    infos = input_infos(target)
    config = SearchConfig(max_kernel_ops=2, max_block_ops=3, prune=False)
    lay = next(lay for lay in B.layouts(("X", "G"), infos, 1) if lay.loop_sym == "k")
    made = []
    real = MemoEnumerator.structures
    monkeypatch.setattr(MemoEnumerator, "structures",
                        lambda self, *a, **k: made.append(1) or real(self, *a, **k))
    full = _LateContext(target, config, 0.0)
    assert B.enumerate_layout(full, lay, infos, False) and made == [1]
    late = _LateContext(target, config, 0.0)
    late.after = full.calls // 2  # the deadline passes in the middle of the enumeration
    assert B.enumerate_layout(late, lay, infos, False) == []
    late.calls = 0
    assert layout_options(late, lay, infos, False) == []
    assert made == [1] and late.counts["states"] > 0  # stopped midway, nothing put in order


def test_the_enumeration_makes_no_tensor_past_the_deadline(monkeypatch):
    """Once the deadline passes, ``MemoEnumerator`` makes no further tensor (``_new``) and joins
    no completions (``_join``) in any frame of its recursion (before, every frame still ran its
    remaining ops, their child states and the joins), and the layout still lists nothing."""
    from mpk_dist.superopt.blockmemo import MemoEnumerator

    target = analyze(build("rmsnorm_linear", {"M": 4, "K": 512, "N": 256}))
    infos = input_infos(target)
    config = SearchConfig(max_kernel_ops=2, max_block_ops=3, prune=False)
    lay = next(lay for lay in B.layouts(("X", "G"), infos, 1) if lay.loop_sym == "k")
    full = _LateContext(target, config, 0.0)
    assert B.enumerate_layout(full, lay, infos, False)
    late = _LateContext(target, config, 0.0)
    late.after = full.calls // 2
    made, joined = [], []
    real_new, real_did = MemoEnumerator._new, MemoEnumerator._did
    monkeypatch.setattr(MemoEnumerator, "_new", lambda self, *a: made.append(
        late.calls > late.after) or real_new(self, *a))
    monkeypatch.setattr(MemoEnumerator, "_did", lambda self, *a: joined.append(
        late.calls > late.after) or real_did(self, *a))
    assert B.enumerate_layout(late, lay, infos, False) == []
    assert made and sum(made) == 0  # no tensor made past the deadline
    assert joined and sum(joined) == 0  # no completion joined past it


def test_a_finished_enumeration_is_not_put_in_order_past_the_deadline(monkeypatch):
    """The deadline passing after the enumeration but before its graphs are put in canonical
    order (``MemoEnumerator.structures``, checked every 4096 graphs: qk_norm_rope's layout
    "none" of Q has 1.9 M) lists nothing and orders none of them."""
    from mpk_dist.superopt import blockmemo

    target = analyze(build("rmsnorm_linear", {"M": 4, "K": 512, "N": 256}))
    infos = input_infos(target)
    config = SearchConfig(max_kernel_ops=2, max_block_ops=3, prune=False)
    lay = next(lay for lay in B.layouts(("X", "G"), infos, 1) if lay.loop_sym == "k")
    entry, real = [], blockmemo.MemoEnumerator.structures
    monkeypatch.setattr(blockmemo.MemoEnumerator, "structures", lambda self, *a: entry.append(
        self.ctx.calls) or real(self, *a))
    full = _LateContext(target, config, 0.0)
    assert B.enumerate_layout(full, lay, infos, False)
    late = _LateContext(target, config, 0.0)
    late.after = entry[0]  # every check of the enumeration passes, the first one after fails
    ordered, order = [], blockmemo.canonical_order
    monkeypatch.setattr(blockmemo, "canonical_order", lambda ops: ordered.append(1) or order(ops))
    assert B.enumerate_layout(late, lay, infos, False) == []
    assert late.counts["states"] == full.counts["states"] and not ordered


def test_a_listing_the_deadline_stops_while_costing_lists_nothing():
    """The deadline passing after the structures are in order, in ``catalog.layout_options``'
    costing loop, lists nothing (whole or a part), instead of the options costed so far, which a
    pool worker pickled and the main process unpickled and merged past the deadline
    (qk_norm_rope's Q, "none" in 2 parts: 963,667 options, 28 s in the call, twenty-second
    session)."""
    from mpk_dist.superopt.catalog import layout_options

    target = analyze(build("rmsnorm_linear", {"M": 4, "K": 512, "N": 256}))
    infos = input_infos(target)
    config = SearchConfig(max_kernel_ops=2, max_block_ops=3, prune=False)
    lay = next(lay for lay in B.layouts(("X", "G"), infos, 1) if lay.loop_sym == "k")
    for part in (None, (0, 2)):
        full = _LateContext(target, config, 0.0)
        listed = layout_options(full, lay, infos, False, part=part)
        n = len(B.enumerate_layout(_LateContext(target, config, 0.0), lay, infos, False, part=part))
        assert len(listed if part is None else listed[0]) > 10
        late = _LateContext(target, config, 0.0)
        late.after = full.calls - n // 2  # in the costing loop (one call per structure), halfway
        got = layout_options(late, lay, infos, False, part=part)
        assert got == ([] if part is None else ([], [])) and late.calls > late.after


def test_enumerate_layout_asks_structures_once_with_keep_and_part(monkeypatch):
    """``enumerate_layout`` makes one ``MemoEnumerator.structures(graphs, keep, part)`` call
    whatever ``keep`` and ``part`` are (None passed through: ``structures`` takes both as None),
    instead of four call forms chosen by branches; a stand-in that requires both parameters
    sees the same arguments in every case, and ``keep`` reaches it only for a non-last op."""
    from mpk_dist.superopt.blockmemo import MemoEnumerator

    target = analyze(build("rmsnorm_linear", {"M": 4, "K": 512, "N": 256}))
    infos = input_infos(target)
    config = SearchConfig(max_kernel_ops=2, max_block_ops=3, prune=False)
    lay = next(lay for lay in B.layouts(("X", "G"), infos, 1) if lay.loop_sym == "k")
    seen, real = [], MemoEnumerator.structures

    def strict(self, graphs, keep, part):  # no defaults: every call names both
        seen.append((keep is not None, part))
        return real(self, graphs, keep, part)

    monkeypatch.setattr(MemoEnumerator, "structures", strict)
    every = lambda outs: True  # noqa: E731
    for keep, part in ((None, None), (every, None), (None, (1, 2)), (every, (0, 2))):
        ctx = Context(target, config, time.monotonic() + 60)
        assert B.enumerate_layout(ctx, lay, infos, False, keep=keep, part=part)
    ctx = Context(target, config, time.monotonic() + 60)
    B.enumerate_layout(ctx, lay, infos, True, share=False, keep=every)
    assert seen == [(False, None), (True, None), (False, (1, 2)), (True, (0, 2)), (False, None)]

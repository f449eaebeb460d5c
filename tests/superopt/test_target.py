"""Target facts: ``origin_of`` answers as a function of the expression alone."""

from mpk_dist.superopt import expr as E
from mpk_dist.superopt.patterns import build
from mpk_dist.superopt.target import analyze

D = 64


def _weighted_v(inner: int, outer: int) -> tuple:
    """sum_outer(exp(sum_inner(Q*Kt) * D^-0.5) * V): with inner = D the scores are complete and the
    expression is a partial sum of attention's second matmul; with inner < D they are partial dot
    products, which no target op contains. Both have one sizeless form."""
    scores = E.mk_mul([E.mk_sum(inner, E.mk_mul([E.var("Q"), E.var("Kt")])), E.const(float(D) ** -0.5)])
    return E.mk_sum(outer, E.mk_mul([E.mk_exp(scores), E.var("V")]))


def test_origin_of_does_not_depend_on_the_order_of_calls():
    """Before the fifteenth session the fallback answer was memoized under the sizeless form, so
    whichever of these two was asked first answered for both ("" twice, or matmul#1 twice)."""
    g = build("attention_decode", {"H": 4, "D": D, "S": 256})
    inside, outside = _weighted_v(D, 32), _weighted_v(32, 32)
    a, b = analyze(g), analyze(g)
    origins = dict(a.origins)
    first = {e: a.origin_of(e) for e in (inside, outside)}
    second = {e: b.origin_of(e) for e in (outside, inside)}
    assert first == second
    assert first[inside] == "matmul#1" and first[outside] == ""
    # asked again, in either target, the same answers; the target ops' table did not grow
    assert a.origin_of(outside) == "" and b.origin_of(inside) == "matmul#1"
    assert a.origins == origins == b.origins


def test_a_target_op_is_matched_with_sum_sizes_ignored():
    """A partial sum of exactly a target op's expression (the scores over 32 of 64) is that op."""
    g = build("attention_decode", {"H": 4, "D": D, "S": 256})
    t = analyze(g)
    assert t.origin_of(E.mk_sum(32, E.mk_mul([E.var("Q"), E.var("Kt")]))) == "matmul#0"
    assert t.origin_of(E.mk_sum(D, E.mk_mul([E.var("Q"), E.var("Kt")]))) == "matmul#0"


def _instantiate_qk_first_ops(origin_for) -> None:
    """qk_norm_rope (H=4, D=16): 300 first ops of every layout over (G,) and (Q,) instantiated one after the
    other as the lanes do, every expression of their block graphs through ``origin_for(target)``."""
    import time

    from mpk_dist.superopt import blocksearch as B
    from mpk_dist.superopt.bounds import input_infos
    from mpk_dist.superopt.catalog import BlockCatalog
    from mpk_dist.superopt.context import Context, SearchConfig

    target = analyze(build("qk_norm_rope", {"H": 4, "D": 16}))
    ctx = Context(target, SearchConfig(max_kernel_ops=2, max_block_ops=3, prune=False), time.monotonic() + 120)
    cat, infos, origin = BlockCatalog(ctx, 1), input_infos(target), origin_for(target)
    for subset in (("G",), ("Q",)):
        for k in range(len(cat.layouts(subset, infos))):
            for st, sizes, _, _ in cat.layout_options(subset, k, infos, False)[:300]:
                B.instantiate(st, sizes, infos, ("t0", "t1"), origin)


def test_origin_of_kept_by_identity_answers_as_computed(monkeypatch, count_calls):
    """First ops as the lanes instantiate them (``_instantiate_qk_first_ops``): the answers of ``origin_of``
    (kept by the identity of the expression) equal ``_origin_of`` (the former computation) asked every time,
    and ``_sizeless`` walks far fewer nodes."""
    from mpk_dist.superopt import target as T

    walked, _ = count_calls(T, "_sizeless")
    # every call walks (the sizeless forms' own memo, shared by both runs, would hide the
    # difference: test_sizeless_kept_by_identity_gives_the_walks_answers checks that one)
    monkeypatch.setattr(T, "SIZELESS_MEMO", False)
    got = []
    for memo in (True, False):
        answers = []

        def origin_for(target, memo=memo, answers=answers):
            ask = target.origin_of if memo else target._origin_of

            def origin(e):
                answers.append(ask(e))
                return answers[-1]
            return origin

        walked[0] = 0
        _instantiate_qk_first_ops(origin_for)
        got.append((answers, walked[0]))
    (new, w_new), (ref, w_ref) = got
    assert new == ref and len(new) > 1000 and any(new)
    assert w_new * 2 < w_ref, (w_new, w_ref)


def test_sizeless_kept_by_identity_gives_the_walks_answers(monkeypatch, count_calls):
    """First ops as the lanes instantiate them: ``_origin_of`` (no origin memo) answers the same with
    ``_sizeless`` kept by the identity of each term as with the whole term walked every time (``SIZELESS_MEMO =
    False``), and the same sizeless forms, with at least 5x fewer nodes walked."""
    from mpk_dist.superopt import target as T

    walked, _ = count_calls(T, "_sizeless_walk")
    monkeypatch.setattr(T, "_SIZELESS", {})
    got = []
    for memo in (True, False):
        monkeypatch.setattr(T, "SIZELESS_MEMO", memo)
        answers = []

        def origin_for(target, answers=answers):
            def origin(e):
                answers.append((target._origin_of(e), T._sizeless(e)))
                return answers[-1][0]
            return origin

        walked[0] = 0
        _instantiate_qk_first_ops(origin_for)
        got.append((answers, walked[0]))
    (new, w_new), (ref, w_ref) = got
    assert new == ref and len(new) > 1000 and any(o for o, _ in new)
    assert w_new * 5 < w_ref, (w_new, w_ref)


def test_sizeless_memo_capped_by_sizeless_entries(monkeypatch, count_calls):
    """``_sizeless`` clears its memo once it holds more than ``SIZELESS_ENTRIES`` terms, and answers
    as the walk does on both sides of a clearing: with the cap at 7 the memo never holds all the
    subterms of these terms, so a second pass walks again; with no cap reached it walks nothing."""
    from mpk_dist.superopt import target as T

    walked, _ = count_calls(T, "_sizeless_walk")
    monkeypatch.setattr(T, "SIZELESS_MEMO", True)
    terms = [_weighted_v(i, o) for i in (4, 8, 16, 64) for o in (2, 3, 5)]
    got = {}
    for cap in (7, 10**6):
        monkeypatch.setattr(T, "_SIZELESS", {})
        monkeypatch.setattr(T, "SIZELESS_ENTRIES", cap)
        passes = []
        for _ in range(2):
            walked[0] = 0
            assert [T._sizeless(t) for t in terms] == [T._sizeless_walk(t) for t in terms]
            passes.append(walked[0] - len(terms))  # less the reference walks' top calls
        got[cap] = (passes, len(T._SIZELESS))
    (first, second), held = got[10**6]
    assert second == 0 and held > 8, got
    (first7, second7), held7 = got[7]
    assert second7 > 0 and held7 <= 8, got

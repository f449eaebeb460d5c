"""The z3 pruning oracle: verdicts, the cache, and 'unknown' keeping the candidate."""

from mpk_dist.superopt import expr as E
from mpk_dist.superopt import prune
from mpk_dist.superopt.prune import SubexprOracle

X, W = E.var("X"), E.var("W")
TARGET = E.mk_sum(64, E.mk_mul([X, W, E.mk_inv(E.mk_sqrt(E.mk_sum(64, E.mk_mul([X, X]))))]))


def test_z3_keeps_subexpressions_and_prunes_others():
    o = SubexprOracle(TARGET, E.closure(TARGET))
    assert o.is_sub(E.mk_sum(8, E.mk_mul([X, W])))
    assert not o.is_sub(E.mk_exp(X))
    assert not o.is_sub(E.mk_mul([W, W]))
    assert o.stats["z3_queries"] == 3


def test_verdicts_are_cached():
    o = SubexprOracle(TARGET, E.closure(TARGET))
    e = E.mk_sum(8, E.mk_mul([X, X]))
    assert o.is_sub(e) and o.is_sub(e) and o.is_sub(e)
    assert o.stats["z3_queries"] == 1
    assert o.stats["cache_hits"] == 2


def test_unknown_keeps_the_candidate(monkeypatch):
    monkeypatch.setattr(prune, "RLIMIT", 1)  # too small for z3 to decide anything
    o = SubexprOracle(TARGET, E.closure(TARGET))
    assert o.is_sub(E.mk_exp(X))  # not a subexpression, but z3 cannot tell: kept
    assert o.stats["z3_unknown"] == 1


def test_one_off_check_normalizes_first():
    raw = ("mul", (W, ("sum", 2, ("sum", 4, ("mul", (X, W))))))
    assert not prune.check(raw, TARGET)  # W*W*X is nowhere in the target
    assert prune.check(("sum", 2, ("mul", (W, X))), TARGET)

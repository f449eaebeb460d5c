"""Abstract expressions: canonical forms under the axioms and subexpression closures."""

from mpk_dist.superopt import expr as E

X, Y, Z = E.var("X"), E.var("Y"), E.var("Z")


def test_commutativity_and_associativity_give_one_form():
    a = E.mk_add([X, E.mk_add([Y, Z])])
    b = E.mk_add([E.mk_add([Z, X]), Y])
    assert a == b
    assert E.mk_mul([X, Y]) == E.mk_mul([Y, X])


def test_distributivity_and_division():
    lhs = E.mk_mul([E.mk_add([X, Y]), Z])
    rhs = E.mk_add([E.mk_mul([X, Z]), E.mk_mul([Y, Z])])
    assert lhs == rhs
    # (x / z) * y == (x * y) / z
    assert E.mk_mul([E.mk_mul([X, E.mk_inv(Z)]), Y]) == E.mk_mul([E.mk_mul([X, Y]), E.mk_inv(Z)])


def test_exp_of_sum_is_product_of_exps():
    assert E.mk_exp(E.mk_add([X, Y])) == E.mk_mul([E.mk_exp(X), E.mk_exp(Y)])


def test_nested_sums_merge_with_exact_sizes():
    assert E.mk_sum(4, E.mk_sum(16, X)) == E.mk_sum(64, X)
    assert E.mk_sum(4, E.mk_sum(16, X)) != E.mk_sum(32, X)


def test_closure_holds_partial_sums_and_subproducts_only():
    target = E.mk_sum(64, E.mk_mul([X, Y, E.mk_inv(E.mk_sqrt(E.mk_sum(64, E.mk_mul([X, X]))))]))
    c = E.closure(target)
    assert E.mk_sum(16, E.mk_mul([X, Y])) in c          # partial matmul tile
    assert E.mk_sum(8, E.mk_mul([X, X])) in c           # partial sum of squares
    assert target in c
    assert E.mk_exp(X) not in c                         # no exp in the target
    assert E.mk_sum(16, E.mk_mul([Y, Y])) not in c      # Y is never squared
    assert E.mk_sum(48, E.mk_mul([X, Y])) not in c      # 48 does not divide 64
    assert E.mk_add([X, Y]) not in c


def test_normalize_is_idempotent():
    t = ("mul", (("add", (X, Y)), ("sum", 4, ("sum", 2, Z))))
    n = E.normalize(t)
    assert E.normalize(n) == n
    assert n == E.mk_mul([E.mk_add([X, Y]), E.mk_sum(8, Z)])

"""Finite-field arithmetic: primes, inverses, exp as a homomorphism, consistent sqrt."""

import numpy as np

from mpk_dist.superopt.field import FieldAlgebra, FieldArr, primes


def _is_prime(n):
    return n > 1 and all(n % f for f in range(2, int(n ** 0.5) + 1))


def test_primes_q_divides_p_minus_1_and_w_has_order_q():
    p, q, w = primes()
    assert _is_prime(p) and _is_prime(q) and (p - 1) % q == 0
    assert pow(w, q, p) == 1 and w != 1


def test_exp_is_a_homomorphism_and_division_inverts():
    alg = FieldAlgebra(1)
    a, b = alg.random_input((64,)), alg.random_input((64,))
    lhs = alg.exp(alg.add(a, b))
    rhs = alg.mul(alg.exp(a), alg.exp(b))
    assert np.array_equal(lhs.p, rhs.p)
    back = alg.mul(alg.div(a, b), b)
    nz = (b.p != 0) & (b.q != 0)
    assert np.array_equal(back.p[nz], a.p[nz]) and np.array_equal(back.q[nz], a.q[nz])


def test_sqrt_is_a_consistent_function_within_a_trial_and_fresh_across_trials():
    a1, a2 = FieldAlgebra(1), FieldAlgebra(2)
    x = a1.random_input((256,))
    assert a1.equal(a1.sqrt(x), a1.sqrt(FieldArr(x.p.copy(), x.q.copy())))
    assert not np.array_equal(a1.sqrt(x).p, a2.sqrt(x).p)


def test_exact_matmul_matches_integer_arithmetic_for_long_reductions():
    alg = FieldAlgebra(3)
    a, b = alg.random_input((3, 20000)), alg.random_input((20000, 5))
    out = alg.matmul(a, b)
    ref = [[sum(int(x) * int(y) for x, y in zip(a.p[i], b.p[:, j])) % alg.P for j in range(5)]
           for i in range(3)]
    assert np.array_equal(out.p, np.array(ref))


def test_constants_integers_exact_others_random():
    alg = FieldAlgebra(4)
    assert int(alg.const(3.0).p) == 3 and int(alg.const(-1.0).p) == alg.P - 1
    assert alg.const(1e-6) is alg.const(1e-6)

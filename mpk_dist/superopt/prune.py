"""Pruning oracle: is an abstract expression a subexpression of the target's?

The axioms (docs/SUPEROPT.md) are applied in two steps. ``expr.normalize`` turns them into a
terminating rewrite system (associativity and commutativity by flattening and sorting,
distributivity, division as product with inverse, exp of a sum, nested and linear sums), so every
term has one canonical form. The subexpression axioms (x <= f(x, ...), sub-sums, sub-products and
partial reductions sum_d(x) <= sum_n(x) for d | n) then give a finite set: ``expr.closure``.

z3 decides the resulting ground problem: abstract expressions become terms over uninterpreted
functions add/mul/inv/exp/sqrt/sum of an uninterpreted sort, the closure becomes facts ``inT(t)``,
and a query asks whether ``not inT(E)`` is satisfiable: sat means E is not a subexpression and the
prefix is pruned, unsat keeps it, and 'unknown' (the resource limit hit) keeps it too. Verdicts
are cached per canonical expression.
"""

from __future__ import annotations

from mpk_dist.superopt import expr as E

# z3 resource limit per query: small, because a query is a ground congruence-closure problem.
RLIMIT = 200_000


class SubexprOracle:
    """Answers ``is_sub(e)`` for one target; counts queries and cache hits in ``stats``."""

    def __init__(self, target_expr: tuple, closure: frozenset, use_z3: bool = True) -> None:
        self.target = target_expr
        self.closure = closure
        self.use_z3 = use_z3
        self.cache: dict = {}
        self.stats = {"z3_queries": 0, "cache_hits": 0, "z3_unknown": 0}
        self._solver = None

    def is_sub(self, e: tuple) -> bool:
        """True when ``e`` may be part of the target (keep), False when it provably is not."""
        hit = self.cache.get(e)
        if hit is not None:
            self.stats["cache_hits"] += 1
            return hit
        verdict = self._ask_z3(e) if self.use_z3 else (e in self.closure)
        self.cache[e] = verdict
        return verdict

    # -- z3 ---------------------------------------------------------------------------------
    def _setup(self):
        import z3

        ctx = z3.Context()
        sort = z3.DeclareSort("P", ctx)
        b = z3.BoolSort(ctx)
        i = z3.IntSort(ctx)
        self._z3 = z3
        self._ctx = ctx
        self._fn = {
            "add": z3.Function("add", sort, sort, sort),
            "mul": z3.Function("mul", sort, sort, sort),
            "inv": z3.Function("inv", sort, sort),
            "exp": z3.Function("exp", sort, sort),
            "sqrt": z3.Function("sqrt", sort, sort),
            "sum": z3.Function("sum", i, sort, sort),
        }
        self._sort = sort
        self._leaves: dict = {}
        self._in_t = z3.Function("inT", sort, b)
        s = z3.Solver(ctx=ctx)
        s.set("rlimit", RLIMIT)
        self._memo: dict = {}
        for t in self.closure:
            s.add(self._in_t(self._term(t)))
        self._solver = s

    def _term(self, t: tuple):
        z = self._memo.get(t)
        if z is not None:
            return z
        z3 = self._z3
        head = t[0]
        if head in ("v", "c"):
            z = z3.Const(f"{head}:{t[1]}", self._sort)
        elif head in ("add", "mul"):
            args = [self._term(a) for a in t[1]]
            z = args[0]
            for a in args[1:]:  # n-ary node as a left fold of the binary function
                z = self._fn[head](z, a)
        elif head == "sum":
            z = self._fn["sum"](z3.IntVal(t[1], self._ctx), self._term(t[2]))
        else:
            z = self._fn[head](self._term(t[1]))
        self._memo[t] = z
        return z

    def _ask_z3(self, e: tuple) -> bool:
        if self._solver is None:
            self._setup()
        z3 = self._z3
        self.stats["z3_queries"] += 1
        s = self._solver
        s.push()
        s.add(z3.Not(self._in_t(self._term(e))))
        r = s.check()
        s.pop()
        if r == z3.unknown:
            self.stats["z3_unknown"] += 1
            return True
        return r == z3.unsat


def check(e: tuple, target: tuple) -> bool:
    """One-off question (no cache reuse): is canonical ``e`` a subexpression of ``target``?"""
    return SubexprOracle(E.normalize(target), E.closure(E.normalize(target))).is_sub(
        E.normalize(e))

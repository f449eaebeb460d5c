"""Abstract expressions: what a tensor computes, with positions forgotten.

An abstract expression is a hashable tuple term. It keeps the operators and the exact size of every
reduction but not which element is combined with which, so one term describes a whole tile or
tensor. Terms:

    ("v", name)             an input tensor          ("c", value)        a scalar constant
    ("add", (t, ...))       n-ary sum                ("mul", (t, ...))   n-ary product
    ("inv", t)              1 / t                    ("exp", t)          e ** t
    ("sqrt", t)             square root              ("sum", n, t)       a reduction over n elements

``normalize`` rewrites a term with the axioms of docs/SUPEROPT.md (associativity and commutativity
by flattening and sorting, distributivity, division as a product with an inverse, exp of a sum,
nested and linear sums) into one canonical form. NOTE: the rules deliberately over-identify
(abstract expressions carry no indices, so a factor may always move in or out of a sum); that can
only keep more prefixes during pruning, never drop a correct one. ``closure`` lists every term a
canonical target contains as a subexpression, partial sums (any divisor of a reduction size) and
sub-products / sub-sums included.
"""

from __future__ import annotations

from itertools import combinations

# Bounds that keep closure() finite and small; targets of fused LLM subgraphs stay far below them.
_MAX_SUBSET_ARGS = 8


def var(name: str) -> tuple:
    """The abstract expression of the input tensor ``name``."""
    return ("v", name)


def const(value: float) -> tuple:
    """The abstract expression of a scalar constant."""
    return ("c", float(value))


def _sorted(args) -> tuple:
    # Terms compare as plain tuples: equal heads imply equal layouts, so no mixed-type compare.
    return tuple(sorted(args))


def mk_add(args) -> tuple:
    """Canonical n-ary sum of already canonical terms (flattened, sorted)."""
    flat = []
    for a in args:
        flat.extend(a[1] if a[0] == "add" else (a,))
    return flat[0] if len(flat) == 1 else ("add", _sorted(flat))


def mk_sum(n: int, t: tuple) -> tuple:
    """Canonical reduction of ``n`` elements of the canonical term ``t``."""
    if n == 1:
        return t
    if t[0] == "sum":  # sum_n(sum_m(x)) = sum_{n*m}(x)
        return mk_sum(n * t[1], t[2])
    if t[0] == "add":  # the sum of a sum distributes
        return mk_add(mk_sum(n, a) for a in t[1])
    return ("sum", n, t)


def mk_mul(args) -> tuple:
    """Canonical n-ary product: flattened, distributed over sums, factors moved into reductions."""
    flat = []
    for a in args:
        flat.extend(a[1] if a[0] == "mul" else (a,))
    for i, a in enumerate(flat):
        if a[0] == "add":  # distributivity
            rest = flat[:i] + flat[i + 1:]
            return mk_add(mk_mul([b, *rest]) for b in a[1])
    sums = [a for a in flat if a[0] == "sum"]
    if sums:
        # NOTE: without indices any factor may move into a reduction; products of reductions
        # merge into one reduction over the product of sizes (an over-approximation).
        size = 1
        inner = []
        for s in sums:
            size *= s[1]
            inner.append(s[2])
        others = [a for a in flat if a[0] != "sum"]
        return mk_sum(size, mk_mul(inner + others))
    return flat[0] if len(flat) == 1 else ("mul", _sorted(flat))


def mk_inv(t: tuple) -> tuple:
    """Canonical 1 / t."""
    if t[0] == "inv":
        return t[1]
    if t[0] == "mul":
        return mk_mul(mk_inv(a) for a in t[1])
    return ("inv", t)


def mk_exp(t: tuple) -> tuple:
    """Canonical e ** t (exp of a sum is a product of exps)."""
    if t[0] == "add":
        return mk_mul(mk_exp(a) for a in t[1])
    return ("exp", t)


def mk_sqrt(t: tuple) -> tuple:
    """Canonical sqrt(t); sqrt is uninterpreted (no axiom moves anything through it)."""
    return ("sqrt", t)


def normalize(t: tuple) -> tuple:
    """Rewrite any term (built with the mk_* helpers or by hand) into canonical form."""
    head = t[0]
    if head in ("v", "c"):
        return t
    if head == "add":
        return mk_add(normalize(a) for a in t[1])
    if head == "mul":
        return mk_mul(normalize(a) for a in t[1])
    if head == "sum":
        return mk_sum(t[1], normalize(t[2]))
    return {"inv": mk_inv, "exp": mk_exp, "sqrt": mk_sqrt}[head](normalize(t[1]))


def children(t: tuple) -> tuple:
    """The direct sub-terms of ``t``."""
    if t[0] in ("add", "mul"):
        return t[1]
    if t[0] == "sum":
        return (t[2],)
    if t[0] in ("inv", "exp", "sqrt"):
        return (t[1],)
    return ()


def _divisors(n: int) -> list[int]:
    return [d for d in range(2, n + 1) if n % d == 0]


def _sub_multisets(args: tuple) -> list[tuple]:
    if len(args) > _MAX_SUBSET_ARGS:
        return [args]
    out = []
    for r in range(1, len(args) + 1):
        out.extend(combinations(args, r))
    return out


def closure(target: tuple) -> frozenset:
    """Every canonical term that is a subexpression of the canonical ``target`` under the axioms."""
    seen: set = set()
    stack = [target]
    while stack:
        t = stack.pop()
        if t in seen:
            continue
        seen.add(t)
        stack.extend(children(t))
        if t[0] in ("add", "mul"):
            build = mk_add if t[0] == "add" else mk_mul
            stack.extend(build(s) for s in _sub_multisets(t[1]) if len(s) < len(t[1]))
        elif t[0] == "sum":
            body = t[2]
            variants = [body]
            if body[0] == "mul":
                variants += [mk_mul(s) for s in _sub_multisets(body[1]) if len(s) < len(body[1])]
            # partial reductions: sum_n = sum_{n/d}(sum_d), so sum_d of any variant is inside
            for d in _divisors(t[1]):
                stack.extend(("sum", d, v) if v[0] not in ("sum", "add") else mk_sum(d, v)
                             for v in variants)
    return frozenset(seen)


def to_text(t: tuple) -> str:
    """A compact human-readable rendering of a term."""
    head = t[0]
    if head == "v":
        return t[1]
    if head == "c":
        return f"{t[1]:g}"
    if head == "add":
        return "(" + " + ".join(to_text(a) for a in t[1]) + ")"
    if head == "mul":
        return "*".join(to_text(a) for a in t[1])
    if head == "sum":
        return f"sum{t[1]}({to_text(t[2])})"
    return f"{head}({to_text(t[1])})"

"""Facts about a target Graph that the search needs, computed once.

* abstract expression of every node and of the output, and the output's subexpression closure;
* index symbols: every dimension of every node gets a name (like einsum letters) by unifying the
  dimensions that matmul and broadcasting tie together. A grid axis or a for-loop of a block graph
  splits one symbol, which fixes imap, fmap and omap consistently for every tensor at once;
* element-wise chains: the maximal single-input element-wise sub-DAGs of the target (e.g.
  ``x / (1 + exp(-x))`` of silu, ``sqrt(x/K + eps)`` of rms_norm). The search applies each as one
  thread-level fused op (registers, no shared-memory round trip between its steps).
"""

from __future__ import annotations

from dataclasses import dataclass

from mpk_dist.superopt import expr as E
from mpk_dist.superopt.graph import ELEMENTWISE, Graph

# A chain program is a nested tuple over the placeholder "x" and float constants, e.g.
# ("div", "x", ("add", ("exp", ("mul", "x", -1.0)), 1.0)).


def chain_expr(prog, x: tuple) -> tuple:
    """Abstract expression of a chain program applied to the term ``x``."""
    if prog == "x":
        return x
    if isinstance(prog, float):
        return E.const(prog)
    op, *args = prog
    sub = [chain_expr(a, x) for a in args]
    if op == "add":
        return E.mk_add(sub)
    if op == "mul":
        return E.mk_mul(sub)
    if op == "div":
        return E.mk_mul([sub[0], E.mk_inv(sub[1])])
    return {"exp": E.mk_exp, "sqrt": E.mk_sqrt}[op](sub[0])


def chain_text(prog) -> str:
    """Readable form of a chain program, e.g. ``x/(exp(x*-1)+1)``."""
    if prog == "x":
        return "x"
    if isinstance(prog, float):
        return f"{prog:g}"
    op, *args = prog
    if op in ("exp", "sqrt"):
        return f"{op}({chain_text(args[0])})"
    sym = {"add": "+", "mul": "*", "div": "/"}[op]
    return "(" + sym.join(chain_text(a) for a in args) + ")"


class _UnionFind:
    def __init__(self) -> None:
        self.parent: dict = {}

    def find(self, k):
        self.parent.setdefault(k, k)
        while self.parent[k] != k:
            self.parent[k] = self.parent[self.parent[k]]
            k = self.parent[k]
        return k

    def union(self, a, b) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[max(ra, rb)] = min(ra, rb)


def _node_expr(g: Graph, i: int, exprs: list) -> tuple:
    n = g.nodes[i]
    a = [exprs[j] for j in n.inputs]
    if n.op == "input":
        return E.var(n.attrs["name"])
    if n.op == "const":
        return E.const(n.attrs["value"])
    if n.op == "matmul":
        return E.mk_sum(g.nodes[n.inputs[0]].shape[-1], E.mk_mul(a))
    if n.op == "sum":
        return E.mk_sum(g.nodes[n.inputs[0]].shape[n.attrs["dim"]], a[0])
    if n.op == "div":
        return E.mk_mul([a[0], E.mk_inv(a[1])])
    if n.op == "add":
        return E.mk_add(a)
    if n.op == "mul":
        return E.mk_mul(a)
    return {"exp": E.mk_exp, "sqrt": E.mk_sqrt}[n.op](a[0])


def _unify(g: Graph, uf: _UnionFind) -> None:
    for i, n in enumerate(g.nodes):
        if n.op == "matmul":
            a, b = n.inputs
            ra = len(g.nodes[a].shape)
            uf.union((a, ra - 1), (b, 0))
            for d in range(ra - 1):
                uf.union((i, d), (a, d))
            uf.union((i, ra - 1), (b, 1))
        elif n.op in ("add", "mul", "div", "exp", "sqrt", "sum"):
            for j in n.inputs:
                sj = g.nodes[j].shape
                for k in range(1, len(sj) + 1):
                    if sj[-k] != 1 and sj[-k] == n.shape[-k]:
                        uf.union((i, len(n.shape) - k), (j, len(sj) - k))


@dataclass
class Target:
    """Analysis of a target Graph (see module docstring)."""

    graph: Graph
    exprs: list
    out_expr: tuple
    closure: frozenset
    syms: list           # per node: tuple of symbol names (None for size-1 dims)
    sym_size: dict       # symbol -> extent
    chains: list         # [(program, origin)]
    origins: dict        # sizeless canonical expr of a target op -> its origin label (never
                         # grows: origin_of's other answers go to its own memo, by exact expr)

    @property
    def out_node(self) -> int:
        return self.graph.outputs[0]

    def input_syms(self) -> dict:
        """{input name: symbols of its dimensions}."""
        return {n.attrs["name"]: self.syms[i] for i, n in enumerate(self.graph.nodes)
                if n.op == "input"}

    def origin_of(self, e: tuple) -> str:
        """The user-level op ``e`` implements: the op whose expression matches it (sum sizes
        ignored), else the first op (in program order) that contains ``e`` itself as a
        subexpression, else "". A function of ``e`` alone: the fallback is memoized under ``e``,
        not under its sizeless form, because two expressions with one sizeless form (a full sum
        and a partial one) can get different fallback answers, and the first one asked would
        otherwise answer for both, so one graph could print different origins in two processes
        (docs/SUPEROPT.md, fourteenth and fifteenth sessions).

        Answers are also kept by the identity of ``e`` (``_origin_ids``, the entry keeping ``e``
        alive so its id stays unique; at most 200,000, then cleared): an unpruned search's lanes
        instantiate every first op with its expressions, mostly the same interned objects from
        one first op to the next, and ``_sizeless`` (a walk that sorts operands by ``repr``) was
        ~12% of a lane's time per first op (twentieth session)."""
        ids = self.__dict__.setdefault("_origin_ids", {})
        hit = ids.get(id(e))
        if hit is not None and hit[0] is e:
            return hit[1]
        if len(ids) > 200_000:
            ids.clear()
        out = ids[id(e)] = (e, self._origin_of(e))
        return out[1]

    def _origin_of(self, e: tuple) -> str:
        """``origin_of`` without the identity memo."""
        hit = self.origins.get(_sizeless(e))
        if hit is not None:
            return hit
        memo = self.__dict__.setdefault("_fallback", {})
        found = memo.get(e)
        if found is None:
            if len(memo) > 200_000:
                memo.clear()  # bounds a lane's memory on long searches; answers depend on e alone
            if "_node_closures" not in self.__dict__:
                self._node_closures = [(n.origin, E.closure(self.exprs[i]))
                                       for i, n in enumerate(self.graph.nodes)
                                       if n.op not in ("input", "const")]
            found = next((o for o, c in self._node_closures if e in c), "")
            memo[e] = found
        return found


_SIZELESS: dict = {}  # id(t) -> (t, _sizeless(t)); the entry keeps t alive, so its id stays unique
SIZELESS_MEMO = True  # False: every call walks the whole term (as before the twenty-first session)
SIZELESS_ENTRIES = 200_000
"""How many terms ``_sizeless`` keeps (then the memo is cleared; a cleared entry is walked again,
identically). Each entry keeps its term alive, so without a cap a lane that runs millions of first
ops would keep every expression it ever built; the cap bounds that memory, and is large enough to
hold the subterms that one first op's block graph shares with the next ones."""


def _sizeless(t: tuple) -> tuple:
    """``t`` with every reduction size set to 0 and the operands of sums and products sorted by
    ``repr``. Kept by the identity of ``t`` (a pure function of it; at most ``SIZELESS_ENTRIES``
    entries, then cleared): the expressions of one first op's block graph share most subterms with those of
    the previous first ops (interned tensors), and the walk over whole terms was ~7% of a lane's
    time per first op (twenty-first session)."""
    if not SIZELESS_MEMO:
        return _sizeless_walk(t)
    hit = _SIZELESS.get(id(t))
    if hit is not None and hit[0] is t:
        return hit[1]
    if len(_SIZELESS) > SIZELESS_ENTRIES:
        _SIZELESS.clear()
    out = _sizeless_walk(t)
    _SIZELESS[id(t)] = (t, out)
    return out


def _sizeless_walk(t: tuple) -> tuple:
    if t[0] == "sum":
        return ("sum", 0, _sizeless(t[2]))
    if t[0] in ("add", "mul"):
        return (t[0], tuple(sorted((_sizeless(a) for a in t[1]), key=repr)))
    if t[0] in ("inv", "exp", "sqrt"):
        return (t[0], _sizeless(t[1]))
    return t


def _symbols(g: Graph) -> tuple[list, dict]:
    uf = _UnionFind()
    _unify(g, uf)
    names: dict = {}
    syms, size = [], {}
    letters = "mknhdsefgijlopqrtuvwxyzabc"
    for i, n in enumerate(g.nodes):
        row = []
        for d, s in enumerate(n.shape):
            if s == 1:
                row.append(None)
                continue
            root = uf.find((i, d))
            if root not in names:
                k = len(names)
                names[root] = letters[k] if k < len(letters) else f"s{k}"
            row.append(names[root])
            size[names[root]] = s
        syms.append(tuple(row))
    return syms, size


def _chains(g: Graph) -> list:
    """Maximal single-input element-wise sub-DAGs, as (program, origin)."""
    leaves: list = []
    for i, n in enumerate(g.nodes):
        if n.op in ELEMENTWISE:
            acc = set()
            for j in n.inputs:
                acc |= leaves[j]
            leaves.append(frozenset(acc))
        else:
            leaves.append(frozenset() if n.op == "const" else frozenset([i]))
    consumers: dict = {}
    for i, n in enumerate(g.nodes):
        for j in n.inputs:
            consumers.setdefault(j, []).append(i)

    def program(i: int, leaf: int):
        n = g.nodes[i]
        if i == leaf:
            return "x"
        if n.op == "const":
            return n.attrs["value"]
        return (n.op, *(program(j, leaf) for j in n.inputs))

    out, seen = [], set()
    for i, n in enumerate(g.nodes):
        if n.op not in ELEMENTWISE or len(leaves[i]) != 1:
            continue
        if any(g.nodes[c].op in ELEMENTWISE and leaves[c] == leaves[i]
               for c in consumers.get(i, [])):
            continue  # not maximal
        prog = program(i, next(iter(leaves[i])))
        if prog not in seen:
            seen.add(prog)
            out.append((prog, n.origin))
    return out


def analyze(g: Graph) -> Target:
    """Compute the Target facts of ``g`` (which must have exactly one output)."""
    g.check()
    exprs: list = []
    for i in range(len(g.nodes)):
        exprs.append(_node_expr(g, i, exprs))
    out = exprs[g.outputs[0]]
    syms, size = _symbols(g)
    origins = {}
    for i, n in enumerate(g.nodes):
        if n.op not in ("input", "const"):
            origins.setdefault(_sizeless(exprs[i]), n.origin)
    return Target(g, exprs, out, E.closure(out), syms, size, _chains(g), origins)

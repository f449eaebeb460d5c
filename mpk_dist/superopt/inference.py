"""Shape, index-symbol and abstract-expression inference for one op (kernel or block level).

``infer(kind, args, attrs)`` returns the TensorInfo of the result or None when the op is not
valid on those operands. Validity is stricter than numpy broadcasting: two dims meet only when
they carry the same index symbol, so the search never combines, say, a head dim with a feature
dim that happens to have the same size. Dims whose symbol ends in ``#`` hold per-block partial
results (written with omap STACK); reducing one drops the dim.
"""

from __future__ import annotations

from mpk_dist.superopt import expr as E
from mpk_dist.superopt.target import chain_expr
from mpk_dist.superopt.ugraph import TensorInfo


def is_stack_sym(sym) -> bool:
    """True for the symbol of a dim that holds partial results of split blocks."""
    return isinstance(sym, str) and sym.endswith("#")


def _broadcast(a: TensorInfo, b: TensorInfo):
    shape, syms = [], []
    for i in range(1, max(len(a.shape), len(b.shape)) + 1):
        x = (a.shape[-i], a.syms[-i]) if i <= len(a.shape) else (1, None)
        y = (b.shape[-i], b.syms[-i]) if i <= len(b.shape) else (1, None)
        if x[0] == 1 and (y[0] != 1 or x[1] is None):
            x, y = y, x  # x: the dim that survives (a split dim of extent 1 keeps its symbol)
        if y[0] != 1 and (x[0] != y[0] or x[1] != y[1]):
            return None
        if y[0] == 1 and y[1] is not None and x[1] != y[1]:
            return None  # a tile dim of extent 1 still indexes its symbol: no broadcasting
        shape.append(x[0])
        syms.append(x[1])
    return tuple(reversed(shape)), tuple(reversed(syms))


_MEMO: dict = {}
_SHAPE_MEMO: dict = {}
_INTERN: dict = {}


def intern(info: TensorInfo | None) -> TensorInfo | None:
    """The canonical object equal to ``info``: equal infos become identical, so the identity
    memo of ``infer`` also hits across layouts and subsets."""
    if info is None:
        return None
    if len(_INTERN) > 500_000:
        _INTERN.clear()
    return _INTERN.setdefault(info, info)


def infer(kind: str, args: list, attrs: dict, exprs: bool = True) -> TensorInfo | None:
    """Result info of ``kind`` on ``args`` (TensorInfos), or None if invalid (memoized).

    ``exprs=False`` skips the abstract expression (None): costing many tile sizes needs shapes only.
    """
    if not exprs:
        # shapes only: a function of the kind, the dim attributes and the operands' shapes and
        # symbols (a chain keeps its operand's), memoized by those (the count search infers
        # every op of every structure at several counts)
        a = args[0]
        key = (kind, attrs.get("dim"), attrs.get("keepdim"), a.shape, a.syms) \
            if len(args) == 1 else (kind, a.shape, a.syms, args[1].shape, args[1].syms)
        hit = _SHAPE_MEMO.get(key, False)
        if hit is False:
            if len(_SHAPE_MEMO) > 500_000:
                _SHAPE_MEMO.clear()
            hit = _SHAPE_MEMO[key] = _infer(kind, args, attrs, False)
        return hit
    # NOTE: keyed by object identity (the entry keeps its arguments and the chain program alive,
    # so ids stay unique); hashing deep expression tuples on every lookup would dominate the search.
    # The program is kept too (since the eleventh session): a later search in the same process
    # (another eps) could otherwise get a freed program's id for its own and the old expression.
    prog = attrs.get("prog")
    key = (kind, *map(id, args), attrs.get("dim"), id(prog), attrs.get("keepdim"))
    hit = _MEMO.get(key)
    if hit is not None and hit[1] is prog and all(x is y for x, y in zip(hit[0], args)):
        return hit[2]
    if len(_MEMO) > 500_000:  # bound memory on very long searches
        _MEMO.clear()
    out = intern(_infer(kind, args, attrs))
    _MEMO[key] = (tuple(args), prog, out)
    return out


def _infer(kind: str, args: list, attrs: dict, exprs: bool = True) -> TensorInfo | None:
    if kind == "matmul":
        a, b = args
        if (len(a.shape) < 2 or len(b.shape) != 2 or a.shape[-1] != b.shape[0]
                or a.syms[-1] is None or a.syms[-1] != b.syms[0]):
            return None
        return TensorInfo(a.shape[:-1] + (b.shape[1],), a.syms[:-1] + (b.syms[1],),
                          E.mk_sum(a.shape[-1], E.mk_mul([a.expr, b.expr])) if exprs else None)
    if kind in ("add", "mul", "div"):
        a, b = args
        bc = _broadcast(a, b)
        if bc is None:
            return None
        if not exprs:
            e = None
        elif kind == "add":
            e = E.mk_add([a.expr, b.expr])
        elif kind == "mul":
            e = E.mk_mul([a.expr, b.expr])
        else:
            e = E.mk_mul([a.expr, E.mk_inv(b.expr)])
        return TensorInfo(bc[0], bc[1], e)
    if kind == "sum":
        (a,) = args
        d = attrs["dim"]
        if d >= len(a.shape) or a.syms[d] is None:
            return None
        keep = attrs.get("keepdim", True)
        shape = a.shape[:d] + ((1,) if keep else ()) + a.shape[d + 1:]
        syms = a.syms[:d] + ((None,) if keep else ()) + a.syms[d + 1:]
        return TensorInfo(shape, syms, E.mk_sum(a.shape[d], a.expr) if exprs else None)
    if kind == "chain":
        (a,) = args
        return TensorInfo(a.shape, a.syms, chain_expr(attrs["prog"], a.expr) if exprs else None)
    raise ValueError(f"infer: unknown op kind {kind!r}")


def candidate_ops(infos: list, chains: list, newest: set | None = None):
    """Every (kind, arg indices, attrs, attr key) on ``infos``; ops must use one of ``newest``.

    Element-wise binary ops take operands in index order (a before b) except div, which is not
    commutative. ``chains`` are the target's chain programs. The attr key is a small comparable
    tuple (the canonical order compares ops by (kind, args, attr key)).
    """
    n = len(infos)

    def fresh(*idx):
        return newest is None or any(i in newest for i in idx)

    for i in range(n):
        if not fresh(i):
            continue
        for d, s in enumerate(infos[i].syms):
            if s is not None:
                yield "sum", (i,), {"dim": d, "keepdim": not is_stack_sym(s)}, (d,)
        for k, prog in enumerate(chains):
            yield "chain", (i,), {"prog": prog}, (k,)
    for i in range(n):
        for j in range(n):
            if not fresh(i, j):
                continue
            yield "matmul", (i, j), {}, ()
            yield "div", (i, j), {}, ()
            if i <= j:
                yield "mul", (i, j), {}, ()
                yield "add", (i, j), {}, ()

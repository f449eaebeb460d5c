"""From a chosen qk_norm_rope µGraph (its ``UGraph.to_dict()``) to a per-head-row expression plan.

The qkv_prep task runs, per head row of one sequence, ``rope(rms_norm(q, G))`` with rope written as
the pattern does: ``n * C + (n @ R) * S`` (patterns.qk_norm_rope). The search returns kernel graphs
of custom ops gridded over the heads (one grid block = one head row); this module reads such a graph
into one expression tree per output element instead of assuming its shape:

* every kernel op must be a custom op whose grid splits only the output's row (head) symbol, with
  no for-loop and one output concatenated along the rows (``omap=[0]``); a kernel tensor between two
  ops becomes the tree of the op that wrote it (its value is a bf16 row, as stored);
* leaves: ``Q`` (the head row), the vectors ``G`` (norm weight), ``C`` / ``S`` (cos / sin at the
  row's position) and ``R``, the rotate-half matrix (the ABI binds R to rotate-half, as it binds W
  to the weight of a linear): ``matmul(e, R)`` becomes ``rot(e)``, ``matmul(e, mul(v, R))``
  becomes ``v * rot(e)`` (v scales R's columns);
* ``sum[dim=1](chain[x*x](Q))`` is the row statistic; ``div(e, chain[sqrt(..)](stat))`` is lowered
  as a row factor r = rsqrt(..) applied to Q inside ``e`` (``scaled``), where the reference rounds
  (the normalised head ``bf16(q * r)`` exists before the weight multiply; codegen_plan's NOTE);
* a sum over a dim whose tile extent is 1 (the head row's own dim) is the identity.

Nodes are tuples ``(tag, ops, *args)``; ``ops`` lists the µGraph ops (kernel output, op dict) the
node comes from, for the generated comments. Tags: ``q``; ``vec`` (name); ``scaled``; ``rot`` (e);
``ew`` (kind, prog, args) for mul / add / div / chain; intermediates that must not survive to the
root: ``R``, ``Rv`` (v), ``sq`` (e), ``stat``, ``rsq`` (inner program).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mpk_dist.superopt.codegen_plan import CodegenError

ROPE_INPUTS = ("Q", "G", "C", "S", "R")
ELEMENT_TAGS = ("q", "vec", "scaled", "rot", "ew")


def _fail(what: str, expected: str, got) -> None:
    raise CodegenError(f"superopt codegen qk_norm_rope {what}: expected {expected}, got {got!r}; "
                       "this µGraph needs a new lowering (or use the hand-written qkv_prep body)")


@dataclass
class RopePlan:
    """Everything the renderer needs: the output tree, the row factor, shapes and origins."""

    root: tuple
    factor: tuple | None     # ("rsq", ops, inner_prog, stat node) or None
    d_extent: int            # the head dim at the search's shapes (binds the constant 1/D)
    kernel_text: list        # per kernel op: "t0 = custom(Q) grid=(m/16) loop=none"
    origins: list = field(default_factory=list)


def _check_block(kop: dict, row_sym: str) -> dict:
    if kop["kind"] != "custom":
        _fail("kernel op " + ",".join(kop["outputs"]), "custom ops only", kop["kind"])
    blk = kop["block"]
    if len(blk["grid"]) != 1 or blk["grid"][0][0] != row_sym:
        _fail("grid", f"one axis over the head rows ({row_sym})", blk["grid"])
    if blk["loop"] is not None or blk["body"] or blk["accs"]:
        _fail("loop", "no for-loop (one head row per grid block)", blk["loop"])
    if len(blk["outputs"]) != 1 or list(blk["outputs"][0]["omap"]) != [0]:
        _fail("outputs", "one output concatenated along the rows (omap=[0])", blk["outputs"])
    return blk


def _is_element(n) -> bool:
    return n[0] in ELEMENT_TAGS


def _contains_q(n) -> bool:
    if n[0] == "q":
        return True
    return any(_contains_q(a) for a in _children(n))


def _children(n) -> list:
    if n[0] == "rot":
        return [n[2]]
    if n[0] == "ew":
        return list(n[4])
    return []


def _scale_q(n, ops):
    """``n`` with the head row Q replaced by the row-factor-scaled row."""
    if n[0] == "q":
        return ("scaled", ops)
    if n[0] == "rot":
        return ("rot", n[1], _scale_q(n[2], ops))
    if n[0] == "ew":
        return ("ew", n[1], n[2], n[3], tuple(_scale_q(a, ops) for a in n[4]))
    return n


class _Reader:
    """Reads the kernel ops into nodes; ``factors`` collects the row factors it lowered."""

    def __init__(self, d: dict) -> None:
        self.d = d
        self.factors: list = []

    def op(self, tname: str, op: dict, args: list, tile_of):
        kind, attrs = op["kind"], dict(op["attrs"])
        ops = [(tname, op)]
        if kind == "chain":
            return self._chain(ops, attrs["prog"], args[0])
        if kind == "sum":
            return self._sum(ops, attrs.get("dim"), args[0], tile_of(op["inputs"][0]))
        if kind == "matmul":
            a, b = args
            if not _is_element(a):
                _fail("matmul " + op["out"], "a head-row element operand", a[0])
            if b[0] == "R":
                return ("rot", ops, a)
            if b[0] == "Rv":
                return ("ew", b[1] + ops, "mul", None, (b[2], ("rot", ops, a)))
            _fail("matmul " + op["out"], "the rotate-half matrix R (or R with scaled columns) on the right", b[0])
        if kind == "mul" and {args[0][0], args[1][0]} == {"R", "vec"}:
            v = args[0] if args[0][0] == "vec" else args[1]
            return ("Rv", ops, v)
        if kind == "div" and args[1][0] == "rsq":
            return self._factor(ops, args[0], args[1])
        if kind in ("mul", "add", "div") and all(_is_element(a) for a in args):
            return ("ew", ops, kind, None, tuple(args))
        _fail(f"{kind} {op['out']}", "element-wise ops on the head row and the vectors G, C, S",
              [a[0] for a in args])

    def _chain(self, ops, prog, a):
        prog = _tuple(prog)
        if prog == ("mul", "x", "x") and _is_element(a):
            return ("sq", ops, a)
        if prog[0] == "sqrt" and a[0] == "stat":
            return ("rsq", ops, prog[1], a)
        if _is_element(a):
            return ("ew", ops, "chain", prog, (a,))
        _fail("chain " + ops[0][1]["out"], "x*x or an element-wise chain of the row, sqrt(..) of its statistic",
              prog)

    def _sum(self, ops, dim, a, tile):
        if dim == 0 and tile and tile[0] == 1 and _is_element(a):
            return a  # a sum over the head row's own dim of extent 1: the identity
        if dim == 1 and a[0] == "sq" and a[2][0] == "q":
            return ("stat", a[1] + ops, a[2])
        _fail("sum " + ops[0][1]["out"], "sum[dim=1] of chain[x*x] of the head row Q", (dim, a[0]))

    def _factor(self, ops, num, rsq):
        if not _is_element(num) or not _contains_q(num):
            _fail("div " + ops[0][1]["out"], "the head row (or an element-wise op of it) over the row's RMS",
                  num[0])
        if self.factors and self.factors[0][2] != rsq[2]:
            _fail("row factors", "one rms factor", len(self.factors) + 1)
        self.factors.append(rsq)
        return _scale_q(num, ops)


def _tuple(p):
    return tuple(_tuple(x) for x in p) if isinstance(p, list) else p


def plan_rope(d: dict) -> RopePlan:
    """The RopePlan of µGraph dict ``d``; CodegenError naming the part that does not fit."""
    missing = sorted(set(ROPE_INPUTS) - set(d["inputs"]))
    if missing:
        _fail("inputs", f"the qk_norm_rope µGraph's inputs {list(ROPE_INPUTS)}", sorted(d["inputs"]))
    row_sym = d["tensors"][d["output"]]["syms"][0]
    env = {"Q": ("q", []), "G": ("vec", [], "G"), "C": ("vec", [], "C"), "S": ("vec", [], "S"), "R": ("R", [])}
    reader, text, origins = _Reader(d), [], set()
    for kop in d["kernel_ops"]:
        blk = _check_block(kop, row_sym)
        tname = kop["outputs"][0]
        local = {i["local"]: env[i["name"]] for i in blk["inputs"]}
        tiles = {i["local"]: tuple(i["tile"]) for i in blk["inputs"]}
        for op in blk["post"]:
            local[op["out"]] = reader.op(tname, op, [local[a] for a in op["inputs"]], lambda n: tiles.get(n))
            tiles[op["out"]] = tuple(op["info"]["shape"])
            origins.add(op.get("origin") or "")
        env[tname] = local[blk["outputs"][0]["src"]]
        text.append(f"{tname} = custom({', '.join(kop['inputs'])}) grid=({row_sym}/{blk['grid'][0][1]}) loop=none")
    root = env[d["output"]]
    if not _is_element(root) or not _only_elements(root):
        _fail("output", "an element-wise tree of the head row, G, C, S and rot(..)", root[0])
    factor = reader.factors[0] if reader.factors else None
    if factor is None and not _contains_q(root):
        _fail("output", "a function of the head row Q", root[0])
    return RopePlan(root, factor, d["inputs"]["Q"]["shape"][-1], text, sorted(origins - {""}))


def _only_elements(n) -> bool:
    return _is_element(n) and all(_only_elements(a) for a in _children(n))

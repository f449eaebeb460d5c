"""From a chosen µGraph (its ``UGraph.to_dict()`` form) to a GEMV task plan for code generation.

The fused linear task kinds (norm_linear, silu_linear) all compute, per tile of output columns,
``y[b, n] = epi(scale * sum_k operand[b, k] * W[k, n])``. This module reads that structure off a
block graph instead of assuming it:

* the grid axis must split the output's column symbol: one grid block = one task tile (N_TILE);
* the for-loop must split the matmul's reduction symbol: the task's K loop;
* body ops: element-wise ops (chain, mul, add, div) on the row inputs form the **operand**
  expression; exactly one ``matmul(operand, W)``; optional row reductions
  ``sum[dim=1](chain[x*x](input))`` (sum of squares);
* accumulators are sums; post ops apply a per-row factor: ``div(acc_matmul, chain[sqrt(..)](acc_ss))``.

NOTE (rounding): the µGraph divides the *accumulated* matmul by the RMS (Mirage's reassociation),
but the task must round as its CPU reference does: the normalised value ``bf16(x * r)`` is formed
before the multiply. So a post-loop ``div`` by ``sqrt(..)`` of a row statistic is lowered as a row
factor ``r = rsqrt(..)`` applied to the input the statistic reduces over, inside the operand. The
two are equal as formulas (the verifier proved the µGraph equal to the target); the plan keeps
every op's origin so the generated comments still name the µGraph ops.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mpk_dist.errors import MpkError

ELEMENTWISE = ("chain", "mul", "add", "div")


class CodegenError(MpkError):
    """A µGraph outside what the code generator lowers (say which part, and what it expects)."""


@dataclass
class RowStat:
    """A per-row fp32 statistic: sum over k of input^2 (accumulator ``acc``)."""

    acc: str
    src_input: str          # µGraph input local (i0) the statistic reduces over
    ops: list               # body ops that compute it (for comments)


@dataclass
class RowFactor:
    """r = 1 / chain(stat): lowered as rsqrt of the chain's inner program (see module NOTE)."""

    stat: RowStat
    inner_prog: object      # the chain program under sqrt, applied to the statistic
    ops: list               # the post ops (chain, div) it replaces


@dataclass
class GemvPlan:
    """Everything the renderer needs, taken from the block graph."""

    grid: tuple             # (symbol, count)
    loop: tuple | None      # (symbol, count)
    inputs: dict            # local -> input dict (name, imap, fmap, tile)
    weight: str             # local of W
    operand: object         # expression tree over locals: ("in", l) | ("scaled", l) | (kind, op, args)
    matmul: dict            # the body matmul op
    acc: dict               # its accumulator
    factor: RowFactor | None
    output: dict            # block output
    k_extent: int           # the reduction length at the search's shapes (binds constant 1/K)
    origins: list = field(default_factory=list)


def _fail(what: str, expected: str, got) -> None:
    raise CodegenError(f"superopt codegen {what}: expected {expected}, got {got!r}; "
                       "this µGraph needs a new lowering (or use the hand-written task)")


def _custom_block(d: dict) -> tuple:
    ops = d["kernel_ops"]
    if len(ops) != 1 or ops[0]["kind"] != "custom":
        _fail("kernel graph", "exactly one custom kernel op", [o["kind"] for o in ops])
    return ops[0], ops[0]["block"]


def _operand_tree(name: str, ops: dict, locals_in: set):
    """Expression tree of an element-wise body tensor down to block inputs."""
    if name in locals_in:
        return ("in", name)
    op = ops.get(name)
    if op is None or op["kind"] not in ELEMENTWISE:
        _fail("matmul operand", "element-wise ops (chain, mul, add, div) on block inputs",
              op["kind"] if op else name)
    return (op["kind"], op, [_operand_tree(a, ops, locals_in) for a in op["inputs"]])


def _row_stat(acc: dict, ops: dict, locals_in: set) -> RowStat:
    red = ops.get(acc["src"])
    if red is None or red["kind"] != "sum" or dict(red["attrs"]).get("dim") != 1:
        _fail("accumulator " + acc["out"], "a row reduction sum[dim=1]", red and red["kind"])
    sq = ops.get(red["inputs"][0])
    prog = dict(sq["attrs"]).get("prog") if sq and sq["kind"] == "chain" else None
    if prog != ["mul", "x", "x"] and prog != ("mul", "x", "x") or sq["inputs"][0] not in locals_in:
        _fail("row reduction " + red["out"], "sum of chain[x*x] of a block input", prog)
    return RowStat(acc["out"], sq["inputs"][0], [sq, red])


def _scale(tree, local: str):
    """The operand tree with input ``local`` multiplied by the row factor."""
    if tree[0] == "in":
        return ("scaled", tree[1]) if tree[1] == local else tree
    return (tree[0], tree[1], [_scale(a, local) for a in tree[2]])


def _post(blk: dict, acc_mm: str, stats: dict, out_src: str):
    """The output tensor's post ops -> RowFactor or None (output = the matmul accumulator)."""
    post = {p["out"]: p for p in blk["post"]}
    if out_src == acc_mm:
        if post:
            _fail("post ops", "none when the output is the matmul accumulator", list(post))
        return None
    div = post.get(out_src)
    if div is None or div["kind"] != "div" or div["inputs"][0] != acc_mm:
        _fail("output " + out_src, "div(matmul accumulator, row factor)", div and div["kind"])
    ch = post.get(div["inputs"][1])
    prog = dict(ch["attrs"]).get("prog") if ch and ch["kind"] == "chain" else None
    if not prog or prog[0] != "sqrt" or ch["inputs"][0] not in stats or len(post) != 2:
        _fail("row factor", "chain[sqrt(..)] of a sum-of-squares accumulator", prog)
    return RowFactor(stats[ch["inputs"][0]], prog[1], [ch, div])


def plan(d: dict) -> GemvPlan:
    """The GemvPlan of µGraph dict ``d`` (``UGraph.to_dict()``); CodegenError if it does not fit."""
    kop, blk = _custom_block(d)
    out_syms = d["tensors"][d["output"]]["syms"]
    if len(blk["grid"]) != 1 or blk["grid"][0][0] != out_syms[-1]:
        _fail("grid", f"one axis over the output columns ({out_syms[-1]})", blk["grid"])
    inputs = {i["local"]: i for i in blk["inputs"]}
    ops = {o["out"]: o for o in blk["body"]}
    mms = [o for o in blk["body"] if o["kind"] == "matmul"]
    if len(mms) != 1:
        _fail("body", "exactly one matmul", len(mms))
    mm = mms[0]
    weight = mm["inputs"][1]
    if weight not in inputs or list(inputs[weight]["imap"]) != [1]:
        _fail("matmul weight", "a block input split by the grid on its column dim (imap=[1])", weight)
    ksym = d["tensors"][inputs[weight]["name"]]["syms"][0]
    if blk["loop"] is not None and blk["loop"][0] != ksym:
        _fail("loop", f"a for-loop over the reduction symbol {ksym}", blk["loop"])
    rows = set(inputs) - {weight}
    accs = {a["src"]: a for a in blk["accs"]}
    if any(a["kind"] != "sum" for a in blk["accs"]) or mm["out"] not in accs:
        _fail("accumulators", "sum accumulators, one of them over the matmul", [a["kind"] for a in blk["accs"]])
    stats = {a["out"]: _row_stat(a, ops, rows) for a in blk["accs"] if a["src"] != mm["out"]}
    if len(blk["outputs"]) != 1 or list(blk["outputs"][0]["omap"]) != [1]:
        _fail("outputs", "one output concatenated along its columns (omap=[1])", blk["outputs"])
    factor = _post(blk, accs[mm["out"]]["out"], stats, blk["outputs"][0]["src"])
    operand = _operand_tree(mm["inputs"][0], ops, rows)
    if factor is not None:
        operand = _scale(operand, factor.stat.src_input)
    origins = sorted({o["origin"] for o in blk["body"] + blk["post"] if o.get("origin")})
    return GemvPlan(tuple(blk["grid"][0]), tuple(blk["loop"]) if blk["loop"] else None, inputs, weight,
                    operand, mm, accs[mm["out"]], factor, blk["outputs"][0],
                    d["tensors"][inputs[weight]["name"]]["shape"][0], origins)

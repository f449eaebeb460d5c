"""CUDA task bodies for the mega-kernel, generated from the µGraphs the superoptimizer chose.

``render(ug, kind)`` lowers a chosen µGraph (a ``UGraph`` or its ``to_dict()``) of the
rmsnorm_linear or silu_mul_linear pattern to a ``__device__`` function in namespace ``mpk::gen``
with the same name, signature and argument order as the hand-written fused kind it replaces
(csrc/tasks/norm_linear.cuh, silu_linear.cuh; args/params of mpk_dist/taskgraph/tasks/), built from
csrc/tasks/tile_primitives.cuh. The text is deterministic (same µGraph, same bytes) and readable:
every step carries a comment naming the µGraph op(s) it comes from. ``write_if_changed`` saves it
(csrc/tasks/generated/, next to the kernel sources) without touching an unchanged file, so the
kernel's build cache is not invalidated by a re-run.

Numerics follow the kinds' CPU references: row statistics in fp32, every element-wise value of the
operand rounded to bf16 as the unfused tasks store it, the row factor applied before the matmul
(see codegen_plan's NOTE), fp32 GEMV accumulation, the ABI's epilogue (``Epi``) for the output.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from mpk_dist.superopt.codegen_plan import CodegenError, GemvPlan, plan


@dataclass(frozen=True)
class KindAbi:
    """How a fused task kind's C signature binds the µGraph's inputs."""

    name: str               # the hand-written kind (and the generated function's name)
    pattern: str            # superopt pattern (patterns.py)
    signature: str          # C parameter list, in the order run_<kind> in dispatch.cuh passes it
    rows: dict              # µGraph input -> (C type, pointer at batch row b, per-row?)
    weight: str             # C name of the [N, K] weight (W^T of the µGraph's (K, N) W)
    has_eps: bool = False


KINDS = {
    "norm_linear": KindAbi(
        "norm_linear", "rmsnorm_linear",
        "int B, const float* x, int ldx, const bf16* nw, const bf16* w, const Epi& epi, int K, int n_tile, "
        "float eps, float* smem, int tid, int nt",
        {"X": ("const float*", "x + (size_t)b * ldx", True), "G": ("const bf16*", "nw", False)}, "w", True),
    "silu_linear": KindAbi(
        "silu_linear", "silu_mul_linear",
        "int B, const bf16* gu, int ldg, int up, const bf16* w, const Epi& epi, int K, int n_tile, "
        "float* smem, int tid, int nt",
        {"A": ("const bf16*", "gu + (size_t)b * ldg", True), "B": ("const bf16*", "gu + (size_t)b * ldg + up", True)},
        "w"),
}


def _c_float(v: float) -> str:
    s = repr(float(v))
    return (s if ("e" in s or "." in s) else s + ".0") + "f"


class _Consts:
    """Constants of the search shape bound to the ABI's run-time values (1/K -> / K, eps -> eps)."""

    def __init__(self, K: int, eps: float | None, kname: str = "K"):
        self.K, self.eps, self.kname = K, eps, kname  # kname: the C name of the run-time extent

    def is_inv_k(self, c) -> bool:
        return isinstance(c, float) and abs(c * self.K - 1.0) < 1e-9

    def value(self, c) -> str:
        if self.eps is not None and isinstance(c, float) and abs(c - self.eps) <= 1e-12 * max(1.0, abs(c)):
            return "eps"
        if self.is_inv_k(c):
            return f"(1.0f / (float){self.kname})"
        return _c_float(c)


def _prog(p, x: str, consts: _Consts) -> str:
    """C expression of a chain program (target.py's form) applied to ``x``."""
    if p == "x":
        return x
    if isinstance(p, (int, float)):
        return consts.value(float(p))
    op, *args = p
    if op == "mul" and len(args) == 2 and consts.is_inv_k(args[1]):  # x * (1/K) as the reference's x / K
        return f"({_prog(args[0], x, consts)} / (float){consts.kname})"
    a = [_prog(q, x, consts) for q in args]
    if op in ("mul", "add", "div"):
        return f"({a[0]} {dict(mul='*', add='+', div='/')[op]} {a[1]})"
    if op in ("exp", "sqrt"):
        return f"{op}f({a[0]})"
    raise CodegenError(f"superopt codegen chain: expected ops mul, add, div, exp, sqrt, got {op!r}")


def _prog_text(p) -> str:
    if p == "x" or isinstance(p, (int, float)):
        return str(p)
    op, *args = p
    a = [_prog_text(q) for q in args]
    return f"({a[0]}{dict(mul='*', add='+', div='/')[op]}{a[1]})" if len(a) == 2 else f"{op}({a[0]})"


def op_text(op: dict) -> str:
    """One µGraph block op as in UGraph's text form: ``b1 = mul(i0, i1) (8, 256)  # rms_norm#0``."""
    prog = dict(op["attrs"]).get("prog")
    kind = f"chain[{_prog_text(prog)}]" if prog is not None else op["kind"]
    dim = dict(op["attrs"]).get("dim")
    kind += f"[dim={dim}]" if op["kind"] == "sum" else ""
    shape = tuple(op["info"]["shape"])
    return f"{op['out']} = {kind}({', '.join(op['inputs'])}) {shape}  # {op.get('origin', '')}".rstrip(" #")


def _expr(tree, consts: _Consts, root: bool = True) -> str:
    """C expression of element e of the operand tree; every op's value rounded to bf16 except the
    root's (pack8 rounds it)."""
    if tree[0] == "in":
        return f"v_{tree[1]}[e]"
    if tree[0] == "scaled":
        return f"round_bf(v_{tree[1]}[e] * r)"
    kind, op, args = tree
    a = [_expr(t, consts, False) for t in args]
    s = (_prog(dict(op["attrs"])["prog"], a[0], consts) if kind == "chain"
         else f"({a[0]} {dict(mul='*', add='+', div='/')[kind]} {a[1]})")
    return s if root else f"round_bf({s})"


def _operand_ops(tree) -> list:
    if tree[0] in ("in", "scaled"):
        return []
    return [o for t in tree[2] for o in _operand_ops(t)] + [tree[1]]


def _used(tree) -> list:
    if tree[0] in ("in", "scaled"):
        return [tree[1]]
    return sorted({u for t in tree[2] for u in _used(t)})


def _row_struct(p: GemvPlan, abi: KindAbi, consts: _Consts, struct: str) -> list:
    """The operand of the matmul for one batch row, computed in registers 8 values at a time."""
    used = _used(p.operand)
    lines = [f"// Operand of {op_text(p.matmul)}: element-wise ops in registers, each value rounded to",
             "// bf16 as the unfused tasks store it:"]
    lines += [f"//   {op_text(o)}" for o in _operand_ops(p.operand)]
    if p.factor is not None:
        lines.append(f"//   {p.factor.stat.src_input} scaled by the row factor r before use (see {abi.name}() below)")
    lines.append(f"struct {struct} {{")
    for loc in used:
        name = p.inputs[loc]["name"]
        ctype, _, per_row = abi.rows[name]
        where = "row b" if per_row else "whole"
        lines.append(f"  {ctype} {loc};  // µGraph input {name} ({where}), tile {tuple(p.inputs[loc]['tile'])}, "
                     f"imap={_map(p.inputs[loc]['imap'])} fmap={p.inputs[loc]['fmap']}")
    loads = [(loc, "load8" if abi.rows[p.inputs[loc]["name"]][2] else "load8_param") for loc in used]
    combine = ["    float o[8];", "#pragma unroll",
               f"    for (int e = 0; e < 8; ++e) o[e] = {_expr(p.operand, consts)};",
               "    return tile::pack8(o);", "  }"]
    one_step = ["  __device__ __forceinline__ uint4 load8(int k) const {"]
    for loc, load in loads:
        one_step += [f"    float v_{loc}[8];", f"    tile::{load}({loc} + k, v_{loc});"]
    one_step += combine + ["};"]
    if p.factor is None:
        return lines + one_step
    lines.append("  float r;  // row factor")
    if not _fetch_first(p, abi):
        return lines + one_step
    # The parameter (the input every row shares: the norm weights) in a step of its own, so a batch-1 prologue can
    # copy it ahead of r (stage_row_fetch_first, fused_gemv.cuh); the row inputs are loaded with the arithmetic (the
    # statistic has just read them). finish(load of params_at(k), k, r) == load8(k).
    param = next(loc for loc, load in loads if load == "load8_param")
    lines += [f"  __device__ __forceinline__ const bf16* params_at(int k) const {{ return {param} + k; }}",
              "  __device__ __forceinline__ uint4 finish(uint4 p, int k, float r) const {"]
    src = p.factor.stat.src_input
    # The norm's operand bf16(bf16(x r) g) is tile::scale_mul8's (bf16x2 arithmetic, the same bits as the fp32
    # expression) in every method; another operand keeps the element-wise expression.
    scale_mul = (_expr(p.operand, consts) == f"(round_bf(v_{src}[e] * r) * v_{param}[e])"
                 and abi.rows[p.inputs[src]["name"]][0] == "const float*")
    if scale_mul:
        lines += [f"    float v_{src}[8];", f"    tile::load8({src} + k, v_{src});",
                  f"    return tile::scale_mul8(v_{src}, r, p);", "  }"]
    else:
        for loc, load in loads:
            lines.append(f"    float v_{loc}[8];")
            lines.append(f"    tile::unpack_param(p, v_{loc});" if load == "load8_param"
                         else f"    tile::{load}({loc} + k, v_{loc});")
        lines += combine
    if _rows_in_regs(p, abi):  # the row's 8 values already in registers (<kind>_rows_in_regs)
        lines += [f"  __device__ __forceinline__ uint4 from_regs(const float* v_{src}, uint4 p) const {{"]
        if scale_mul:
            lines += [f"    return tile::scale_mul8(v_{src}, r, p);", "  }"]
        else:
            lines += [f"    float v_{loc}[8];\n    tile::unpack_param(p, v_{loc});" for loc, load in loads
                      if load == "load8_param"]
            lines += combine
    if scale_mul:  # the row's loads, then the parameter's (the one-step form's order)
        lines += ["  __device__ __forceinline__ uint4 load8(int k) const {",
                  f"    float v_{src}[8];", f"    tile::load8({src} + k, v_{src});",
                  f"    return tile::scale_mul8(v_{src}, r, tile::load_param16({param} + k));", "  }", "};"]
        return lines
    return lines + one_step


def _fetch_first(p: GemvPlan, abi: KindAbi) -> bool:
    """Whether the operand splits its one parameter's load from the arithmetic (``_row_struct``)."""
    return p.factor is not None and sum(not abi.rows[p.inputs[loc]["name"]][2] for loc in _used(p.operand)) == 1


def _rows_in_regs(p: GemvPlan, abi: KindAbi) -> bool:
    """Whether the staged path can keep each thread's vectors of the rows in registers across the statistic
    (``<kind>_rows_in_regs``): one parameter, and the one row input is the statistic's fp32 source."""
    if not _fetch_first(p, abi):
        return False
    rows = [loc for loc in _used(p.operand) if abi.rows[p.inputs[loc]["name"]][2]]
    src = p.factor.stat.src_input
    return rows == [src] and abi.rows[p.inputs[src]["name"]][0] == "const float*"


_NOT_IN_PROLOGUE = ("B", "w", "epi", "n_tile")
"""Parameters of a kind's signature its staged prologue does not read (the batch is the template's kB)."""


def _prologue_signature(abi: KindAbi) -> tuple[str, str]:
    """The C parameter list of the staged prologue's functions and the arguments that call them."""
    parts = [part.strip() for part in abi.signature.split(",")]
    keep = [part for part, name in zip(parts, _param_names(abi.signature)) if name not in _NOT_IN_PROLOGUE]
    return ", ".join(keep), ", ".join(_param_names(", ".join(keep)))


def _map(m) -> str:
    return "[" + ",".join("φ" if v is None else str(v) for v in m) + "]"


def _row_init(p: GemvPlan, abi: KindAbi, r: str = "r") -> str:
    """The operand struct's initialiser at batch row b; ``r``: the row factor's expression (with a factor)."""
    vals = [abi.rows[p.inputs[loc]["name"]][1] for loc in _used(p.operand)]
    return ", ".join(vals + ([r] if p.factor is not None else []))


def _param_names(signature: str) -> list:
    """The parameter names of a C parameter list (``int B, const float* x`` -> ``['B', 'x']``)."""
    return [part.replace("*", " ").replace("&", " ").split()[-1] for part in signature.split(",")]


def _row_factors(p: GemvPlan, consts: _Consts) -> list:
    """The kB rows' factors r[b] = 1 / p(statistic) and the function ``factor`` that the statistic's block reduction
    applies to a row's total (tile::rows_block_sum: one thread a row computes it, every thread reads it)."""
    stat = p.factor.stat
    lines = ["  // post ops, as a row factor r = 1 / p applied before the matmul (reference rounding):"]
    lines += [f"  //   {op_text(o)}" for o in p.factor.ops]
    return lines + [f"  const auto factor = [&](float {stat.acc}) {{ return rsqrtf({_prog(p.factor.inner_prog, stat.acc, consts)}); }};",
                    f"  float r[kB];  // acc {stat.acc} of each row, finished as its factor"]


def _two_passes(p: GemvPlan, abi: KindAbi, consts: _Consts, struct: str, sig: str) -> list:
    """The staged prologue of kB rows with a statistic in two passes over the rows: every row's statistic in one
    block reduction (tile::rows_sum_sq), then every row's operand staged with several vectors' loads in flight
    (tile::stage_rows)."""
    stat = p.factor.stat
    x = abi.rows[p.inputs[stat.src_input]["name"]][1]
    lines = ["// The rows' statistics in one block reduction, then their operands staged: two passes over the rows.",
             "template <int kB>",
             f"__device__ __forceinline__ void {abi.name}_two_passes({sig}) {{",
             "  bf16* st = stage_base(smem);",
             f"  // acc {stat.acc} = sum over the loop of:"]
    lines += [f"  //   {op_text(o)}" for o in stat.ops]
    lines += _row_factors(p, consts)
    lines += [f"  tile::rows_sum_sq<kB>([&](int b) {{ return {x}; }}, K, smem, r, tid, nt, factor);",
              f"  tile::stage_rows<kB>(st, K, [&](int b) {{ return {struct}{{{_row_init(p, abi, 'r[b]')}}}; }}, tid, nt);",
              "}", ""]
    return lines


def _in_regs(p: GemvPlan, abi: KindAbi, consts: _Consts, struct: str, sig: str) -> list:
    """The staged prologue of kB rows read once (MPK_NORM_ROWS_IN_REGS, tile_primitives.cuh): each thread's one
    vector of every row (K <= 8 x threads) kept in registers across the statistic's block reduction."""
    stat = p.factor.stat
    src = stat.src_input
    x = abi.rows[p.inputs[src]["name"]][1]
    return ["// The same where a thread's share of each row is one vector (tile::share_is_one_vector): the rows read once,",
            "// the thread's vectors kept in registers across the statistic (MPK_NORM_ROWS_IN_REGS, tile_primitives.cuh).",
            "template <int kB>",
            f"__device__ __noinline__ void {abi.name}_rows_in_regs({sig}) {{",
            "  bf16* st = stage_base(smem);",
            "  const bool mine = tid * 8 < K;",
            "  const int k = mine ? tid * 8 : 0;  // past the row: the loads of its first vector (no branch), no store",
            "  uint4 p;",
            "  {",
            "    const int b = 0;",
            f"    p = tile::load_param16({struct}{{{_row_init(p, abi, '0.f')}}}.params_at(k));",
            "  }",
            "  float v[kB][8];",
            "#pragma unroll",
            f"  for (int b = 0; b < kB; ++b) tile::load8({x} + k, v[b]);",
            *_row_factors(p, consts),
            "  tile::rows_share_sum_sq<kB>(v, mine, smem, r, tid, nt, factor);",
            "  if (!mine) return;",
            "#pragma unroll",
            "  for (int b = 0; b < kB; ++b)",
            f"    *reinterpret_cast<uint4*>(st + (size_t)b * K + k) = {struct}{{{_row_init(p, abi, 'r[b]')}}}.from_regs(v[b], p);",
            "}", ""]


def _staged(p: GemvPlan, abi: KindAbi, consts: _Consts, struct: str) -> list:
    """The staged path for kB rows (the kernel's compile-time batch): the rows' statistics and operands
    (``_two_passes``, or ``_in_regs`` where it applies), then the GEMV over the tile. The same values as row by
    row, so the same bits."""
    lines = []
    if p.factor is not None:
        sig, args = _prologue_signature(abi)
        lines += _two_passes(p, abi, consts, struct, sig)
        in_regs = _rows_in_regs(p, abi)
        if in_regs:
            lines += _in_regs(p, abi, consts, struct, sig)
    lines += ["// The staged path for the kernel's kB batch rows: the rows' statistics and operands computed together",
              "// (a few memory round trips a tile, not a few a row).",
              "template <int kB>",
              f"__device__ __forceinline__ void {abi.name}_staged({abi.signature}) {{",
              "  bf16* st = stage_base(smem);  // [kB, K] operand rows after the reduction scratch"]
    if p.factor is None:
        lines.append(f"  tile::stage_rows<kB>(st, K, [&](int b) {{ return {struct}{{{_row_init(p, abi)}}}; }}, tid, nt);")
    else:
        stat = p.factor.stat
        x = abi.rows[p.inputs[stat.src_input]["name"]][1]
        one_round = "kB == 1 && MPK_NORM_ONE_ROUND" if _fetch_first(p, abi) else "false"
        lines += [f"  if constexpr ({one_round}) {{  // the parameter's copies in flight beside the statistic's loads",
                  "    const int b = 0;",
                  f"    stage_row_fetch_first(st, K, {struct}{{{_row_init(p, abi, '0.f')}}}, [&] {{",
                  f"      const float {stat.acc} = tile::row_sum_sq({x}, K, smem, tid, nt);",
                  f"      return rsqrtf({_prog(p.factor.inner_prog, stat.acc, consts)});",
                  "    }, tid, nt);"]
        if in_regs:
            lines += ["  } else if constexpr (kB > 1 && MPK_NORM_ROWS_IN_REGS && MPK_STAGE_ROWS_TOGETHER) {",
                      "    if (tile::share_is_one_vector(K, nt))",
                      f"      {abi.name}_rows_in_regs<kB>({args});",
                      "    else",
                      f"      {abi.name}_two_passes<kB>({args});"]
        lines += ["  } else {", f"    {abi.name}_two_passes<kB>({args});", "  }"]
    lines += ["  worker_barrier(nt);  // the staged rows are complete before any warp reads them",
              f"  // {op_text(p.matmul)}",
              f"  // acc {p.acc['out']} = sum({p.acc['src']}); out {p.output['src']} -> {p.output['name']} "
              f"omap={_map(p.output['omap'])} through the ABI's epilogue",
              f"  tile::gemv_acc<kB>(XRows{{st, K}}, {abi.weight}, K, n_tile, epi, tid, nt);",
              "}", ""]
    return lines


def _body(p: GemvPlan, abi: KindAbi, consts: _Consts, struct: str) -> list:
    """The task function: the staged path (``_staged``) when the B operand rows fit the shared memory,
    else per batch row the row statistic and factor and the GEMV with the operand computed per element."""
    grid, loop = p.grid, p.loop
    args = ", ".join(_param_names(abi.signature))
    lines = _staged(p, abi, consts, struct)
    lines += [f"__device__ void {abi.name}({abi.signature}) {{",
              f"  // grid=({grid[0]}/{grid[1]}): one grid block = this task's tile of n_tile output columns;",
              (f"  // loop={loop[0]}/{loop[1]}: the K loop of the tile primitives (16-byte vectors per lane; the"
               if loop else "  // no for-loop: the K loop of the tile primitives (16-byte vectors per lane; the"),
              "  // search's loop count sizes its shared-memory tile, the primitives stream K instead).",
              "  if (stage_fits(B, K)) {",
              f"    MPK_FUSED_WITH_BATCH(B, ({abi.name}_staged<kB>({args})));",
              "    return;",
              "  }",
              "  for (int b = 0; b < B; ++b) {  // the staged rows do not fit: the operand per element, row by row"]
    if p.factor is not None:
        st = p.factor.stat
        x = abi.rows[p.inputs[st.src_input]["name"]][1]
        lines += [f"    const float {st.acc} = tile::row_sum_sq({x}, K, smem, tid, nt);",
                  f"    const float r = rsqrtf({_prog(p.factor.inner_prog, st.acc, consts)});"]
    lines += [f"    const {struct} row{{{_row_init(p, abi)}}};",
              f"    tile::gemv_acc_row(row, {abi.weight}, K, n_tile, epi, b, tid, nt);  // {p.matmul['out']} per row",
              "  }",
              "}"]
    return lines


def render(ug, kind: str, eps: float = 1e-6) -> str:
    """CUDA source of the generated body of fused kind ``kind`` from µGraph ``ug`` (a UGraph or its
    to_dict()); ``eps`` is the rms_norm epsilon the search's target used (bound to the EPS param)."""
    if kind == "qk_norm_rope":  # the per-head norm + rope of qkv_prep (codegen_rope.py)
        from mpk_dist.superopt.codegen_rope import render_rope

        return render_rope(ug, eps)
    if kind not in KINDS:
        raise CodegenError(f"superopt codegen kind: expected one of {sorted(KINDS) + ['qk_norm_rope']}, "
                           f"got {kind!r}")
    abi = KINDS[kind]
    d = ug if isinstance(ug, dict) else ug.to_dict()
    missing = sorted(set(abi.rows) - set(d["inputs"]))
    if missing:
        raise CodegenError(f"superopt codegen {kind}: expected the {abi.pattern} µGraph's inputs "
                           f"{sorted(abi.rows) + ['W']}, got {sorted(d['inputs'])}")
    p = plan(d)
    consts = _Consts(p.k_extent, eps if abi.has_eps else None)
    struct = "".join(w.capitalize() for w in kind.split("_")) + "Operand"
    cost = d.get("cost") or {}
    head = [f"// GENERATED by mpk_dist.superopt.codegen from the {abi.pattern} µGraph; do not edit.",
            f"// Replaces the hand-written {kind} (csrc/tasks/{kind}.cuh): same signature and ABI.",
            f"// µGraph ops: {', '.join(p.origins)}; search estimate {_us(cost.get('time_us'))} at shapes "
            + ", ".join(f"{k}{tuple(v['shape'])}" for k, v in sorted(d["inputs"].items())) + ".",
            "#pragma once", '#include "tile_primitives.cuh"  // csrc/tasks (on the include path)', "", "namespace mpk {", "namespace gen {", ""]
    tail = ["", "}  // namespace gen", "}  // namespace mpk", ""]
    return "\n".join(head + _row_struct(p, abi, consts, struct) + [""] + _body(p, abi, consts, struct) + tail)


def _us(t) -> str:
    return "?" if t is None else f"{t:.2f} us"


def write_if_changed(path, text: str) -> bool:
    """Write ``text`` to ``path`` atomically unless it already holds exactly that; True if written."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            if f.read() == text:
                return False
    except FileNotFoundError:
        pass
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)
    return True

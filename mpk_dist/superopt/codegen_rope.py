"""CUDA body of the per-head q/k norm + rope, generated from the chosen qk_norm_rope µGraph.

``render_rope(d, eps)`` lowers the RopePlan of a µGraph (codegen_rope_plan.py) to
``mpk::gen::qk_norm_rope``: the same name, signature and argument order as the hand-written
``mpk::qk_norm_rope`` in csrc/tasks/qkv_prep.cuh, which ``qkv_prep`` calls per sequence (one warp per
head row; ``MPK_SUPEROPT_QK_NORM_ROPE`` selects the generated one). Layout as the hand-written body:
lane l holds the pairs (d, d + D/2) for d = l, l + 32, ... (D <= 512), so ``rot`` (the µGraph's
matmul by the rotate-half matrix R) is a swap within a lane: rot(e)[d] = -e[d + D/2],
rot(e)[d + D/2] = e[d].

How the µGraph's inputs bind to the task's ABI: Q -> the head row ``src`` (bf16), G -> ``norm_w``,
C / S -> ``round_bf(cos(a))`` / ``round_bf(sin(a))`` (one ``sincosf`` when both are used) with the fp32 angle ``a = (float)pos *
inv_freq[d]`` (both halves share d's frequency), R -> rotate-half. Constants of the search's shapes
are bound to run-time values: 1/D (the search's D) -> ``/ (float)D``, the target's eps -> ``eps``.

Rounding follows the task's reference (torch on bf16): the row statistic in fp32 (a warp sum of
``lo*lo + hi*hi`` per lane, as the hand-written loop), every element-wise value rounded to bf16
(the normalised head ``bf16(q * r)``, its product with the weight, x*cos, r*sin and their sum),
``rot`` exact (a sign flip). Every step of the body carries a comment naming its µGraph op(s).
"""

from __future__ import annotations

from mpk_dist.superopt.codegen_plan import CodegenError
from mpk_dist.superopt.codegen_rope_plan import RopePlan, plan_rope

SIGNATURE = ("const bf16* src, const bf16* norm_w, const float* inv_freq, int pos, bf16* dst, int D, "
             "float eps, int lane")
"""The hook's C parameter list (csrc/tasks/qkv_prep.cuh, mpk::qk_norm_rope)."""

CALL_ARGS = "src, norm_w, inv_freq, pos, dst, D, eps, lane"
"""The hook's arguments, forwarded to the instance with the head size's pair count."""

VEC = {"G": ("bf2f(norm_w[d])", "bf2f(norm_w[d + half])"), "C": ("c", "c"), "S": ("s", "s")}


def _op_comment(tname: str, op: dict) -> str:
    from mpk_dist.superopt.codegen import op_text

    return f"{tname}.{op_text(op)}"


class _Emitter:
    """Emits one C local per tree node (memoized by identity) inside the per-pair loop."""

    def __init__(self, consts) -> None:
        self.consts = consts
        self.lines: list = []
        self.names: dict = {}
        self.vecs: set = set()

    def comment(self, ops) -> None:
        self.lines += [f"      // {_op_comment(t, o)}" for t, o in ops]

    def val(self, n) -> tuple:
        key = "scaled" if n[0] == "scaled" else id(n)  # every use of Q under the factor is one value
        if key in self.names:
            return self.names[key]
        tag = n[0]
        if tag == "q":
            out = ("q_lo[i]", "q_hi[i]")
        elif tag == "vec":
            self.vecs.add(n[2])
            out = VEC[n[2]]
        elif tag == "scaled":
            out = self._def(n, "xr", "round_bf(q_lo[i] * r)", "round_bf(q_hi[i] * r)",
                            "the head row times the row factor r, rounded (reference rounding)")
        elif tag == "rot":
            lo, hi = self.val(n[2])
            out = self._def(n, "rot", f"-{hi}", lo, "rotate-half: a swap within the lane, exact")
        else:
            out = self._ew(n)
        self.names[key] = out
        return out

    def _ew(self, n) -> tuple:
        from mpk_dist.superopt.codegen import _prog

        kind, prog, args = n[2], n[3], n[4]
        vals = [self.val(a) for a in args]
        if kind == "chain":
            lo, hi = (_prog(prog, vals[0][k], self.consts) for k in (0, 1))
        else:
            sym = {"mul": "*", "add": "+", "div": "/"}[kind]
            lo, hi = (f"{vals[0][k]} {sym} {vals[1][k]}" for k in (0, 1))
        return self._def(n, n[1][-1][1]["out"] if n[1] else "v", f"round_bf({lo})", f"round_bf({hi})", "")

    def _def(self, n, base: str, lo: str, hi: str, why: str) -> tuple:
        name = f"{n[1][-1][0]}_{base}" if n[1] else base
        while any(name + "_lo" == v[0] for v in self.names.values()):
            name += "_"
        self.comment(n[1])
        if why:
            self.lines.append(f"      // {why}")
        self.lines.append(f"      const float {name}_lo = {lo}, {name}_hi = {hi};")
        return (f"{name}_lo", f"{name}_hi")


def _stat_lines(p: RopePlan, consts) -> list:
    """Loading the head row, and with a row factor its statistic and r."""
    from mpk_dist.superopt.codegen import _prog

    lines = ["  float q_lo[kMaxPairs], q_hi[kMaxPairs];"]
    if p.factor is not None:
        lines.append("  float ss = 0.f;")
    lines += ["#pragma unroll", "  for (int i = 0; i < kMaxPairs; ++i) {", "    const int d = lane + 32 * i;",
              "    q_lo[i] = q_hi[i] = 0.f;", "    if (d < half) {", "      q_lo[i] = bf2f(src[d]);  // µGraph input Q",
              "      q_hi[i] = bf2f(src[d + half]);"]
    if p.factor is not None:
        stat = p.factor[3]
        lines += [f"      // {_op_comment(t, o)}" for t, o in stat[1]]
        lines.append("      ss += q_lo[i] * q_lo[i] + q_hi[i] * q_hi[i];")
    lines += ["    }", "  }"]
    if p.factor is not None:
        lines += [f"  // {_op_comment(t, o)}" for t, o in p.factor[1]]
        lines += ["  // as a row factor r = 1 / sqrt(..) applied to the head row before use (reference rounding)",
                  "  const float stat = warp_sum(ss);",
                  f"  const float r = rsqrtf({_prog(p.factor[2], 'stat', consts)});"]
    return lines


def _loop_lines(p: RopePlan, consts) -> list:
    em = _Emitter(consts)
    lo, hi = em.val(p.root)
    head = ["#pragma unroll", "  for (int i = 0; i < kMaxPairs; ++i) {", "    const int d = lane + 32 * i;",
            "    if (d < half) {"]
    if em.vecs & {"C", "S"}:
        head += ["      const float ang = (float)pos * inv_freq[d];  // fp32 product, as torch forms the angles"]
        if {"C", "S"} <= em.vecs:  # both from one sincosf (common.cuh rope_cos_sin: the values of cosf, sinf)
            head += ["      float cr, sr;", "      rope_cos_sin(ang, cr, sr);",
                     "      const float c = round_bf(cr);  // µGraph input C",
                     "      const float s = round_bf(sr);  // µGraph input S"]
        elif "C" in em.vecs:
            head.append("      const float c = round_bf(cosf(ang));  // µGraph input C")
        else:
            head.append("      const float s = round_bf(sinf(ang));  // µGraph input S")
    tail = [f"      dst[d] = f2bf({lo});", f"      dst[d + half] = f2bf({hi});", "    }", "  }"]
    return head + em.lines + tail


def render_rope(ug, eps: float = 1e-6) -> str:
    """CUDA source of ``mpk::gen::qk_norm_rope`` from a qk_norm_rope µGraph (UGraph or to_dict())."""
    from mpk_dist.superopt.codegen import _Consts, _us

    d = ug if isinstance(ug, dict) else ug.to_dict()
    p = plan_rope(d)
    consts = _Consts(p.d_extent, eps, kname="D")
    cost = d.get("cost") or {}
    head = ["// GENERATED by mpk_dist.superopt.codegen from the qk_norm_rope µGraph; do not edit.",
            "// Replaces the hand-written per-head q/k norm + rope (mpk::qk_norm_rope, csrc/tasks/qkv_prep.cuh):",
            "// same signature; qkv_prep calls it per sequence when the model has q/k norms.",
            f"// µGraph ops: {', '.join(p.origins)}; search estimate {_us(cost.get('time_us'))} at shapes "
            + ", ".join(f"{k}{tuple(v['shape'])}" for k, v in sorted(d["inputs"].items())) + ".",
            "// Kernel ops (each gridded over the head rows: one grid block = one head row = one warp here):"]
    head += [f"//   {t}" for t in p.kernel_text]
    head += ["#pragma once", '#include "common.cuh"  // csrc/runtime (on the include path)', "",
             "namespace mpk {", "namespace gen {", "",
             "// One head row of one sequence, one warp: lane l holds the pairs (d, d + D/2), d = l, l + 32, ...",
             "// kMaxPairs: the per-lane pair slots (common.cuh MPK_ROPE_PAIRS picks the instance for D).",
             "template <int kMaxPairs>",
             f"__device__ __forceinline__ void qk_norm_rope_pairs({SIGNATURE}) {{",
             "  const int half = D / 2;"]
    body = _stat_lines(p, consts) + _loop_lines(p, consts)
    tail = ["}", "", f"__device__ __forceinline__ void qk_norm_rope({SIGNATURE}) {{",
            f"  MPK_ROPE_PAIRS(D, (qk_norm_rope_pairs<kPairs>({CALL_ARGS})));", "}", "",
            "}  // namespace gen", "}  // namespace mpk", ""]
    return "\n".join(head + body + tail)


__all__ = ["render_rope", "CodegenError", "SIGNATURE"]

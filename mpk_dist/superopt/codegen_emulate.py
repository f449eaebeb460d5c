"""CPU emulation of a GemvPlan's operand, with the rounding the generated CUDA applies.

Tests use it to check the code generator's lowering logic without a GPU: the staged operand rows a
generated body computes (every element-wise value rounded to bf16, the row factor r = rsqrt(..)
applied to its input first) must equal the operand the fused kind's CPU reference feeds its linear.
"""

from __future__ import annotations

from mpk_dist.superopt.codegen_plan import GemvPlan


def _prog(p, x, K: int, eps: float, k0: int, e0: float):
    """A chain program on a torch tensor (fp32); constants bound as in codegen: 1/k0 (k0 the
    search's K) divides by the run-time K, e0 (the search's eps) is the run-time eps."""
    if p == "x":
        return x
    if isinstance(p, (int, float)):
        return x.new_tensor(eps if abs(p - e0) <= 1e-12 * max(1.0, abs(e0)) else float(p))
    op, *args = p
    if op == "mul" and isinstance(args[1], float) and abs(args[1] * k0 - 1.0) < 1e-9:
        return _prog(args[0], x, K, eps, k0, e0) / K
    a = [_prog(q, x, K, eps, k0, e0) for q in args]
    import torch

    fns = {"mul": torch.mul, "add": torch.add, "div": torch.div, "exp": torch.exp, "sqrt": torch.sqrt}
    return fns[op](*a)


def operand(p: GemvPlan, rows: dict, K: int, eps: float = 1e-6, search_eps: float = 1e-6):
    """[B, K] bf16 operand of plan ``p``; ``rows``: µGraph input name -> torch tensor ([B, K] rows
    or a [K] vector, in the ABI's dtype); ``search_eps``: the eps of the searched target."""
    import torch

    vals = {loc: rows[i["name"]].float() for loc, i in p.inputs.items() if i["name"] in rows}
    r = None
    if p.factor is not None:
        x = vals[p.factor.stat.src_input]
        stat = (x * x).sum(-1, keepdim=True)
        r = torch.rsqrt(_prog(p.factor.inner_prog, stat, K, eps, p.k_extent, search_eps))

    def rnd(t):
        return t.to(torch.bfloat16).float()

    def ev(tree, root=False):
        if tree[0] == "in":
            return vals[tree[1]]
        if tree[0] == "scaled":
            return rnd(vals[tree[1]] * r)
        kind, op, args = tree
        a = [ev(t) for t in args]
        out = _prog(dict(op["attrs"])["prog"], a[0], K, eps, p.k_extent, search_eps) if kind == "chain" else \
            {"mul": torch.mul, "add": torch.add, "div": torch.div}[kind](a[0], a[1])
        return out if root else rnd(out)

    return ev(p.operand, root=True).to(torch.bfloat16)


def rope_rows(p, q, norm_w, inv_freq, pos, eps: float = 1e-6, search_eps: float = 1e-6):
    """[B, D] bf16 output of the generated ``qk_norm_rope`` of RopePlan ``p`` (codegen_rope_plan),
    emulated with its rounding: ``q`` [B, D] bf16 head rows, ``norm_w`` [D] bf16, ``inv_freq``
    [D/2] fp32, ``pos`` [B] int positions. Each tree node is evaluated on whole rows (the lo|hi
    halves side by side), ``rot`` as rotate-half."""
    import torch

    D = q.shape[-1]
    half = D // 2

    def rnd(t):
        return t.to(torch.bfloat16).float()

    ang = pos.float().unsqueeze(-1) * inv_freq  # [B, D/2] fp32
    ang = torch.cat([ang, ang], dim=-1)
    leaves = {"G": norm_w.float(), "C": rnd(ang.cos()), "S": rnd(ang.sin())}
    x = q.float()
    r = None
    if p.factor is not None:
        stat = (x * x).sum(-1, keepdim=True)
        r = torch.rsqrt(_prog(p.factor[2], stat, D, eps, p.d_extent, search_eps))

    def ev(n):
        tag = n[0]
        if tag == "q":
            return x
        if tag == "vec":
            return leaves[n[2]]
        if tag == "scaled":
            return rnd(x * r)
        if tag == "rot":
            e = ev(n[2])
            return torch.cat([-e[..., half:], e[..., :half]], dim=-1)
        kind, prog, args = n[2], n[3], n[4]
        a = [ev(t) for t in args]
        if kind == "chain":
            return rnd(_prog(prog, a[0], D, eps, p.d_extent, search_eps))
        return rnd({"mul": torch.mul, "add": torch.add, "div": torch.div}[kind](a[0], a[1]))

    return ev(p.root).to(torch.bfloat16)

"""Lowering of the fused linears planned by ``mpk_dist.taskgraph.fusion`` (norm_linear,
linear_residual, silu_linear).

Tiles are the linear's own (``Lowerer._linear_tiles``: the same column blocks as unfused), so a
fused program differs from the unfused one only by the task-ops that disappear. Footprints: a
prologue fusion reads the whole pre-fusion input (all B rows, all K columns: the norm's statistics
and silu's gate|up need them), a residual epilogue reads and writes the tile's columns.
"""

from __future__ import annotations

from mpk_dist.taskgraph.fusion import FusedLinear
from mpk_dist.taskgraph.lowering import Lowerer, _all_fp, _cols_fp
from mpk_dist.taskgraph.tasks import BY_NAME


def lower_fused(lw: Lowerer, f: FusedLinear) -> None:
    """Append the task-op of one fused linear to the program."""
    p, B, lin = lw.p, lw.B, f.linear
    w, y = p.id(lin.inputs[1]), p.id(f.output)
    N, K = lw.g.tensors[lin.inputs[1]].shape
    tiles = lw._linear_tiles(lin, N)
    t = p.op(lin.name, BY_NAME[f.kind], lin.layer, lin.name)
    res = f.residual_input()
    rid = None if res is None else p.id(res)
    common = {"BATCH": B, "K": K, "Y_STRIDE": N}
    for n0, n in tiles:
        args = {"W": (w, n0 * K, n * K), "Y": (y, n0, (B - 1) * N + n)}
        if f.kind == "norm_linear":
            x, nw = p.id(f.norm.inputs[0]), p.id(f.norm.inputs[1])
            args.update(X=(x, 0, (B - 1) * K + K), NORM_W=(nw, 0, K))
            prm = {**common, "N_TILE": n, "X_STRIDE": K, "EPS": f.norm.attrs["eps"]}
        elif f.kind == "silu_linear":
            args.update(GU=(p.id(f.silu.inputs[0]), 0, (B - 1) * 2 * K + 2 * K),
                        RESIDUAL=None if rid is None else (rid, n0, (B - 1) * N + n))
            prm = {**common, "N_TILE": n, "GU_STRIDE": 2 * K, "UP_OFFSET": K}
        else:
            args.update(X=(p.id(lin.inputs[0]), 0, (B - 1) * K + K), RESIDUAL=(rid, n0, (B - 1) * N + n))
            prm = {**common, "N_TILE": n, "X_STRIDE": K}
        t.add_tile(args, prm)
    src = {"norm_linear": f.norm.inputs[0] if f.norm else None,
           "silu_linear": f.silu.inputs[0] if f.silu else None}.get(f.kind) or lin.inputs[0]
    t.reads = [_all_fp(p.id(src), p, len(tiles))] + ([] if rid is None else [_cols_fp(rid, tiles, B)])
    t.writes = [_cols_fp(y, tiles, B)]

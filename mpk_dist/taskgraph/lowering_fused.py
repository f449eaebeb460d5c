"""Lowering of the fused linears planned by ``mpk_dist.taskgraph.fusion`` (norm_linear,
linear_residual, silu_linear, norm_linear_silu).

Tiles are the linear's own (``Lowerer.linear_grid``: the same column blocks and row blocks as
unfused), so a fused program differs from the unfused one only by the task-ops that disappear.
Footprints: a prologue fusion reads the whole pre-fusion input of its row block (all K columns: the
norm's statistics and silu's gate|up need them; each row's prologue uses that row only, so a row block
of <= 16 rows computes exactly what the whole batch would), a residual epilogue reads and writes the
tile's rectangle. A ``norm_linear_silu`` tile owns a block of intermediate columns instead: its gate rows and
its up rows (``lower_gate_up_silu``).
"""

from __future__ import annotations

from mpk_dist.errors import InputError
from mpk_dist.taskgraph.fusion import FusedLinear
from mpk_dist.taskgraph.lowering import LINEAR_ALIGN, Lowerer, _grid_fp, _rows_fp, col_tiles, row_blocks
from mpk_dist.taskgraph.tasks import BY_NAME


DOWN_VEC, DOWN_MAX_COLS = 8, 256
"""A folded down projection's tile columns: whole 16-byte vectors, at most a warp of them a row
(``kDownVec`` and ``kDownMaxCols`` in csrc/tasks/down_partial.cuh)."""


def lower_fused(lw: Lowerer, f: FusedLinear) -> None:
    """Append the task-op of one fused linear to the program."""
    if f.act is not None:
        lower_gate_up_silu(lw, f)
        return
    p, lin = lw.p, f.linear
    w, y = p.id(lin.inputs[1]), p.id(f.output)
    N, K = lw.g.tensors[lin.inputs[1]].shape
    grid = lw.linear_grid(lw._linear_tiles(lin, N))
    t = p.op(lin.name, BY_NAME[f.kind], lin.layer, lin.name)
    res = f.residual_input()
    rid = None if res is None else p.id(res)
    for r0, nr, n0, n in grid:
        args = {"W": (w, n0 * K, n * K), "Y": (y, r0 * N + n0, (nr - 1) * N + n)}
        common = {"BATCH": nr, "K": K, "N_TILE": n, "Y_STRIDE": N}
        if f.kind == "norm_linear":
            x, nw = p.id(f.norm.inputs[0]), p.id(f.norm.inputs[1])
            args.update(X=(x, r0 * K, nr * K), NORM_W=(nw, 0, K), X_FLAGS=None)  # flagged copy: flag_words.py
            prm = {**common, "X_STRIDE": K, "EPS": f.norm.attrs["eps"]}
        elif f.kind == "silu_linear":
            args.update(GU=(p.id(f.silu.inputs[0]), r0 * 2 * K, nr * 2 * K),
                        RESIDUAL=None if rid is None else (rid, r0 * N + n0, (nr - 1) * N + n))
            prm = {**common, "GU_STRIDE": 2 * K, "UP_OFFSET": K}
        else:
            args.update(X=(p.id(lin.inputs[0]), r0 * K, nr * K), RESIDUAL=(rid, r0 * N + n0, (nr - 1) * N + n),
                        Y_FLAGS=None, RESIDUAL_FLAGS=None, X_FLAGS=None,  # flagged copies: flag_words.py
                        COPY=None if f.copy is None else (p.id(f.copy), r0 * N + n0, (nr - 1) * N + n))
            prm = {**common, "X_STRIDE": K}
        t.add_tile(args, prm)
    src = {"norm_linear": f.norm.inputs[0] if f.norm else None,
           "silu_linear": f.silu.inputs[0] if f.silu else None}.get(f.kind) or lin.inputs[0]
    src_cols = 2 * K if f.kind == "silu_linear" else K
    t.reads = [_rows_fp(p.id(src), grid, src_cols)] + ([] if rid is None else [_grid_fp(rid, grid)])
    t.writes = [_grid_fp(y, grid)] + ([] if f.copy is None else [_grid_fp(p.id(f.copy), grid)])


def lower_gate_up_silu(lw: Lowerer, f: FusedLinear) -> None:
    """The gate|up projection with its norm prologue and silu_mul epilogue: one tile per block of
    intermediate columns [c0, c0 + n) (multiples of LINEAR_ALIGN, about one tile per SM as the unfused
    projection's halves had) and row block; the tile reads the gate rows c0.. and the up rows I + c0.. of
    the [2I, K] weight and writes act[rows, c0:c0 + n]. With the down projection folded in (``f.down``, fusion
    'silu_down') the tile also reads columns c0.. of the [H, I] down weight and adds its partial of every output
    row into the down's output (an accumulating write of the whole row block)."""
    p, lin = lw.p, f.linear
    w, y = p.id(lin.inputs[1]), p.id(f.output)
    N, K = lw.g.tensors[lin.inputs[1]].shape
    I = N // 2
    x, nw = p.id(f.norm.inputs[0]), p.id(f.norm.inputs[1])
    share = max(1, lw.sms // len(row_blocks(lw.B)))
    grid = lw.linear_grid(col_tiles(I, share, LINEAR_ALIGN))
    t = p.op(lin.name, BY_NAME[f.kind], lin.layer, lin.name)
    wd = xo = None
    H = 0
    if f.down is not None:
        wd, xo = p.id(f.down.linear.inputs[1]), p.id(f.down.output)
        H = lw.g.tensors[f.down.linear.inputs[1]].shape[0]
        bad = sorted({n for _, _, _, n in grid if n % DOWN_VEC or n > DOWN_MAX_COLS}) or ([I] if I % DOWN_VEC else [])
        if bad:
            raise InputError(f"fusion 'silu_down' ({lin.name}): the gate|up tiles own {bad} activation columns of "
                             f"I = {I}; the folded down projection needs multiples of {DOWN_VEC} up to {DOWN_MAX_COLS} "
                             "(csrc/tasks/down_partial.cuh); run without MPK_FUSE_SILU_DOWN")
    for r0, nr, c0, n in grid:
        down = {"WD": None, "XO": None} if wd is None else {
            "WD": (wd, c0, (H - 1) * I + n), "XO": (xo, r0 * H, nr * H)}
        t.add_tile({"X": (x, r0 * K, nr * K), "NORM_W": (nw, 0, K), "W": (w, c0 * K, (I + n) * K),
                    "Y": (y, r0 * I + c0, (nr - 1) * I + n), "Y_FLAGS": None, "X_FLAGS": None, **down},
                   {"BATCH": nr, "K": K, "N_TILE": 2 * n, "X_STRIDE": K, "Y_STRIDE": I, "UP_ROWS": I,
                    "EPS": f.norm.attrs["eps"], "H": H, "WD_STRIDE": I if H else 0, "XO_STRIDE": H})
    t.reads = [_rows_fp(x, grid, K)]
    t.writes = [_grid_fp(y, grid)] + ([] if xo is None else [_rows_fp(xo, grid, H)])

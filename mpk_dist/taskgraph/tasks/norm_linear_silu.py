"""norm_linear_silu: the gate|up projection with rms_norm as its prologue and silu_mul as its epilogue
(fusions 'norm' and 'silu_epi', docs/TASKGRAPH.md).

A tile owns COLS intermediate columns [c0, c0 + COLS): the COLS gate weight rows starting at row c0 and
the COLS up weight rows starting at row UP_ROWS + c0 of the [2I, K] gate|up weight (N_TILE = 2 * COLS
weight rows in all). It normalises its B input rows as ``norm_linear`` does, computes both halves' sums,
rounds each to the activation dtype (what the gate|up linear would store) and writes
act = silu(gate) * up rounded as the standalone ``silu_mul`` task rounds it. So the gate|up activation
never exists, the silu_mul level disappears, and the down projection reads act as a plain input (one
load per element instead of silu over every element in each of its tiles).

With the down projection folded in as well (opt-in fusion 'silu_down', tp 1): the tile then multiplies its COLS
activation columns by the matching COLS columns of the [H, I] down weight and adds that fp32 partial of every
output row into the residual stream XO (atomic adds; o_proj's tiles wrote XO = x_mid first, COPY of
linear_residual). So the down level and its boundary disappear; the down product is summed in fp32 over the
tiles (in no fixed order on the GPU) instead of rounded once to bf16, so it is not bit-identical to the unfused
pair, and a GPU run is not bit-reproducible.
"""

from __future__ import annotations

import numpy as np
import torch.nn.functional as F

from mpk_dist.backends import torch_ops as T
from mpk_dist.taskgraph.tasks.base import Access, ArgSpec, ParamSpec, TaskKind, TileContext, rect, view2d
from mpk_dist.taskgraph.tasks.norm_linear import normed_rows


class NormLinearSilu(TaskKind):
    """Y[:, c0:c0+COLS] = silu(rms_norm(X) @ Wgate.T) * (rms_norm(X) @ Wup.T), each product rounded first"""

    name = "norm_linear_silu"
    opcode = 27
    doc = ("y[b, c0:c0+N_TILE/2] = silu(rms_norm(x[b]) . w[c0:..]) * (rms_norm(x[b]) . w[UP_ROWS+c0:..]) "
           "(fp32 statistics and accumulation, each product rounded before the silu)")
    args = (
        ArgSpec("X", "r", "[B, K] input before the norm (the fp32 residual stream); offset = row 0"),
        ArgSpec("NORM_W", "r", "[K] rms_norm weight"),
        ArgSpec("W", "r", "[2I, K] gate|up weight; offset = gate row c0 (its up rows start UP_ROWS rows later)"),
        ArgSpec("Y", "w", "[B, I] activation silu(gate) * up; offset = column c0 of row 0"),
        ArgSpec("Y_FLAGS", "w", "flagged copy of Y (mpk_dist.taskgraph.flag_words: one (two bf16, step tag) word per "
                "column pair, i32 pairs); offset = Y's; NULL: none (kernel only)", optional=True),
        ArgSpec("X_FLAGS", "r", "flagged copy of X (mpk_dist.taskgraph.flag_words), polled instead of waiting on "
                "X's producers; offset = 2 x X's; NULL: read X after the wait", optional=True),
        ArgSpec("WD", "r", "[H, I] down weight (fusion 'silu_down'); offset = column c0 of row 0, row stride WD_STRIDE; "
                "NULL: no down projection in the tile", optional=True),
        ArgSpec("XO", "a", "[B, H] residual stream after the MLP (fp32), which the tile's down partial is added into "
                "(atomically); offset = row 0; NULL with WD", optional=True),
    )
    params = (
        ParamSpec("BATCH", "B"),
        ParamSpec("K", "reduction length (= the normalised row length)"),
        ParamSpec("N_TILE", "weight rows of the tile: COLS gate rows and COLS up rows (2 * COLS)"),
        ParamSpec("X_STRIDE", "elements between rows of X"),
        ParamSpec("Y_STRIDE", "elements between rows of Y (I)"),
        ParamSpec("UP_ROWS", "weight rows from a gate row to its up row (I)"),
        ParamSpec("EPS", "rms_norm epsilon", is_float=True),
        ParamSpec("H", "rows of the down weight (the hidden size); 0 without WD"),
        ParamSpec("WD_STRIDE", "elements between rows of WD (I); 0 without WD"),
        ParamSpec("XO_STRIDE", "elements between rows of XO (H); 0 without WD"),
    )

    def run_tile(self, t: TileContext) -> None:
        B, K, n, up = t.p("BATCH"), t.p("K"), t.p("N_TILE") // 2, t.p("UP_ROWS")
        x = view2d(t.buf("X"), t.off("X"), B, K, t.p("X_STRIDE"))
        nw = t.buf("NORM_W")[t.off("NORM_W"): t.off("NORM_W") + K]
        wg = view2d(t.buf("W"), t.off("W"), n, K, K)
        wu = view2d(t.buf("W"), t.off("W") + up * K, n, K, K)
        y = view2d(t.buf("Y"), t.off("Y"), B, n, t.p("Y_STRIDE"))
        a = normed_rows(x, nw, t.f("EPS"))
        # the products in the activation dtype (what the gate|up linear stores), then silu_mul's rounding
        y.copy_(F.silu(T.linear(a, wg, y.dtype)) * T.linear(a, wu, y.dtype))
        if t.buf("WD") is not None:  # the down projection's split-K partial over this tile's columns, in fp32
            H = t.p("H")
            wd = view2d(t.buf("WD"), t.off("WD"), H, n, t.p("WD_STRIDE"))
            xo = view2d(t.buf("XO"), t.off("XO"), B, H, t.p("XO_STRIDE"))
            xo.add_(y.float() @ wd.float().T)

    def accesses(self, t: TileContext) -> list[Access]:
        B, K, n, up = t.p("BATCH"), t.p("K"), t.p("N_TILE") // 2, t.p("UP_ROWS")
        w0 = t.off("W")
        return [Access(0, "r", rect(t.off("X"), B, K, t.p("X_STRIDE"))),
                Access(1, "r", t.off("NORM_W") + np.arange(K)),
                Access(2, "r", np.concatenate([w0 + np.arange(n * K), w0 + up * K + np.arange(n * K)])),
                Access(3, "w", rect(t.off("Y"), B, n, t.p("Y_STRIDE")))] + (
            [] if t.buf("WD") is None else [Access(7, "a", rect(t.off("XO"), B, t.p("H"), t.p("XO_STRIDE")))])

    def traffic(self, counts, elem_bytes, params, world):
        B, K, n, H = params[0], params[1], params[2], params[7]
        down = (H * (n // 2) * elem_bytes[6], B * H * elem_bytes[7]) if counts[6] else (0, 0)
        return (B * K * elem_bytes[0] + K * elem_bytes[1] + n * K * elem_bytes[2] + down[0],
                B * (n // 2) * elem_bytes[3] + down[1])


KIND = NormLinearSilu()

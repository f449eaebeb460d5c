"""norm_linear_silu: the gate|up projection with rms_norm as its prologue and silu_mul as its epilogue
(fusions 'norm' and 'silu_epi', docs/TASKGRAPH.md).

A tile owns COLS intermediate columns [c0, c0 + COLS): the COLS gate weight rows starting at row c0 and
the COLS up weight rows starting at row UP_ROWS + c0 of the [2I, K] gate|up weight (N_TILE = 2 * COLS
weight rows in all). It normalises its B input rows as ``norm_linear`` does, computes both halves' sums,
rounds each to the activation dtype (what the gate|up linear would store) and writes
act = silu(gate) * up rounded as the standalone ``silu_mul`` task rounds it. So the gate|up activation
never exists, the silu_mul level disappears, and the down projection reads act as a plain input (one
load per element instead of silu over every element in each of its tiles).
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
    )
    params = (
        ParamSpec("BATCH", "B"),
        ParamSpec("K", "reduction length (= the normalised row length)"),
        ParamSpec("N_TILE", "weight rows of the tile: COLS gate rows and COLS up rows (2 * COLS)"),
        ParamSpec("X_STRIDE", "elements between rows of X"),
        ParamSpec("Y_STRIDE", "elements between rows of Y (I)"),
        ParamSpec("UP_ROWS", "weight rows from a gate row to its up row (I)"),
        ParamSpec("EPS", "rms_norm epsilon", is_float=True),
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

    def accesses(self, t: TileContext) -> list[Access]:
        B, K, n, up = t.p("BATCH"), t.p("K"), t.p("N_TILE") // 2, t.p("UP_ROWS")
        w0 = t.off("W")
        return [Access(0, "r", rect(t.off("X"), B, K, t.p("X_STRIDE"))),
                Access(1, "r", t.off("NORM_W") + np.arange(K)),
                Access(2, "r", np.concatenate([w0 + np.arange(n * K), w0 + up * K + np.arange(n * K)])),
                Access(3, "w", rect(t.off("Y"), B, n, t.p("Y_STRIDE")))]

    def traffic(self, counts, elem_bytes, params, world):
        B, K, n = params[0], params[1], params[2]
        return B * K * elem_bytes[0] + K * elem_bytes[1] + n * K * elem_bytes[2], B * (n // 2) * elem_bytes[3]


KIND = NormLinearSilu()

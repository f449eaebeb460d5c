"""linear: a block of N_TILE output features for all B rows (GEMV at batch 1).

The weight block W[n0:n0+N_TILE, :] is contiguous, so a tile can stream its weights before its
input event fires; only X waits. fp32 accumulation, result cast to Y's dtype.
"""

from __future__ import annotations

import numpy as np

from mpk_dist.backends import torch_ops as T
from mpk_dist.taskgraph.tasks.base import Access, ArgSpec, ParamSpec, TaskKind, TileContext, rect, view2d


class Linear(TaskKind):
    """Y[:, n0:n0+N_TILE] = X @ W[n0:n0+N_TILE].T"""

    name = "linear"
    opcode = 3
    doc = "y[b, n0:n0+N_TILE] = x[b, :K] . w[n0:n0+N_TILE, :K] (fp32 accumulate)"
    args = (
        ArgSpec("X", "r", "[B, K] input; offset = row 0"),
        ArgSpec("W", "r", "[N, K] weight; offset = row n0 (the tile's rows are contiguous)"),
        ArgSpec("Y", "w", "[B, N] output; offset = column n0 of row 0"),
    )
    params = (
        ParamSpec("BATCH", "B"),
        ParamSpec("K", "reduction length"),
        ParamSpec("N_TILE", "output features in this tile"),
        ParamSpec("X_STRIDE", "elements between rows of X"),
        ParamSpec("Y_STRIDE", "elements between rows of Y (N)"),
    )

    def run_tile(self, t: TileContext) -> None:
        B, K, n = t.p("BATCH"), t.p("K"), t.p("N_TILE")
        x = view2d(t.buf("X"), t.off("X"), B, K, t.p("X_STRIDE"))
        w = view2d(t.buf("W"), t.off("W"), n, K, K)
        y = view2d(t.buf("Y"), t.off("Y"), B, n, t.p("Y_STRIDE"))
        y.copy_(T.linear(x, w, y.dtype))

    def accesses(self, t: TileContext) -> list[Access]:
        B, K, n = t.p("BATCH"), t.p("K"), t.p("N_TILE")
        return [Access(0, "r", rect(t.off("X"), B, K, t.p("X_STRIDE"))),
                Access(1, "r", t.off("W") + np.arange(n * K)),
                Access(2, "w", rect(t.off("Y"), B, n, t.p("Y_STRIDE")))]

    def traffic(self, counts, elem_bytes, params, world):
        B, K, n = params[0], params[1], params[2]
        return B * K * elem_bytes[0] + n * K * elem_bytes[1], B * n * elem_bytes[2]


KIND = Linear()

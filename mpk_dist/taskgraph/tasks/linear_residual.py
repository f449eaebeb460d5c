"""linear_residual: the residual add fused into a linear tile's epilogue (fusion 'residual', tp 1).

y = residual + round(x @ w.T): the product is rounded once to the activation dtype (what the
unfused linear stores) and added to the fp32 residual in fp32, exactly as the unfused
linear -> add pair computes it; the add task and its dependency level disappear. At tp > 1 the
all-reduce already adds the residual, so this kind is only used at tp 1.
"""

from __future__ import annotations

import numpy as np

from mpk_dist.backends import torch_ops as T
from mpk_dist.taskgraph.tasks.base import Access, ArgSpec, ParamSpec, TaskKind, TileContext, rect, view2d


class LinearResidual(TaskKind):
    """Y[:, n0:n0+N_TILE] = RESIDUAL[:, n0:..] + round(X @ W[n0:n0+N_TILE].T)"""

    name = "linear_residual"
    opcode = 17
    doc = "y[b, n0:n0+N_TILE] = residual[b, n0:..] + round(x[b, :K] . w[n0:n0+N_TILE, :K]) (fp32 add)"
    args = (
        ArgSpec("X", "r", "[B, K] input; offset = row 0"),
        ArgSpec("W", "r", "[N, K] weight; offset = row n0 (the tile's rows are contiguous)"),
        ArgSpec("RESIDUAL", "r", "[B, N] residual stream (fp32); offset = column n0 of row 0, row stride Y_STRIDE"),
        ArgSpec("Y", "w", "[B, N] output (fp32 residual stream); offset = column n0 of row 0"),
        ArgSpec("Y_FLAGS", "w", "flagged copy of Y (mpk_dist.taskgraph.flag_words: one (value, step tag) word per "
                "element, i32 pairs); offset = 2 x Y's; NULL: none (kernel only, the interpreter ignores it)",
                optional=True),
        ArgSpec("RESIDUAL_FLAGS", "r", "flagged copy of RESIDUAL, read instead of it; offset = 2 x RESIDUAL's; "
                "NULL: read RESIDUAL", optional=True),
        ArgSpec("X_FLAGS", "r", "flagged copy of X (one (two bf16, step tag) word per column pair), polled instead of "
                "waiting on X's producers; offset = X's; NULL: read X after the wait", optional=True),
        ArgSpec("COPY", "w", "a second output written with Y's values (fusion 'silu_down': the residual stream the "
                "next down partials are added into); offset = column n0 of row 0, row stride Y_STRIDE; NULL: none",
                optional=True),
    )
    params = (
        ParamSpec("BATCH", "B"),
        ParamSpec("K", "reduction length"),
        ParamSpec("N_TILE", "output features in this tile"),
        ParamSpec("X_STRIDE", "elements between rows of X"),
        ParamSpec("Y_STRIDE", "elements between rows of Y and RESIDUAL (N)"),
    )

    def run_tile(self, t: TileContext) -> None:
        B, K, n, ys = t.p("BATCH"), t.p("K"), t.p("N_TILE"), t.p("Y_STRIDE")
        x = view2d(t.buf("X"), t.off("X"), B, K, t.p("X_STRIDE"))
        w = view2d(t.buf("W"), t.off("W"), n, K, K)
        res = view2d(t.buf("RESIDUAL"), t.off("RESIDUAL"), B, n, ys)
        part = T.linear(x, w)  # rounded once to the weight dtype, as the unfused linear's output
        y = view2d(t.buf("Y"), t.off("Y"), B, n, ys)
        y.copy_(part + res)
        if t.buf("COPY") is not None:
            view2d(t.buf("COPY"), t.off("COPY"), B, n, ys).copy_(y)

    def accesses(self, t: TileContext) -> list[Access]:
        B, K, n, ys = t.p("BATCH"), t.p("K"), t.p("N_TILE"), t.p("Y_STRIDE")
        return [Access(0, "r", rect(t.off("X"), B, K, t.p("X_STRIDE"))),
                Access(1, "r", t.off("W") + np.arange(n * K)),
                Access(2, "r", rect(t.off("RESIDUAL"), B, n, ys)),
                Access(3, "w", rect(t.off("Y"), B, n, ys))] + (
            [] if t.buf("COPY") is None else [Access(7, "w", rect(t.off("COPY"), B, n, ys))])

    def traffic(self, counts, elem_bytes, params, world):
        B, K, n = params[0], params[1], params[2]
        return B * K * elem_bytes[0] + n * K * elem_bytes[1] + B * n * elem_bytes[2], B * n * elem_bytes[3]


KIND = LinearResidual()

"""norm_linear: rms_norm fused into a linear tile's prologue (fusion 'norm', docs/TASKGRAPH.md).

Each tile normalises the B input rows itself (fp32 statistics over all K columns of the fp32
residual stream) and multiplies the normalised rows, rounded exactly as the standalone rms_norm
task rounds them (``torch_ops.rms_norm``: x * r rounded to the weight dtype, times NORM_W, rounded),
by its block of N_TILE weight rows. Reading x costs B*K values per tile, small next to the
N_TILE*K weight block; the rms_norm task and its dependency level disappear.
"""

from __future__ import annotations

import numpy as np
import torch

from mpk_dist.backends import torch_ops as T
from mpk_dist.taskgraph.tasks.base import Access, ArgSpec, ParamSpec, TaskKind, TileContext, rect, view2d


def normed_rows(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm of each row of x [B, K] exactly as the standalone rms_norm tile computes it (one
    row at a time, so the reduction is the same), in the weight's dtype."""
    return torch.stack([T.rms_norm(x[b], w, eps) for b in range(x.shape[0])])


class NormLinear(TaskKind):
    """Y[:, n0:n0+N_TILE] = rms_norm(X, NORM_W) @ W[n0:n0+N_TILE].T"""

    name = "norm_linear"
    opcode = 16
    doc = "y[b, n0:n0+N_TILE] = rms_norm(x[b, :K], norm_w) . w[n0:n0+N_TILE, :K] (fp32 statistics and accumulation)"
    args = (
        ArgSpec("X", "r", "[B, K] input before the norm (the fp32 residual stream); offset = row 0"),
        ArgSpec("NORM_W", "r", "[K] rms_norm weight"),
        ArgSpec("W", "r", "[N, K] weight; offset = row n0 (the tile's rows are contiguous)"),
        ArgSpec("Y", "w", "[B, N] output; offset = column n0 of row 0"),
        ArgSpec("X_FLAGS", "r", "flagged copy of X (mpk_dist.taskgraph.flag_words), polled instead of waiting on "
                "X's producers; offset = 2 x X's; NULL: read X after the wait", optional=True),
    )
    params = (
        ParamSpec("BATCH", "B"),
        ParamSpec("K", "reduction length (= the normalised row length)"),
        ParamSpec("N_TILE", "output features in this tile"),
        ParamSpec("X_STRIDE", "elements between rows of X"),
        ParamSpec("Y_STRIDE", "elements between rows of Y (N)"),
        ParamSpec("EPS", "rms_norm epsilon", is_float=True),
    )

    def run_tile(self, t: TileContext) -> None:
        B, K, n = t.p("BATCH"), t.p("K"), t.p("N_TILE")
        x = view2d(t.buf("X"), t.off("X"), B, K, t.p("X_STRIDE"))
        nw = t.buf("NORM_W")[t.off("NORM_W"): t.off("NORM_W") + K]
        w = view2d(t.buf("W"), t.off("W"), n, K, K)
        y = view2d(t.buf("Y"), t.off("Y"), B, n, t.p("Y_STRIDE"))
        y.copy_(T.linear(normed_rows(x, nw, t.f("EPS")), w, y.dtype))

    def accesses(self, t: TileContext) -> list[Access]:
        B, K, n = t.p("BATCH"), t.p("K"), t.p("N_TILE")
        return [Access(0, "r", rect(t.off("X"), B, K, t.p("X_STRIDE"))),
                Access(1, "r", t.off("NORM_W") + np.arange(K)),
                Access(2, "r", t.off("W") + np.arange(n * K)),
                Access(3, "w", rect(t.off("Y"), B, n, t.p("Y_STRIDE")))]

    def traffic(self, counts, elem_bytes, params, world):
        B, K, n = params[0], params[1], params[2]
        return B * K * elem_bytes[0] + K * elem_bytes[1] + n * K * elem_bytes[2], B * n * elem_bytes[3]


KIND = NormLinear()

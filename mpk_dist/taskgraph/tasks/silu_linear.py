"""silu_linear: silu_mul fused into the down projection's prologue (fusion 'silu'), with an optional
residual epilogue (fusion 'residual', tp 1).

The tile computes its input a = silu(gate) * up from the gate|up activation itself, rounding as the
standalone silu_mul task does (silu rounded to the activation dtype, the product rounded once),
multiplies it by its block of N_TILE weight rows, rounds the product once, and, when RESIDUAL is
given, adds it to the fp32 residual in fp32 (as linear_residual). The silu_mul task (and at tp 1
the add task) and their dependency levels disappear.
"""

from __future__ import annotations

import numpy as np
import torch.nn.functional as F

from mpk_dist.backends import torch_ops as T
from mpk_dist.taskgraph.tasks.base import Access, ArgSpec, ParamSpec, TaskKind, TileContext, rect, view2d


class SiluLinear(TaskKind):
    """Y[:, n0:n0+N_TILE] = (RESIDUAL +) round((silu(GATE) * UP) @ W[n0:n0+N_TILE].T)"""

    name = "silu_linear"
    opcode = 18
    doc = "y[b, n0:..] = (residual[b, n0:..] +) (silu(gu[b, :K]) * gu[b, UP_OFFSET:UP_OFFSET+K]) . w[n0:n0+N_TILE, :K]"
    args = (
        ArgSpec("GU", "r", "[B, 2K] gate|up activation; offset = gate column 0 of row 0"),
        ArgSpec("W", "r", "[N, K] weight; offset = row n0 (the tile's rows are contiguous)"),
        ArgSpec("RESIDUAL", "r", "[B, N] fp32 residual at column n0, row stride Y_STRIDE; NULL: no residual (tp > 1)",
                optional=True),
        ArgSpec("Y", "w", "[B, N] output (fp32 residual stream, or the bf16 partial at tp > 1); offset = column n0"),
    )
    params = (
        ParamSpec("BATCH", "B"),
        ParamSpec("K", "reduction length (intermediate size I on this rank)"),
        ParamSpec("N_TILE", "output features in this tile"),
        ParamSpec("GU_STRIDE", "elements between rows of GU (2I)"),
        ParamSpec("UP_OFFSET", "elements from a gate column to its up column (I)"),
        ParamSpec("Y_STRIDE", "elements between rows of Y and RESIDUAL (N)"),
    )

    def run_tile(self, t: TileContext) -> None:
        B, K, n, ys, gs = t.p("BATCH"), t.p("K"), t.p("N_TILE"), t.p("Y_STRIDE"), t.p("GU_STRIDE")
        gate = view2d(t.buf("GU"), t.off("GU"), B, K, gs)
        up = view2d(t.buf("GU"), t.off("GU") + t.p("UP_OFFSET"), B, K, gs)
        w = view2d(t.buf("W"), t.off("W"), n, K, K)
        y = view2d(t.buf("Y"), t.off("Y"), B, n, ys)
        part = T.linear(F.silu(gate) * up, w)  # both rounded in the activation dtype, as silu_mul + linear
        res = t.buf("RESIDUAL")
        y.copy_(part if res is None else part + view2d(res, t.off("RESIDUAL"), B, n, ys))

    def accesses(self, t: TileContext) -> list[Access]:
        B, K, n, ys, gs = t.p("BATCH"), t.p("K"), t.p("N_TILE"), t.p("Y_STRIDE"), t.p("GU_STRIDE")
        out = [Access(0, "r", rect(t.off("GU"), B, K, gs)), Access(0, "r", rect(t.off("GU") + t.p("UP_OFFSET"), B, K, gs)),
               Access(1, "r", t.off("W") + np.arange(n * K)), Access(3, "w", rect(t.off("Y"), B, n, ys))]
        if t.buf("RESIDUAL") is not None:
            out.append(Access(2, "r", rect(t.off("RESIDUAL"), B, n, ys)))
        return out

    def traffic(self, counts, elem_bytes, params, world):
        B, K, n = params[0], params[1], params[2]
        res = B * n * elem_bytes[2] if counts[2] else 0
        return 2 * B * K * elem_bytes[0] + n * K * elem_bytes[1] + res, B * n * elem_bytes[3]


KIND = SiluLinear()

"""rms_norm: one whole row (one sequence) per tile, since the mean needs every column.

y = x / sqrt(mean(x^2) + EPS) * w, normalised in fp32 (mpk_dist.backends.torch_ops.rms_norm).
"""

from __future__ import annotations

import numpy as np

from mpk_dist.backends import torch_ops as T
from mpk_dist.taskgraph.tasks.base import Access, ArgSpec, ParamSpec, TaskKind, TileContext


class RmsNorm(TaskKind):
    """Normalise row b of X into row b of Y."""

    name = "rms_norm"
    opcode = 2
    doc = "y[b] = x[b] * rsqrt(mean(x[b]^2) + EPS) * w (fp32 statistics)"
    args = (
        ArgSpec("X", "r", "[B, N]; offset = row b"),
        ArgSpec("W", "r", "[N] weight"),
        ArgSpec("Y", "w", "[B, N]; offset = row b"),
    )
    params = (
        ParamSpec("N", "row length"),
        ParamSpec("EPS", "epsilon", is_float=True),
    )

    def run_tile(self, t: TileContext) -> None:
        n = t.p("N")
        x = t.buf("X")[t.off("X"): t.off("X") + n]
        w = t.buf("W")[t.off("W"): t.off("W") + n]
        t.buf("Y")[t.off("Y"): t.off("Y") + n].copy_(T.rms_norm(x, w, t.f("EPS")))

    def accesses(self, t: TileContext) -> list[Access]:
        ar = np.arange(t.p("N"))
        return [Access(0, "r", t.off("X") + ar), Access(1, "r", t.off("W") + ar), Access(2, "w", t.off("Y") + ar)]


KIND = RmsNorm()

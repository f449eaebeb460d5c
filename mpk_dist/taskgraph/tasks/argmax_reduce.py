"""argmax_reduce: this rank's (max, index) over its vocabulary tiles' candidates (one task)."""

from __future__ import annotations

import numpy as np
import torch

from mpk_dist.taskgraph.tasks.argmax_partial import best_pair
from mpk_dist.taskgraph.tasks.base import Access, ArgSpec, ParamSpec, TaskKind, TileContext


class ArgmaxReduce(TaskKind):
    """OUT[b] = the best of PARTIAL[b, 0..NTILES) (largest value, ties to the smallest index)."""

    name = "argmax_reduce"
    opcode = 11
    doc = "cand[b] = best over tiles of partial[b, tile] (largest value, ties to the lowest index)"
    args = (
        ArgSpec("PARTIAL", "r", "f32 [B, NTILES, 2]"),
        ArgSpec("OUT", "w", "f32 [B, 2] this rank's candidate"),
    )
    params = (
        ParamSpec("BATCH", "B"),
        ParamSpec("NTILES", "vocabulary tiles"),
    )

    def run_tile(self, t: TileContext) -> None:
        B, nt = t.p("BATCH"), t.p("NTILES")
        p = t.buf("PARTIAL")[t.off("PARTIAL"): t.off("PARTIAL") + B * nt * 2].view(B, nt, 2)
        val, idx = best_pair(p[..., 0], p[..., 1])
        t.buf("OUT")[t.off("OUT"): t.off("OUT") + 2 * B].copy_(torch.stack([val, idx], dim=-1).reshape(-1))

    def accesses(self, t: TileContext) -> list[Access]:
        B, nt = t.p("BATCH"), t.p("NTILES")
        return [Access(0, "r", t.off("PARTIAL") + np.arange(B * nt * 2)), Access(1, "w", t.off("OUT") + np.arange(2 * B))]


KIND = ArgmaxReduce()

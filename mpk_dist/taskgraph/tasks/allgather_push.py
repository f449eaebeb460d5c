"""allgather_push: copy my (max, index) candidates into slot[my_rank] of every rank's gather buffer.

Signals the gather event on every rank (target ALL_RANKS), so argmax_select there waits for WORLD
pushes. This is the vocabulary-parallel end of the step: no rank sees the full logits.
"""

from __future__ import annotations

import numpy as np

from mpk_dist.taskgraph.tasks.base import Access, ArgSpec, ParamSpec, TaskKind, TileContext


class AllgatherPush(TaskKind):
    """cands@r[my_rank] = cand for every rank r."""

    name = "allgather_push"
    opcode = 12
    doc = "for every rank r: cands@r[my_rank, :] = src[:] (COUNT elements)"
    args = (
        ArgSpec("SRC", "r", "f32 [B, 2] my candidate"),
        ArgSpec("DST", "w", "symmetric f32 [WORLD, B, 2]; offset = slot my_rank; written on every rank", remote=True),
    )
    params = (ParamSpec("COUNT", "elements to copy (2 B)"),)

    def run_tile(self, t: TileContext) -> None:
        n = t.p("COUNT")
        src = t.buf("SRC")[t.off("SRC"): t.off("SRC") + n]
        for peer in t.peers("DST"):
            peer[t.off("DST"): t.off("DST") + n].copy_(src)

    def accesses(self, t: TileContext) -> list[Access]:
        ar = np.arange(t.p("COUNT"))
        return [Access(0, "r", t.off("SRC") + ar), Access(1, "w", t.off("DST") + ar, remote=True)]


KIND = AllgatherPush()

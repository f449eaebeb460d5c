"""silu_mul: a block of COLS intermediate columns: a = silu(gate) * up.

gate columns [c0, c0+COLS) and up columns [I + c0, I + c0 + COLS) of the gate_up activation.
"""

from __future__ import annotations

import torch.nn.functional as F

from mpk_dist.taskgraph.tasks.base import Access, ArgSpec, ParamSpec, TaskKind, TileContext, rect, view2d


class SiluMul(TaskKind):
    """OUT[:, c0:c0+COLS] = silu(GU[:, c0:..]) * GU[:, UP_OFFSET + c0:..]"""

    name = "silu_mul"
    opcode = 6
    doc = "a[b, cols] = silu(gu[b, cols]) * gu[b, UP_OFFSET + cols]"
    args = (
        ArgSpec("GU", "r", "[B, 2I]; offset = gate column c0 of row 0"),
        ArgSpec("OUT", "w", "[B, I]; offset = column c0 of row 0"),
    )
    params = (
        ParamSpec("BATCH", "B"),
        ParamSpec("COLS", "columns in this tile"),
        ParamSpec("GU_STRIDE", "elements between rows of GU (2I)"),
        ParamSpec("UP_OFFSET", "elements from a gate column to its up column (I)"),
        ParamSpec("OUT_STRIDE", "elements between rows of OUT (I)"),
    )

    def run_tile(self, t: TileContext) -> None:
        B, n, gs = t.p("BATCH"), t.p("COLS"), t.p("GU_STRIDE")
        gate = view2d(t.buf("GU"), t.off("GU"), B, n, gs)
        up = view2d(t.buf("GU"), t.off("GU") + t.p("UP_OFFSET"), B, n, gs)
        view2d(t.buf("OUT"), t.off("OUT"), B, n, t.p("OUT_STRIDE")).copy_(F.silu(gate) * up)

    def accesses(self, t: TileContext) -> list[Access]:
        B, n, gs = t.p("BATCH"), t.p("COLS"), t.p("GU_STRIDE")
        return [Access(0, "r", rect(t.off("GU"), B, n, gs)), Access(0, "r", rect(t.off("GU") + t.p("UP_OFFSET"), B, n, gs)),
                Access(1, "w", rect(t.off("OUT"), B, n, t.p("OUT_STRIDE")))]

    def traffic(self, counts, elem_bytes, params, world):
        B, n = params[0], params[1]
        return 2 * B * n * elem_bytes[0], B * n * elem_bytes[1]


KIND = SiluMul()

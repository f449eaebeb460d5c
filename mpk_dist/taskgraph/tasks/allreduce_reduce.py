"""allreduce_reduce: one-shot all-reduce, phase 2: sum the WORLD slots of one tile in fp32.

Waits for the tile's receive event (WORLD pushes), sums slots 0..WORLD-1 in rank order in fp32,
adds the residual once (every rank adds its own replicated copy to the sum, so the residual counts
once in the result), and stores in OUT's dtype. Same arithmetic as the torch backend's all_reduce.
"""

from __future__ import annotations

import torch

from mpk_dist.taskgraph.tasks.base import Access, ArgSpec, ParamSpec, TaskKind, TileContext, rect, view2d


class AllreduceReduce(TaskKind):
    """OUT[:, cols] = sum_r recv[r, :, cols] (+ RESIDUAL[:, cols]), fp32."""

    name = "allreduce_reduce"
    opcode = 9
    doc = "out[b, cols] = (sum over r of recv[r, b, cols]) + residual[b, cols], in fp32"
    args = (
        ArgSpec("RECV", "r", "symmetric [WORLD, B, N]; offset = slot 0, column c0"),
        ArgSpec("RESIDUAL", "r", "[B, N]; offset = column c0; NULL for no residual", optional=True),
        ArgSpec("OUT", "w", "[B, N]; offset = column c0"),
    )
    params = (
        ParamSpec("BATCH", "B"),
        ParamSpec("COLS", "columns in this tile"),
        ParamSpec("WORLD", "ranks (slots)"),
        ParamSpec("SLOT_STRIDE", "elements between slots of RECV (B N)"),
        ParamSpec("STRIDE", "elements between rows of RECV slots, RESIDUAL and OUT (N)"),
    )

    def run_tile(self, t: TileContext) -> None:
        B, n, s, ss = t.p("BATCH"), t.p("COLS"), t.p("STRIDE"), t.p("SLOT_STRIDE")
        acc = torch.zeros((B, n), dtype=torch.float32)
        for r in range(t.p("WORLD")):
            acc = acc + view2d(t.buf("RECV"), t.off("RECV") + r * ss, B, n, s).float()
        if t.buf("RESIDUAL") is not None:
            acc = acc + view2d(t.buf("RESIDUAL"), t.off("RESIDUAL"), B, n, s).float()
        view2d(t.buf("OUT"), t.off("OUT"), B, n, s).copy_(acc)

    def accesses(self, t: TileContext) -> list[Access]:
        B, n, s, ss = t.p("BATCH"), t.p("COLS"), t.p("STRIDE"), t.p("SLOT_STRIDE")
        out = [Access(0, "r", rect(t.off("RECV") + r * ss, B, n, s)) for r in range(t.p("WORLD"))]
        if t.buf("RESIDUAL") is not None:
            out.append(Access(1, "r", rect(t.off("RESIDUAL"), B, n, s)))
        return out + [Access(2, "w", rect(t.off("OUT"), B, n, s))]

    def traffic(self, counts, elem_bytes, params, world):
        B, n, W = params[0], params[1], params[2]
        res = B * n * elem_bytes[1] if counts[1] else 0
        return W * B * n * elem_bytes[0] + res, B * n * elem_bytes[2]


KIND = AllreduceReduce()

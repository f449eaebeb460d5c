"""add: a block of COLS columns of y = a + b (the residual add at tp 1)."""

from __future__ import annotations

from mpk_dist.taskgraph.tasks.base import Access, ArgSpec, ParamSpec, TaskKind, TileContext, rect, view2d


class Add(TaskKind):
    """OUT = X + Y on a column block, in the buffers' dtype."""

    name = "add"
    opcode = 7
    doc = "out[b, cols] = x[b, cols] + y[b, cols]"
    args = (
        ArgSpec("X", "r", "[B, N]; offset = column c0 of row 0"),
        ArgSpec("Y", "r", "[B, N]; offset = column c0 of row 0"),
        ArgSpec("OUT", "w", "[B, N]; offset = column c0 of row 0"),
    )
    params = (
        ParamSpec("BATCH", "B"),
        ParamSpec("COLS", "columns in this tile"),
        ParamSpec("STRIDE", "elements between rows (N)"),
    )

    def run_tile(self, t: TileContext) -> None:
        B, n, s = t.p("BATCH"), t.p("COLS"), t.p("STRIDE")
        x = view2d(t.buf("X"), t.off("X"), B, n, s)
        y = view2d(t.buf("Y"), t.off("Y"), B, n, s)
        view2d(t.buf("OUT"), t.off("OUT"), B, n, s).copy_(x + y)

    def accesses(self, t: TileContext) -> list[Access]:
        B, n, s = t.p("BATCH"), t.p("COLS"), t.p("STRIDE")
        return [Access(i, "r" if i < 2 else "w", rect(t.off(a.name), B, n, s)) for i, a in enumerate(self.args)]

    def traffic(self, counts, elem_bytes, params, world):
        B, n = params[0], params[1]
        return B * n * (elem_bytes[0] + elem_bytes[1]), B * n * elem_bytes[2]


KIND = Add()

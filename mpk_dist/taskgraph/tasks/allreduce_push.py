"""allreduce_push: one-shot all-reduce, phase 1: push my partial tile to every rank.

Copies columns [c0, c0+COLS) of my partial [B, N] into slot[my_rank] of the symmetric receive
buffer [WORLD, B, N] of EVERY rank (my own included) through the peer pointer table, then signals
the tile's receive event on every rank (signal target ALL_RANKS; release at system scope after the
stores). The receive buffer has the partial's dtype; the reduce sums in fp32.
"""

from __future__ import annotations

from mpk_dist.taskgraph.tasks.base import Access, ArgSpec, ParamSpec, TaskKind, TileContext, rect, view2d


class AllreducePush(TaskKind):
    """recv[my_rank, :, c0:c0+COLS] on every rank = my partial[:, c0:c0+COLS]."""

    name = "allreduce_push"
    opcode = 8
    doc = "for every rank r: recv@r[my_rank, b, cols] = partial[b, cols]"
    args = (
        ArgSpec("SRC", "r", "[B, N] my partial; offset = column c0 of row 0"),
        ArgSpec("DST", "w", "symmetric [WORLD, B, N]; offset = slot my_rank, column c0; written on every rank",
                remote=True),
    )
    params = (
        ParamSpec("BATCH", "B"),
        ParamSpec("COLS", "columns in this tile"),
        ParamSpec("SRC_STRIDE", "elements between rows of SRC (N)"),
        ParamSpec("DST_STRIDE", "elements between rows of one slot of DST (N)"),
    )

    def run_tile(self, t: TileContext) -> None:
        B, n = t.p("BATCH"), t.p("COLS")
        src = view2d(t.buf("SRC"), t.off("SRC"), B, n, t.p("SRC_STRIDE"))
        for peer in t.peers("DST"):
            view2d(peer, t.off("DST"), B, n, t.p("DST_STRIDE")).copy_(src)

    def accesses(self, t: TileContext) -> list[Access]:
        B, n = t.p("BATCH"), t.p("COLS")
        return [Access(0, "r", rect(t.off("SRC"), B, n, t.p("SRC_STRIDE"))),
                Access(1, "w", rect(t.off("DST"), B, n, t.p("DST_STRIDE")), remote=True)]

    def traffic(self, counts, elem_bytes, params, world):
        B, n = params[0], params[1]
        return B * n * elem_bytes[0], world * B * n * elem_bytes[1]


KIND = AllreducePush()

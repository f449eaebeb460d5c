"""embedding: a block of hidden columns of the embedding rows of this rank's vocabulary slice.

Tile = columns [c0, c0 + COLS) of the hidden axis for all B rows, so the all-reduce of the same
column block (tp > 1) depends on this tile alone. Ids outside [VOCAB_START, VOCAB_START +
VOCAB_ROWS) give zero rows (the all-reduce sums the one rank that holds the id).
"""

from __future__ import annotations

import numpy as np

from mpk_dist.taskgraph.tasks.base import Access, ArgSpec, ParamSpec, TaskKind, TileContext, rect, view2d


class Embedding(TaskKind):
    """out[b, c0:c0+COLS] = table[tokens[b] - VOCAB_START, c0:c0+COLS] or 0."""

    name = "embedding"
    opcode = 1
    doc = "out[b, cols] = table[tok[b]-VOCAB_START, cols] if tok[b] is in this rank's slice else 0"
    args = (
        ArgSpec("TOKENS", "r", "i32 [B] ids"),
        ArgSpec("TABLE", "r", "[VOCAB_ROWS, H] embedding slice; offset = column c0 of row 0"),
        ArgSpec("OUT", "w", "[B, H]; offset = column c0 of row 0"),
    )
    params = (
        ParamSpec("BATCH", "B"),
        ParamSpec("COLS", "columns in this tile"),
        ParamSpec("TABLE_STRIDE", "elements between table rows (H)"),
        ParamSpec("OUT_STRIDE", "elements between output rows (H)"),
        ParamSpec("VOCAB_START", "first vocabulary id of this rank's slice"),
        ParamSpec("VOCAB_ROWS", "rows of this rank's slice"),
    )

    def _rows(self, t: TileContext):
        B = t.p("BATCH")
        tok = t.buf("TOKENS")[t.off("TOKENS"): t.off("TOKENS") + B].long()
        local = tok - t.p("VOCAB_START")
        return local, (local >= 0) & (local < t.p("VOCAB_ROWS"))

    def run_tile(self, t: TileContext) -> None:
        B, n = t.p("BATCH"), t.p("COLS")
        local, inside = self._rows(t)
        out = view2d(t.buf("OUT"), t.off("OUT"), B, n, t.p("OUT_STRIDE"))
        table = t.buf("TABLE")
        for b in range(B):
            if inside[b]:
                out[b].copy_(table[t.off("TABLE") + int(local[b]) * t.p("TABLE_STRIDE"):][:n])
            else:
                out[b].zero_()

    def accesses(self, t: TileContext) -> list[Access]:
        B, n = t.p("BATCH"), t.p("COLS")
        local, inside = self._rows(t)
        rows = [t.off("TABLE") + int(r) * t.p("TABLE_STRIDE") + np.arange(n) for r, ok in zip(local, inside) if ok]
        return [Access(0, "r", t.off("TOKENS") + np.arange(B)),
                Access(1, "r", np.concatenate(rows) if rows else np.zeros(0, np.int64)),
                Access(2, "w", rect(t.off("OUT"), B, n, t.p("OUT_STRIDE")))]

    def traffic(self, counts, elem_bytes, params, world):
        B, n = params[0], params[1]
        return B * 4 + B * n * elem_bytes[1], B * n * elem_bytes[2]


KIND = Embedding()

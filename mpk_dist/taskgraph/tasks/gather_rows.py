"""gather_rows: a block of COLS columns of the rows ``ROWS[b]`` of X (the residual stream before the head).

Paged serving graphs (docs/SERVING.md): only each emitting sequence's last token of the pass needs
logits, so the head (final norm, lm_head, argmax) runs over the MB gathered rows instead of all N
token rows. ``ROWS[b] < 0`` (no sequence) gives a zero row; a row id >= X_ROWS is a bad input (the
CPU reference raises, the CUDA body reports a bad task). The copy converts to OUT's dtype, as the
torch reference (``torch_ops.gather_rows`` then the declared dtype).
"""

from __future__ import annotations

import numpy as np

from mpk_dist.errors import InputError
from mpk_dist.taskgraph.tasks.base import Access, ArgSpec, ParamSpec, TaskKind, TileContext, rect, view2d


class GatherRows(TaskKind):
    """out[b, cols] = x[rows[b], cols] (0 where rows[b] < 0) on a column block."""

    name = "gather_rows"
    opcode = 23
    doc = "out[b, cols] = rows[b] >= 0 ? x[rows[b], cols] : 0"
    args = (
        ArgSpec("X", "r", "[X_ROWS, C]; offset = column c0 of row 0"),
        ArgSpec("ROWS", "r", "i32 [B] row of X for each output row; -1 = zero row"),
        ArgSpec("OUT", "w", "[B, C]; offset = column c0 of row 0"),
    )
    params = (
        ParamSpec("BATCH", "B, output rows (MB)"),
        ParamSpec("COLS", "columns in this tile"),
        ParamSpec("X_STRIDE", "elements between rows of X (C)"),
        ParamSpec("OUT_STRIDE", "elements between rows of OUT (C)"),
        ParamSpec("X_ROWS", "rows of X (N); a row id must be below it"),
    )

    def _rows(self, t: TileContext) -> np.ndarray:
        """The row ids of this launch, checked against X_ROWS."""
        B, n = t.p("BATCH"), t.p("X_ROWS")
        rows = t.buf("ROWS")[t.off("ROWS"): t.off("ROWS") + B].numpy().astype(np.int64)
        if (rows >= n).any():
            raise InputError(f"gather_rows: expected row ids < {n} (tokens in the pass) or -1, got "
                             f"{rows.tolist()}; check the pass's logit_rows")
        return rows

    def run_tile(self, t: TileContext) -> None:
        B, n = t.p("BATCH"), t.p("COLS")
        rows = self._rows(t)
        out = view2d(t.buf("OUT"), t.off("OUT"), B, n, t.p("OUT_STRIDE"))
        x = t.buf("X")
        for b in range(B):
            if rows[b] < 0:
                out[b].zero_()
            else:
                start = t.off("X") + int(rows[b]) * t.p("X_STRIDE")
                out[b].copy_(x[start: start + n])

    def accesses(self, t: TileContext) -> list[Access]:
        B, n = t.p("BATCH"), t.p("COLS")
        rows = self._rows(t)
        live = rows[rows >= 0]
        src = (t.off("X") + live[:, None] * t.p("X_STRIDE") + np.arange(n)[None, :]).reshape(-1)
        return [Access(0, "r", src), Access(1, "r", t.off("ROWS") + np.arange(B)),
                Access(2, "w", rect(t.off("OUT"), B, n, t.p("OUT_STRIDE")))]

    def traffic(self, counts, elem_bytes, params, world):
        B, n = params[0], params[1]
        return B * 4 + B * n * elem_bytes[0], B * n * elem_bytes[2]


KIND = GatherRows()

"""paged_attention: attention of the GROUP query heads of one kv head over a page pool, all N tokens.

Token b attends over positions 0..POSITIONS[b] of sequence SLOTS[b], read page by page through
PAGE_TABLE (``tasks/paged.py``); scores and softmax in fp32; padding tokens (slot -1) get zeros
(torch_ops.paged_attention).
"""

from __future__ import annotations

import numpy as np
import torch

from mpk_dist.errors import InputError
from mpk_dist.taskgraph.tasks.base import Access, ArgSpec, ParamSpec, TaskKind, TileContext, rect, view2d
from mpk_dist.taskgraph.tasks.paged import PAGE_PARAMS, page_rows, table_reads, token_inputs


class PagedAttention(TaskKind):
    """o[b, heads of kv head h] = softmax(q k^T * SCALE) v over the pages of sequence slot[b]."""

    name = "paged_attention"
    opcode = 15
    doc = "per kv head h: o[b, g] = softmax(q[b, g] . k[slot[b], 0..pos[b], h] * SCALE) v[...] through the page table"
    args = (
        ArgSpec("Q", "r", "[N, Hq D]; offset = first column of query head h*GROUP"),
        ArgSpec("K_PAGES", "r", "[NP, P, Hkv, D]; offset = head h of row 0 of page 0"),
        ArgSpec("V_PAGES", "r", "[NP, P, Hkv, D]; offset as K_PAGES"),
        ArgSpec("POSITIONS", "r", "i32 [N]"),
        ArgSpec("SLOTS", "r", "i32 [N] page-table row of each token; -1 = padding"),
        ArgSpec("PAGE_TABLE", "r", "i32 [MB, MP] page ids"),
        ArgSpec("OUT", "w", "[N, Hq D]; offset as Q"),
    )
    params = (
        ParamSpec("BATCH", "N, tokens in the pass"),
        ParamSpec("HEAD_DIM", "D"),
        ParamSpec("GROUP", "query heads per kv head (Hq / Hkv)"),
        ParamSpec("Q_STRIDE", "elements between rows of Q and OUT (Hq D)"),
        ParamSpec("SCALE", "softmax scale (D^-0.5)", is_float=True),
        *PAGE_PARAMS,
    )

    def _kv_index(self, t: TileContext, slot: int, p: int) -> np.ndarray:
        """[p+1, D] element offsets (relative to the pool argument base) of positions 0..p."""
        return page_rows(t, slot, np.arange(p + 1))[:, None] + np.arange(t.p("HEAD_DIM"))[None, :]

    def run_tile(self, t: TileContext) -> None:
        B, D, G, qs = t.p("BATCH"), t.p("HEAD_DIM"), t.p("GROUP"), t.p("Q_STRIDE")
        q = view2d(t.buf("Q"), t.off("Q"), B, G * D, qs)
        out = view2d(t.buf("OUT"), t.off("OUT"), B, G * D, qs)
        pos, slots = token_inputs(t)
        for b in range(B):
            if slots[b] < 0:
                out[b].zero_()
                continue
            idx = torch.from_numpy(self._kv_index(t, slots[b], pos[b]))
            k = t.buf("K_PAGES")[t.off("K_PAGES") + idx].float()  # [p+1, D]
            v = t.buf("V_PAGES")[t.off("V_PAGES") + idx].float()
            probs = torch.softmax(torch.matmul(q[b].reshape(G, D).float(), k.t()) * t.f("SCALE"), dim=-1)
            out[b].copy_(torch.matmul(probs, v).reshape(-1))

    def accesses(self, t: TileContext) -> list[Access]:
        B, D, G, qs = t.p("BATCH"), t.p("HEAD_DIM"), t.p("GROUP"), t.p("Q_STRIDE")
        pos, slots = token_inputs(t)
        try:
            kv = [self._kv_index(t, s, p).reshape(-1) for s, p in zip(slots, pos) if s >= 0]
        except InputError:
            # NOTE: a bad page (run_tile raises) or one page_alloc has not written yet: declare no pool
            # reads, so the race checker first sees the unordered page-table read below.
            kv = []
        kv = np.concatenate(kv) if kv else np.zeros(0, np.int64)
        ar = np.arange(B)
        return [Access(0, "r", rect(t.off("Q"), B, G * D, qs)), Access(1, "r", t.off("K_PAGES") + kv),
                Access(2, "r", t.off("V_PAGES") + kv), Access(3, "r", t.off("POSITIONS") + ar),
                Access(4, "r", t.off("SLOTS") + ar), Access(5, "r", table_reads(t, pos, slots, prefix=True)),
                Access(6, "w", rect(t.off("OUT"), B, G * D, qs))]

    def traffic(self, counts, elem_bytes, params, world):
        B, D, G = params[0], params[1], params[2]
        P, mp = params[5], params[8]
        # Worst case: every token reads a full-length sequence; the real number follows the lengths.
        return B * G * D * elem_bytes[0] + 2 * B * mp * P * D * elem_bytes[1] + 2 * B * 4, B * G * D * elem_bytes[6]


KIND = PagedAttention()

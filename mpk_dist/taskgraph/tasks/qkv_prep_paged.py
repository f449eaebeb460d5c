"""qkv_prep_paged: qkv_prep over a ragged batch whose KV cache is a page pool (docs/SERVING.md).

One tile per q head or kv head, as qkv_prep. A q tile writes q for every token. A kv tile writes
k and v of token b at its position's page row (``tasks/paged.py`` addressing) when SLOTS[b] >= 0;
padding tokens (slot -1) write nothing. Norm and rope as qkv_prep (torch_ops.qkv_prep_paged).
"""

from __future__ import annotations

import numpy as np
import torch

from mpk_dist.backends import torch_ops as T
from mpk_dist.errors import InputError
from mpk_dist.taskgraph.tasks.base import Access, ArgSpec, ParamSpec, TaskKind, TileContext, rect, view2d
from mpk_dist.taskgraph.tasks.paged import PAGE_PARAMS, page_rows, table_reads, token_inputs


class QkvPrepPaged(TaskKind):
    """Norm + rope of one q head, or norm + rope + paged cache append of one kv head."""

    name = "qkv_prep_paged"
    opcode = 14
    doc = "q head: q = rope(norm(qkv[:, head])); kv head: pool[page(slot[b], pos[b]), pos[b] % P] = rope(norm(k)), v"
    args = (
        ArgSpec("QKV", "r", "[N, (Hq+2Hkv)D]; offset = first column of this head (q head or k head)"),
        ArgSpec("POSITIONS", "r", "i32 [N]"),
        ArgSpec("SLOTS", "r", "i32 [N] page-table row of each token; -1 = padding"),
        ArgSpec("PAGE_TABLE", "r", "i32 [MB, MP] page ids"),
        ArgSpec("NORM_W", "r", "[D] q_norm or k_norm weight; NULL when the model has no q/k norm", optional=True),
        ArgSpec("INV_FREQ", "r", "f32 [D/2] rope inverse frequencies (constant buffer)"),
        ArgSpec("DST", "w", "q tile: [N, Hq D] at this head's column; kv tile: k pool [NP, P, Hkv, D] at head h"),
        ArgSpec("DST_V", "w", "kv tile: v pool [NP, P, Hkv, D] at head h; NULL for q tiles", optional=True),
    )
    params = (
        ParamSpec("BATCH", "N, tokens in the pass"),
        ParamSpec("HEAD_DIM", "D"),
        ParamSpec("QKV_STRIDE", "elements between rows of qkv ((Hq+2Hkv)D)"),
        ParamSpec("V_OFFSET", "elements from this k head's columns to its v columns (Hkv D); 0 for q tiles"),
        ParamSpec("Q_STRIDE", "q tiles: elements between rows of DST (Hq D); kv tiles: 0"),
        ParamSpec("IS_KV", "0: q head, 1: kv head"),
        ParamSpec("EPS", "q/k norm epsilon", is_float=True),
        *PAGE_PARAMS,
    )

    def _dst(self, t: TileContext, name: str, pos: list[int], slots: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """(token rows written, flat destination indices [rows * D])."""
        D = t.p("HEAD_DIM")
        if not t.p("IS_KV"):
            rows = np.arange(t.p("BATCH"))
            return rows, (t.off(name) + rows[:, None] * t.p("Q_STRIDE") + np.arange(D)).reshape(-1)
        rows = np.array([b for b, s in enumerate(slots) if s >= 0], dtype=np.int64)
        idx = [t.off(name) + page_rows(t, slots[b], np.array([pos[b]]))[0] + np.arange(D) for b in rows]
        return rows, (np.concatenate(idx) if idx else np.zeros(0, np.int64))

    def _dst_declared(self, t: TileContext, name: str, pos: list[int], slots: list[int]) -> np.ndarray:
        """``_dst``'s indices for ``accesses``; none when a page is bad (run_tile raises) or not yet
        written by page_alloc, so the race checker first sees the unordered page-table read."""
        try:
            return self._dst(t, name, pos, slots)[1]
        except InputError:
            return np.zeros(0, np.int64)

    def run_tile(self, t: TileContext) -> None:
        B, D, st = t.p("BATCH"), t.p("HEAD_DIM"), t.p("QKV_STRIDE")
        pos, slots = token_inputs(t)
        x = view2d(t.buf("QKV"), t.off("QKV"), B, D, st)[:, None, :]  # [N, 1 head, D]
        norm = t.buf("NORM_W")
        if norm is not None:
            x = T.rms_norm(x, norm[t.off("NORM_W"): t.off("NORM_W") + D], t.f("EPS"))
        inv = t.buf("INV_FREQ")[t.off("INV_FREQ"): t.off("INV_FREQ") + D // 2]
        x = T.apply_rope(x, torch.tensor(pos, dtype=torch.int32), inv)[:, 0]  # [N, D]
        rows, idx = self._dst(t, "DST", pos, slots)
        sel = torch.from_numpy(rows)
        dst = t.buf("DST")
        dst[torch.from_numpy(idx)] = x[sel].reshape(-1).to(dst.dtype)
        if t.p("IS_KV"):
            v = view2d(t.buf("QKV"), t.off("QKV") + t.p("V_OFFSET"), B, D, st)
            dv = t.buf("DST_V")
            dv[torch.from_numpy(self._dst(t, "DST_V", pos, slots)[1])] = v[sel].reshape(-1).to(dv.dtype)

    def accesses(self, t: TileContext) -> list[Access]:
        B, D, st = t.p("BATCH"), t.p("HEAD_DIM"), t.p("QKV_STRIDE")
        pos, slots = token_inputs(t)
        ar = np.arange(B)
        out = [Access(0, "r", rect(t.off("QKV"), B, D, st)), Access(1, "r", t.off("POSITIONS") + ar),
               Access(2, "r", t.off("SLOTS") + ar), Access(5, "r", t.off("INV_FREQ") + np.arange(D // 2)),
               Access(6, "w", self._dst_declared(t, "DST", pos, slots))]
        if t.buf("NORM_W") is not None:
            out.append(Access(4, "r", t.off("NORM_W") + np.arange(D)))
        if t.p("IS_KV"):
            out.append(Access(0, "r", rect(t.off("QKV") + t.p("V_OFFSET"), B, D, st)))
            out.append(Access(7, "w", self._dst_declared(t, "DST_V", pos, slots)))
            out.append(Access(3, "r", table_reads(t, pos, slots, prefix=False)))
        return out

    def traffic(self, counts, elem_bytes, params, world):
        B, D, is_kv = params[0], params[1], params[5]
        n = B * D * (2 if is_kv else 1)
        return n * elem_bytes[0] + 2 * B * 4 + D * (elem_bytes[4] + 2), n * elem_bytes[6]


KIND = QkvPrepPaged()

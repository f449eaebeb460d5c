"""qkv_prep: one attention head per tile: optional per-head RMSNorm, rope, and for KV heads the
KV-cache append.

A q tile (IS_KV = 0) reads its head's columns of qkv and writes q. A kv tile (IS_KV = 1) reads the
k columns (and the v columns V_OFFSET further), normalises and ropes k, and writes k and v at
position pos[b] of the caches. Rope uses the INV_FREQ constant buffer ([HEAD_DIM/2] fp32, computed
at compile time from the model's rope parameters); cos/sin are evaluated in fp32 and cast to the
activation dtype (HF convention, mpk_dist.backends.torch_ops.apply_rope).
"""

from __future__ import annotations

import numpy as np

from mpk_dist.backends import torch_ops as T
from mpk_dist.errors import InputError
from mpk_dist.taskgraph.tasks.base import Access, ArgSpec, ParamSpec, TaskKind, TileContext, rect, view2d


class QkvPrep(TaskKind):
    """Norm + rope of one q head, or norm + rope + cache append of one kv head."""

    name = "qkv_prep"
    opcode = 4
    doc = "q head: q = rope(norm(qkv[:, head])); kv head: cache[b, pos[b]] = rope(norm(k)), v"
    args = (
        ArgSpec("QKV", "r", "[B, (Hq+2Hkv)D]; offset = first column of this head (q head or k head)"),
        ArgSpec("POSITIONS", "r", "i32 [B]"),
        ArgSpec("NORM_W", "r", "[D] q_norm or k_norm weight; NULL when the model has no q/k norm", optional=True),
        ArgSpec("INV_FREQ", "r", "f32 [D/2] rope inverse frequencies (constant buffer)"),
        ArgSpec("DST", "w", "q tile: [B, Hq D] at this head's column; kv tile: k_cache [B, S, Hkv, D] at head h"),
        ArgSpec("DST_V", "w", "kv tile: v_cache [B, S, Hkv, D] at head h; NULL for q tiles", optional=True),
    )
    params = (
        ParamSpec("BATCH", "B"),
        ParamSpec("HEAD_DIM", "D"),
        ParamSpec("QKV_STRIDE", "elements between rows of qkv ((Hq+2Hkv)D)"),
        ParamSpec("V_OFFSET", "elements from this k head's columns to its v columns (Hkv D); 0 for q tiles"),
        ParamSpec("DST_BATCH_STRIDE", "elements between sequences of DST (q: Hq D; cache: S Hkv D)"),
        ParamSpec("DST_POS_STRIDE", "elements between positions of DST (q: 0; cache: Hkv D)"),
        ParamSpec("MAX_SEQ", "S, positions the cache holds (q tiles: 1)"),
        ParamSpec("IS_KV", "0: q head, 1: kv head"),
        ParamSpec("EPS", "q/k norm epsilon", is_float=True),
    )

    def _positions(self, t: TileContext):
        B = t.p("BATCH")
        pos = t.buf("POSITIONS")[t.off("POSITIONS"): t.off("POSITIONS") + B]
        if t.p("IS_KV") and (int(pos.max()) >= t.p("MAX_SEQ") or int(pos.min()) < 0):
            raise InputError(f"position: expected 0 <= pos < {t.p('MAX_SEQ')} (max_seq_len), got {pos.tolist()}")
        return pos

    def _dst_index(self, t: TileContext, name: str, pos) -> np.ndarray:
        D, bs, ps = t.p("HEAD_DIM"), t.p("DST_BATCH_STRIDE"), t.p("DST_POS_STRIDE")
        return np.concatenate([t.off(name) + b * bs + int(p) * ps + np.arange(D) for b, p in enumerate(pos.tolist())])

    def run_tile(self, t: TileContext) -> None:
        B, D, st = t.p("BATCH"), t.p("HEAD_DIM"), t.p("QKV_STRIDE")
        pos = self._positions(t)
        x = view2d(t.buf("QKV"), t.off("QKV"), B, D, st)[:, None, :]  # [B, 1 head, D]
        norm = t.buf("NORM_W")
        if norm is not None:
            x = T.rms_norm(x, norm[t.off("NORM_W"): t.off("NORM_W") + D], t.f("EPS"))
        inv = t.buf("INV_FREQ")[t.off("INV_FREQ"): t.off("INV_FREQ") + D // 2]
        x = T.apply_rope(x, pos, inv)[:, 0]  # [B, D]
        dst = t.buf("DST")
        dst[self._dst_index(t, "DST", pos)] = x.reshape(-1).to(dst.dtype)
        if t.p("IS_KV"):
            v = view2d(t.buf("QKV"), t.off("QKV") + t.p("V_OFFSET"), B, D, st)
            dv = t.buf("DST_V")
            dv[self._dst_index(t, "DST_V", pos)] = v.reshape(-1).to(dv.dtype)

    def accesses(self, t: TileContext) -> list[Access]:
        B, D, st = t.p("BATCH"), t.p("HEAD_DIM"), t.p("QKV_STRIDE")
        pos = self._positions(t)
        out = [Access(0, "r", rect(t.off("QKV"), B, D, st)), Access(1, "r", t.off("POSITIONS") + np.arange(B)),
               Access(3, "r", t.off("INV_FREQ") + np.arange(D // 2)), Access(4, "w", self._dst_index(t, "DST", pos))]
        if t.buf("NORM_W") is not None:
            out.append(Access(2, "r", t.off("NORM_W") + np.arange(D)))
        if t.p("IS_KV"):
            out.append(Access(0, "r", rect(t.off("QKV") + t.p("V_OFFSET"), B, D, st)))
            out.append(Access(5, "w", self._dst_index(t, "DST_V", pos)))
        return out

    def traffic(self, counts, elem_bytes, params, world):
        B, D, is_kv = params[0], params[1], params[7]
        n = B * D * (2 if is_kv else 1)
        return n * elem_bytes[0] + B * 4 + D * (elem_bytes[2] + 2), n * elem_bytes[4]


KIND = QkvPrep()

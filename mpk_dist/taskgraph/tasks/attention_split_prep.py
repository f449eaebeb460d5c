"""attention_split_prep: qkv_prep's work folded into the split-KV attention tiles (fusion 'attn_prep' in a
split-KV program).

Tile (kv head j, KV range i) covers all B sequences, as attention_split's tile does. For each sequence b:

1. the q heads j*GROUP .. (j+1)*GROUP-1: q = rope(norm(q head)) at pos[b], kept in the tile (shared memory
   on the GPU), not written to a q buffer: every range of head j needs the same q, and each computes it;
2. only the tile whose range holds pos[b]: k = rope(norm(k head j)) -> K_CACHE at pos[b], v -> V_CACHE;
   the other ranges read rows below pos[b] only, written by earlier steps;
3. a block barrier, then exactly attention_split's partial for (b, range i): fp32 acc, max, sum-exp over
   [s0, min(s1, pos[b] + 1)) -> OUT.

Same arithmetic and rounding points as qkv_prep + attention_split (the CPU reference below runs their
``run_tile`` on one-sequence sub-tiles; csrc/tasks/attention_split_prep.cuh calls their device functions),
so the merge sees the unfused program's partials. One dependent level less per layer: the split tiles
wait on the qkv_proj tiles of their head's columns instead of on the qkv_prep level.

Addressing: QKV's offset is row 0's first column of query head j*GROUP (rows QKV_STRIDE apart); the k head
is K_OFFSET further and the v head V_OFFSET after that. K_CACHE / V_CACHE at sequence 0, position 0, kv
head j; OUT at the (j, b=0, range i, g=0) entry of attention_split's scratch.

With TICKET and MERGED (fusion 'attn_merge') the last range of head j to finish merges the head, as
attention_split's tiles do (its module docstring); the merged rows are (QKV_STRIDE - 2 V_OFFSET) = Hq D apart.
"""

from __future__ import annotations

import numpy as np
import torch

from mpk_dist.errors import InputError
from mpk_dist.taskgraph.tasks import attention_split as _split
from mpk_dist.taskgraph.tasks import qkv_prep as _qkv_prep
from mpk_dist.taskgraph.tasks.base import Access, ArgSpec, ParamSpec, TaskKind, TileContext, rect, sub_tile


class AttentionSplitPrep(TaskKind):
    """q/k norm + rope (+ the KV append in the range holding the position), then one KV range's partial."""

    name = "attention_split_prep"
    opcode = 26
    doc = ("per (kv head j, KV range i): q heads of group j normed and roped in the tile, k/v of head j appended "
           "by the range holding pos[b], then attention_split's partial of (b, range i)")
    args = (
        ArgSpec("QKV", "r", "[B, (Hq+2Hkv)D]; offset = row 0, first column of query head j*GROUP"),
        ArgSpec("POSITIONS", "r", "i32 [B]"),
        ArgSpec("Q_NORM_W", "r", "[D] q_norm weight; NULL when the model has no q/k norm", optional=True),
        ArgSpec("K_NORM_W", "r", "[D] k_norm weight; NULL when the model has no q/k norm", optional=True),
        ArgSpec("INV_FREQ", "r", "f32 [D/2] rope inverse frequencies (constant buffer)"),
        ArgSpec("K_CACHE", "rw", "[B, S, Hkv, D]; offset = sequence 0, position 0, head j"),
        ArgSpec("V_CACHE", "rw", "[B, S, Hkv, D]; offset as K_CACHE"),
        ArgSpec("OUT", "w", "f32 [Hkv, B, SPLITS, GROUP, D+2]; offset = entry (j, 0, range i, 0)"),
        ArgSpec("TICKET", "rw", _split.TICKET_DOC, optional=True),
        ArgSpec("MERGED", "w", _split.MERGED_DOC, optional=True),
        ArgSpec("MERGED_FLAGS", "w", _split.MERGED_FLAGS_DOC, optional=True),
    )
    params = (
        ParamSpec("BATCH", "B"),
        ParamSpec("HEAD_DIM", "D"),
        ParamSpec("GROUP", "query heads per kv head (Hq / Hkv)"),
        ParamSpec("QKV_STRIDE", "elements between rows of QKV ((Hq+2Hkv)D)"),
        ParamSpec("K_OFFSET", "elements from QKV's offset to the k head's columns ((Hq + j - j*GROUP) D)"),
        ParamSpec("V_OFFSET", "elements from the k head's columns to its v columns (Hkv D)"),
        ParamSpec("KV_POS_STRIDE", "elements between cache positions (Hkv D)"),
        ParamSpec("KV_BATCH_STRIDE", "elements between cache sequences (S Hkv D)"),
        ParamSpec("MAX_SEQ", "S, positions the cache holds"),
        ParamSpec("POS_BEGIN", "s0: first cache position of the range"),
        ParamSpec("POS_END", "s1: one past the last cache position of the range"),
        ParamSpec("OUT_STRIDE", "elements between sequences in OUT (SPLITS GROUP (D+2))"),
        ParamSpec("EPS", "q/k norm epsilon", is_float=True),
        ParamSpec("SCALE", "softmax scale (D^-0.5)", is_float=True),
        ParamSpec("SPLIT_INDEX", _split.SPLIT_INDEX_DOC),
    )

    def _merged_stride(self, t: TileContext) -> int:
        return t.p("QKV_STRIDE") - 2 * t.p("V_OFFSET")

    def ticket(self, t: TileContext) -> tuple[str, int] | None:
        return _split.merge_last_ticket(t)

    def run_last(self, t: TileContext) -> None:
        _split.run_merge_last(t, self._merged_stride(t))

    def last_accesses(self, t: TileContext) -> list[Access]:
        return _split.merge_last_accesses(t, self._merged_stride(t), self.arg_index("OUT"), self.arg_index("MERGED"))

    def _positions(self, t: TileContext) -> list[int]:
        B, S = t.p("BATCH"), t.p("MAX_SEQ")
        pos = t.buf("POSITIONS")[t.off("POSITIONS"): t.off("POSITIONS") + B].tolist()
        for p in pos:
            if not 0 <= p < S:
                raise InputError(f"position: expected 0 <= pos < {S} (max_seq_len), got {pos}")
        return pos

    def _owns(self, t: TileContext, p: int) -> bool:
        """Whether this range holds position p (its tile appends that position's k and v)."""
        return t.p("POS_BEGIN") <= p < t.p("POS_END")

    def run_tile(self, t: TileContext) -> None:
        D, G, S = t.p("HEAD_DIM"), t.p("GROUP"), t.p("MAX_SEQ")
        qs, kps, kbs = t.p("QKV_STRIDE"), t.p("KV_POS_STRIDE"), t.p("KV_BATCH_STRIDE")
        qkv, pos_buf = t.buf("QKV"), t.buf("POSITIONS")
        arg = lambda name, extra=0: None if t.buf(name) is None else (t.buf(name), t.off(name) + extra)  # noqa: E731
        common = {"BATCH": 1, "HEAD_DIM": D, "QKV_STRIDE": 0, "EPS": t.f("EPS")}
        prep = _qkv_prep.KIND
        for b, p in enumerate(self._positions(t)):
            row = t.off("QKV") + b * qs
            pos_b = (pos_buf, t.off("POSITIONS") + b)
            q = torch.empty(G * D, dtype=qkv.dtype)  # the tile's q (shared memory on the GPU)
            for g in range(G):
                prep.run_tile(sub_tile(t, prep, {"QKV": (qkv, row + g * D), "POSITIONS": pos_b,
                                                  "NORM_W": arg("Q_NORM_W"), "INV_FREQ": arg("INV_FREQ"),
                                                  "DST": (q, g * D), "DST_V": None},
                                        {**common, "V_OFFSET": 0, "DST_BATCH_STRIDE": G * D, "DST_POS_STRIDE": 0,
                                         "MAX_SEQ": 1, "IS_KV": 0}))
            if self._owns(t, p):
                prep.run_tile(sub_tile(t, prep, {"QKV": (qkv, row + t.p("K_OFFSET")), "POSITIONS": pos_b,
                                                  "NORM_W": arg("K_NORM_W"), "INV_FREQ": arg("INV_FREQ"),
                                                  "DST": arg("K_CACHE", b * kbs), "DST_V": arg("V_CACHE", b * kbs)},
                                        {**common, "V_OFFSET": t.p("V_OFFSET"), "DST_BATCH_STRIDE": S * kps,
                                         "DST_POS_STRIDE": kps, "MAX_SEQ": S, "IS_KV": 1}))
            sp = _split.KIND
            sp.run_tile(sub_tile(t, sp, {"Q": (q, 0), "K_CACHE": arg("K_CACHE", b * kbs),
                                          "V_CACHE": arg("V_CACHE", b * kbs), "POSITIONS": pos_b,
                                          "OUT": arg("OUT", b * t.p("OUT_STRIDE"))},
                                  {"BATCH": 1, "HEAD_DIM": D, "GROUP": G, "Q_STRIDE": G * D, "KV_POS_STRIDE": kps,
                                   "KV_BATCH_STRIDE": kbs, "POS_BEGIN": t.p("POS_BEGIN"), "POS_END": t.p("POS_END"),
                                   "OUT_STRIDE": t.p("OUT_STRIDE"), "SCALE": t.f("SCALE"),
                                   "SPLIT_INDEX": t.p("SPLIT_INDEX")}))

    def accesses(self, t: TileContext) -> list[Access]:
        B, D, G, qs = t.p("BATCH"), t.p("HEAD_DIM"), t.p("GROUP"), t.p("QKV_STRIDE")
        kps, kbs, s0, s1 = t.p("KV_POS_STRIDE"), t.p("KV_BATCH_STRIDE"), t.p("POS_BEGIN"), t.p("POS_END")
        pos = self._positions(t)
        q0, k0 = t.off("QKV"), t.off("QKV") + t.p("K_OFFSET")
        out = [Access(0, "r", rect(q0, B, G * D, qs)), Access(1, "r", t.off("POSITIONS") + np.arange(B)),
               Access(4, "r", t.off("INV_FREQ") + np.arange(D // 2)),
               Access(7, "w", rect(t.off("OUT"), B, G * (D + 2), t.p("OUT_STRIDE")))]
        for i, name in ((2, "Q_NORM_W"), (3, "K_NORM_W")):
            if t.buf(name) is not None:
                out.append(Access(i, "r", t.off(name) + np.arange(D)))
        for b, p in enumerate(pos):
            if self._owns(t, p):  # the append: k and v columns of row b, the cache row at p
                out += [Access(0, "r", k0 + b * qs + np.arange(D)), Access(0, "r", k0 + t.p("V_OFFSET") + b * qs
                                                                         + np.arange(D))]
                out += [Access(i, "w", t.off(n) + b * kbs + p * kps + np.arange(D))
                        for i, n in ((5, "K_CACHE"), (6, "V_CACHE"))]
            e = min(s1, p + 1)
            out += [Access(i, "r", t.off(n) + b * kbs + rect(s0 * kps, max(0, e - s0), D, kps))
                    for i, n in ((5, "K_CACHE"), (6, "V_CACHE"))]
        return out

    def traffic(self, counts, elem_bytes, params, world):
        B, D, G = params[0], params[1], params[2]
        n = params[10] - params[9]
        norms = D * (elem_bytes[2] + elem_bytes[3])
        # Worst case: this range appends for every sequence and the whole range is below every position.
        rd = B * (G + 2) * D * elem_bytes[0] + B * 4 + norms + D // 2 * 4 + 2 * B * n * D * elem_bytes[5]
        wr = 2 * B * D * elem_bytes[5] + B * G * (D + 2) * elem_bytes[7]
        return rd, wr


KIND = AttentionSplitPrep()

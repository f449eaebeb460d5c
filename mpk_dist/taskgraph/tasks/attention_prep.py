"""attention_prep: qkv_prep's work for one (kv head j, sequence b), then that pair's attention.

Fused kind (opt-in: ``compile_rank_programs(fuse=[..., 'attn_prep'])``, ``mpk_dist.taskgraph.fusion``):
one tile does, for sequence b only,

1. what qkv_prep's kv tile j does: k = rope(norm(k head j)) -> K_CACHE at pos[b], v -> V_CACHE at pos[b];
2. what qkv_prep's q tiles j*GROUP .. (j+1)*GROUP-1 do: q = rope(norm(q head)) -> the Q rows attention reads;
3. a block barrier, then exactly what the attention tile (j, b) computes: softmax(q k^T * SCALE) v over
   positions 0..pos[b] -> OUT.

Same arithmetic and rounding points as the two unfused kinds: the CPU reference below runs their
``run_tile`` on one-sequence sub-tiles, and csrc/tasks/attention_prep.cuh calls their device functions
(qkv_prep.cuh's ``qk_norm_rope`` hook, attention.cuh's ``attention_seq``).

Addressing: QKV's offset is row b's first column of query head j*GROUP; the k head is K_OFFSET further
and the v head V_OFFSET after that. Q and OUT start at row b, query head j*GROUP (GROUP*D elements);
K_CACHE and V_CACHE at sequence b, position 0, kv head j (position p at + p*KV_POS_STRIDE).
"""

from __future__ import annotations

import numpy as np

from mpk_dist.errors import InputError
from mpk_dist.taskgraph.tasks import attention as _attention
from mpk_dist.taskgraph.tasks import qkv_prep as _qkv_prep
from mpk_dist.taskgraph.tasks.base import Access, ArgSpec, ParamSpec, TaskKind, TileContext, rect, sub_tile


class AttentionPrep(TaskKind):
    """q/k norm + rope + KV append of one (kv head, sequence), then its GROUP heads' attention."""

    name = "attention_prep"
    opcode = 24
    doc = ("per (kv head j, sequence b): qkv_prep of k/v head j and q heads of group j at pos[b], "
           "then attention of (j, b)")
    args = (
        ArgSpec("QKV", "r", "[B, (Hq+2Hkv)D]; offset = row b, first column of query head j*GROUP"),
        ArgSpec("POSITIONS", "r", "i32 [B]; offset = b (one element)"),
        ArgSpec("Q_NORM_W", "r", "[D] q_norm weight; NULL when the model has no q/k norm", optional=True),
        ArgSpec("K_NORM_W", "r", "[D] k_norm weight; NULL when the model has no q/k norm", optional=True),
        ArgSpec("INV_FREQ", "r", "f32 [D/2] rope inverse frequencies (constant buffer)"),
        ArgSpec("Q", "rw", "[B, Hq D]; offset = row b, query head j*GROUP: written (roped q), then read"),
        ArgSpec("K_CACHE", "rw", "[B, S, Hkv, D]; offset = sequence b, position 0, head j"),
        ArgSpec("V_CACHE", "rw", "[B, S, Hkv, D]; offset as K_CACHE"),
        ArgSpec("OUT", "w", "[B, Hq D]; offset as Q"),
    )
    params = (
        ParamSpec("HEAD_DIM", "D"),
        ParamSpec("GROUP", "query heads per kv head (Hq / Hkv)"),
        ParamSpec("K_OFFSET", "elements from QKV's offset to the k head's columns ((Hq + j - j*GROUP) D)"),
        ParamSpec("V_OFFSET", "elements from the k head's columns to its v columns (Hkv D)"),
        ParamSpec("KV_POS_STRIDE", "elements between cache positions (Hkv D)"),
        ParamSpec("MAX_SEQ", "S, positions the cache holds"),
        ParamSpec("EPS", "q/k norm epsilon", is_float=True),
        ParamSpec("SCALE", "softmax scale (D^-0.5)", is_float=True),
    )

    def _pos(self, t: TileContext) -> int:
        p = int(t.buf("POSITIONS")[t.off("POSITIONS")])
        if not 0 <= p < t.p("MAX_SEQ"):
            raise InputError(f"position: expected 0 <= pos < {t.p('MAX_SEQ')} (max_seq_len), got {p}")
        return p

    def _sub(self, t: TileContext, kind: TaskKind, args: dict, params: dict) -> TileContext:
        """A one-sequence tile of another kind over this tile's buffers (name -> (my arg, extra offset))."""
        mine = {k: None if v is None else (t.buf(v[0]), t.off(v[0]) + v[1]) for k, v in args.items()}
        return sub_tile(t, kind, mine, params)

    def run_tile(self, t: TileContext) -> None:
        D, G, S, kps = t.p("HEAD_DIM"), t.p("GROUP"), t.p("MAX_SEQ"), t.p("KV_POS_STRIDE")
        self._pos(t)
        qn = None if t.buf("Q_NORM_W") is None else ("Q_NORM_W", 0)
        kn = None if t.buf("K_NORM_W") is None else ("K_NORM_W", 0)
        common = {"BATCH": 1, "HEAD_DIM": D, "QKV_STRIDE": 0, "EPS": t.f("EPS")}
        prep = _qkv_prep.KIND
        # the kv head, then the q heads: they write disjoint elements, so the order is immaterial
        prep.run_tile(self._sub(t, prep, {"QKV": ("QKV", t.p("K_OFFSET")), "POSITIONS": ("POSITIONS", 0),
                                          "NORM_W": kn, "INV_FREQ": ("INV_FREQ", 0), "DST": ("K_CACHE", 0),
                                          "DST_V": ("V_CACHE", 0)},
                                {**common, "V_OFFSET": t.p("V_OFFSET"), "DST_BATCH_STRIDE": S * kps,
                                 "DST_POS_STRIDE": kps, "MAX_SEQ": S, "IS_KV": 1}))
        for g in range(G):
            prep.run_tile(self._sub(t, prep, {"QKV": ("QKV", g * D), "POSITIONS": ("POSITIONS", 0), "NORM_W": qn,
                                              "INV_FREQ": ("INV_FREQ", 0), "DST": ("Q", g * D), "DST_V": None},
                                    {**common, "V_OFFSET": 0, "DST_BATCH_STRIDE": G * D, "DST_POS_STRIDE": 0,
                                     "MAX_SEQ": 1, "IS_KV": 0}))
        att = _attention.KIND
        att.run_tile(self._sub(t, att, {"Q": ("Q", 0), "K_CACHE": ("K_CACHE", 0), "V_CACHE": ("V_CACHE", 0),
                                        "POSITIONS": ("POSITIONS", 0), "OUT": ("OUT", 0)},
                               {"BATCH": 1, "HEAD_DIM": D, "GROUP": G, "Q_STRIDE": G * D, "KV_POS_STRIDE": kps,
                                "KV_BATCH_STRIDE": S * kps, "MAX_SEQ": S, "SCALE": t.f("SCALE")}))

    def accesses(self, t: TileContext) -> list[Access]:
        D, G, kps = t.p("HEAD_DIM"), t.p("GROUP"), t.p("KV_POS_STRIDE")
        p = self._pos(t)
        q0, k0 = t.off("QKV"), t.off("QKV") + t.p("K_OFFSET")
        qrow = t.off("Q") + np.arange(G * D)
        out = [Access(0, "r", q0 + np.arange(G * D)), Access(0, "r", k0 + np.arange(D)),
               Access(0, "r", k0 + t.p("V_OFFSET") + np.arange(D)),
               Access(1, "r", t.off("POSITIONS") + np.arange(1)),
               Access(4, "r", t.off("INV_FREQ") + np.arange(D // 2)),
               Access(5, "w", qrow), Access(5, "r", qrow)]
        for i, name in ((2, "Q_NORM_W"), (3, "K_NORM_W")):
            if t.buf(name) is not None:
                out.append(Access(i, "r", t.off(name) + np.arange(D)))
        for i, name in ((6, "K_CACHE"), (7, "V_CACHE")):
            out.append(Access(i, "w", t.off(name) + p * kps + np.arange(D)))
            out.append(Access(i, "r", t.off(name) + rect(0, p + 1, D, kps)))
        out.append(Access(8, "w", t.off("OUT") + np.arange(G * D)))
        return out

    def traffic(self, counts, elem_bytes, params, world):
        D, G, S = params[0], params[1], params[5]
        norms = D * (elem_bytes[2] + elem_bytes[3])
        # Worst case for the cache (every position live), as attention's; Q is written and read back.
        rd = (G + 2) * D * elem_bytes[0] + 4 + norms + D // 2 * 4 + G * D * elem_bytes[5] + 2 * S * D * elem_bytes[6]
        wr = G * D * elem_bytes[5] + 2 * D * elem_bytes[6] + G * D * elem_bytes[8]
        return rd, wr


KIND = AttentionPrep()

"""attention: decode attention of the GROUP query heads that share one KV head, all B sequences.

Sequence b attends over cache positions 0..pos[b] (inclusive); scores and softmax in fp32, output
cast to the activation dtype (mpk_dist.backends.torch_ops.attention).
"""

from __future__ import annotations

import numpy as np
import torch

from mpk_dist.taskgraph.tasks.base import Access, ArgSpec, ParamSpec, TaskKind, TileContext, rect, view2d


class Attention(TaskKind):
    """o[b, heads of kv head h] = softmax(q k^T * SCALE) v over positions 0..pos[b]."""

    name = "attention"
    opcode = 5
    doc = "per kv head h: o[b, g] = softmax(q[b, g] . k[b, 0..pos[b], h] * SCALE) v[b, 0..pos[b], h]"
    args = (
        ArgSpec("Q", "r", "[B, Hq D]; offset = first column of query head h*GROUP"),
        ArgSpec("K_CACHE", "r", "[B, S, Hkv, D]; offset = head h of position 0 of sequence 0"),
        ArgSpec("V_CACHE", "r", "[B, S, Hkv, D]; offset as K_CACHE"),
        ArgSpec("POSITIONS", "r", "i32 [B]"),
        ArgSpec("OUT", "w", "[B, Hq D]; offset as Q"),
    )
    params = (
        ParamSpec("BATCH", "B"),
        ParamSpec("HEAD_DIM", "D"),
        ParamSpec("GROUP", "query heads per kv head (Hq / Hkv)"),
        ParamSpec("Q_STRIDE", "elements between rows of Q and OUT (Hq D)"),
        ParamSpec("KV_POS_STRIDE", "elements between cache positions (Hkv D)"),
        ParamSpec("KV_BATCH_STRIDE", "elements between cache sequences (S Hkv D)"),
        ParamSpec("MAX_SEQ", "S"),
        ParamSpec("SCALE", "softmax scale (D^-0.5)", is_float=True),
    )

    def _pos(self, t: TileContext) -> list[int]:
        B = t.p("BATCH")
        return t.buf("POSITIONS")[t.off("POSITIONS"): t.off("POSITIONS") + B].tolist()

    def run_tile(self, t: TileContext) -> None:
        B, D, G, qs = t.p("BATCH"), t.p("HEAD_DIM"), t.p("GROUP"), t.p("Q_STRIDE")
        kps, kbs = t.p("KV_POS_STRIDE"), t.p("KV_BATCH_STRIDE")
        q = view2d(t.buf("Q"), t.off("Q"), B, G * D, qs)
        out = view2d(t.buf("OUT"), t.off("OUT"), B, G * D, qs)
        for b, p in enumerate(self._pos(t)):
            k = view2d(t.buf("K_CACHE"), t.off("K_CACHE") + b * kbs, p + 1, D, kps).float()  # [p+1, D]
            v = view2d(t.buf("V_CACHE"), t.off("V_CACHE") + b * kbs, p + 1, D, kps).float()
            qb = q[b].reshape(G, D).float()
            probs = torch.softmax(torch.matmul(qb, k.t()) * t.f("SCALE"), dim=-1)  # [G, p+1]
            out[b].copy_(torch.matmul(probs, v).reshape(-1))

    def accesses(self, t: TileContext) -> list[Access]:
        B, D, G, qs = t.p("BATCH"), t.p("HEAD_DIM"), t.p("GROUP"), t.p("Q_STRIDE")
        kps, kbs = t.p("KV_POS_STRIDE"), t.p("KV_BATCH_STRIDE")
        kv = [rect(b * kbs, p + 1, D, kps) for b, p in enumerate(self._pos(t))]
        return [Access(0, "r", rect(t.off("Q"), B, G * D, qs)),
                Access(1, "r", t.off("K_CACHE") + np.concatenate(kv)),
                Access(2, "r", t.off("V_CACHE") + np.concatenate(kv)),
                Access(3, "r", t.off("POSITIONS") + np.arange(B)),
                Access(4, "w", rect(t.off("OUT"), B, G * D, qs))]

    def traffic(self, counts, elem_bytes, params, world):
        B, D, G, S = params[0], params[1], params[2], params[6]
        # Worst case (full cache); the real number grows with the position.
        return B * G * D * elem_bytes[0] + 2 * B * S * D * elem_bytes[1] + B * 4, B * G * D * elem_bytes[4]


KIND = Attention()

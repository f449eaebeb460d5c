"""attention_merge: combine the KV-range partials of ``attention_split`` into the attention output.

One tile per (kv head h, sequence b): for each of the GROUP query heads g, with the SPLITS partials
(acc_i, m_i, l_i) of (h, b, g) (log-sum-exp rule, all fp32):

    M = max_i m_i,  w_i = exp(m_i - M),  o[d] = sum_i w_i acc_i[d] / sum_i w_i l_i

Splits with m_i = -inf (empty ranges) are skipped (weight 0; their acc is never read into the sum).
The output is rounded once to OUT's dtype, as the unsplit reference rounds softmax(..) v.
Splits are summed in index order (the CUDA body does the same), so the result is deterministic.
"""

from __future__ import annotations

import torch

from mpk_dist.taskgraph.tasks.base import Access, ArgSpec, ParamSpec, TaskKind, TileContext, rect, view2d


class AttentionMerge(TaskKind):
    """o[b, heads of kv head h] = log-sum-exp merge of the SPLITS partials of (h, b)."""

    name = "attention_merge"
    opcode = 20
    doc = "per (kv head h, sequence b): o[g] = sum_i exp(m_i - M) acc_i / sum_i exp(m_i - M) l_i, rounded once"
    args = (
        ArgSpec("PARTIAL", "r", "f32 [Hkv, B, SPLITS, GROUP, D+2]; offset = entry (h, b, 0, 0)"),
        ArgSpec("OUT", "w", "[B, Hq D]; offset = row b, first column of query head h*GROUP"),
    )
    params = (
        ParamSpec("HEAD_DIM", "D"),
        ParamSpec("GROUP", "query heads per kv head (Hq / Hkv)"),
        ParamSpec("SPLITS", "number of KV ranges"),
    )

    def run_tile(self, t: TileContext) -> None:
        D, G, P = t.p("HEAD_DIM"), t.p("GROUP"), t.p("SPLITS")
        part = view2d(t.buf("PARTIAL"), t.off("PARTIAL"), P * G, D + 2, D + 2).reshape(P, G, D + 2).float()
        M = part[:, :, D].amax(dim=0)  # [G]; a split that saw no position has m = -inf
        num, den = torch.zeros(G, D), torch.zeros(G)
        for i in range(P):  # index order, as the CUDA body
            m = part[i, :, D]
            live = torch.isfinite(m)  # empty ranges: weight 0, acc not read into the sum
            w = torch.where(live, torch.exp(m - M), torch.zeros_like(m))  # [G]
            num += w[:, None] * torch.where(live[:, None], part[i, :, :D], torch.zeros_like(part[i, :, :D]))
            den += w * torch.where(live, part[i, :, D + 1], torch.zeros_like(m))
        o = torch.where(den[:, None] > 0, num / den[:, None], torch.zeros_like(num))
        out = t.buf("OUT")
        out[t.off("OUT"): t.off("OUT") + G * D] = o.reshape(-1).to(out.dtype)

    def accesses(self, t: TileContext) -> list[Access]:
        D, G, P = t.p("HEAD_DIM"), t.p("GROUP"), t.p("SPLITS")
        return [Access(0, "r", rect(t.off("PARTIAL"), 1, P * G * (D + 2), 1)),
                Access(1, "w", rect(t.off("OUT"), 1, G * D, 1))]

    def traffic(self, counts, elem_bytes, params, world):
        D, G, P = params
        return P * G * (D + 2) * elem_bytes[0], G * D * elem_bytes[1]


KIND = AttentionMerge()

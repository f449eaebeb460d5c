"""attention_split: one KV range of decode attention for the GROUP query heads of one KV head.

Split-KV decode attention (docs/TASKGRAPH.md, "Split-KV attention"): the cache positions are cut
into ranges [s0, s1); tile (h, i) handles range i of KV head h for all B sequences and writes, per
(sequence b, query head g), the UNNORMALISED fp32 partial output and its softmax statistics

    m = max_t s_t,  l = sum_t exp(s_t - m),  acc[d] = sum_t exp(s_t - m) v[t, d]

over t in [s0, s1) ∩ [0, pos[b]] (s_t = q . k_t * SCALE, fp32). An empty range (s0 > pos[b])
writes m = -inf, l = 0, acc = 0, so it contributes nothing to ``attention_merge``.

Scratch layout (fp32, one row per (kv head, sequence)): [Hkv, B, SPLITS, GROUP, D + 2], each
(g) entry = acc[0..D), m, l. The tile's OUT offset is the (h, b=0, split i, g=0) entry.

Merge in the last tile (fusion 'attn_merge', ``lowering_attention``): with a TICKET word (one per kv head,
a 'ticket' buffer) the tile ends with an acquire-release add on it, and the tile that completes the
head's SPLITS adds runs ``attention_merge`` for every sequence of the head into MERGED (the attention
output), then resets the word: the merge level of the program disappears. SPLITS = OUT_STRIDE / (GROUP
(D + 2)); the merged rows are Q_STRIDE apart (the output has q's layout). Same sums as the merge tiles.
"""

from __future__ import annotations

import numpy as np
import torch

from mpk_dist.taskgraph.tasks import attention_merge as _merge
from mpk_dist.taskgraph.tasks.base import Access, ArgSpec, ParamSpec, TaskKind, TileContext, rect, sub_tile, view2d

TICKET_DOC = "i32 [Hkv] per-launch ticket words; offset = kv head j; NULL: a separate merge op merges"
MERGED_DOC = "[B, Hq D] attention output (with TICKET); offset = row 0, first column of query head j*GROUP"
MERGED_FLAGS_DOC = ("flagged copy of MERGED (mpk_dist.taskgraph.flag_words: one (two bf16, step tag) word per column "
                    "pair, i32 pairs); offset = MERGED's; NULL: none (kernel only, the interpreter ignores it)")
SPLIT_INDEX_DOC = "i: this tile's range (its partial is entry i of the head's SPLITS)"


def merge_last_ticket(t: TileContext) -> tuple[str, int] | None:
    """The ticket of a split tile that may merge its head (TICKET present): ('TICKET', SPLITS)."""
    if t.buf("TICKET") is None:
        return None
    return "TICKET", t.p("OUT_STRIDE") // (t.p("GROUP") * (t.p("HEAD_DIM") + 2))


def _merge_rows(t: TileContext, merged_stride: int) -> list[tuple[int, int]]:
    """(partial offset of (head, b, range 0), merged offset of row b) for every sequence b."""
    D, G = t.p("HEAD_DIM"), t.p("GROUP")
    head = t.off("OUT") - t.p("SPLIT_INDEX") * G * (D + 2)
    return [(head + b * t.p("OUT_STRIDE"), t.off("MERGED") + b * merged_stride) for b in range(t.p("BATCH"))]


def run_merge_last(t: TileContext, merged_stride: int) -> None:
    """attention_merge of the tile's kv head for every sequence, from the head's partials into MERGED."""
    D, G, P = t.p("HEAD_DIM"), t.p("GROUP"), merge_last_ticket(t)[1]
    for part, out in _merge_rows(t, merged_stride):
        _merge.KIND.run_tile(sub_tile(t, _merge.KIND, {"PARTIAL": (t.buf("OUT"), part), "OUT": (t.buf("MERGED"), out)},
                                      {"HEAD_DIM": D, "GROUP": G, "SPLITS": P}))


def merge_last_accesses(t: TileContext, merged_stride: int, out_arg: int, merged_arg: int) -> list[Access]:
    """What run_merge_last reads (every range's partial of the head) and writes (the head's output columns)."""
    D, G, P = t.p("HEAD_DIM"), t.p("GROUP"), merge_last_ticket(t)[1]
    out = []
    for part, row in _merge_rows(t, merged_stride):
        out += [Access(out_arg, "r", part + np.arange(P * G * (D + 2))), Access(merged_arg, "w", row + np.arange(G * D))]
    return out


class AttentionSplit(TaskKind):
    """Partial softmax(q k^T * SCALE) v of one KV range, with (max, sum-exp) statistics."""

    name = "attention_split"
    opcode = 19
    doc = "per (kv head h, KV range [s0, s1)): fp32 acc, max, sum-exp of each (b, g) over [s0, min(s1, pos[b] + 1))"
    args = (
        ArgSpec("Q", "r", "[B, Hq D]; offset = first column of query head h*GROUP"),
        ArgSpec("K_CACHE", "r", "[B, S, Hkv, D]; offset = head h of position 0 of sequence 0"),
        ArgSpec("V_CACHE", "r", "[B, S, Hkv, D]; offset as K_CACHE"),
        ArgSpec("POSITIONS", "r", "i32 [B]"),
        ArgSpec("OUT", "w", "f32 [Hkv, B, SPLITS, GROUP, D+2]; offset = entry (h, 0, split, 0)"),
        ArgSpec("TICKET", "rw", TICKET_DOC, optional=True),
        ArgSpec("MERGED", "w", MERGED_DOC, optional=True),
        ArgSpec("MERGED_FLAGS", "w", MERGED_FLAGS_DOC, optional=True),
    )
    params = (
        ParamSpec("BATCH", "B"),
        ParamSpec("HEAD_DIM", "D"),
        ParamSpec("GROUP", "query heads per kv head (Hq / Hkv)"),
        ParamSpec("Q_STRIDE", "elements between rows of Q (Hq D)"),
        ParamSpec("KV_POS_STRIDE", "elements between cache positions (Hkv D)"),
        ParamSpec("KV_BATCH_STRIDE", "elements between cache sequences (S Hkv D)"),
        ParamSpec("POS_BEGIN", "s0: first cache position of the range"),
        ParamSpec("POS_END", "s1: one past the last cache position of the range"),
        ParamSpec("OUT_STRIDE", "elements between sequences in OUT (SPLITS GROUP (D+2))"),
        ParamSpec("SCALE", "softmax scale (D^-0.5)", is_float=True),
        ParamSpec("SPLIT_INDEX", SPLIT_INDEX_DOC),
    )

    def ticket(self, t: TileContext) -> tuple[str, int] | None:
        return merge_last_ticket(t)

    def run_last(self, t: TileContext) -> None:
        run_merge_last(t, t.p("Q_STRIDE"))

    def last_accesses(self, t: TileContext) -> list[Access]:
        return merge_last_accesses(t, t.p("Q_STRIDE"), self.arg_index("OUT"), self.arg_index("MERGED"))

    def _pos(self, t: TileContext) -> list[int]:
        B = t.p("BATCH")
        return t.buf("POSITIONS")[t.off("POSITIONS"): t.off("POSITIONS") + B].tolist()

    def _range(self, t: TileContext, p: int) -> tuple[int, int]:
        """[s0, e) = the range clipped to positions 0..p; e <= s0 when empty."""
        s0 = t.p("POS_BEGIN")
        return s0, min(t.p("POS_END"), p + 1)

    def run_tile(self, t: TileContext) -> None:
        B, D, G, qs = t.p("BATCH"), t.p("HEAD_DIM"), t.p("GROUP"), t.p("Q_STRIDE")
        kps, kbs, os_ = t.p("KV_POS_STRIDE"), t.p("KV_BATCH_STRIDE"), t.p("OUT_STRIDE")
        q = view2d(t.buf("Q"), t.off("Q"), B, G * D, qs)
        for b, p in enumerate(self._pos(t)):
            out = view2d(t.buf("OUT"), t.off("OUT") + b * os_, G, D + 2, D + 2)  # [G, acc | m | l]
            s0, e = self._range(t, p)
            if e <= s0:  # empty range: contributes nothing to the merge
                out.zero_()
                out[:, D] = float("-inf")
                continue
            base = s0 * kps + b * kbs
            k = view2d(t.buf("K_CACHE"), t.off("K_CACHE") + base, e - s0, D, kps).float()  # [n, D]
            v = view2d(t.buf("V_CACHE"), t.off("V_CACHE") + base, e - s0, D, kps).float()
            s = torch.matmul(q[b].reshape(G, D).float(), k.t()) * t.f("SCALE")  # [G, n]
            m = s.amax(dim=-1, keepdim=True)
            e_s = torch.exp(s - m)
            out[:, :D] = torch.matmul(e_s, v).to(out.dtype)
            out[:, D] = m[:, 0].to(out.dtype)
            out[:, D + 1] = e_s.sum(-1).to(out.dtype)

    def accesses(self, t: TileContext) -> list[Access]:
        B, D, G, qs = t.p("BATCH"), t.p("HEAD_DIM"), t.p("GROUP"), t.p("Q_STRIDE")
        kps, kbs, os_ = t.p("KV_POS_STRIDE"), t.p("KV_BATCH_STRIDE"), t.p("OUT_STRIDE")
        kv = [rect(b * kbs + s0 * kps, max(0, e - s0), D, kps)
              for b, (s0, e) in enumerate(self._range(t, p) for p in self._pos(t))]
        kv_idx = np.concatenate(kv) if kv else np.zeros(0, np.int64)
        return [Access(0, "r", rect(t.off("Q"), B, G * D, qs)),
                Access(1, "r", t.off("K_CACHE") + kv_idx),
                Access(2, "r", t.off("V_CACHE") + kv_idx),
                Access(3, "r", t.off("POSITIONS") + np.arange(B)),
                Access(4, "w", rect(t.off("OUT"), B, G * (D + 2), os_))]

    def traffic(self, counts, elem_bytes, params, world):
        B, D, G = params[0], params[1], params[2]
        n = params[7] - params[6]
        # Worst case (the whole range is below every position).
        return (B * G * D * elem_bytes[0] + 2 * B * n * D * elem_bytes[1] + B * 4,
                B * G * (D + 2) * elem_bytes[4])


KIND = AttentionSplit()

"""attention_split: one KV range of decode attention for the GROUP query heads of one KV head.

Split-KV decode attention (docs/TASKGRAPH.md, "Split-KV attention"): the positions 0..pos[b] a sequence
has in the cache are cut into SPLITS ranges of equal length at run time (``split_range``: range i is
[i per, min((i + 1) per, pos[b] + 1)) with per = ceil((pos[b] + 1) / SPLITS)); tile (h, i) handles range i
of KV head h for all B sequences and writes, per (sequence b, query head g), the UNNORMALISED fp32 partial
output and its softmax statistics

    m = max_t s_t,  l = sum_t exp(s_t - m),  acc[d] = sum_t exp(s_t - m) v[t, d]

over t in its range (s_t = q . k_t * SCALE, fp32). An empty range (i per > pos[b]: only when
pos[b] + 1 < SPLITS) writes m = -inf, l = 0, acc = 0, so it contributes nothing to ``attention_merge``.
Why ranges of the current length and not of the cache's: the tile's walk is a chain of per-position steps
(csrc/tasks/attention_split.cuh), so its latency follows the longest range; with ranges cut from
max_seq_len, a sequence at position 600 of a 4096-position cache had two tiles walking 256 positions each
and the rest idle.

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
SPLIT_INDEX_DOC = "i: this tile's range (its partial is entry i of the head's SPLITS)"


def split_range(i: int, splits: int, p: int) -> tuple[int, int]:
    """[s0, e): the positions range ``i`` of ``splits`` walks for a sequence at position ``p`` (e <= s0:
    empty). Ranges of equal length ceil((p + 1) / splits) from position 0; the last non-empty one holds p.
    csrc/tasks/attention_split.cuh ``split_range`` computes the same."""
    per = -(-(p + 1) // splits)
    s0 = i * per
    return s0, min(s0 + per, p + 1)


def split_count(t: TileContext) -> int:
    """SPLITS of a split tile's head, from its scratch stride (OUT_STRIDE = SPLITS GROUP (D + 2))."""
    return t.p("OUT_STRIDE") // (t.p("GROUP") * (t.p("HEAD_DIM") + 2))


def range_rows(splits: int, max_seq: int) -> int:
    """The most positions one range can hold: ceil(max_seq / splits) (a sequence at position max_seq - 1)."""
    return -(-max_seq // splits)


def merge_last_ticket(t: TileContext) -> tuple[str, int] | None:
    """The ticket of a split tile that may merge its head (TICKET present): ('TICKET', SPLITS)."""
    if t.buf("TICKET") is None:
        return None
    return "TICKET", split_count(t)


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
    doc = "per (kv head h, KV range i): fp32 acc, max, sum-exp of each (b, g) over range i of positions 0..pos[b]"
    args = (
        ArgSpec("Q", "r", "[B, Hq D]; offset = first column of query head h*GROUP"),
        ArgSpec("K_CACHE", "r", "[B, S, Hkv, D]; offset = head h of position 0 of sequence 0"),
        ArgSpec("V_CACHE", "r", "[B, S, Hkv, D]; offset as K_CACHE"),
        ArgSpec("POSITIONS", "r", "i32 [B]"),
        ArgSpec("OUT", "w", "f32 [Hkv, B, SPLITS, GROUP, D+2]; offset = entry (h, 0, split, 0)"),
        ArgSpec("TICKET", "rw", TICKET_DOC, optional=True),
        ArgSpec("MERGED", "w", MERGED_DOC, optional=True),
    )
    params = (
        ParamSpec("BATCH", "B"),
        ParamSpec("HEAD_DIM", "D"),
        ParamSpec("GROUP", "query heads per kv head (Hq / Hkv)"),
        ParamSpec("Q_STRIDE", "elements between rows of Q (Hq D)"),
        ParamSpec("KV_POS_STRIDE", "elements between cache positions (Hkv D)"),
        ParamSpec("KV_BATCH_STRIDE", "elements between cache sequences (S Hkv D)"),
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
        """[s0, e) = this tile's range of positions 0..p (``split_range``); e <= s0 when empty."""
        return split_range(t.p("SPLIT_INDEX"), split_count(t), p)

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
        n = range_rows(params[6] // (G * (D + 2)), params[5] // max(1, params[4]))  # SPLITS, S
        # Worst case (a sequence at the cache's last position: the longest range).
        return (B * G * D * elem_bytes[0] + 2 * B * n * D * elem_bytes[1] + B * 4,
                B * G * (D + 2) * elem_bytes[4])


KIND = AttentionSplit()

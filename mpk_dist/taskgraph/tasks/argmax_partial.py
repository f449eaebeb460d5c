"""argmax_partial: (max, index) of one vocabulary tile of the logits, per sequence.

Ties resolve to the lowest index (first maximum), like torch.max. With sampling on (the launch's
SAMPLING words hold a temperature T > 0) the tile scores l * (1/T) + g instead of l, g a Gumbel draw
of (seed, step, sequence, vocabulary id) (``mpk_dist.taskgraph.sampling_rng``): the best score over
the vocabulary is then a draw from softmax(l / T), and argmax_reduce / argmax_select stay as they are.
In nucleus programs (top_p < 1) a CUT argument holds (M, last kept bin) per sequence from
argmax_nucleus_cut: tokens of a later bin score -inf (never chosen).
"""

from __future__ import annotations

import numpy as np
import torch

from mpk_dist.taskgraph import sampling_rng as rng
from mpk_dist.taskgraph.tasks.base import Access, ArgSpec, ParamSpec, TaskKind, TileContext, rect, view2d


class ArgmaxPartial(TaskKind):
    """OUT[b, tile] = (max of logits[b, v0:v0+COLS], INDEX_BASE + first argmax) as fp32."""

    name = "argmax_partial"
    opcode = 10
    doc = ("cand[b, tile] = (max_v score[b, v], INDEX_BASE + argmax) over this tile's columns; score = logit, "
           "or logit / T + Gumbel(seed, step, b, v) when SAMPLING holds T > 0")
    args = (
        ArgSpec("LOGITS", "r", "f32 [B, V]; offset = column v0 of row 0"),
        ArgSpec("OUT", "w", "f32 [B, NTILES, 2]; offset = this tile's pair in row 0"),
        ArgSpec("SAMPLING", "r", "i32 [4] per-launch words: temperature bits, top_p bits, seed lo, seed hi "
                "(host-written; temperature 0 = greedy)", optional=True),
        ArgSpec("CUT", "r", "f32 [B, 2] (M, last kept bin) of the nucleus (argmax_nucleus_cut); nucleus programs "
                "only", optional=True),
    )
    params = (
        ParamSpec("BATCH", "B"),
        ParamSpec("COLS", "vocabulary columns in this tile"),
        ParamSpec("LOGITS_STRIDE", "elements between rows of LOGITS (V)"),
        ParamSpec("OUT_STRIDE", "elements between rows of OUT (2 NTILES)"),
        ParamSpec("INDEX_BASE", "global vocabulary id of column v0 (vocab_start + v0)"),
    )

    def run_tile(self, t: TileContext) -> None:
        B, n = t.p("BATCH"), t.p("COLS")
        x = view2d(t.buf("LOGITS"), t.off("LOGITS"), B, n, t.p("LOGITS_STRIDE")).float()
        temperature, top_p, seed = self.sampling(t)
        if temperature > 0:
            scores = rng.gumbel_scores(x.numpy(), temperature, seed, t.step, t.p("INDEX_BASE"))
            if t.buf("CUT") is not None and top_p < 1.0:
                cut = t.buf("CUT")[t.off("CUT"): t.off("CUT") + 2 * B].view(B, 2).numpy()
                z = rng.nucleus_z(x.numpy(), cut[:, :1], rng.inv_temperature(temperature))
                scores = np.where(rng.nucleus_bin(z) <= cut[:, 1:].astype(np.int64), scores, np.float32(-np.inf))
            idx = torch.from_numpy(scores.argmax(-1))  # first maximum, as the kernel
            val = torch.from_numpy(np.take_along_axis(scores, idx.numpy()[:, None], -1)[:, 0])
        else:
            val, idx = x.max(dim=-1)
        pair = torch.stack([val, (idx + t.p("INDEX_BASE")).float()], dim=-1)
        view2d(t.buf("OUT"), t.off("OUT"), B, 2, t.p("OUT_STRIDE")).copy_(pair)

    @staticmethod
    def sampling(t: TileContext) -> tuple[float, float, int]:
        """(temperature, top_p, seed) of the launch; greedy (0, 1, 0) without a SAMPLING buffer."""
        words = t.buf("SAMPLING")
        if words is None:
            return 0.0, 1.0, 0
        o = t.off("SAMPLING")
        return rng.unpack_words(words[o:o + rng.SAMPLING_WORDS].numpy())

    def accesses(self, t: TileContext) -> list[Access]:
        B, n = t.p("BATCH"), t.p("COLS")
        acc = [Access(0, "r", rect(t.off("LOGITS"), B, n, t.p("LOGITS_STRIDE"))),
               Access(1, "w", rect(t.off("OUT"), B, 2, t.p("OUT_STRIDE")))]
        if t.buf("SAMPLING") is not None:
            acc.append(Access(2, "r", t.off("SAMPLING") + np.arange(rng.SAMPLING_WORDS)))
        if t.buf("CUT") is not None:
            acc.append(Access(3, "r", t.off("CUT") + np.arange(2 * B)))
        return acc

    def traffic(self, counts, elem_bytes, params, world):
        B, n = params[0], params[1]
        return B * n * elem_bytes[0], B * 2 * elem_bytes[1]


KIND = ArgmaxPartial()


def best_pair(vals: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Largest value over the last axis, ties to the smallest index: (value, index) per row."""
    best = vals.max(dim=-1, keepdim=True).values
    masked = torch.where(vals == best, idx, torch.full_like(idx, float("inf")))
    return best[..., 0], masked.min(dim=-1).values



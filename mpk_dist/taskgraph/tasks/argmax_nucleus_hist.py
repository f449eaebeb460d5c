"""argmax_nucleus_hist: one vocabulary tile's top-p mass histogram (nucleus programs only).

Adds the fixed-point mass of each logit of the tile, rint(exp(-(M - l) / T) * 2^44), into bin
floor((M - l) / T * 64) of this rank's histogram (``mpk_dist.taskgraph.sampling_rng``), M being the
step's max logit over every rank (the gathered greedy candidates). On the GPU the adds are uint64
atomics: integer sums are exact, so the histogram does not depend on the order of tiles or threads.
Does nothing unless the launch samples with top_p < 1.
"""

from __future__ import annotations

import numpy as np
import torch

from mpk_dist.taskgraph import sampling_rng as rng
from mpk_dist.taskgraph.tasks.argmax_partial import ArgmaxPartial
from mpk_dist.taskgraph.tasks.base import Access, ArgSpec, ParamSpec, TaskKind, TileContext, rect, view2d


def gathered_max(t: TileContext, name: str, B: int, W: int) -> np.ndarray:
    """M [B]: the largest value of the gathered [W, B, 2] candidates (every rank's max logit)."""
    c = t.buf(name)[t.off(name): t.off(name) + W * B * 2].view(W, B, 2)
    return c[..., 0].max(dim=0).values.numpy().astype(np.float32)


def hist64(t: TileContext, name: str, rows: int) -> torch.Tensor:
    """The int64 [rows, NUCLEUS_BINS] view of an i32 histogram argument (two words per bin)."""
    o = t.off(name)
    return t.buf(name)[o: o + 2 * rows * rng.NUCLEUS_BINS].view(torch.int64).view(rows, rng.NUCLEUS_BINS)


def nucleus_active(temperature: float, top_p: float) -> bool:
    """True when the launch samples with a nucleus (temperature > 0 and top_p < 1)."""
    return temperature > 0 and top_p < 1.0


class ArgmaxNucleusHist(TaskKind):
    """HIST[b, bin(l)] += mass(l) for the tile's logits l of sequence b."""

    name = "argmax_nucleus_hist"
    opcode = 21
    doc = "hist[b, bin] += rint(exp(-(M - l) / T) * 2^44) over the tile's logits, bin = floor((M - l) / T * 64)"
    args = (
        ArgSpec("LOGITS", "r", "f32 [B, V]; offset = column v0 of row 0"),
        ArgSpec("MAXES", "r", "symmetric f32 [WORLD, B, 2] every rank's greedy (max, index)"),
        ArgSpec("SAMPLING", "r", "i32 [4] the launch's sampling words"),
        ArgSpec("HIST", "w", "i32 [B, 2 NUCLEUS_BINS]: uint64 mass per bin, atomic adds (zeroed by argmax_nucleus_cut)"),
    )
    params = (
        ParamSpec("BATCH", "B"),
        ParamSpec("COLS", "vocabulary columns in this tile"),
        ParamSpec("LOGITS_STRIDE", "elements between rows of LOGITS (V)"),
        ParamSpec("WORLD", "ranks"),
    )

    def run_tile(self, t: TileContext) -> None:
        temperature, top_p, _ = ArgmaxPartial.sampling(t)
        if not nucleus_active(temperature, top_p):
            return
        B, n = t.p("BATCH"), t.p("COLS")
        x = view2d(t.buf("LOGITS"), t.off("LOGITS"), B, n, t.p("LOGITS_STRIDE")).float().numpy()
        m = gathered_max(t, "MAXES", B, t.p("WORLD"))
        hist64(t, "HIST", B).add_(torch.from_numpy(rng.nucleus_histogram(x, m, rng.inv_temperature(temperature))))

    def accesses(self, t: TileContext) -> list[Access]:
        # NOTE: HIST is left out: every tile adds into every bin, which the race checker (plain
        # reads/writes) would call a write-write race; the adds are atomic and commute exactly.
        B, W = t.p("BATCH"), t.p("WORLD")
        return [Access(0, "r", rect(t.off("LOGITS"), B, t.p("COLS"), t.p("LOGITS_STRIDE"))),
                Access(1, "r", t.off("MAXES") + np.arange(W * B * 2))]


KIND = ArgmaxNucleusHist()

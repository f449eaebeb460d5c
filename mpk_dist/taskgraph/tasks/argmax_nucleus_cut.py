"""argmax_nucleus_cut: the step's top-p cut per sequence from every rank's mass histogram (one task).

Sums the WORLD gathered histograms bin by bin (exact uint64), finds the last bin whose mass above it
is < top_p of the total (``sampling_rng.nucleus_cut``) and writes (M, that bin) for the scoring
pass of argmax_partial; then zeroes this rank's histogram for the next step (its adds start from 0).
Without a nucleus (greedy, or top_p = 1) the cut is the last bin.
"""

from __future__ import annotations

import numpy as np
import torch

from mpk_dist.taskgraph import sampling_rng as rng
from mpk_dist.taskgraph.tasks.argmax_nucleus_hist import gathered_max, hist64, nucleus_active
from mpk_dist.taskgraph.tasks.argmax_partial import ArgmaxPartial
from mpk_dist.taskgraph.tasks.base import Access, ArgSpec, ParamSpec, TaskKind, TileContext


class ArgmaxNucleusCut(TaskKind):
    """CUT[b] = (M_b, last kept bin of sequence b); HIST = 0."""

    name = "argmax_nucleus_cut"
    opcode = 22
    doc = "cut[b] = (M, last bin with mass above it < top_p * total) over the summed rank histograms; hist = 0"
    args = (
        ArgSpec("HIST_ALL", "r", "symmetric i32 [WORLD, B, 2 NUCLEUS_BINS] every rank's histogram"),
        ArgSpec("MAXES", "r", "symmetric f32 [WORLD, B, 2] every rank's greedy (max, index)"),
        ArgSpec("SAMPLING", "r", "i32 [4] the launch's sampling words"),
        ArgSpec("CUT", "w", "f32 [B, 2]: (M, last kept bin) read by argmax_partial"),
        ArgSpec("HIST", "w", "i32 [B, 2 NUCLEUS_BINS] this rank's histogram, zeroed for the next step"),
    )
    params = (ParamSpec("BATCH", "B"), ParamSpec("WORLD", "ranks"))

    def run_tile(self, t: TileContext) -> None:
        B, W = t.p("BATCH"), t.p("WORLD")
        temperature, top_p, _ = ArgmaxPartial.sampling(t)
        m = gathered_max(t, "MAXES", B, W)
        last = np.full(B, rng.NUCLEUS_BINS - 1, np.int64)
        if nucleus_active(temperature, top_p):
            total = hist64(t, "HIST_ALL", W * B).view(W, B, rng.NUCLEUS_BINS).sum(0)  # exact int64
            last = rng.nucleus_cut(total.numpy(), top_p)
        cut = torch.from_numpy(np.stack([m, last.astype(np.float32)], -1).reshape(-1))
        t.buf("CUT")[t.off("CUT"): t.off("CUT") + 2 * B].copy_(cut)
        hist64(t, "HIST", B).zero_()

    def accesses(self, t: TileContext) -> list[Access]:
        B, W, nb = t.p("BATCH"), t.p("WORLD"), 2 * rng.NUCLEUS_BINS
        return [Access(0, "r", t.off("HIST_ALL") + np.arange(W * B * nb)),
                Access(1, "r", t.off("MAXES") + np.arange(W * B * 2)),
                Access(3, "w", t.off("CUT") + np.arange(2 * B)), Access(4, "w", t.off("HIST") + np.arange(B * nb))]


KIND = ArgmaxNucleusCut()

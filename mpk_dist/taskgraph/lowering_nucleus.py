"""Lowering of the vocabulary-parallel head with top-p (nucleus) sampling (``lower_graph(nucleus=True)``).

The threshold of the nucleus needs the step's max logit M over the whole vocabulary first and the
mass histogram over all ranks second, so the head gets three stages before the usual scoring pass:

    argmax_partial/max tiles -> argmax_reduce -> allgather_push (every rank's max)           M
    argmax_nucleus_hist tiles (atomic uint64 adds into this rank's histogram) -> allgather_push
    argmax_nucleus_cut (sum of the WORLD histograms -> last kept bin; zeroes the histogram)
    argmax_partial tiles (Gumbel scores, tokens past the cut -inf) -> argmax_reduce -> (graph's all_gather,
    argmax_select)

Six more dependent levels than the plain head, so only programs compiled with ``nucleus=True`` carry
them; plain programs sample with temperature alone (docs/TASKGRAPH.md, "Sampling").
"""

from __future__ import annotations

from mpk_dist.errors import InputError
from mpk_dist.graph import Op
from mpk_dist.taskgraph import sampling_rng as rng
from mpk_dist.taskgraph.lowering import Lowerer, _all_fp, _cols_fp, col_tiles
from mpk_dist.taskgraph.lowering_comm import gather_push, head_tiles, sampling_buffer


def lower_nucleus_head(lw: Lowerer, op: Op) -> None:
    """The argmax_partial graph op of a nucleus program: max, histogram, cut, then the scoring pass."""
    p, B, W = lw.p, lw.B, lw.W
    logits, cand = p.id(op.inputs[0]), p.id(op.outputs[0])
    V = lw.g.tensors[op.inputs[0]].shape[-1]
    if V * W > rng.MAX_NUCLEUS_VOCAB:
        raise InputError(f"top-p sampling: expected a vocabulary of at most {rng.MAX_NUCLEUS_VOCAB} ids, got {V * W}; "
                         "compile without nucleus (temperature-only sampling)")
    smp = sampling_buffer(lw)
    # 1. M: the greedy (max, index) of every rank (no SAMPLING: plain max whatever the launch asks).
    max_cand = p.buffer(f"{op.name}.max_cand", (B, 2), "f32", "activation")
    maxes = p.buffer(f"{op.name}.maxes", (W, B, 2), "f32", "comm", view=(W * B, 2))
    head_tiles(lw, op, logits, max_cand, f"{op.name}.max_tiles", "/max", None, None)
    gather_push(lw, op, max_cand, maxes, "/max/gather")
    # 2. This rank's histogram, then every rank's.
    nb = 2 * rng.NUCLEUS_BINS  # int32 words: one uint64 per bin
    hist = p.buffer(f"{op.name}.hist", (B, nb), "i32", "activation")
    hist_all = p.buffer(f"{op.name}.hist_all", (W, B, nb), "i32", "comm", view=(W * B, nb))
    tiles = col_tiles(V, lw.sms)
    h = lw._new(op, "argmax_nucleus_hist", "/hist")
    for v0, n in tiles:
        h.add_tile({"LOGITS": (logits, v0, (B - 1) * V + n), "MAXES": (maxes, 0, W * B * 2),
                    "SAMPLING": (smp, 0, rng.SAMPLING_WORDS), "HIST": (hist, 0, B * nb)},
                   {"BATCH": B, "COLS": n, "LOGITS_STRIDE": V, "WORLD": W})
    h.reads = [_cols_fp(logits, tiles, B), _all_fp(maxes, p, len(tiles))]
    h.writes = [_all_fp(hist, p, len(tiles))]  # every tile adds into every bin (atomics)
    gather_push(lw, op, hist, hist_all, "/hist/gather")
    # 3. The cut, then the scoring pass restricted to it.
    cut = p.buffer(f"{op.name}.cut", (B, 2), "f32", "activation")
    c = lw._new(op, "argmax_nucleus_cut", "/cut")
    c.add_tile({"HIST_ALL": (hist_all, 0, W * B * nb), "MAXES": (maxes, 0, W * B * 2),
                "SAMPLING": (smp, 0, rng.SAMPLING_WORDS), "CUT": (cut, 0, 2 * B), "HIST": (hist, 0, B * nb)},
               {"BATCH": B, "WORLD": W})
    c.reads = [_all_fp(hist_all, p, 1), _all_fp(maxes, p, 1)]
    c.writes = [_all_fp(cut, p, 1), _all_fp(hist, p, 1)]
    head_tiles(lw, op, logits, cand, f"{op.name}.tiles", "", smp, cut)

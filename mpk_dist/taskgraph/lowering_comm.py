"""Lowering of the communication ops and the vocabulary-parallel head.

all_reduce -> allreduce_push (per column tile: my partial tile into slot[my_rank] of every rank's
symmetric receive buffer, signalling every rank) + allreduce_reduce (per tile: sum the WORLD slots in
fp32, add the residual once). argmax_partial -> per-vocabulary-tile (max, index) (of Gumbel scores when sampling) + one local reduce;
all_gather -> allgather_push of the rank's candidate; argmax_select picks the token.
"""

from __future__ import annotations

import numpy as np

from mpk_dist.graph import Op
from mpk_dist.taskgraph.lowering import Lowerer, _all_fp, _cols_fp, _grid_fp, col_tiles
from mpk_dist.taskgraph.program import Footprint
from mpk_dist.taskgraph.sampling_rng import SAMPLING_WORDS


def all_reduce(lw: Lowerer, op: Op) -> None:
    """Push + reduce tiles over a per-op symmetric receive buffer [WORLD, B, N], one per tile of the
    producing linear (its column blocks x row blocks, ``Lowerer.linear_grid``)."""
    p, B, W = lw.p, lw.B, lw.W
    part = p.id(op.inputs[0])
    res = p.id(op.inputs[1]) if len(op.inputs) > 1 else None
    out = p.id(op.outputs[0])
    N = lw.g.tensors[op.outputs[0]].shape[-1]
    recv = p.buffer(f"{op.name}.recv", (W, B, N), p.buffers[part].dtype, "comm", view=(W * B, N))
    grid = lw.linear_grid(lw.linear_cols(N))  # the producing linear's tiles: one producer per tile
    push = lw._new(op, "allreduce_push", "/push")
    for r0, nr, c0, n in grid:
        push.add_tile({"SRC": (part, r0 * N + c0, (nr - 1) * N + n),
                       "DST": (recv, (lw.rank * B + r0) * N + c0, (nr - 1) * N + n)},
                      {"BATCH": nr, "COLS": n, "SRC_STRIDE": N, "DST_STRIDE": N})
    push.reads = [_grid_fp(part, grid)]
    # Every rank writes its own slot of every rank's buffer: in the rank-symmetric graph that is
    # every slot's rows of the tile's row block and columns.
    push.writes = _slot_fps(recv, grid, B, W, remote=True)
    red = lw._new(op, "allreduce_reduce", "/reduce")
    for r0, nr, c0, n in grid:
        ext = (r0 * N + c0, (nr - 1) * N + n)
        red.add_tile({"RECV": (recv, ext[0], (W - 1) * B * N + ext[1]), "RESIDUAL": None if res is None else (res, *ext),
                      "OUT": (out, *ext)}, {"BATCH": nr, "COLS": n, "WORLD": W, "SLOT_STRIDE": B * N, "STRIDE": N})
    red.reads = _slot_fps(recv, grid, B, W) + ([] if res is None else [_grid_fp(res, grid)])
    red.writes = [_grid_fp(out, grid)]


def _slot_fps(recv: int, grid, B: int, W: int, remote: bool = False) -> list[Footprint]:
    """The tiles' rectangles in every slot of a [W, B, N] receive buffer (view [W * B, N]): one
    footprint covering all slots when a tile holds all B rows (the slots' rows are then contiguous),
    else one footprint per slot (row blocks: rows w * B + r0 .. of each slot w, exact)."""
    if all(nr == B for _, nr, _, _ in grid):
        return [Footprint(recv, np.array([(0, W * B, c0, c0 + n) for _, _, c0, n in grid], np.int64).reshape(-1, 4),
                          remote)]
    return [_grid_fp(recv, grid, row_shift=w * B, remote=remote) for w in range(W)]


def sampling_buffer(lw: Lowerer) -> int:
    """The host-written per-launch sampling words (``sampling_rng.sampling_words``), declared once."""
    p = lw.p
    if "sampling" not in p.by_name:
        p.buffer("sampling", (SAMPLING_WORDS,), "i32", "input")
        p.special["sampling"] = p.id("sampling")
    return p.id("sampling")


def argmax_partial(lw: Lowerer, op: Op, cut: int | None = None) -> None:
    """(max, index) per vocabulary tile (the lm_head's tiles), then one local reduce.

    ``cut``: the nucleus programs' (M, last kept bin) buffer (``lowering_nucleus``), else None."""
    p = lw.p
    logits, cand = p.id(op.inputs[0]), p.id(op.outputs[0])
    head_tiles(lw, op, logits, cand, f"{op.name}.tiles", "", sampling_buffer(lw), cut)


def head_tiles(lw: Lowerer, op: Op, logits: int, cand: int, part_name: str, suffix: str, smp: int | None,
               cut: int | None) -> None:
    """argmax_partial over the vocabulary tiles into ``part_name`` [B, NTILES, 2], argmax_reduce into ``cand``."""
    p, B = lw.p, lw.B
    V = lw.g.tensors[op.inputs[0]].shape[-1]
    tiles = col_tiles(V, lw.sms)
    nt = len(tiles)
    part = p.buffer(part_name, (B, nt, 2), "f32", "activation", view=(B, nt * 2))
    t = lw._new(op, "argmax_partial", suffix)
    for j, (v0, n) in enumerate(tiles):
        t.add_tile({"LOGITS": (logits, v0, (B - 1) * V + n), "OUT": (part, 2 * j, (B - 1) * nt * 2 + 2),
                    "SAMPLING": None if smp is None else (smp, 0, SAMPLING_WORDS),
                    "CUT": None if cut is None else (cut, 0, 2 * B)},
                   {"BATCH": B, "COLS": n, "LOGITS_STRIDE": V, "OUT_STRIDE": nt * 2,
                    "INDEX_BASE": op.attrs["vocab_start"] + v0})
    t.reads = [_cols_fp(logits, tiles, B)] + ([] if cut is None else [_all_fp(cut, p, nt)])
    t.writes = [Footprint(part, np.array([(0, B, 2 * j, 2 * j + 2) for j in range(nt)], np.int64))]
    r = lw._new(op, "argmax_reduce", suffix + "/reduce")
    r.add_tile({"PARTIAL": (part, 0, B * nt * 2), "OUT": (cand, 0, 2 * B)}, {"BATCH": B, "NTILES": nt})
    r.reads, r.writes = [_all_fp(part, p, 1)], [_all_fp(cand, p, 1)]


def gather_push(lw: Lowerer, op: Op, src: int, dst: int, suffix: str = "") -> None:
    """One allgather_push task: all of ``src`` into slot[my_rank] of every rank's ``dst``."""
    p = lw.p
    n = p.buffers[src].numel
    t = lw._new(op, "allgather_push", suffix)
    t.add_tile({"SRC": (src, 0, n), "DST": (dst, lw.rank * n, n)}, {"COUNT": n})
    t.reads, t.writes = [_all_fp(src, p, 1)], [_all_fp(dst, p, 1, remote=True)]


def all_gather(lw: Lowerer, op: Op) -> None:
    """One task: my candidate into slot[my_rank] of every rank's gather buffer."""
    gather_push(lw, op, lw.p.id(op.inputs[0]), lw.p.id(op.outputs[0]))


def argmax_select(lw: Lowerer, op: Op) -> None:
    """One task: the token, into next_token and row ``step`` of token_out."""
    p, B, W = lw.p, lw.B, lw.W
    cands, nxt, out = p.id(op.inputs[0]), p.id(op.outputs[0]), p.id("token_out")
    t = lw._new(op, "argmax_select")
    t.add_tile({"CANDS": (cands, 0, W * B * 2), "NEXT_TOKEN": (nxt, 0, B), "TOKEN_OUT": (out, 0, p.max_steps * B)},
               {"BATCH": B, "WORLD": W, "MAX_STEPS": p.max_steps})
    t.reads = [_all_fp(cands, p, 1)]
    t.writes = [_all_fp(nxt, p, 1), _all_fp(out, p, 1)]


def lower_graph(graph, sms: int, max_steps: int, fuse=False, attn_splits=1, nucleus: bool = False):
    """The ``Program`` of one rank: buffers and task-ops in a topological order of one step.

    ``fuse``: which fusions to apply (``mpk_dist.taskgraph.fusion.fusion_set``); False keeps every op.
    ``attn_splits``: KV ranges per attention kv head (int or 'auto', ``lowering_attention``); 1 keeps
    one attention task per kv head.
    ``nucleus``: add the top-p stages before the token's scoring pass (``lowering_nucleus``); without
    them a launch can sample with temperature but not with top_p < 1.
    """
    from mpk_dist.taskgraph.fusion import FusedAttention, FusedLinear, dropped_tensors, plan
    from mpk_dist.taskgraph.lowering_attn_prep import lower_attn_prep
    from mpk_dist.taskgraph.lowering_attention import (check_attn_splits, lower_split_attention, next_weight_bytes,
                                                       resolve_splits)
    from mpk_dist.taskgraph.lowering_fused import lower_fused
    from mpk_dist.taskgraph.lowering_pages import declare_page_state, is_paged, page_alloc
    from mpk_dist.taskgraph.lowering_nucleus import lower_nucleus_head

    from mpk_dist.taskgraph.fusion import fusion_set

    check_attn_splits(attn_splits)
    items = plan(graph, fuse)
    merge_last = "attn_merge" in fusion_set(fuse)
    lw = Lowerer(graph, sms, max_steps)
    lw.declare_buffers(skip=dropped_tensors(items))
    lw.step_begin()
    if is_paged(lw):  # the page allocator runs on the device, before any reader of the page table
        declare_page_state(lw)
        page_alloc(lw)
    handlers = {"all_reduce": all_reduce, "argmax_partial": argmax_partial, "all_gather": all_gather,
                "argmax_select": argmax_select}
    if nucleus:
        handlers["argmax_partial"] = lower_nucleus_head
    for op in items:
        if isinstance(op, FusedLinear):
            lower_fused(lw, op)
            continue
        if isinstance(op, FusedAttention):  # split-KV programs: lowered unfused (lowering_attn_prep)
            lower_attn_prep(lw, op, attn_splits, merge_last)
            continue
        if op.kind == "attention" and attn_splits != 1:
            splits = resolve_splits(attn_splits, sms, op.attrs["kv_heads"], graph.max_seq_len, graph.batch,
                                    next_weight_bytes(graph, op))
            if splits > 1:
                lower_split_attention(lw, op, splits, merge_last)
                continue
        h = handlers.get(op.kind)
        if h is not None:
            h(lw, op)
        else:
            getattr(lw, op.kind)(op)
    return lw.p

"""Lowering of the ``attn_prep`` fusion (``mpk_dist.taskgraph.fusion.FusedAttention``): qkv_prep ->
attention as one ``attention_prep`` task-op.

Tiles are the attention's own: one per (kv head j, sequence b), j-major. Tile (j, b) reads row b of
qkv at query heads j*G .. (j+1)*G-1, k head j and v head j, so it waits only on the qkv_proj tiles
covering those columns (not on every q head's prep as the unfused attention tile did through the
qkv_prep level). It writes k, v at (b, pos[b], j) and the q rows (b, heads of group j), then reads
them back after a block barrier: both stay inside the tile, so they add no events. Footprints
declare the whole cache rows of (b, j), as qkv_prep's and attention's do (the position is a run-time
value).

In split-KV programs the fusion lowers to ``attention_split_prep`` tiles (kv head j, range i) and the
usual merge: each range computes the q heads of group j itself (kept in the tile, not written), and the
range holding a sequence's position appends its k and v (tasks/attention_split_prep.py).
"""

from __future__ import annotations

import numpy as np

from mpk_dist.taskgraph.fusion import FusedAttention
from mpk_dist.taskgraph.lowering import Lowerer, _all_fp
from mpk_dist.taskgraph.program import Footprint
from mpk_dist.taskgraph.tasks import BY_NAME, kind_params


def lower_attn_prep(lw: Lowerer, f: FusedAttention, attn_splits=1, merge_last: bool = False) -> None:
    """Append the ``attention_prep`` task-op of ``f``, or in a split-KV program ``attention_split_prep`` +
    ``attention_merge`` (``_lower_fused_split``; ``merge_last``: the last split tile of a head merges it)."""
    from mpk_dist.taskgraph.lowering_attention import next_weight_bytes, resolve_splits

    splits = 1 if attn_splits == 1 else resolve_splits(attn_splits, lw.sms, f.attention.attrs["kv_heads"],
                                                       lw.g.max_seq_len, lw.B, next_weight_bytes(lw.g, f.attention))
    if splits > 1:
        _lower_fused_split(lw, f, splits, merge_last)
    else:
        _lower_fused(lw, f)


def _lower_fused_split(lw: Lowerer, f: FusedAttention, splits: int, merge_last: bool) -> None:
    """qkv_prep folded into the split tiles: tile (j, i) norms and ropes the q heads of group j itself
    (every range of head j, for its sequences: all B, or one above SPLIT_TILE_MAX_SEQS), appends k/v of
    head j where range i holds the position, and writes attention_split's partial; then the unchanged
    merge op (or the merge in the last tile)."""
    from mpk_dist.taskgraph.lowering_attention import (finish_split, merge_last_args, merge_ticket, partial_footprint,
                                                       split_scratch, split_tile_rects, split_tiles)

    p, B, a, att = lw.p, lw.B, f.prep.attrs, f.attention
    hq, hkv, D = a["q_heads"], a["kv_heads"], a["head_dim"]
    qkv, pos = p.id(f.prep.inputs[0]), p.id(f.prep.inputs[1])
    qn, kn = (p.id(f.prep.inputs[2]), p.id(f.prep.inputs[3])) if a.get("qk_norm") else (None, None)
    _, kc, vc = (p.id(n) for n in f.prep.outputs)
    S, G, QS, inv = lw.g.max_seq_len, hq // hkv, (hq + 2 * hkv) * D, lw._inv_freq(a)
    ranges, P, E, part = split_scratch(lw, att, splits)
    tiles = split_tiles(hkv, B, P)
    ticket = merge_ticket(lw, att, tiles) if merge_last else None
    sp = p.op(att.name + "/split", BY_NAME["attention_split_prep"], att.layer, att.name)
    for t in tiles:
        s0, s1 = ranges[t.i]
        k_off = (hq + t.j) * D - t.j * G * D
        cache_count = (t.nb - 1) * S * hkv * D + (S - 1) * hkv * D + D
        kv_at = t.b0 * S * hkv * D + t.j * D
        sp.add_tile({"QKV": (qkv, t.b0 * QS + t.j * G * D, (t.nb - 1) * QS + k_off + hkv * D + D),
                     "POSITIONS": (pos, t.b0, t.nb),
                     "Q_NORM_W": None if qn is None else (qn, 0, D), "K_NORM_W": None if kn is None else (kn, 0, D),
                     "INV_FREQ": (inv, 0, D // 2), "K_CACHE": (kc, kv_at, cache_count),
                     "V_CACHE": (vc, kv_at, cache_count),
                     "OUT": (part, ((t.j * B + t.b0) * P + t.i) * E, (t.nb - 1) * P * E + E),
                     **merge_last_args(lw, att, ticket, t)},
                    {"BATCH": t.nb, "HEAD_DIM": D, "GROUP": G, "QKV_STRIDE": QS, "K_OFFSET": k_off, "V_OFFSET": hkv * D,
                     "KV_POS_STRIDE": hkv * D, "KV_BATCH_STRIDE": S * hkv * D, "MAX_SEQ": S, "POS_BEGIN": s0,
                     "POS_END": s1, "OUT_STRIDE": P * E, "EPS": a["eps"], "SCALE": att.attrs["scale"],
                     "SPLIT_INDEX": t.i})
    # The whole head's cache rows (the appended position is a run-time value); no other op touches the
    # caches, so the rectangles add no events: rows below the position come from earlier steps, ordered
    # through the step's token chain.
    kvrect = split_tile_rects(tiles, S, lambda j: j * D, D)
    sp.reads = [Footprint(qkv, split_tile_rects(tiles, 1, lambda j: j * G * D, G * D)),
                Footprint(qkv, split_tile_rects(tiles, 1, lambda j: (hq + j) * D, D)),
                Footprint(qkv, split_tile_rects(tiles, 1, lambda j: (hq + hkv + j) * D, D)),
                _all_fp(pos, p, len(tiles)),
                Footprint(kc, kvrect.copy()), Footprint(vc, kvrect.copy())]
    sp.writes = [Footprint(kc, kvrect.copy()), Footprint(vc, kvrect.copy()), partial_footprint(part, B, E, tiles)]
    finish_split(lw, att, sp, part, P, E, tiles, ticket)


def _lower_fused(lw: Lowerer, f: FusedAttention) -> None:
    p, B, a, att = lw.p, lw.B, f.prep.attrs, f.attention
    hq, hkv, D = a["q_heads"], a["kv_heads"], a["head_dim"]
    qkv, pos = p.id(f.prep.inputs[0]), p.id(f.prep.inputs[1])
    qn, kn = (p.id(f.prep.inputs[2]), p.id(f.prep.inputs[3])) if a.get("qk_norm") else (None, None)
    q, kc, vc = (p.id(n) for n in f.prep.outputs)
    o = p.id(att.outputs[0])
    S, G, QS, inv = lw.g.max_seq_len, hq // hkv, (hq + 2 * hkv) * D, lw._inv_freq(a)
    t = p.op(att.name, BY_NAME["attention_prep"], att.layer, att.name)
    pairs = [(j, b) for j in range(hkv) for b in range(B)]
    cache_count = (S - 1) * hkv * D + D
    for j, b in pairs:
        k_off = (hq + j) * D - j * G * D
        qa = (b * hq * D + j * G * D, G * D)
        kva = (b * S * hkv * D + j * D, cache_count)
        t.add_tile({"QKV": (qkv, b * QS + j * G * D, k_off + hkv * D + D), "POSITIONS": (pos, b, 1),
                    "Q_NORM_W": None if qn is None else (qn, 0, D), "K_NORM_W": None if kn is None else (kn, 0, D),
                    "INV_FREQ": (inv, 0, D // 2), "Q": (q, *qa), "K_CACHE": (kc, *kva), "V_CACHE": (vc, *kva),
                    "OUT": (o, *qa)},
                   {"HEAD_DIM": D, "GROUP": G, "K_OFFSET": k_off, "V_OFFSET": hkv * D, "KV_POS_STRIDE": hkv * D,
                    "MAX_SEQ": S, "EPS": a["eps"], "SCALE": att.attrs["scale"]})
    rects = lambda c0, n: np.array([(b, b + 1, c0(j), c0(j) + n) for j, b in pairs], np.int64)  # noqa: E731
    qrect = rects(lambda j: j * G * D, G * D)
    kvrect = np.array([(b * S, (b + 1) * S, j * D, (j + 1) * D) for j, b in pairs], np.int64)
    t.reads = [Footprint(qkv, qrect.copy()), Footprint(qkv, rects(lambda j: (hq + j) * D, D)),
               Footprint(qkv, rects(lambda j: (hq + hkv + j) * D, D)), _all_fp(pos, p, len(pairs)),
               Footprint(q, qrect.copy()), Footprint(kc, kvrect.copy()), Footprint(vc, kvrect.copy())]
    t.writes = [Footprint(q, qrect.copy()), Footprint(kc, kvrect.copy()), Footprint(vc, kvrect.copy()),
                Footprint(o, qrect.copy())]


def attn_prep_smem_bytes(cg, worker_threads: int) -> int:
    """Dynamic shared memory the attention part of the program's attention_prep tiles needs: nwarps x
    GROUP x (D + 2) floats, as the unfused attention (csrc/tasks/attention.cuh ``attention_smem_bytes``; less in
    the kernel with the phased merge, ``lowering_attention.merge_smem_bytes``); 0 without such tiles. ``mpk_dist.runtime.tables.smem_bytes`` must count it (the kernel refuses the
    task as bad when the launch has less)."""
    from mpk_dist.taskgraph.lowering_attention import attention_staging_bytes

    return attention_staging_bytes(cg, "attention_prep", worker_threads)


def split_prep_smem_bytes(cg, worker_threads: int) -> int:
    """Dynamic shared memory the program's attention_split_prep tiles need: the staged merge's nwarps x
    GROUP x (D + 2) floats plus the tile's q (GROUP x D bf16; csrc/tasks/attention_split_prep.cuh
    ``split_prep_smem_bytes``); 0 without such tiles. ``mpk_dist.runtime.tables.smem_bytes`` counts it (the
    kernel refuses the task as bad when the launch has less)."""
    p = kind_params(cg, "attention_split_prep", "GROUP", "HEAD_DIM")
    if p is None:
        return 0
    G, D = p
    return int(((worker_threads // 32) * G * (D + 2) * 4 + G * D * 2).max())

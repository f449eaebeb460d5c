"""Lowering of the ``attn_prep`` fusion (``mpk_dist.taskgraph.fusion.FusedAttention``): qkv_prep ->
attention as one ``attention_prep`` task-op.

Tiles are the attention's own: one per (kv head j, sequence b), j-major. Tile (j, b) reads row b of
qkv at query heads j*G .. (j+1)*G-1, k head j and v head j, so it waits only on the qkv_proj tiles
covering those columns (not on every q head's prep as the unfused attention tile did through the
qkv_prep level). It writes k, v at (b, pos[b], j) and the q rows (b, heads of group j), then reads
them back after a block barrier: both stay inside the tile, so they add no events. Footprints
declare the whole cache rows of (b, j), as qkv_prep's and attention's do (the position is a run-time
value).

Split-KV programs keep the unfused qkv_prep + attention_split/merge (the split tiles cover KV ranges,
not sequences; one prep per sequence would have to run before all of them): ``lower_attn_prep`` falls
back to them and says so once per process on stderr.
"""

from __future__ import annotations

import sys

import numpy as np

from mpk_dist.taskgraph.fusion import FusedAttention
from mpk_dist.taskgraph.lowering import Lowerer, _all_fp
from mpk_dist.taskgraph.program import Footprint
from mpk_dist.taskgraph.tasks import BY_NAME

_NOTED: set[str] = set()


def split_reason(lw: Lowerer, f: FusedAttention, attn_splits) -> str | None:
    """Why ``f`` stays unfused in this program (split-KV attention), or None when it is fused."""
    from mpk_dist.taskgraph.lowering_attention import resolve_splits

    if attn_splits == 1:
        return None
    splits = resolve_splits(attn_splits, lw.sms, f.attention.attrs["kv_heads"], lw.g.max_seq_len, lw.B)
    if splits == 1:
        return None
    return (f"fuse attn_prep: not applied with split-KV attention (attn_splits={attn_splits} -> {splits} ranges): "
            "qkv_prep and attention_split/merge stay separate tasks")


def lower_attn_prep(lw: Lowerer, f: FusedAttention, attn_splits=1) -> None:
    """Append the ``attention_prep`` task-op of ``f`` (or, in a split-KV program, the unfused ops)."""
    why = split_reason(lw, f, attn_splits)
    if why is not None:
        from mpk_dist.taskgraph.lowering_attention import lower_split_attention, resolve_splits

        if why not in _NOTED:
            _NOTED.add(why)
            print(why, file=sys.stderr, flush=True)
        lw.qkv_prep(f.prep)
        lower_split_attention(lw, f.attention, resolve_splits(attn_splits, lw.sms, f.attention.attrs["kv_heads"],
                                                              lw.g.max_seq_len, lw.B))
        return
    _lower_fused(lw, f)


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
    GROUP x (D + 2) floats, as the unfused attention (csrc/tasks/attention.cuh ``attention_smem_bytes``);
    0 without such tiles. ``mpk_dist.runtime.tables.smem_bytes`` must count it (the kernel refuses the
    task as bad when the launch has less)."""
    from mpk_dist.taskgraph.lowering_attention import attention_staging_bytes

    return attention_staging_bytes(cg, "attention_prep", worker_threads)

"""Lowering of split-KV decode attention (``compile_rank_programs(..., attn_splits=N|'auto')``; the megakernel
backend's default is 'auto').

One ``attention`` op becomes two task-ops: ``<op>/split`` with one tile per (kv head h, KV range i)
(kind attention_split) and ``<op>/merge`` with one tile per (kv head h, sequence b) (kind
attention_merge), connected through an fp32 scratch buffer ``<op>.partial`` [Hkv, B, SPLITS, GROUP,
D + 2] whose 2-D view has one row per (h, b), so split tile (h, i) writes one rectangle (rows of h,
the columns of range i) and merge tile (h, b) reads one row: the merge of head h waits only for
head h's splits ('auto' splits only one sequence, and not when the next linear's weights outlast the walk:
``resolve_splits``). Above SPLIT_TILE_MAX_SEQS sequences
(an explicit count) a split tile takes one sequence: one tile per (h, b, i) (``split_tiles``). See docs/TASKGRAPH.md,
"Split-KV attention".
"""

from __future__ import annotations

import numbers
from typing import NamedTuple

import numpy as np

from mpk_dist.errors import InputError
from mpk_dist.graph import Op
from mpk_dist.taskgraph.abi import DTYPE_BYTES
from mpk_dist.taskgraph.lowering import Lowerer, _all_fp
from mpk_dist.taskgraph.program import Footprint
from mpk_dist.taskgraph.tasks import BY_NAME, kind_params

MIN_SPLIT_POSITIONS_B1 = 32
"""The same floor for one sequence. Measured on an H200 at context ~512 (max_seq_len 544, docs/PERF.md v0.14,
one process): 12 or 16 ranges per kv head instead of 64-position ranges (9) gave qwen3-8b 4.984 / 4.987 vs
5.010 / 5.016 ms, qwen3-0.6b 1.251 / 1.252 vs 1.270 / 1.263, qwen3-1.7b 1.782 (12) vs 1.797 / 1.795: the walk
shortens and the tiles (up to sms // kv_heads per head) still fit the workers."""
SPLIT_TILE_MAX_SEQS = 4
"""Up to this many sequences a split tile walks its range for every sequence; above it each split tile takes one
sequence (``split_tiles``). Measured on an H200 at context ~512, qwen3-8b batch 8 with MMA linears: all 8
sequences in each split tile 11.04 ms vs 9.71 unsplit (2026-11-30, v0.7: a tile walks its range once per
sequence, with two block barriers and a shared-memory merge each time); one sequence per tile, 2 ranges (128
tiles) 7.568 ms vs 7.374 unsplit (v0.12)."""
AUTO_SPLIT_MAX_BATCH = 1
"""'auto' splits only programs of at most this many sequences. Since the unsplit tiles walk on tensor cores
(csrc/tasks/attention_mma_walk.cuh; the split tiles keep the scalar walk) every batch from 2 runs faster unsplit:
at context ~512, one process, qwen3-8b batch 2 5.744 / 5.741 ms unsplit vs 6.412 / 6.393 split, batch 3 6.548 /
6.554 vs 7.590 / 7.602, batch 4 5.706 / 5.696 vs 7.084 / 7.085, qwen3-0.6b batch 2 1.456 / 1.456 vs 1.802 / 1.802
(docs/PERF.md v0.28-v0.29; batch 8: unsplit since v0.7)."""
UNSPLIT_B1_MIN_NEXT_BYTES_PER_POSITION = 32 * 1024
"""At batch 1 'auto' leaves attention unsplit when the weights of the linear that reads its output (o_proj's
shard) hold at least this many bytes per cache position. Measured on an H200 (docs/PERF.md v0.29, one process each,
unsplit vs split, ms): max_seq_len 544: qwen3-8b (o_proj 32 MiB, 62 KB a position) 4.652 / 4.655 vs 4.794 / 4.797,
llama3-8b (the same) 4.447 / 4.450 vs 4.618 / 4.614, qwen3-1.7b (8 MiB, 15 KB) 1.679 / 1.678 vs 1.670 / 1.670,
qwen3-0.6b (4 MiB, 7.7 KB) 1.130 / 1.129 vs 1.101 / 1.100; max_seq_len 2048: qwen3-8b (16 KB) 5.163 / 5.157 vs
5.045 / 5.046. Those unsplit rows ran with o_proj's whole tiles prefetched into L2 behind the 8 walking tiles;
since v0.30 batch 1 plans no prefetch behind attention (runtime/prefetch_plan.py NO_PLAN_BEHIND_ATTENTION_MAX_BATCH,
0.5-0.6% faster: qwen3-8b 4.609 / 4.614 vs 4.639 / 4.643 at max_seq_len 544), so unsplit is ahead by more there. The
split tiles win where the walk is long against the next stream (long caches, small o_proj): the rule above."""


def check_attn_splits(attn_splits) -> int | str:
    """Normalise the option: a positive int or 'auto'; raise InputError otherwise."""
    if isinstance(attn_splits, str):
        text = attn_splits.strip().lower()
        if text == "auto":
            return "auto"
        n = int(text) if text.isdigit() else 0
    else:
        n = int(attn_splits) if isinstance(attn_splits, numbers.Integral) and not isinstance(attn_splits, bool) else 0
    if n < 1:
        raise InputError(f"attn_splits: expected a positive integer or 'auto', got {attn_splits!r}; "
                         "e.g. --attn-splits 4 or --attn-splits auto (1 = one attention task per kv head)")
    return n


def resolve_splits(attn_splits, sms: int, kv_heads: int, max_seq_len: int, batch: int = 1,
                   next_weight_bytes: int = 0) -> int:
    """Number of KV ranges per kv head. 'auto': 1 (no split) above AUTO_SPLIT_MAX_BATCH sequences or when the
    linear after the attention streams ``next_weight_bytes`` >= UNSPLIT_B1_MIN_NEXT_BYTES_PER_POSITION per cache
    position, else enough for kv_heads x splits to about fill ``sms`` workers, but no range shorter than
    MIN_SPLIT_POSITIONS_B1 positions."""
    n = check_attn_splits(attn_splits)
    if n == "auto":
        if batch > AUTO_SPLIT_MAX_BATCH:
            return 1
        if next_weight_bytes >= UNSPLIT_B1_MIN_NEXT_BYTES_PER_POSITION * max_seq_len:
            return 1
        return max(1, min(sms // max(1, kv_heads), max_seq_len // MIN_SPLIT_POSITIONS_B1))
    if n > max_seq_len:
        raise InputError(f"attn_splits: expected at most max_seq_len = {max_seq_len} ranges, got {n}; "
                         "use fewer splits or 'auto'")
    return n


def next_weight_bytes(graph, op) -> int:
    """Bytes of the weights read by the ops that consume ``op``'s first output (o_proj's shard after an attention;
    0 when none reads weights)."""
    out = op.outputs[0]
    total = 0
    for user in graph.ops:
        if out in user.inputs:
            for name in user.inputs:
                t = graph.tensors.get(name)
                if t is not None and t.kind == "weight":
                    total += t.numel * DTYPE_BYTES[t.dtype]
    return total


def split_ranges(max_seq_len: int, splits: int) -> list[tuple[int, int]]:
    """[(s0, s1), ...]: ``splits`` requested ranges of equal length (the last may be shorter; a
    request that would leave trailing ranges empty gets fewer ranges)."""
    per = -(-max_seq_len // splits)
    return [(s0, min(s0 + per, max_seq_len)) for s0 in range(0, max_seq_len, per)]


def seq_tiles(batch: int) -> bool:
    """Whether each split tile takes one sequence (above SPLIT_TILE_MAX_SEQS sequences) instead of all."""
    return batch > SPLIT_TILE_MAX_SEQS


class SplitTile(NamedTuple):
    """One split tile: kv head j, sequences b0 .. b0 + nb - 1, KV range i; ``word``: its merge ticket's
    index (one word per kv head, or per kv head and sequence with one-sequence tiles)."""
    j: int
    b0: int
    nb: int
    i: int
    word: int


def split_tiles(hkv: int, B: int, P: int) -> list[SplitTile]:
    """The split tiles of one attention op in program order: per kv head, per sequence group, per range."""
    groups = [(b, 1) for b in range(B)] if seq_tiles(B) else [(0, B)]
    return [SplitTile(j, b0, nb, i, j * len(groups) + g) for j in range(hkv) for g, (b0, nb) in enumerate(groups)
            for i in range(P)]


def split_tile_rects(tiles: list[SplitTile], rows_per_seq: int, c0, width: int) -> np.ndarray:
    """One rectangle per tile of a [B * rows_per_seq, ...] buffer: its sequences' rows, columns c0(j) .. +width."""
    return np.array([(t.b0 * rows_per_seq, (t.b0 + t.nb) * rows_per_seq, c0(t.j), c0(t.j) + width) for t in tiles],
                    np.int64).reshape(-1, 4)


def lower_split_attention(lw: Lowerer, op: Op, splits: int, merge_last: bool = False) -> None:
    """Append ``<op>/split`` and ``<op>/merge`` (and the scratch buffer) for one attention op; with
    ``merge_last`` (fusion 'attn_merge') no merge op: the last split tile of each kv head merges it."""
    p, B, a = lw.p, lw.B, op.attrs
    hq, hkv, D = a["q_heads"], a["kv_heads"], a["head_dim"]
    q, kc, vc, pos = (p.id(n) for n in op.inputs)
    S, G = lw.g.max_seq_len, hq // hkv
    ranges, P, E, part = split_scratch(lw, op, splits)
    tiles = split_tiles(hkv, B, P)
    ticket = merge_ticket(lw, op, tiles) if merge_last else None
    sp = p.op(op.name + "/split", BY_NAME["attention_split"], op.layer, op.name)
    for t in tiles:
        s0, s1 = ranges[t.i]
        cache_count = (t.nb - 1) * S * hkv * D + (S - 1) * hkv * D + D
        kv_at = t.b0 * S * hkv * D + t.j * D
        sp.add_tile({"Q": (q, t.b0 * hq * D + t.j * G * D, (t.nb - 1) * hq * D + G * D),
                     "K_CACHE": (kc, kv_at, cache_count), "V_CACHE": (vc, kv_at, cache_count),
                     "POSITIONS": (pos, t.b0, t.nb),
                     "OUT": (part, ((t.j * B + t.b0) * P + t.i) * E, (t.nb - 1) * P * E + E),
                     **merge_last_args(lw, op, ticket, t)},
                    {"BATCH": t.nb, "HEAD_DIM": D, "GROUP": G, "Q_STRIDE": hq * D, "KV_POS_STRIDE": hkv * D,
                     "KV_BATCH_STRIDE": S * hkv * D, "POS_BEGIN": s0, "POS_END": s1, "OUT_STRIDE": P * E,
                     "SCALE": a["scale"], "SPLIT_INDEX": t.i})
    qrect = split_tile_rects(tiles, 1, lambda j: j * G * D, G * D)
    # NOTE: the whole head's cache rows, not just the range: qkv_prep's kv tile writes them all, so
    # the finer rectangle would give the same edges.
    kvrect = split_tile_rects(tiles, S, lambda j: j * D, D)
    sp.reads = [Footprint(q, qrect), Footprint(kc, kvrect), Footprint(vc, kvrect.copy()), _all_fp(pos, p, len(tiles))]
    sp.writes = [partial_footprint(part, B, E, tiles)]
    finish_split(lw, op, sp, part, P, E, tiles, ticket)


def merge_ticket(lw: Lowerer, op: Op, tiles: list[SplitTile]) -> int:
    """The 'ticket' buffer ``<op>.ticket``: one word per merge group (kv head, or kv head and sequence:
    ``SplitTile.word``), counting its finished split tiles."""
    return lw.p.buffer(f"{op.name}.ticket", (max(t.word for t in tiles) + 1,), "i32", "ticket")


def merge_last_args(lw: Lowerer, op: Op, ticket: int | None, t: SplitTile) -> dict:
    """TICKET and MERGED of split tile t (both None without the merge in the last tile)."""
    if ticket is None:
        return {"TICKET": None, "MERGED": None, "MERGED_FLAGS": None}
    a = op.attrs
    hq, D, G = a["q_heads"], a["head_dim"], a["q_heads"] // a["kv_heads"]
    return {"TICKET": (ticket, t.word, 1),
            "MERGED": (lw.p.id(op.outputs[0]), t.b0 * hq * D + t.j * G * D, (t.nb - 1) * hq * D + G * D),
            "MERGED_FLAGS": None}  # flagged copy: flag_words.py


def finish_split(lw: Lowerer, op: Op, sp, part: int, P: int, E: int, tiles: list[SplitTile],
                 ticket: int | None) -> None:
    """After a split op's tiles: without a ticket, the merge op; with one, the split tiles also declare
    the head's output columns (the last tile of each head writes them, so every tile of the head is a
    producer of those columns for the op's readers)."""
    if ticket is None:
        lower_merge(lw, op, part, P, E)
        return
    a = op.attrs
    D, G = a["head_dim"], a["q_heads"] // a["kv_heads"]
    o = lw.p.id(op.outputs[0])
    sp.writes.append(Footprint(o, split_tile_rects(tiles, 1, lambda j: j * G * D, G * D)))


def split_scratch(lw: Lowerer, op: Op, splits: int) -> tuple[list[tuple[int, int]], int, int, int]:
    """The KV ranges of ``op`` (an attention op), their count P, the floats E of one (h, b, range) entry
    and the fp32 scratch buffer ``<op>.partial`` [Hkv, B, P, GROUP, D + 2] (2-D view: a row per (h, b))."""
    a = op.attrs
    hkv, D, G = a["kv_heads"], a["head_dim"], a["q_heads"] // a["kv_heads"]
    ranges = split_ranges(lw.g.max_seq_len, splits)
    P, E = len(ranges), G * (D + 2)
    part = lw.p.buffer(f"{op.name}.partial", (hkv, lw.B, P, G, D + 2), "f32", "activation", view=(hkv * lw.B, P * E))
    return ranges, P, E, part


def partial_footprint(part: int, B: int, E: int, tiles: list[SplitTile]) -> Footprint:
    """What split tile t writes of the scratch (2-D view: a row per (kv head, sequence)): the rows of its
    kv head and sequences, the column block of its range."""
    return Footprint(part, np.array([(t.j * B + t.b0, t.j * B + t.b0 + t.nb, t.i * E, (t.i + 1) * E) for t in tiles],
                                    np.int64).reshape(-1, 4))


def lower_merge(lw: Lowerer, op: Op, part: int, P: int, E: int) -> None:
    """Append ``<op>/merge``: one tile per (kv head, sequence) combining its P partials into op's output."""
    p, B, a = lw.p, lw.B, op.attrs
    hq, hkv, D = a["q_heads"], a["kv_heads"], a["head_dim"]
    G, o = hq // hkv, p.id(op.outputs[0])
    mg = p.op(op.name + "/merge", BY_NAME["attention_merge"], op.layer, op.name)
    for j in range(hkv):
        for b in range(B):
            mg.add_tile({"PARTIAL": (part, (j * B + b) * P * E, P * E), "OUT": (o, b * hq * D + j * G * D, G * D)},
                        {"HEAD_DIM": D, "GROUP": G, "SPLITS": P})
    mg.reads = [Footprint(part, np.array([(j * B + b, j * B + b + 1, 0, P * E) for j in range(hkv) for b in range(B)],
                                         np.int64).reshape(-1, 4))]
    mg.writes = [Footprint(o, np.array([(b, b + 1, j * G * D, (j + 1) * G * D) for j in range(hkv) for b in range(B)],
                                       np.int64).reshape(-1, 4))]


MERGE_PHASE_KINDS = ("attention", "attention_prep")
"""Kinds whose block merge is attention_seq's, which can run in phases (csrc/tasks/attention.cuh
``attention_merge_smem_bytes``); the split-KV kinds merge their own way."""

ATTN_MERGE_PHASES = (1, 2, 4)
"""Phases attention_seq's block merge may take (csrc/tasks/attention.cuh kAttnMaxMergePhases)."""


def merge_smem_bytes(nwarps: int, G, D, phases: int):
    """attention_seq's merge in ``phases`` phases (csrc/tasks/attention.cuh ``attention_merge_smem_bytes``; G and D
    may be arrays): one phase nwarps x G x (D + 2) floats; P phases ceil(nwarps / P) slots of G x (D + 2) floats,
    every warp's (m, l) pairs (nwarps x G x 2) and the running sums (G x D)."""
    if phases not in ATTN_MERGE_PHASES:
        raise ValueError(f"merge phases: expected one of {ATTN_MERGE_PHASES}, got {phases}")
    if phases == 1:
        return nwarps * G * (D + 2) * 4
    slots = -(-nwarps // phases)
    return (slots * G * (D + 2) + nwarps * G * 2 + G * D) * 4


def attention_staging_bytes(cg, kind_name: str, worker_threads: int, merge_phases: int = 1) -> int:
    """nwarps x GROUP x (D + 2) floats (csrc/tasks/attention.cuh ``attention_smem_bytes``: the warps'
    partials merged through shared memory), the largest over the program's tasks of ``kind_name``
    (attention, attention_split or attention_prep); 0 without them. ``merge_phases``: the kinds of
    MERGE_PHASE_KINDS merge in that many phases (``merge_smem_bytes``), the others ignore it."""
    p = kind_params(cg, kind_name, "GROUP", "HEAD_DIM")
    if p is None:
        return 0
    G, D = p
    phases = merge_phases if kind_name in MERGE_PHASE_KINDS else 1
    return int(merge_smem_bytes(worker_threads // 32, G, D, phases).max())


def split_smem_bytes(cg, worker_threads: int) -> int:
    """Dynamic shared memory the staged path of csrc/tasks/attention_split.cuh wants: nwarps x GROUP x
    (D + 2) floats (the unsplit attention's formula, ``attention_smem_bytes``), the largest over the
    program's attention_split tasks; 0 without them. With less, the kernel takes its per-warp path
    (same math, one warp per sequence), so the runtime should size its dynamic shared memory to at
    least this (``mpk_dist.runtime.tables.smem_bytes`` counts it)."""
    return attention_staging_bytes(cg, "attention_split", worker_threads)


KV_STAGE_KINDS = ("attention_split", "attention_split_prep")
"""Split-KV tile kinds that can stage their range's cache rows in shared memory (REC_FLAG_STAGE_KV)."""


def _align16(n: np.ndarray) -> np.ndarray:
    return (n + 15) // 16 * 16


def kv_stage_smem_bytes(cg, worker_threads: int) -> int:
    """Dynamic shared memory the split-KV tiles need to stage their range's k and v rows (csrc/tasks/
    attention_split.cuh ``KvStage``): their scratch (the staged merge's nwarps x GROUP x (D + 2) floats, and
    for attention_split_prep the GROUP x D bf16 of q), 16-byte aligned, then BATCH x range x 2 x D bf16; the
    largest over the program's tiles of KV_STAGE_KINDS, 0 without them. The kernel checks the same sum
    against the launch's shared memory and reads the cache directly when it is short (same bits)."""
    need = 0
    for name in KV_STAGE_KINDS:
        p = kind_params(cg, name, "GROUP", "HEAD_DIM", "BATCH", "POS_BEGIN", "POS_END")
        if p is None:
            continue
        G, D, B, s0, s1 = p
        scratch = (worker_threads // 32) * G * (D + 2) * 4
        if name == "attention_split_prep":
            scratch = scratch + G * D * 2
        need = max(need, int((_align16(scratch) + B * (s1 - s0) * 2 * D * 2).max()))
    return need

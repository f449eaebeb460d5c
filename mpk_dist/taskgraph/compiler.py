"""Compile a model for all (or some) TP ranks: op graph -> lowered program -> events -> arrays, validated.

The dependency structure is computed once, on rank 0, and shared: every rank's graph is
structurally identical (same task-ops, tiles and footprints); ranks differ only in argument offsets
(their slot in receive buffers) and parameters (vocabulary start). This is checked, not assumed.
"""

from __future__ import annotations

import time

import numpy as np

from mpk_dist.config import ModelConfig
from mpk_dist.errors import InputError
from mpk_dist.models import build_graph
from mpk_dist.taskgraph.deps import EventGraph, build_events, reduce_events
from mpk_dist.taskgraph.lowering_comm import lower_graph
from mpk_dist.taskgraph.program import Program
from mpk_dist.taskgraph.serialize import CompiledGraph, serialize
from mpk_dist.taskgraph.validate import validate


def _same_structure(a: Program, b: Program) -> bool:
    if [(o.name, o.kind.opcode, o.tiles) for o in a.ops] != [(o.name, o.kind.opcode, o.tiles) for o in b.ops]:
        return False
    for x, y in zip(a.ops, b.ops):
        for fx, fy in zip(x.reads + x.writes, y.reads + y.writes):
            if fx.buf != fy.buf or fx.remote != fy.remote or not np.array_equal(fx.rects, fy.rects):
                return False
    return True


def compile_rank_programs(cfg: ModelConfig, tp: int, batch: int = 1, sms: int = 132, max_seq_len: int = 512,
                          max_steps: int | None = None, ranks: list[int] | None = None, check: bool = True,
                          timings: dict | None = None, fuse=False, attn_splits=1,
                          nucleus: bool = False) -> list[CompiledGraph]:
    """The compiled program of each rank in ``ranks`` (default all), validated when ``check``.

    ``fuse``: fold rms_norm / silu_mul / the tp-1 residual add into the neighbouring linear tiles
    (True = all, or names, see ``mpk_dist.taskgraph.fusion``); default off.
    ``attn_splits``: split-KV attention, N KV ranges per kv head or 'auto' (from ``sms`` and
    ``max_seq_len``; ``mpk_dist.taskgraph.lowering_attention``); default 1 = unsplit.
    ``nucleus``: add the top-p stages to the head (``mpk_dist.taskgraph.lowering_nucleus``); default off.
    """
    from mpk_dist.taskgraph.lowering_attention import check_attn_splits
    from mpk_dist.taskgraph.fusion import fusion_set

    fusions = fusion_set(fuse)
    attn_splits = check_attn_splits(attn_splits)
    if sms < 1 or batch < 1:
        raise InputError(f"--sms / --batch: expected positive integers, got sms={sms}, batch={batch}")
    max_steps = max_seq_len if max_steps is None else max_steps
    ranks = list(range(tp)) if ranks is None else ranks
    t0 = time.perf_counter()
    progs = {r: lower_graph(build_graph(cfg, tp=tp, rank=r, batch=batch, max_seq_len=max_seq_len), sms, max_steps,
                            fusions, attn_splits, nucleus)
             for r in sorted(set(ranks) | {0})}
    flagged = []
    if "flags" in fusions:  # flagged copies of activations (a kernel-side channel: no footprint changes)
        from mpk_dist.taskgraph.flag_words import apply_flag_words

        flagged = [apply_flag_words(p, fusions) for p in progs.values()][0]
    t1 = time.perf_counter()
    eg: EventGraph = reduce_events(build_events(progs[0]))
    t2 = time.perf_counter()
    info = {"model": cfg.architecture or cfg.family, "family": cfg.family, "max_seq_len": max_seq_len,
            "sms": sms, "num_layers": cfg.num_layers}
    if fusions:  # only when on, so unfused programs (and their metadata) stay exactly as before
        info["fusions"] = sorted(fusions)
    if attn_splits != 1:  # likewise: unsplit programs keep their metadata
        info["attn_splits"] = attn_splits
    if nucleus:  # likewise
        info["nucleus"] = True
    out = []
    for r in ranks:
        if not _same_structure(progs[0], progs[r]):
            raise AssertionError(f"rank {r}: task graph structure differs from rank 0")
        cg = serialize(progs[r], eg, info, sms)
        if flagged:
            from mpk_dist.taskgraph.flag_words import skip_waits

            cg.meta["flag_words"] = flagged
            cg.meta["skip_waits"] = np.flatnonzero(skip_waits(cg)).tolist()
        if check:
            same = out and all(np.array_equal(cg.arrays[k], out[0].arrays[k])
                               for k in ("tasks", "events", "waits", "signals", "worker_offsets", "worker_tasks"))
            validate(cg, structure=not same)
        out.append(cg)
    t3 = time.perf_counter()
    if timings is not None:
        timings.update(lower_s=t1 - t0, events_s=t2 - t1, serialize_validate_s=t3 - t2, total_s=t3 - t0)
    return out

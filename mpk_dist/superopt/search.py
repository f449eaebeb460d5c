"""``superoptimize``: search, verify, rank, cache.

Kernel graphs are explored with 1, 2, ... ``max_kernel_ops`` ops (iterative deepening: the fused
forms are found first and a timeout keeps the best so far). Complete graphs are ranked by the
cost model and verified best-first until ``keep`` pass; an optional ``rank`` hook (a callable
taking the verified candidates and returning them reordered, e.g. by GPU timing) reranks them.
Results are cached on disk by graph signature, search parameters and package version.
"""

from __future__ import annotations

import hashlib
import math
import os
import pickle
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from mpk_dist import __version__
from mpk_dist.errors import MpkError
from mpk_dist.superopt.context import Context, SearchConfig
from mpk_dist.superopt.graph import Graph
from mpk_dist.superopt.catalog import BlockCatalog
from mpk_dist.superopt.kernelsearch import TIE_US, KernelSearch
from mpk_dist.superopt.lanes import Lanes
from mpk_dist.superopt.target import analyze
from mpk_dist.superopt.cost import H200
from mpk_dist.superopt.ugraph import DTYPE_BYTES, UGraph, _numel
from mpk_dist.superopt.verify import verify

# 2: grid counts costed at their first loop count that fits in shared memory
# 3: last custom ops from blockmemo (each block graph once, in canonical order)
CACHE_FORMAT = 3
STAT_KEYS = ("explored", "pruned", "z3_queries", "cache_hits", "verified", "rejected", "seconds")


@dataclass
class SearchResult:
    """best: the cheapest verified µGraph (None if none verified); candidates: verified, ranked."""

    best: UGraph | None
    candidates: list
    stats: dict = field(default_factory=dict)

    def __str__(self) -> str:
        s = self.stats
        head = (f"superopt: {len(self.candidates)} verified candidate(s); explored "
                f"{s.get('explored')}, pruned {s.get('pruned')}, z3 queries "
                f"{s.get('z3_queries')}, {s.get('seconds', 0):.2f} s")
        return head + "\n" + (str(self.best) if self.best else "no verified µGraph found")


def cache_dir() -> Path:
    """MPK_CACHE_DIR/superopt, or ~/.cache/mpk_dist/superopt."""
    base = os.environ.get("MPK_CACHE_DIR")
    root = Path(base) if base else Path.home() / ".cache" / "mpk_dist"
    return root / "superopt"


def cache_key(g: Graph, config: SearchConfig) -> str:
    """Hash of graph signature (ops, shapes, constants), search parameters and versions."""
    text = f"{g.signature()}|{config!r}|{__version__}|{CACHE_FORMAT}"
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _load(path: Path):
    try:
        with open(path, "rb") as f:
            return pickle.load(f)
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError):
        return None


def _store(path: Path, res: SearchResult) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        with open(tmp, "wb") as f:
            pickle.dump(res, f)
        os.replace(tmp, path)  # atomic: a concurrent reader sees the old file or the new one
    except OSError:
        pass  # a cache that cannot be written only costs a later search


def _check_args(max_kernel_ops, max_block_ops, timeout_s, processes) -> None:
    for name, v in (("max_kernel_ops", max_kernel_ops), ("max_block_ops", max_block_ops)):
        if not isinstance(v, int) or v < 1:
            raise MpkError(f"superoptimize {name}: expected an int >= 1, got {v!r}")
    if not timeout_s or timeout_s <= 0:
        raise MpkError(f"superoptimize timeout_s: expected seconds > 0, got {timeout_s!r}")
    if processes is not None and (not isinstance(processes, int) or processes < 1):
        raise MpkError(f"superoptimize processes: expected an int >= 1, got {processes!r}")


def superoptimize(g: Graph, max_kernel_ops: int = 2, max_block_ops: int = 6,
                  timeout_s: float = 60.0, prune: bool = True, processes: int | None = None,
                  cache: bool = True, rank=None, progress=None, profile: bool = False, top_k: int = 4,
                  **bounds) -> SearchResult:
    """Find the cheapest verified µGraph computing ``g``'s output.

    bounds: further SearchConfig fields (grid_counts, loop_counts, max_grid_dims,
    max_custom_inputs, max_block_outputs, keep, trials, dedup: False enumerates last custom ops
    prefix by prefix as before blockmemo, for comparisons).
    processes: worker processes for the block-graph enumeration (default: CPU count, at most 8;
    1 runs in this process).
    rank: optional callable taking the verified candidates and returning them reordered (the
    GPU-timing hook).
    progress: optional callable receiving the stats dict while searching.
    profile: rank the ``top_k`` best candidates by their measured time on the GPU (each compiled
    as a standalone kernel, mpk_dist.superopt.profile.GpuRanker); the timings and where the cost
    model and the measurement disagree land in ``res.stats["profile"]``. Needs a CUDA GPU.
    Raises MpkError for bad bounds; returns a SearchResult (best None if nothing verified).
    """
    _check_args(max_kernel_ops, max_block_ops, timeout_s, processes)
    if profile:
        if rank is not None:
            raise MpkError("superoptimize: expected either profile=True (GPU timing ranks the candidates) or a "
                           "rank= hook, got both")
        from mpk_dist.superopt.profile import GpuRanker, eps_of

        ranker = GpuRanker(top_k=top_k, eps=eps_of(g))
        res = superoptimize(g, max_kernel_ops, max_block_ops, timeout_s, prune, processes, cache, ranker,
                            progress, **bounds)
        return replace(res, stats=dict(res.stats, profile=ranker.report))
    bad = sorted(set(bounds) - set(SearchConfig.__dataclass_fields__))
    if bad:
        raise MpkError(f"superoptimize: expected bounds among "
                       f"{sorted(SearchConfig.__dataclass_fields__)}, got {bad}")
    config = SearchConfig(max_kernel_ops=max_kernel_ops, max_block_ops=max_block_ops,
                          prune=prune, **bounds)
    start = time.monotonic()
    path = cache_dir() / f"{cache_key(g, config)}.pkl"
    if cache:
        hit = _load(path)
        if isinstance(hit, SearchResult):
            stats = dict(hit.stats, cached=True, seconds=time.monotonic() - start)
            return _ranked(replace(hit, stats=stats), rank)
    procs = processes or min(8, os.cpu_count() or 1)
    res = _search(g, config, timeout_s, procs, progress, start)
    if cache and not res.stats.get("timed_out"):
        _store(path, res)
    return _ranked(res, rank)


def _ranked(res: SearchResult, rank) -> SearchResult:
    if rank is None or not res.candidates:
        return res
    order = list(rank(list(res.candidates)))
    return replace(res, best=order[0], candidates=order)


def _search(g: Graph, config: SearchConfig, timeout_s: float, processes: int, progress,
            start: float) -> SearchResult:
    target = analyze(g)
    ctx = Context(target, config, start + timeout_s, progress=progress)
    found: dict = {}
    status: dict = {}     # graph key -> True (verified) / False (rejected)

    def check(ug: UGraph) -> bool:
        # verification of a graph found inside a depth (KernelSearch's branch and bound)
        k = ug.key()
        if k not in status:
            status[k] = verify(ug, g, config.trials)
        return status[k]

    with BlockCatalog(ctx, processes) as catalog:
        # unpruned: last kernel ops on lane processes (lanes.py); the pruned search is unchanged
        lanes = Lanes(ctx, processes) if not config.prune and processes > 1 else None
        try:
            skipped = _depths(g, ctx, catalog, lanes, check, found, status)
        finally:
            if lanes is not None:
                lanes.close()
    ranked = [u for u in _rank(found) if status.get(u.key())][:config.keep]
    stats = _stats(ctx, len(ranked), sum(1 for ok in status.values() if not ok), start,
                   len(found))
    stats.update(timed_out=ctx.timed_out(), processes=processes, skipped_depths=skipped)
    return SearchResult(ranked[0] if ranked else None, ranked, stats)


def _depths(g: Graph, ctx: Context, catalog: BlockCatalog, lanes, check, found: dict,
            status: dict) -> int:
    """Iterative deepening (depth 1, 2, ... ``max_kernel_ops``) into ``found`` / ``status``;
    returns the number of depths skipped by the depth lower bound."""
    config, target = ctx.config, ctx.target
    bound = math.inf      # cost of the best verified graph so far
    for depth in range(1, config.max_kernel_ops + 1):
        if depth_lower_bound(target, depth) >= bound:
            return config.max_kernel_ops - depth + 1  # every such graph costs more than a verified one
        found.update(KernelSearch(ctx, catalog, bound, verify=check, lanes=lanes,
                                  shorter_searched=depth > 1).run(depth))
        ctx.tick(force=True)
        _verify_ranked(g, found, status, config)
        costs = [found[k].cost["time_us"] for k, ok in status.items() if ok]
        bound = min(costs, default=math.inf)
        if ctx.timed_out():
            break
    return 0


def depth_lower_bound(target, depth: int, m=H200) -> float:
    """No graph of ``depth`` kernel ops costs less: a sync point per op, and reading every input
    and writing the output once at full device-memory bandwidth."""
    g = target.graph
    io = 0
    for n in g.nodes:
        if n.op == "input":
            io += _numel(n.shape)
    io += _numel(g.nodes[g.outputs[0]].shape)
    return depth * m.sync_us + io * DTYPE_BYTES / m.hbm_bytes_per_us


def rank_key(ug: UGraph) -> tuple:
    """The order of ``superoptimize``'s candidates: cost, quantized to ``TIE_US``, then the
    graph's canonical text (``UGraph.key``). Both depend on the graph alone, never on which
    worker or lane found it, when, or in which process, so any complete search ranks its
    complete graphs the same way and picks the same best among equal-cost ones (the one whose
    text sorts first)."""
    c = ug.cost["time_us"]
    return (round(c / TIE_US) if math.isfinite(c) else math.inf, ug.key())


def _rank(found: dict) -> list:
    return sorted(found.values(), key=rank_key)


def _verify_ranked(g: Graph, found: dict, status: dict, config: SearchConfig) -> None:
    """Verify the cheapest untried graphs until ``keep`` of the cheapest are verified."""
    good = 0
    for ug in _rank(found):
        if good >= config.keep:
            break
        k = ug.key()
        if k not in status:
            status[k] = verify(ug, g, config.trials)
        good += status[k]


def _stats(ctx: Context, verified: int, rejected: int, start: float, complete: int) -> dict:
    s = ctx.stats()
    s.update(verified=verified, rejected=rejected, complete_graphs=complete,
             seconds=time.monotonic() - start)
    return {k: s.get(k, 0) for k in STAT_KEYS} | {k: v for k, v in s.items() if k not in STAT_KEYS}

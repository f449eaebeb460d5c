"""Pruned and unpruned search side by side: does abstract-expression pruning change the answer?

``compare_prune(g, ...)`` runs ``superoptimize`` twice with the same bounds, ``prune=True`` and
then ``prune=False``, and reports both statistics and whether the two best µGraphs are the same
graph. Sameness is canonical: equal ``UGraph.structure_key()`` (the graph's text without costs and
without the ops' origin comments: every kernel op, block graph, map, count and chain), printed as
a short hash of ``UGraph.key()`` (comments included, as the cache and the docs name graphs). The comparison is *complete* only
when neither search timed out; a timed-out search returns the best graph found so far, so its
"best" says nothing about the whole space.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from mpk_dist.errors import MpkError
from mpk_dist.superopt.graph import Graph
from mpk_dist.superopt.search import SearchResult, superoptimize

# Columns of the comparison table: (stat key, header).
# deduplicated / mismatched: prefixes merged into an explored state and last-op block graphs
# whose output cannot be the target's (blockmemo), counted apart from what pruning removes.
COLUMNS = (("explored", "explored"), ("pruned", "pruned"), ("z3_queries", "z3 queries"),
           ("cache_hits", "cache hits"), ("deduplicated", "deduplicated"),
           ("mismatched", "mismatched"), ("complete_graphs", "complete"),
           ("verified", "verified"), ("rejected", "rejected"), ("seconds", "seconds"))


def graph_hash(ug) -> str | None:
    """Short hash of a µGraph's canonical text (None for no graph)."""
    if ug is None:
        return None
    return hashlib.sha256(ug.key().encode()).hexdigest()[:12]


@dataclass
class PruneComparison:
    """The two results of one comparison (same target, same bounds)."""

    pruned: SearchResult
    unpruned: SearchResult

    @property
    def complete(self) -> bool:
        """True when both searches covered their whole space (no timeout)."""
        return not (self.pruned.stats.get("timed_out") or self.unpruned.stats.get("timed_out"))

    @property
    def same_best(self) -> bool | None:
        """Whether both best µGraphs are the same graph (origin comments aside); None when either
        found none."""
        a, b = self.pruned.best, self.unpruned.best
        if a is None or b is None:
            return None
        return a.structure_key() == b.structure_key()

    def verdict(self) -> str:
        """One line: equal / different / undecided, and why."""
        same = self.same_best
        h = graph_hash(self.pruned.best)
        if same is None:
            return "best graphs equal: undecided (a search found no verified graph)"
        word = "yes" if same else "NO"
        h2 = graph_hash(self.unpruned.best)
        if not same:
            tail = f" (pruned {h}, unpruned {h2})"
        elif h2 == h:
            tail = f" (hash {h})"
        else:
            tail = f" (one structure; the ops' origin comments differ: pruned {h}, unpruned {h2})"
        if not self.complete:
            tail += "; a search timed out, so this compares best-so-far graphs only"
        return f"best graphs equal: {word}{tail}"

    def rows(self) -> list[dict]:
        """One dict per search: prune flag, every column, timed_out, best cost and hash."""
        out = []
        for flag, res in (("on", self.pruned), ("off", self.unpruned)):
            s = res.stats
            row = {"prune": flag, **{k: s.get(k, 0) for k, _ in COLUMNS}}
            row.update(timed_out=bool(s.get("timed_out")), cached=bool(s.get("cached")),
                       best_us=res.best.cost["time_us"] if res.best else None,
                       best_hash=graph_hash(res.best))
            out.append(row)
        return out

    def table(self) -> str:
        """The rows as an aligned text table (units: seconds wall clock, est. µs)."""
        heads = ["prune", *(h for _, h in COLUMNS), "timed out", "best (us)", "best hash"]
        lines = []
        for r in self.rows():
            secs = f"{r['seconds']:.1f}" + (" (cached)" if r["cached"] else "")
            cells = [r["prune"], *(f"{r[k]:,}" for k, _ in COLUMNS[:-1]), secs,
                     "yes" if r["timed_out"] else "no",
                     "-" if r["best_us"] is None else f"{r['best_us']:.2f}",
                     r["best_hash"] or "-"]
            lines.append(cells)
        width = [max(len(x) for x in col) for col in zip(heads, *lines)]
        fmt = "  ".join(f"{{:>{w}}}" for w in width)
        return "\n".join(fmt.format(*row) for row in [heads, *lines])


def compare_prune(g: Graph, timeout_s: float = 60.0, progress=None, **kwargs) -> PruneComparison:
    """Run ``superoptimize(g, prune=True, ...)`` and then with ``prune=False``; same bounds.

    timeout_s: the limit of *each* search. progress: optional callable(flag, stats) with flag
    "on" / "off", called once with zero counters when that search starts. kwargs: everything
    else ``superoptimize`` takes (bounds, processes, cache, rank). Raises MpkError for bad bounds
    (from ``superoptimize``).
    """
    if "prune" in kwargs:
        raise MpkError("compare_prune: expected no 'prune' argument (both values run), got "
                       f"prune={kwargs['prune']!r}; drop it")
    results = {}
    for flag, prune in (("on", True), ("off", False)):
        report = None
        if progress is not None:
            report = (lambda s, f=flag: progress(f, s))
            report({"explored": 0, "pruned": 0, "z3_queries": 0})  # this search starts now
        results[flag] = superoptimize(g, timeout_s=timeout_s, prune=prune, progress=report,
                                      **kwargs)
    return PruneComparison(results["on"], results["off"])

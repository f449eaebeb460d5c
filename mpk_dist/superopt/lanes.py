"""Last kernel ops of unpruned searches on worker processes ("lanes").

In an unpruned search the last kernel op is searched once per first op (attention_decode at
depth 2: ~10^5 first ops whose best-first key can beat the verified cost), and that work
(``blockshare`` signatures, the per-input test, costing) ran in the calling process while the
catalog's pool sat idle once the first ops were listed. Here ``KernelSearch`` hands each first op
whose next op is the last one to a lane instead of descending itself: a lane is a one-process
pool with its own ``KernelSearch`` (its own context, catalog and ``blockshare`` signatures), and
it runs exactly ``KernelSearch._dfs`` for that op with the caller's bound at hand-off time. It
sends back the complete graphs it found (the last op and its outputs) and its counters; the
caller records them with ``KernelSearch._record`` (cost, verification, bound) as if it had
found them itself.

Why the result is the same: a lane explores the same last ops the caller would (same code, same
tensors, the same canonical ``prev``), under a bound that is the caller's bound at hand-off time
or higher (a graph verified later only lowers it), so it cuts less, never more, and every
complete graph goes through the caller's ``_record``. The order in which graphs are recorded
changes, which changes nothing in the ranked result (cost, then text) but may change which
graphs get verified along the way. A first op is routed by its inputs and output shapes, so the
first ops that need the same last-op signatures mostly meet in one lane (each lane builds its
own). Used only without pruning (``KernelSearch`` with ``lanes``), so the pruned search, the one
production runs, is unchanged.
"""

from __future__ import annotations

import multiprocessing
from collections import deque

_LANE = None  # the lane process's KernelSearch


def _init_lane(target, config, deadline) -> None:
    global _LANE
    from mpk_dist.superopt.catalog import BlockCatalog
    from mpk_dist.superopt.context import Context
    from mpk_dist.superopt.kernelsearch import KernelSearch

    class Collect(KernelSearch):
        """A lane's search: complete graphs are collected, not recorded (the caller does)."""

        def _record(self, tensors: dict, ops: list, out: str) -> None:
            last = ops[-1]
            self.found.append((last, {n: tensors[n] for n in last.outputs}, out))

    ctx = Context(target, config, deadline)
    _LANE = Collect(ctx, BlockCatalog(ctx, 1))


def _lane_task(batch: list):
    """[complete graphs (last op, its outputs, the output name)] per hand-off of ``batch``, and
    the lane's counters since the last task."""
    ks = _LANE
    before = ks.ctx.stats()
    out = []
    for tensors, ops, prev, spent, bound in batch:
        ks.bound = bound  # the caller's bound at hand-off time
        ks.found = []
        ks._dfs(tensors, ops, prev, 1, spent)
        out.append(ks.found)
    after = ks.ctx.stats()
    return out, {k: after[k] - before.get(k, 0) for k in after}


class Lanes:
    """One-process pools that run the last kernel op for first ops (module docstring)."""

    def __init__(self, ctx, n: int, batch: int = 8, window: int = 4) -> None:
        mp = multiprocessing.get_context("fork")
        self.ctx = ctx
        self.pools = [mp.Pool(1, _init_lane, (ctx.target, ctx.config, ctx.deadline))
                      for _ in range(n)]
        self.batch, self.window = batch, window
        self.open = [[] for _ in range(n)]       # per lane: first ops not sent yet
        self.sent = deque()                      # (lane, AsyncResult, [(tensors, ops)])

    def close(self) -> None:
        """Stop the lane processes."""
        for p in self.pools:
            p.terminate()
            p.join()

    def submit(self, ks, tensors: dict, ops: list, prev, spent: float) -> None:
        """Hand the last op after ``ops`` (``tensors`` so far, ``spent`` their cost) to a lane;
        records what earlier hand-offs found."""
        self.ctx.counts["lane_handoffs"] = self.ctx.counts.get("lane_handoffs", 0) + 1
        first = ops[-1]
        route = (first.inputs, tuple((tensors[n].shape, tensors[n].syms) for n in first.outputs))
        k = hash(route) % len(self.pools)
        self.open[k].append((dict(tensors), list(ops), prev, spent, ks.bound))
        if len(self.open[k]) >= self.batch:
            self._send(k)
        self._collect(ks, block=False)

    def _send(self, k: int) -> None:
        batch, self.open[k] = self.open[k], []
        task = self.pools[k].apply_async(_lane_task, (batch,))
        self.sent.append((k, task, [(t, o) for t, o, *_ in batch]))

    def _collect(self, ks, block: bool) -> None:
        """Record the graphs of finished hand-offs (all of them when ``block``; else only the
        finished ones, waiting for the oldest while too many are in flight)."""
        while self.sent:
            lane, task, items = self.sent[0]
            if not (block or task.ready() or len(self.sent) > self.window * len(self.pools)):
                return
            found, delta = self.ctx.pool_result(task, f"lane {lane}'s last ops")
            self.sent.popleft()
            self.ctx.add_remote(delta)
            for (tensors, ops), graphs in zip(items, found):
                for last, new, out in graphs:
                    ks._record({**tensors, **new}, [*ops, last], out)

    def drain(self, ks) -> None:
        """Send every open batch and record everything the lanes found."""
        for k in range(len(self.pools)):
            if self.open[k]:
                self._send(k)
        self._collect(ks, block=True)

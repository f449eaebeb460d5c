"""Last kernel ops of unpruned searches on worker processes ("lanes").

In an unpruned search the last kernel op is searched once per first op (attention_decode at
depth 2: ~10^5 first ops whose best-first key can beat the verified cost), and that work
(``blockshare`` signatures, the per-input test, costing) ran in the calling process while the
catalog's pool sat idle once the first ops were listed. Here ``KernelSearch`` hands each first op
whose next op is the last one to a lane instead of descending itself: a lane is a one-process
pool with its own ``KernelSearch`` (its own context, catalog and ``blockshare`` signatures), and
it runs exactly what ``KernelSearch._dfs`` runs for that op (``_build`` of the listed move, then
``_take``) with the caller's bound at hand-off time. It sends back the complete graphs it found
(the ops it added and their outputs) and its counters; the caller records them with
``KernelSearch._record`` (cost, verification, bound) as if it had found them itself.

Why the result is the same: a lane explores the same last ops the caller would (same code, same
tensors, the same canonical ``prev``), under a bound that is the caller's bound at hand-off time
or higher (a graph verified later only lowers it), so it cuts less, never more, and every
complete graph goes through the caller's ``_record``. The order in which graphs are recorded
changes, which changes nothing in the ranked result (cost, then text) but may change which
graphs get verified along the way. Used only without pruning (``KernelSearch`` with ``lanes``), so
the pruned search, the one production runs, is unchanged.

Which lane: the first ops that need the same last-op signatures should meet in few lanes (each
lane builds its own signatures), but spread over enough lanes to keep all of them busy. A first
op's *route* (``route_of``: the types of the tensors its last op must read and may read) has a
list of home lanes; it goes to the least loaded of them (first ops handed over and not yet
recorded) unless that lane has more than ``spill`` first ops more than the least loaded lane
overall, which then joins the route's homes (64: a lane's backlog of 64 first ops takes about
as long as building a few signatures; with 16, 8 lanes on 2 cores built 937 signatures in 240 s
where one lane per route built 481).
NOTE: until the fourteenth session a route had one lane (``hash(route) % n``): attention_decode
has few routes, and with 8 lanes one lane did 45 s of 105 s of lane CPU time, one none, and the
main process waited 118 s of 241 s for lane results. A lane with nothing in flight gets a first op
at once (a batch of one); the others get batches of ``batch``, and ``flush`` sends the partial
batches before the caller may wait for something else (a first-op listing).
"""

from __future__ import annotations

import multiprocessing
from collections import deque

WAIT_POLL_S = 0.05
"""How long one wait on the oldest lane task lasts before every task in flight is looked at again
(``Lanes._wait_any``): short beside a batch (seconds), long beside a ``ready()`` test."""

_LANE = None  # the lane process's KernelSearch
_SEED: dict = {}  # the caller's last-op signatures at fork time, for the lanes' contexts

SEEDED = ("_shared_final", "_families", "_shared_table", "_shared_sfp", "_sieve_sfp")
"""What a lane's context takes from its caller's when the lanes start (``Lanes.start``): the
``blockshare`` signatures (with their ``StrippedTable``, whose structure ids the signatures'
sieves use, and the fingerprints) that the caller built at depth 1. qk_norm_rope's depth-1
signature over (Q, G, C, S, R) is the one every first op that makes a tensor of Q's shape and reads
Q needs ((G, C, S, R, t0), the same signature since the seventeenth session); each lane built it
again (~60-80 s on 2 cores). A signature is a function of its key, so a copied one is the one the
lane would build."""

LANE_LISTINGS = 8192
"""How many last-op layout listings (and layout lists) a lane's catalog keeps (``BlockCatalog``'s
``max_listings``, least recently used first). A lane lists the last op once per concrete first-op
output, and nothing released those listings: the unpruned attention_decode run's lanes held 23-27 k
of them after 200 s and still grew ~0.5 MB/s to the end (fourteenth session, second part). A dropped
listing is listed again, identically, if that output comes back."""


def _init_lane(target, config, deadline) -> None:
    global _LANE
    from mpk_dist.superopt.catalog import BlockCatalog
    from mpk_dist.superopt.context import Context
    from mpk_dist.superopt.kernelsearch import KernelSearch

    class Collect(KernelSearch):
        """A lane's search: complete graphs are collected, not recorded (the caller does)."""

        def _record(self, tensors: dict, ops: list, out: str) -> None:
            mine = ops[self.base:]
            self.found.append((mine, {n: tensors[n] for op in mine for n in op.outputs}, out))

    ctx = Context(target, config, deadline)
    ctx.__dict__.update(_SEED)
    cache = ctx.__dict__.get("_shared_final")
    if cache is not None:
        cache.ctx = ctx  # its counters are the lane's now
    _LANE = Collect(ctx, BlockCatalog(ctx, 1, max_listings=LANE_LISTINGS))


def _lane_task(batch: list):
    """[complete graphs (the ops after the hand-off's, their outputs, the output name)] per
    hand-off of ``batch`` (first ops as listed, built here), and the lane's counters since the
    last task."""
    ks = _LANE
    before = ks.ctx.stats()
    out = []
    for tensors, ops, move, spent, bound in batch:
        ks.bound = bound  # the caller's bound at hand-off time
        ks.found, ks.base = [], len(ops)
        # exactly what the caller's KernelSearch._dfs does with a listed move of budget 2
        ks._take(tensors, ops, ks._build(tensors, len(ops), False, move), 2, spent)
        out.append(ks.found)
    after = ks.ctx.stats()
    return out, {k: after[k] - before.get(k, 0) for k in after}


def route_of(tensors: dict, ops: list, reads: tuple, made: dict) -> tuple:
    """A hand-off's route: the types (shape, symbols) of the tensors its last op must read (those
    nobody reads after the move that reads ``reads`` and makes ``made``) and of the others, each
    a sorted multiset. The last op's input sets are the sets of tensors that hold every one of the
    first kind, and a signature's key is its inputs' types (``blockshare.Family.cache_key``), so
    first ops of one route need the same signatures whatever their tensors' names (up to the
    order of inputs whose symbols are equal and shapes differ, which ``blockshare._order``
    breaks by position; tests/superopt/test_lanes.py checks qk_norm_rope's library first ops).

    NOTE: until the eighteenth session the route was the names the move reads and the types it
    makes: qk_norm_rope's G, C and S have one type, and a reduction of G and one of C (the same
    family of last ops over Q, two (128,) vectors, R and a (1,) result) went to both lanes, which
    both built that family (~50-70 s each on 2 cores). Which lane runs a hand-off changes no
    result (module docstring)."""
    read = {a for op in ops for a in op.inputs} | set(reads)
    must = [i for n, i in tensors.items() if n not in read] + list(made.values())
    rest = [i for n, i in tensors.items() if n in read]

    def types(infos: list) -> tuple:
        return tuple(sorted((i.shape, tuple(map(str, i.syms))) for i in infos))

    return types(must), types(rest)


class Lanes:
    """One-process pools that run the last kernel op for first ops (module docstring)."""

    def __init__(self, ctx, n: int, batch: int = 8, window: int = 4, spill: int = 64) -> None:
        """``n`` lanes; they start (fork) at the first hand-off (``start``)."""
        self.ctx = ctx
        self.n = n
        self.pools = None
        self.batch, self.window, self.spill = batch, window, spill
        self.open = [[] for _ in range(n)]       # per lane: first ops not sent yet
        self.sent = deque()                      # (lane, AsyncResult, [(tensors, ops)])
        self.load = [0] * n                      # per lane: first ops handed over, not recorded
        self.busy = [0] * n                      # per lane: tasks sent, not collected
        self.homes: dict = {}                    # route -> lanes that take its first ops

    def start(self) -> None:
        """Fork the lane processes (once, at the first hand-off, so that they start with the
        signatures the caller built before: ``SEEDED``). The caller's own signatures are then
        dropped: with lanes, the caller runs no last op again (every later last op is handed
        over)."""
        if self.pools is not None:
            return
        global _SEED
        ctx = self.ctx
        _SEED = {k: ctx.__dict__[k] for k in SEEDED if k in ctx.__dict__}
        mp = multiprocessing.get_context("fork")
        try:
            self.pools = [mp.Pool(1, _init_lane, (ctx.target, ctx.config, ctx.deadline))
                          for _ in range(self.n)]
        finally:
            _SEED = {}
        ctx.__dict__.pop("_shared_final", None)

    def close(self) -> None:
        """Stop the lane processes."""
        for p in self.pools or ():
            p.terminate()
            p.join()

    def submit(self, ks, tensors: dict, ops: list, move, spent: float) -> None:
        """Hand the listed ``move`` after ``ops`` (``tensors`` so far, ``spent`` their cost) and
        the last op after it to a lane; records what earlier hand-offs found."""
        self.start()
        self.ctx.counts["lane_handoffs"] = self.ctx.counts.get("lane_handoffs", 0) + 1
        k = self._lane(route_of(tensors, ops, move[1], ks._shapes(tensors, move)))
        self.open[k].append((dict(tensors), list(ops), move, spent, ks.bound))
        self.load[k] += 1
        if len(self.open[k]) >= self.batch or not self.busy[k]:
            self._send(k)
        self._collect(ks, block=False)

    def _lane(self, route) -> int:
        """The lane for a first op of ``route`` (module docstring: home lanes, spill)."""
        homes = self.homes.get(route)
        idle = min(range(len(self.pools)), key=self.load.__getitem__)
        if homes is None:
            homes = self.homes[route] = [idle]
        k = min(homes, key=self.load.__getitem__)
        if self.load[k] > self.load[idle] + self.spill:
            homes.append(idle)
            self.ctx.counts["lane_spills"] = self.ctx.counts.get("lane_spills", 0) + 1
            k = idle
        return k

    def flush(self) -> None:
        """Send every partial batch (before the caller waits for something else)."""
        if self.pools is None:
            return
        for k in range(len(self.pools)):
            if self.open[k]:
                self._send(k)

    def _send(self, k: int) -> None:
        batch, self.open[k] = self.open[k], []
        task = self.pools[k].apply_async(_lane_task, (batch,))
        self.busy[k] += 1
        self.sent.append((k, task, [(t, o) for t, o, *_ in batch]))

    def _collect(self, ks, block: bool) -> None:
        """Record the graphs of finished hand-offs (all of them when ``block``; else the finished
        ones, waiting for one more while too many are in flight). Lanes finish out of order, so
        every finished one is looked at, and a wait ends at the first task of ANY lane that
        finishes (``_wait_any``).

        NOTE: until the twenty-fifth session a wait over the window was for the oldest task:
        qk_norm_rope unpruned, the main process sat 136 s and then 227 s on one lane's batch
        (a lane building a last-op signature) while the other lanes had finished theirs and
        waited for work (2 cores); on the H200 host (12 lanes) no progress line came for 288 s."""
        while self.sent:
            done = self._finished()
            if not done and (block or len(self.sent) > self.window * len(self.pools)):
                self.flush()  # idle lanes get their partial batches while this waits
                done = self._wait_any()
            if not done:
                return
            self._record_all(ks, done)

    def _finished(self) -> list:
        """The tasks in flight that are back, oldest first."""
        return [item for item in self.sent if item[1].ready()]

    def _wait_any(self) -> list:
        """The tasks in flight that are back, waiting until one is, but not past the search's
        deadline: then the oldest task is returned as it is, and recording it waits for it as
        every pool wait does (``Context.pool_result``: at most ``POOL_GRACE_S`` more, then the
        clear error of a lost lane)."""
        while True:
            self.sent[0][1].wait(WAIT_POLL_S)
            done = self._finished()
            if done:
                return done
            if self.ctx.timed_out():
                return [self.sent[0]]
            self.ctx.tick()  # the progress line goes on while the main process waits

    def service(self, ks) -> None:
        """Without waiting: send every partial batch and record what the lanes have finished
        (called by a caller that waits for something else, e.g. a first-op listing, so that idle
        lanes get their work and verified graphs lower the bound meanwhile)."""
        if self.pools is None:
            return
        self.flush()
        self._record_all(ks, self._finished())

    def _record_all(self, ks, done: list) -> None:
        """Take the tasks ``done`` out of flight and record them (``_record``)."""
        for item in done:
            self.sent.remove(item)
            self._record(ks, *item)

    def _record(self, ks, lane: int, task, items: list) -> None:
        found, delta = self.ctx.pool_result(task, f"lane {lane}'s last ops")
        self.busy[lane] -= 1
        self.load[lane] -= len(items)
        self.ctx.add_remote(delta)
        for (tensors, ops), graphs in zip(items, found):
            for mine, new, out in graphs:
                ks._record({**tensors, **new}, [*ops, *mine], out)
        if self.open[lane] and not self.busy[lane]:
            self._send(lane)  # the lane is idle: its partial batch goes now

    def drain(self, ks) -> None:
        """Send every open batch and record everything the lanes found."""
        if self.pools is None:
            return
        self.flush()
        self._collect(ks, block=True)

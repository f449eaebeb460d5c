"""Enumeration of kernel graphs: pre-defined ops and custom ops, in canonical order.

A kernel graph is grown one kernel op at a time up to ``max_kernel_ops``. Candidates for the next
op: every pre-defined op (matmul, add, mul, div, sum, a target chain) valid on the tensors so far,
and every custom op over a subset of them (block graphs from ``catalog.BlockCatalog``).
Canonical order: the new op uses a result of the previous op or has a larger key, so a kernel
graph is produced once. A new tensor must pass the pruning oracle and must not repeat an
abstract expression the graph already has. A graph is complete when its newest tensor has the
target's abstract expression and shape and every op contributes to it; complete graphs go to
verification.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections import deque
from itertools import combinations

from mpk_dist.superopt import blocksearch as B
from mpk_dist.superopt.bounds import RestBound, input_infos, move_bound, out_names
from mpk_dist.superopt.catalog import BlockCatalog
from mpk_dist.superopt.context import Context
from mpk_dist.superopt.cost import H200, graph_cost, prim_op_cost
from mpk_dist.superopt.inference import candidate_ops, infer
from mpk_dist.superopt.ugraph import DTYPE_BYTES, KernelOp, TensorInfo, UGraph, _numel

LISTING_POLL_S = 0.02
"""How long the main process waits on a pool listing at a time (``_wait_listing``) before it
looks again at what else is ready, and how often the best-first phase looks at the listings it
set aside while it has other items to take (``_best_first``)."""


class KernelSearch:
    """Depth-first growth of kernel graphs (see module docstring)."""

    # unpruned canonical phase: list and take a subset's custom ops layout by layout (False: the
    # whole subset first, as before the sixteenth session; kept for the comparison test)
    by_layout = True
    # unpruned, with a pool: a depth that is not the last starts the next depth's first
    # first-op listings on the pool (``_prefetch_next_depth``; False: as before, for the test)
    prefetch_next = True
    # unpruned canonical phase with a pool: a layout item whose listing is not back yet lets a
    # later layout item whose listing is back go first (``_ready_layout``; False: in order, as
    # before the twentieth session, for the test)
    ready_first = True
    # ... and a later subset whose layout listing is back is expanded into layout items early
    # (``_ready_layout``; False: only the layout items already in ``pending``, as before the
    # twenty-fifth session, for the test)
    ready_subsets = True
    # the last op's library ops: a result whose stripped fingerprint is not the target's is
    # dropped before its expression is built (``_may_be_output``; False: every one built, as
    # before the twenty-first session, for the test)
    output_gate = True
    # the least layout bound of a subset kept per its tensor types (``_least_layout``; False:
    # computed every time, as before the twenty-first session, for the test)
    least_memo = True
    # unpruned best-first phase with a pool: a layout item whose listing is still on the pool
    # is put aside and the items after it go on; it is listed when it is back (``_best_first``;
    # False: the main process waits for it, as before the twenty-sixth session, for the test)
    defer_listings = True

    def __init__(self, ctx: Context, catalog: BlockCatalog, bound: float = math.inf,
                 verify=None, lanes=None, shorter_searched: bool = False) -> None:
        """``bound``: cost of the best verified graph so far; ``verify``: optional callable
        (UGraph -> bool); a complete graph cheaper than ``bound`` is verified as soon as it is
        found, and if it passes, its cost becomes the bound for the rest of the depth.
        ``lanes``: optional ``lanes.Lanes``; the last kernel op after each first op is then
        searched on a lane process (unpruned searches, see lanes.py).
        ``shorter_searched``: every depth below this one was searched to its end (iterative
        deepening, ``search._depths``), so a graph that completes before its last op adds
        nothing new here; the best-first keys use it (``_item_rest``)."""
        self.ctx = ctx
        self.shorter_searched = shorter_searched
        self.catalog = catalog
        self.bound = bound  # branch and bound: cost of the best verified graph so far
        self.verify = verify
        self.lanes = lanes
        t = ctx.target
        self.inputs = input_infos(t)
        self.out_shape = t.graph.nodes[t.out_node].shape
        self.lower = RestBound(ctx.config, self.out_shape)
        self.candidates: dict = {}

    def run(self, max_ops: int) -> dict:
        """Explore graphs of up to ``max_ops`` kernel ops; returns {key: UGraph}."""
        if self.prefetch_next:
            self._prefetch_next_depth(max_ops)
        self._dfs(dict(self.inputs), [], None, max_ops, 0.0)
        if self.lanes is not None:
            self.lanes.drain(self)
        return self.candidates

    def _dfs(self, tensors: dict, ops: list, prev, budget: int, spent: float) -> None:
        if budget == 0 or self.ctx.timed_out() or spent + H200.sync_us >= self.bound:
            return
        dangling = _dangling(tensors, ops)
        if len(dangling) > budget * self.ctx.config.max_custom_inputs:
            return  # sound bound: every dangling tensor must still be read by some op
        last = budget == 1
        if last:
            moves = self._moves(tensors, ops, prev, True, dangling, spent)
        else:
            listed = self._ordered(tensors, ops, prev, dangling, budget, spent)
            if budget == 2 and self.lanes is not None:
                # NOTE: handed over as listed: the lane builds the op (its block graph's
                # expressions), which took ~25% of the main process's CPU time here
                for m in listed:
                    self.lanes.submit(self, tensors, ops, m, spent)
                return
            moves = (self._build(tensors, len(ops), False, m) for m in listed)
        for move in moves:
            self._take(tensors, ops, move, budget, spent)

    def _take(self, tensors: dict, ops: list, move, budget: int, spent: float) -> None:
        """Extend the graph by the built ``move`` (None: skipped): record it when its result is
        the target's, else search the ops after it; ``tensors`` and ``ops`` are restored."""
        if move is None:
            return
        op, new, key, cost = move
        tensors.update(new)
        ops.append(op)
        done = [n for n, i in new.items() if self._is_output(i)]
        if done:
            self._record(tensors, ops, done[0])
        elif budget > 1:
            self._dfs(tensors, ops, (key, set(new)), budget - 1, spent + cost)
        ops.pop()
        for n in new:
            del tensors[n]

    def _ordered(self, tensors: dict, ops: list, prev, dangling: set, budget: int,
                 spent: float):
        """The moves of a non-last op: in canonical order while no graph is verified, then the
        moves not taken yet best-first (``_best_first``).

        NOTE: without a verified graph the bounds cut nothing and their order is no better than
        the canonical one (qk_norm_rope's first graphs came later in it). Since the ninth session
        the switch happens as soon as a graph is verified, also in the middle of a level
        (attention_decode unpruned verified its first two-op graph after 21 s, and then went on
        through ~10^6 first ops in canonical order). The moves are the same ones either way.

        Unpruned (``by_layout``, since the sixteenth session) a subset's custom ops are listed
        and taken layout by layout (``("L", subset, k)`` items): before, the first move of a
        subset waited for all of its layouts (qk_norm_rope's Q has 7; on 2 cores the whole
        unpruned run handed 70 first ops to the lanes in 470 s, presumably the library ops). A move's key
        is (layout, position), so the same moves are taken, only in another order; layouts not
        listed yet at the switch become layout items of the best-first order."""
        pending = deque(self._moves(tensors, ops, prev, False, set(), spent, custom=False))
        pending.extend(("s", subset, least) for subset, least in
                       self._subsets(tensors, list(tensors), prev, False, set(), spent))
        upcoming = deque(item[1] for item in pending if item[0] == "s")
        by_layout = self.by_layout and not self.ctx.config.prune
        if by_layout and self.ready_first:
            # NOTE: the pool lists the first subsets' layouts while the library moves are handed
            # over (a prefetch: the same listings, only earlier). qk_norm_rope's 70 library first
            # ops kept the main process in ``Lanes._collect`` for ~100 s while a pool worker sat
            # idle, and Q's layouts 1-6 were only submitted when Q's subset came up, ~200 s in
            # (twentieth session), so no ready layout could go first.
            self._prefetch_subsets(tensors, upcoming)
        while pending and self.bound == math.inf and not self.ctx.timed_out():
            item = pending.popleft()
            if item[0] == "s" and by_layout:
                upcoming.popleft()  # this subset: the "s" items come in the same order
                items = self._layout_items(item[1], tensors)
                self._prefetch_subsets(tensors, upcoming)
                pending.extendleft(reversed(items))
            elif item[0] == "s":
                upcoming.popleft()
                self._prefetch_subsets(tensors, upcoming)
                pending.extendleft(reversed(list(
                    self._options(tensors, item[1], prev, False, len(ops)))))
                self._release(ops, budget, item[1], tensors)
            elif item[0] == "L":
                if by_layout and self.ready_first:
                    item = self._ready_layout(item, pending, tensors, upcoming)
                    self._prefetch_subsets(tensors, upcoming)  # a worker may be free now
                # one layout's moves, cheapest first (as ``options`` orders a whole subset)
                moves = sorted(self._options(tensors, item[1], prev, False, len(ops), item[2]),
                               key=lambda m: m[3])
                pending.extendleft(reversed(moves))
                self._release(ops, budget, item[1], tensors, item[2])
            else:
                yield item
        if pending and self.bound < math.inf:
            yield from self._best_first(tensors, ops, prev, dangling, budget, spent, pending)

    def _ready_layout(self, item: tuple, pending, tensors: dict, upcoming=None) -> tuple:
        """The layout item to take now in the unpruned canonical phase: ``item`` (``("L",
        subset, k)``, just taken from the front of ``pending``) when its listing is back from the
        pool (``BlockCatalog.ready``), else the first layout item of ``pending`` whose listing is
        back, ``item`` going back to the front; else (``ready_subsets``) the first subset item
        (``("s", subset, least)``) of ``pending`` with a layout whose listing is back becomes its
        layout items in place (and leaves ``upcoming``), and that layout goes first; ``item``
        again when none is. While it waits, the lanes get their work and their results are
        recorded (``Lanes.service``).

        Why nothing changes but the order: every layout item is still taken once, before the
        switch to best-first or (not taken yet) as an item of ``_best_first``, with the same
        moves (keys (layout, position), the canonical test between moves does not look at the
        order they are taken in), as ``by_layout`` argued for the layouts of one subset; a
        subset item expanded early makes the layout items its turn would have made.
        NOTE: qk_norm_rope's first subset is Q, whose layout 0 ("none") lists 1.9 M first ops
        in ~190 s of a core, while its layouts 1-6 come back within ~30-90 s; the canonical
        phase waited for layout 0 first, and no custom first op reached the lanes within 240 s
        (nineteenth session: 70 hand-offs, the library first ops). Once Q's other layouts were
        taken, the main process still waited 182 s for layout 0 with the next subsets' listings
        back and the lanes idle with partial batches (twenty-fourth session, 2 cores)."""
        cat = self.catalog
        while True:
            if cat.ready(item[1], item[2], tensors, False):
                return item
            for j, other in enumerate(pending):
                if other[0] == "L" and cat.ready(other[1], other[2], tensors, False):
                    del pending[j]
                    pending.appendleft(item)
                    self.ctx.counts["layouts_ready_first"] = \
                        self.ctx.counts.get("layouts_ready_first", 0) + 1
                    return other
            task = cat.pending_task(item[1], item[2], tensors, False)
            if task is None or task.ready() or self.ctx.timed_out():
                # not on the pool (listed here), back under a limit that does not cover this
                # request (listed again), or past the deadline: as before
                return item
            if self.ready_subsets and upcoming is not None and \
                    self._expand_ready_subset(pending, tensors, upcoming):
                continue  # its ready layout is a layout item of ``pending`` now
            self._wait_listing(task)  # until it, or another one, is back

    def _expand_ready_subset(self, pending, tensors: dict, upcoming) -> bool:
        """Replace the first subset item of ``pending`` that has a layout whose listing is back by
        its layout items, in place (what its turn in ``_ordered`` does), and drop the subset from
        ``upcoming``; False when there is none."""
        cat = self.catalog
        for j, other in enumerate(pending):
            if other[0] != "s":
                continue
            if not any(cat.ready(other[1], k, tensors, False)
                       for k in range(len(cat.layouts(other[1], tensors)))):
                continue
            del pending[j]
            upcoming.remove(other[1])
            for layout_item in reversed(self._layout_items(other[1], tensors)):
                pending.insert(j, layout_item)
            self.ctx.counts["subsets_ready_first"] = \
                self.ctx.counts.get("subsets_ready_first", 0) + 1
            return True
        return False

    def _layout_items(self, subset: tuple, tensors: dict) -> list:
        """A subset item's layout items (``("L", subset, k)`` for each of its layouts), their
        listings started on the pool (unpruned canonical phase, ``by_layout``)."""
        ks = range(len(self.catalog.layouts(subset, tensors)))
        self.catalog.prefetch(subset, ks, tensors, False)
        return [("L", subset, k) for k in ks]

    def _prefetch_next_depth(self, max_ops: int) -> None:
        """Unpruned, with a pool, before a depth that is not the last: start the listings the
        next depth's canonical phase asks for first (the layouts of its first input subsets, in
        its order: ``_prefetch_subsets``) on ``processes - 1`` workers, so that the main process
        keeps a core for this depth.

        NOTE: the last op of a depth runs in the main process and the pool waits (qk_norm_rope's
        depth 1: 64-79 s, one of the 2 cores idle; the lanes start at depth 2), and the next
        depth's first listing over Q took 77-140 s CPU from ~140 s on (eighteenth session). A
        prefetched listing is the one the next depth would make (no limit: it serves any later
        request, ``catalog.layout_options``); if that depth asks for none of them (a verified
        graph cuts them, or the depth is skipped), only pool time was spent."""
        config = self.ctx.config
        if config.prune or self.catalog.pool is None or max_ops >= config.max_kernel_ops:
            return
        tensors = dict(self.inputs)
        # the next depth's subsets: the same ``_subsets`` call as its ``_ordered`` at the root
        upcoming = deque(subset for subset, _ in
                         self._subsets(tensors, list(tensors), None, False, set(), 0.0))
        before = len(self.catalog.pending)  # listings (a split one is several pool tasks)
        self._prefetch_subsets(tensors, upcoming, self.catalog.processes - 1)
        n = len(self.catalog.pending) - before
        self.ctx.counts["next_depth_prefetched"] = \
            self.ctx.counts.get("next_depth_prefetched", 0) + n

    def _prefetch_subsets(self, tensors: dict, upcoming, limit: int | None = None) -> None:
        """Unpruned, canonical phase: keep the pool busy with the layouts of the subsets listed
        next (``upcoming``, in canonical order), ``limit`` (default 2 per process) in flight, as
        ``_prefetch_ahead`` does in the best-first phase.

        NOTE: each subset's layouts were enumerated only when the subset came up, and the main
        process waited for its slowest layout: at most a subset's layouts (7 for Q) ran at once
        however many processes there were, and the lanes waited too. A prefetched listing is the
        same listing (no limit: it serves any later request); one that the best-first phase
        never asks for only cost pool time."""
        if self.ctx.config.prune or self.catalog.pool is None:
            return  # the pruned search lists as before (the one production runs)
        limit = 2 * self.catalog.processes if limit is None else limit
        for subset in upcoming:
            for k in range(len(self.catalog.layouts(subset, tensors))):
                if self.catalog.in_flight() >= limit:
                    return
                self.catalog.prefetch(subset, [k], tensors, False)

    def _best_first(self, tensors: dict, ops: list, prev, dangling: set, budget: int,
                    spent: float, items):
        """The moves ``items`` (listed moves and ``("s", subset, least)`` for an input subset
        whose custom ops are not listed yet; a subset is listed layout by layout), in order of a
        lower bound of any complete graph through them (its cost plus ``RestBound.rest`` of what
        it leaves unread; shapes only, see bounds.py), stopping at the first whose bound exceeds
        the verified cost ``self.bound``. Cheap graphs are found and verified early, and then the
        bound cuts. An input subset's custom ops are listed only when the subset's own bound (its
        cheapest layout plus the rest bound of the tensors it leaves unread, before its outputs)
        comes up, and then only the layouts whose own bound can still beat ``self.bound``.
        NOTE: moves are listed without building their block graphs' expressions (``_build`` does
        that for the moves taken): unpruned searches list ~10^6.

        Unpruned with a pool (``defer_listings``), a layout item whose listing is still on the
        pool is put aside (``deferred``) and the items after it go on; it is listed once back
        (its moves join the heap), and the phase ends only when the heap's top exceeds the
        verified cost and nothing deferred is left (``_wait_listing`` meanwhile). Nothing changes but the order: every item
        whose key does not exceed the verified cost is still taken, and the cost only falls.
        NOTE: qk_norm_rope's three layouts over all five inputs have the smallest keys (~2.85 us:
        a first op that reads every input may complete the graph, so no rest bound is added);
        the main process waited for their listing (more than 149 s of a core each, unfinished)
        until the deadline, with the cheaper graphs' first ops not taken (twenty-fifth
        session)."""
        heap: list = []
        order = itertools.count()
        memo: dict = {}
        ahead: list = []  # unpruned: layout items to enumerate on the pool, by key
        for item in items:
            if item[0] in ("s", "L"):
                subset = item[1]
                rest = self._item_rest(tensors, subset, dangling, budget)
                if item[0] == "s":
                    key, item = spent + item[2] + rest, ("s", subset, rest)
                else:  # a layout the canonical phase had not listed yet (``_push_layouts``)
                    lay = self.catalog.layouts(subset, tensors)[item[2]]
                    key = spent + self.lower.layout(lay, tensors, False) + rest
                    item = ("l", subset, item[2])
                    heapq.heappush(ahead, (key, next(order), subset, item[2]))
            else:
                key = self._move_bound(tensors, item, dangling, budget, spent, memo)
            heapq.heappush(heap, (key, next(order), item))
        deferred: list = []  # (key, "l" item) whose listing is still on the pool
        defer = self.defer_listings and not self.ctx.config.prune and self.catalog.pool is not None
        look = 0.0  # when the set-aside listings are looked at next
        while heap or deferred:
            # every later item's bound is at least the top one's; a deferred layout may still
            # add moves under the bound, so the phase waits for it (``_deferred_ready``)
            stuck = not heap or heap[0][0] > self.bound or self.ctx.timed_out()
            if deferred and (stuck or time.monotonic() >= look):
                # NOTE: looked at every LISTING_POLL_S, not before every item: each look asks
                # the catalog about every set-aside listing (56 in the twenty-sixth session's
                # run), and the phase pops ~10^5 moves
                look = time.monotonic() + LISTING_POLL_S
                # one listing a turn: taking one (merging a split listing, pushing ~10^5 moves)
                # can take tens of seconds, and the moves it pushed go to the lanes meanwhile
                item = self._deferred_ready(deferred, tensors)
                if item is not None:
                    self._list_layout(heap, order, tensors, ops, prev, dangling, budget, spent,
                                      memo, item)
                    continue
            if stuck:
                if not deferred or self.ctx.timed_out():
                    return
                first = deferred[0][1]
                self._wait_listing(self.catalog.pending_task(first[1], first[2], tensors, False))
                continue
            bound, _, item = heapq.heappop(heap)
            keyed = None if ops else budget  # the pool keys first ops (``bounds.first_op_keys``)
            if item[0] == "s":
                self._push_layouts(heap, order, tensors, item[1], item[2], spent, ahead)
                self._prefetch_ahead(tensors, ahead, dangling, spent, keyed)
            elif item[0] == "l":
                self._prefetch_ahead(tensors, ahead, dangling, spent, keyed)
                if defer and self._to_pool(tensors, item, dangling, spent, keyed):
                    deferred.append((bound, item))
                    self.ctx.counts["layouts_deferred"] = \
                        self.ctx.counts.get("layouts_deferred", 0) + 1
                    continue
                self._list_layout(heap, order, tensors, ops, prev, dangling, budget, spent,
                                  memo, item)
            else:
                yield item

    def _item_rest(self, tensors: dict, subset: tuple, dangling: set, budget: int) -> float:
        """The rest bound of a subset or layout item of ``_best_first``: what the ops after a
        custom op over ``subset`` cost at least (its outputs are not known yet).

        An op that completes the graph reads every unread tensor (else ``_record`` drops it),
        so an op over a subset holding all of ``dangling`` may be the last one: rest 0. Not when
        ``budget`` >= 2 and the shorter depths were searched (``shorter_searched``): a graph that
        completes there has fewer ops than this depth, and a shorter depth has it already, or,
        when the op has a second output nobody reads, a graph without that output (and the
        block ops only it needs) that costs no more (fewer bytes written, the same reads or
        fewer). So every new graph through the op has another op after it: a sync point plus
        writing the target's output at least (``RestBound.floor``).
        NOTE: with rest 0, qk_norm_rope's three layouts over all five inputs had the smallest
        keys at depth 2 (~2.85-3.05 us), so the best-first phase asked for their listings first
        (each more than 149 s of a core, unfinished, twenty-fifth session); with this bound
        they come at ~4.86-5.06 us, after most first ops of the best graphs (~4.87 us). Unpruned
        only: the pruned search (the one production runs, under a time limit that can end it
        with the best graph so far) keeps its order."""
        if not dangling <= set(subset):
            return self.lower.rest(tensors, dangling - set(subset), budget - 1)
        if budget >= 2 and self.shorter_searched and not self.ctx.config.prune:
            return self.lower.floor(tensors, set())
        return 0.0

    def _list_layout(self, heap: list, order, tensors: dict, ops: list, prev, dangling: set,
                     budget: int, spent: float, memo: dict, item: tuple) -> None:
        """``_best_first``'s layout item ``("l", subset, k)``: list the layout (under the
        verified cost's limit) and push its moves whose keys do not exceed that cost."""
        limit = self._list_limit(tensors, item[1], dangling, spent)
        moves = list(self._options(tensors, item[1], prev, False, len(ops), item[2],
                                   limit))  # listed (and keyed) before the keys are read
        keys = self.catalog.keys(item[1], item[2], tensors, budget) if not ops else None
        if keys is not None:
            self.ctx.counts["pool_keys"] = self.ctx.counts.get("pool_keys", 0) + len(moves)
        timed_out = self.ctx.timed_out
        for i, move in enumerate(moves):
            if not i & 4095 and timed_out():
                break  # nothing is taken past the deadline (qk_norm_rope: ~5 x 10^5 moves)
            # the key the pool worker computed, the same function on the same values
            key = keys[move[6][3]] if keys is not None else \
                self._move_bound(tensors, move, dangling, budget, spent, memo)
            if key <= self.bound:
                # NOTE: a move above the bound would only end the loop when popped, as
                # the next item (whose key is at least its own) does: not kept
                heapq.heappush(heap, (key, next(order), move))
        self._release(ops, budget, item[1], tensors, item[2])

    def _to_pool(self, tensors: dict, item: tuple, dangling: set, spent: float,
                 keyed: int | None) -> bool:
        """``_best_first``'s layout item ``("l", subset, k)`` with a pool: True when its listing
        is a pool task that is not back yet; a listing that is neither back nor on the pool is
        put there first (past ``_prefetch_ahead``'s limit of tasks in flight).
        NOTE: with tasks that do not come back for minutes in flight (qk_norm_rope's listings
        over all five inputs), ``_prefetch_ahead`` put nothing more on the pool and the next
        layouts were listed in the main process, one at a time, with the lanes idle (twenty-sixth
        session: no hand-off in the last 160 s)."""
        cat = self.catalog
        limit = self._list_limit(tensors, item[1], dangling, spent)
        if cat.ready(item[1], item[2], tensors, False, limit):
            return False
        if cat.pending_task(item[1], item[2], tensors, False) is None:
            cat.prefetch(item[1], [item[2]], tensors, False, limit, keyed)
        return self._on_pool(tensors, item)

    def _on_pool(self, tensors: dict, item: tuple) -> bool:
        """Is the listing of layout item ``("l", subset, k)`` a pool task that is not back yet
        (so that ``_options`` would wait for it)?"""
        task = self.catalog.pending_task(item[1], item[2], tensors, False)
        return task is not None and not task.ready()

    def _deferred_ready(self, deferred: list, tensors: dict):
        """Take out of ``deferred`` the oldest layout item whose listing is back (returned; None
        when there is none) and those whose key now exceeds the verified cost (dropped:
        ``_best_first`` would stop before them)."""
        deferred[:] = [(key, item) for key, item in deferred if key <= self.bound]
        for j, (_, item) in enumerate(deferred):
            if not self._on_pool(tensors, item):
                del deferred[j]
                return item
        return None

    def _wait_listing(self, task) -> None:
        """Wait up to ``LISTING_POLL_S`` for the pool listing ``task`` (None: not at all) while
        the lanes get their work and their results are recorded (``Lanes.service``) and the
        progress line goes on; the callers look again and stop at the deadline."""
        if self.lanes is not None:
            self.lanes.service(self)
        self.ctx.tick()
        if task is not None:
            task.wait(LISTING_POLL_S)

    def _release(self, ops: list, budget: int, subset: tuple, tensors: dict,
                 layout: int | None = None) -> None:
        """Drop the catalog's listing of ``subset`` (of its layout ``layout``, or all of its
        layouts) once its moves are taken over, when nothing asks for it again: a first op
        (``ops`` empty) of the last depth, followed by the last op only, whose listings
        (``final``) are other ones. With a third op the second level would list the same
        subsets of inputs again, and so would a later depth; their listings stay."""
        if not ops and budget == 2 == self.ctx.config.max_kernel_ops:
            self.catalog.release(subset, tensors, False, layout)

    def _push_layouts(self, heap: list, order, tensors: dict, subset: tuple, rest: float,
                      spent: float, ahead: list) -> None:
        """Push ``("l", subset, k)`` for every layout k of ``subset`` whose bound (its
        ``RestBound.layout`` plus ``rest``, the subset's rest bound) does not exceed the verified
        cost; those are enumerated on the pool meanwhile, the others never (since the ninth
        session: at most a few layouts of a subset can beat a two-op graph's cost)."""
        todo = []
        for k, lay in enumerate(self.catalog.layouts(subset, tensors)):
            key = spent + self.lower.layout(lay, tensors, False) + rest
            if key <= self.bound:
                heapq.heappush(heap, (key, next(order), ("l", subset, k)))
                todo.append(k)
                if not self.ctx.config.prune:
                    heapq.heappush(ahead, (key, next(order), subset, k))
        if self.ctx.config.prune:
            self.catalog.prefetch(subset, todo, tensors, False)

    def _list_limit(self, tensors: dict, subset: tuple, dangling: set, spent: float):
        """Unpruned, once a graph is verified: the ``limit`` under which the catalog lists a
        non-last op's layout over ``subset`` (``catalog.layout_options``), else None.

        A move over ``subset`` gets the key ``spent`` + its cost + the rest bound of what it
        leaves unread (``_move_bound``), or ``spent`` + its cost alone when it leaves no input
        unread. The rest bound is at least a sync point plus the bytes of what is left unread
        (the tensors of ``dangling`` outside ``subset``, the move's outputs) and of the target's
        output at full bandwidth: ``RestBound.rest`` is that floor, or the cheapest layout
        reading all of them, whose device bytes include those. With ``catalog.bytes_lower_bound``
        of the move's own cost (its outputs counted twice when the rest bound applies), a
        structure over the limit has a key above the verified cost ``self.bound``, which only
        falls, so ``_best_first`` would never take it; not costing or listing it changes nothing
        (``TIE_US``: within rounding, kept). NOTE: unpruned only (the pruned search, which
        production runs, lists as before); at attention_decode's 4.58 us about 80% of the
        ~450,000 first ops listed had keys above it (93,904 at or below)."""
        if self.ctx.config.prune or self.bound == math.inf:
            return None
        m = H200
        if not any(n in self.inputs and n not in subset for n in dangling):
            return (self.bound - spent + TIE_US, 1)
        left = sum(_numel(tensors[n].shape) for n in dangling if n not in subset)
        left = (left + _numel(self.out_shape)) * DTYPE_BYTES
        return (self.bound - spent - m.sync_us - left / m.hbm_bytes_per_us + TIE_US, 2)

    def _prefetch_ahead(self, tensors: dict, ahead: list, dangling: set, spent: float,
                        keyed: int | None = None) -> None:
        """Unpruned: keep the pool busy with the layouts of smallest key not listed yet, a few
        (2 per process) at a time, skipping those whose key now exceeds the verified cost.
        ``keyed``: the level's budget when the listed moves are first ops: the pool then
        computes their best-first keys too (``bounds.first_op_keys``; the main process spent ~60% of
        its CPU time on them, and with 16 processes it was the one that limited the search).

        NOTE: the layouts are popped in key order, so these are the next ones the search lists.
        Prefetching every layout whose key was under the bound when its subset came up (as the
        pruned search does) enumerated most first-op layouts of attention_decode at the first
        verified graph's 4.91 us (layouts in submission order, each 4-20 s), most of them above
        the 4.58 us graph found later, and the search waited for them in the pool's queue. Only
        the order of work changes: a layout not prefetched is listed when it is popped."""
        if self.ctx.config.prune:
            return  # _push_layouts prefetched them all
        limit = 2 * max(1, self.catalog.processes)
        while ahead and self.catalog.in_flight() < limit:
            key, _, subset, k = heapq.heappop(ahead)
            if key > self.bound:
                ahead.clear()  # every later one's key is at least this one
                return
            self.catalog.prefetch(subset, [k], tensors, False,
                                  self._list_limit(tensors, subset, dangling, spent), keyed)

    def _move_bound(self, tensors: dict, move, dangling: set, budget: int, spent: float,
                    memo: dict | None = None) -> float:
        """A lower bound of every complete graph through ``move`` (see ``_best_first``);
        ``memo``: rest bounds of one level's moves (the tensors and what is unread are fixed
        there, so the rest bound depends only on what the move reads and the shapes it makes)."""
        return move_bound(self.lower, self.inputs, self.out_shape, tensors, move[1], move[3],
                          self._shapes(tensors, move), dangling, budget, spent, memo)

    def _shapes(self, tensors: dict, move) -> dict:
        """{new tensor: TensorInfo without expression} of a listed move."""
        if move[0] == "p":
            return move[4][1]
        _, subset, n_ops, _, st, sizes, _, shapes = move
        return {n: TensorInfo(shape, syms, None)
                for n, (shape, syms) in zip(out_names(n_ops, len(st.outputs)), shapes)}

    def _is_output(self, info) -> bool:
        return info.expr == self.ctx.target.out_expr and info.shape == self.out_shape

    def _moves(self, tensors: dict, ops: list, prev, last: bool, must_read: set, spent: float,
               custom: bool = True):
        """Next ops. Last op: (op, new tensors, key, cost), built. Other ops: listed moves
        ``("p", args, key, cost, built)`` (library ops; ``custom=False``: only those) and
        ``("c", subset, n_ops, cost, st, sizes, key, output shapes)``, for ``_build``."""
        names = list(tensors)
        infos = [tensors[n] for n in names]
        seen = {i.expr for i in infos}
        fresh = f"t{len(ops)}"
        gate = self._may_be_output(infos) if last and self.output_gate else None
        for kind, args, attrs, akey in self._library_ops(infos, last):
            arg_names = tuple(names[i] for i in args)
            key = ("p", kind, arg_names, akey)
            if not _canonical(key, arg_names, prev):
                continue
            if gate is not None and not gate(kind, args, attrs):
                continue
            info = infer(kind, [infos[i] for i in args], attrs)
            if info is None or info.expr in seen or (last and not self._is_output(info)):
                continue
            if not self.ctx.keep(info.expr):
                continue
            op = KernelOp(kind, arg_names, (fresh,), tuple(sorted(attrs.items())),
                          origin=self.ctx.target.origin_of(info.expr))
            cost = prim_op_cost([i.shape for i in (infos[j] for j in args)], info.shape)
            built = (op, {fresh: info}, key, cost["time_us"])
            yield built if last else ("p", arg_names, key, cost["time_us"], built)
        if not custom:
            return
        for subset, _ in self._subsets(tensors, names, prev, last, must_read, spent):
            if last and not self.ctx.config.prune:
                options = self._last_options(tensors, subset, prev, len(ops), spent)
            else:
                options = self._options(tensors, subset, prev, last, len(ops))
            for move in options:
                if last:
                    move = self._build(tensors, len(ops), last, move)
                    if move is None:
                        continue
                yield move

    def _may_be_output(self, infos: list):
        """A test ``(kind, args, attrs) -> bool`` of library ops on ``infos``: False only when
        the op ``kind`` on ``infos[i] for i in args`` cannot have the target's abstract
        expression: its stripped fingerprint (``blockshare``'s ``Fingerprint(sized=False)``,
        computed from the operands' by ``Fingerprint.op``) is not the target's output's. The
        operands' fingerprints are looked up once per tensor.

        Why exact: every rewrite the expression constructors apply holds for fingerprints
        (``blockmemo.Fingerprint``), so the result's fingerprint is that of the expression
        ``infer`` would build, and equal expressions have equal fingerprints. A last op whose
        expression is not the target's is dropped by ``_moves`` whatever else holds (before
        anything is counted or asked of the oracle), so dropping it earlier changes nothing.
        NOTE: without it the lanes built the expression of every last library op whose shape is
        the target's (~22 per qk_norm_rope first op, most of them new products distributed over
        sums: ~2.0 s of 7.6 s for 3,000 first ops, twenty-first session) to compare it and drop
        it."""
        from mpk_dist.superopt.blockshare import _stripped_fp

        fp = _stripped_fp(self.ctx)
        want = self.__dict__.get("_want_sfp")
        if want is None or want[0] is not fp:
            want = self._want_sfp = (fp, fp.of_expr(self.ctx.target.out_expr))
        vals = [None] * len(infos)

        def test(kind: str, args: tuple, attrs: dict) -> bool:
            for i in args:
                if vals[i] is None:
                    vals[i] = fp.of_expr(infos[i].expr)
            # stripped: reduction sizes do not count (the extent is not read)
            return fp.op(kind, attrs, [vals[i] for i in args], 1) == want[1]

        return test

    def _library_ops(self, infos: list, last: bool):
        """The pre-defined ops (``inference.candidate_ops``: (kind, arg indices, attrs, attr
        key)) on the tensors ``infos``, in its order; for the last op only those whose result
        has the target's shape (the shape-only ``infer``; the expression is built later only for
        them).

        For the last op that list is a function of the tensors' shapes and symbols (the ops
        ``candidate_ops`` yields depend on how many tensors there are and their symbols, the
        shape-only ``infer`` on shapes, symbols and attrs), so it is kept per those
        (``_last_library``, at most ``LIBRARY_MEMO`` entries). NOTE: the unpruned search's lanes
        run the last op once per first op, and ~1 ms of the ~2.3 ms a first op took there
        (qk_norm_rope, 6 tensors: 134 candidate ops, each shape-inferred, for the one or two
        whose shape is the target's) went to this filter (twentieth session)."""
        chains = [p for p, _ in self.ctx.target.chains]
        if not last:
            return candidate_ops(infos, chains)
        memo = self.__dict__.setdefault("_last_library", {})
        types = tuple((i.shape, i.syms) for i in infos)
        hit = memo.get(types)
        if hit is None:
            if len(memo) >= LIBRARY_MEMO:
                memo.clear()
            hit = memo[types] = [
                (kind, args, attrs, akey) for kind, args, attrs, akey in candidate_ops(infos, chains)
                if (r := infer(kind, [infos[i] for i in args], attrs, exprs=False)) is not None
                and r.shape == self.out_shape]
        return hit

    def _subsets(self, tensors: dict, names: list, prev, last: bool, must_read: set,
                 spent: float):
        """(subset, least cost of a custom op over it) for every input subset a custom op may
        read here, in canonical order. A subset none of whose layouts can cost less than what the
        bound leaves is skipped before its catalog is built (``RestBound.layout``: a lower bound
        of every option of a layout)."""
        for r in range(1, self.ctx.config.max_custom_inputs + 1):
            for subset in combinations(names, r):
                if not must_read <= set(subset):
                    continue  # the last op must read every tensor nobody read yet
                if not _canonical(("c", subset, math.inf), subset, prev):
                    continue  # no option of this subset can be canonical here: do not build
                least = self._least_layout(subset, tensors, last)
                if spent + least <= self.bound:
                    yield subset, least

    def _least_layout(self, subset: tuple, tensors: dict, last: bool) -> float:
        """The least ``RestBound.layout`` over the layouts of a custom op over ``subset``.

        A function of the subset's tensor types (shape and symbols, position by position) and
        ``last``: ``blocksearch.layouts`` picks grid and loop symbols from the symbols alone, and
        ``RestBound.layout`` reads the layout's symbols and its inputs' shapes and symbols. So
        it is kept per those (``_least_memo``, at most ``LIBRARY_MEMO`` entries; ``least_memo``
        False: computed every time, as before the twenty-first session, for the test). NOTE:
        a lane asks it for every subset after every first op (qk_norm_rope: ~6 subsets per
        first op, ~8% of a lane's time on (G,)'s first ops, twenty-first session)."""
        memo = self.__dict__.setdefault("_least_memo", {}) if self.least_memo else None
        key = (tuple((tensors[n].shape, tensors[n].syms) for n in subset), last)
        hit = memo.get(key) if memo is not None else None
        if hit is None:
            lays = B.layouts(subset, tensors, self.ctx.config.max_grid_dims)
            hit = min((self.lower.layout(lay, tensors, last) for lay in lays), default=math.inf)
            if memo is not None:
                if len(memo) >= LIBRARY_MEMO:
                    memo.clear()
                memo[key] = hit
        return hit

    def _last_options(self, tensors: dict, subset: tuple, prev, n_ops: int, spent: float):
        """The last op's custom-op moves over ``subset``, layout by layout, only from layouts
        whose bound (``RestBound.layout`` of the last op) leaves the graph no costlier than the
        verified cost ``self.bound`` (unpruned searches).

        Why nothing that could beat or tie the best is lost: every last-op option of a layout
        whose output has the target's shape (the only ones ``_record`` can complete a graph with)
        costs at least the layout's bound (tests/superopt/test_bounds.py), and a graph costs the
        sum of its ops, so such a graph costs more than ``spent`` + that bound > ``self.bound``,
        more than a verified graph. ``TIE_US`` keeps graphs within rounding of a tie. The bound
        is read again before each layout (a graph verified meanwhile lowers it).
        NOTE: unpruned only, so that the pruned search (the one production runs) records the
        same complete graphs as before; unpruned, the last op's catalogs were most of the time
        (each distinct first-op output asks for every layout of its subsets)."""
        for k, lay in enumerate(self.catalog.layouts(subset, tensors)):
            if spent + self.lower.layout(lay, tensors, True) > self.bound + TIE_US:
                self.ctx.counts["layouts_cut"] = self.ctx.counts.get("layouts_cut", 0) + 1
                continue
            yield from self._options(tensors, subset, prev, True, n_ops, k)

    def _options(self, tensors: dict, subset: tuple, prev, last: bool, n_ops: int,
                 layout: int | None = None, limit=None):
        """Custom-op moves ("c", subset, n_ops, cost, Structure, sizes, key, output shapes) of
        one subset (of its layout ``layout`` only, in enumeration order, when given)."""
        if self.lanes is not None:
            self.lanes.flush()  # the listing may wait for the pool: the lanes get their work first
        if layout is None:
            options = self.catalog.options(subset, tensors, final=last)
        else:
            options = [(*o, (layout, j)) for j, o in enumerate(
                self.catalog.layout_options(subset, layout, tensors, last, limit))]
        for st, sizes, cost, shapes, (k, j) in options:
            if self.ctx.timed_out():
                return
            key = ("c", subset, k, j)
            if _canonical(key, subset, prev):
                yield ("c", subset, n_ops, cost, st, sizes, key, shapes)

    def _build(self, tensors: dict, n_ops: int, last: bool, move):
        """(op, new tensors, key, cost) of a listed move; None when its result repeats an
        expression the graph has (or, as the last op, is not the target)."""
        if move[0] == "p":
            return move[4]
        _, subset, _, cost, st, sizes, key, _ = move
        outs = out_names(n_ops, len(st.outputs))
        bg, kinfos = B.instantiate(st, sizes, tensors, outs, self.ctx.target.origin_of)
        seen = {i.expr for i in tensors.values()}
        if any(i.expr in seen for i in kinfos.values()):
            return None
        if last and not any(self._is_output(i) for i in kinfos.values()):
            return None
        origin = ", ".join(dict.fromkeys(o.origin for o in bg.ops() if o.origin))
        return KernelOp("custom", subset, outs, block=bg, origin=origin), kinfos, key, cost

    def _record(self, tensors: dict, ops: list, out: str) -> None:
        live, need = [], {out}
        for op in reversed(ops):
            if need & set(op.outputs):
                live.append(op)
                need |= set(op.inputs)
        if len(live) != len(ops):
            return  # a dead op: the same graph without it is found on its own
        used = {n for n in need if n in self.inputs}
        ug = UGraph({n: self.inputs[n] for n in self.inputs if n in used}, list(ops),
                    dict(tensors), out)
        if set(used) != set(self.inputs):
            return  # the target reads every input; a graph that ignores one is wrong
        ug.cost = graph_cost(ug)
        key = ug.key()
        if key in self.candidates:
            self.ctx.counts["duplicates"] = self.ctx.counts.get("duplicates", 0) + 1
        self.candidates.setdefault(key, ug)
        cost = ug.cost["time_us"]
        if self.verify is not None and cost < self.bound and self.verify(ug):
            self.bound = cost  # branch and bound inside the depth


LIBRARY_MEMO = 4096
"""How many tensor-type tuples ``KernelSearch._library_ops`` keeps the last op's library ops for
(cleared when full; a cleared entry is computed again, identically)."""

TIE_US = 1e-9
"""Costs closer than this (µs) count as equal: the cost model sums per-op floats, and equal sums in another
order can differ in the last bits. The cuts keep graphs within it of the bound; search.rank_key ranks
candidates within it by their text."""


def _dangling(tensors: dict, ops: list) -> set:
    """Tensors (inputs included) that no op reads yet."""
    read = {a for op in ops for a in op.inputs}
    return {n for n in tensors if n not in read}


def _canonical(key: tuple, args: tuple, prev) -> bool:
    if prev is None:
        return True
    prev_key, prev_outs = prev
    return bool(prev_outs & set(args)) or key > prev_key

"""lanes: which lane a first op goes to (home lanes per route, spilling to the least loaded)."""

import multiprocessing
import time
from collections import deque

import pytest

from mpk_dist.superopt.context import Context
from mpk_dist.superopt.lanes import Lanes


class _Ctx:
    def __init__(self) -> None:
        self.counts: dict = {}


def _lanes(n: int, spill: int) -> Lanes:
    # routing only: no lane processes
    lanes = Lanes.__new__(Lanes)
    lanes.ctx, lanes.pools, lanes.spill = _Ctx(), [None] * n, spill
    lanes.load, lanes.homes = [0] * n, {}
    return lanes


def test_one_busy_route_spreads_over_every_lane():
    """The first ops of one route (attention_decode has few routes) go to its home lane until
    that lane holds ``spill`` more than the least loaded one, then to that one, which becomes a
    home too: with the lanes never done, every lane gets work and the loads stay within
    ``spill`` + 1 of each other (one route used to mean one lane)."""
    lanes = _lanes(4, spill=3)
    for _ in range(100):
        lanes.load[lanes._lane("r")] += 1
    assert min(lanes.load) > 0
    assert max(lanes.load) - min(lanes.load) <= lanes.spill + 1
    assert sorted(lanes.homes["r"]) == [0, 1, 2, 3]
    assert lanes.ctx.counts["lane_spills"] == 3


def test_a_route_stays_on_its_home_lanes_while_they_keep_up():
    """A route whose home lane is within ``spill`` of the least loaded one keeps that lane (its
    last-op signatures are built there); a new route starts on the least loaded lane."""
    lanes = _lanes(3, spill=4)
    assert lanes._lane("a") == 0
    lanes.load[0] = 4
    assert lanes._lane("a") == 0              # 4 <= 0 + 4: stays home
    assert lanes._lane("b") == 1              # new route: least loaded lane
    lanes.load[1] = 2
    lanes.load[0] = 7
    assert lanes._lane("a") == 2              # 7 > 0 + 4: spills to lane 2
    assert lanes.homes["a"] == [0, 2]
    lanes.load[2] = 6
    assert lanes._lane("a") == 2              # the least loaded of its homes (6 < 7)
    assert "lane_spills" in lanes.ctx.counts and lanes.ctx.counts["lane_spills"] == 1


def _signature_keys(ctx, tensors: dict, must: set) -> set:
    """Every ``blockshare`` signature key (``Family.cache_key``) that the last custom op over
    ``tensors`` asks for (its input sets hold every tensor of ``must``)."""
    from itertools import combinations

    from mpk_dist.superopt import blocksearch as B
    from mpk_dist.superopt.blockshare import Family

    keys = set()
    names = list(tensors)
    for r in range(1, ctx.config.max_custom_inputs + 1):
        for subset in combinations(names, r):
            if not must <= set(subset):
                continue
            for lay in B.layouts(subset, tensors, ctx.config.max_grid_dims):
                sym_size = {s: x for n in subset
                            for s, x in zip(tensors[n].syms, tensors[n].shape) if s}
                sizes = B.representative_sizes(lay, tensors, sym_size, ctx.config)
                if sizes is not None:
                    fam = Family(ctx, lay, tensors, sizes, sym_size)
                    keys.add(fam.cache_key(tensors, lay.inputs))
    return keys


def test_first_ops_of_one_route_need_the_same_signatures():
    """qk_norm_rope's library first ops (what the 2-core unpruned run hands over first): first
    ops of one route (``route_of``) ask for the same last-op signatures, and first ops over
    different inputs (G, C and S have one type) share routes: each family is built in the
    lanes of one route, not in every lane that got one of its first ops (both lanes built the
    family over Q, two (128,) vectors, R and a (1,) result in the seventeenth session)."""
    import math
    import time

    from mpk_dist.superopt.bounds import input_infos
    from mpk_dist.superopt.catalog import BlockCatalog
    from mpk_dist.superopt.context import Context, SearchConfig
    from mpk_dist.superopt.kernelsearch import KernelSearch
    from mpk_dist.superopt.lanes import route_of
    from mpk_dist.superopt.patterns import build
    from mpk_dist.superopt.target import analyze

    target = analyze(build("qk_norm_rope", {"H": 4, "D": 16}))
    ctx = Context(target, SearchConfig(max_kernel_ops=2, max_block_ops=5, prune=False),
                  time.monotonic() + 60)
    ks = KernelSearch(ctx, BlockCatalog(ctx, 1), math.inf)
    tensors = dict(input_infos(target))
    by_route: dict = {}
    for move in ks._moves(tensors, [], None, False, set(), 0.0, custom=False):
        made = ks._shapes(tensors, move)
        after = {**tensors, **made}
        must = {n for n in tensors if n not in move[1]} | set(made)
        route = route_of(tensors, [], move[1], made)
        keys = frozenset(_signature_keys(ctx, after, must))
        by_route.setdefault(route, set()).add((keys, tuple(sorted(set(move[1])))))
    assert len(by_route) > 5
    for route, items in by_route.items():
        assert len({keys for keys, _ in items}) == 1, route  # one route, one set of signatures
    shared = [items for items in by_route.values() if len({reads for _, reads in items}) > 1]
    assert len(shared) >= 3  # e.g. sum(G), sum(C), sum(S): one route


class _Task:
    """A lane task that finishes ``after`` seconds from now (an AsyncResult's interface)."""

    def __init__(self, after: float, value=None) -> None:
        self.at, self.value = time.monotonic() + after, value

    def ready(self) -> bool:
        return time.monotonic() >= self.at

    def wait(self, timeout: float) -> None:
        time.sleep(max(0.0, min(timeout, self.at - time.monotonic())))

    def get(self, timeout: float):
        self.wait(timeout)
        if not self.ready():
            raise multiprocessing.TimeoutError
        return self.value


class _WaitCtx(_Ctx):
    def __init__(self, deadline: float) -> None:
        super().__init__()
        self.deadline, self.remote, self.ticks = deadline, {}, 0

    def tick(self) -> None:
        self.ticks += 1

    def timed_out(self) -> bool:
        return Context.timed_out(self)

    def add_remote(self, delta: dict) -> None:
        pass

    def pool_result(self, task, what: str):
        return Context.pool_result(self, task, what)


def _waiting_lanes(tasks: list, window: int, deadline: float) -> Lanes:
    """Two lanes with ``tasks`` in flight (each one batch of one first op that found nothing)."""
    lanes = Lanes.__new__(Lanes)
    lanes.ctx, lanes.pools, lanes.window = _WaitCtx(deadline), [None, None], window
    lanes.open, lanes.load, lanes.busy = [[], []], [0, 0], [0, 0]
    lanes.sent = deque()
    for i, task in enumerate(tasks):
        lanes.sent.append((i % 2, task, [({}, [])]))
        lanes.load[i % 2] += 1
        lanes.busy[i % 2] += 1
    return lanes


def test_collect_over_the_window_waits_for_any_lane_not_the_oldest():
    """Over the window the main process waits until ANY lane's task is back, records it and
    goes on (hands more first ops over), instead of waiting for the oldest task (a lane building
    a last-op signature held the main process 136 s and 227 s while the other lanes were idle);
    the wait keeps the progress line going."""
    slow, fast = _Task(3.0, ([[]], {})), _Task(0.2, ([[]], {}))
    lanes = _waiting_lanes([slow, fast, _Task(3.0, ([[]], {}))], window=1,
                           deadline=time.monotonic() + 60)
    t0 = time.monotonic()
    lanes._collect(None, block=False)         # 3 in flight > window 1 x 2 lanes
    took = time.monotonic() - t0
    assert took < 1.5, took                   # before: ~3 s, the oldest task
    left = [item[1] for item in lanes.sent]
    assert len(left) == 2 and slow in left and fast not in left
    assert lanes.busy == [2, 0] and lanes.load == [2, 0]
    assert lanes.ctx.ticks > 0


def test_collect_of_a_lost_lane_ends_with_a_clear_error(monkeypatch):
    """A lane task that never comes back (the lane died) still ends the wait: after the search
    deadline plus ``POOL_GRACE_S`` recording it raises the error naming the lane."""
    from mpk_dist import errors
    from mpk_dist.superopt import context

    monkeypatch.setattr(context, "POOL_GRACE_S", 0.3)
    lanes = _waiting_lanes([_Task(1e9), _Task(1e9)], window=0, deadline=time.monotonic())
    t0 = time.monotonic()
    with pytest.raises(errors.MpkError, match="lane 0's last ops"):
        lanes._collect(None, block=True)
    assert time.monotonic() - t0 < 5


def test_service_sends_partial_batches_and_records_finished_tasks_without_waiting():
    """``service`` (the main process waits for a first-op listing): every partial batch goes
    to its lane, every finished task is recorded, and nothing waits for a running one."""
    done, running = _Task(0.0, ([[]], {})), _Task(60.0)
    lanes = _waiting_lanes([running, done], window=4, deadline=time.monotonic() + 60)
    sent = []
    lanes._send = lambda k: sent.append(k) or lanes.open[k].clear()
    lanes.open[1] = [("first op",)]
    t0 = time.monotonic()
    lanes.service(None)
    assert time.monotonic() - t0 < 0.5
    assert sent == [1]
    assert [item[1] for item in lanes.sent] == [running]
    assert lanes.busy == [1, 0]

"""lanes: which lane a first op goes to (home lanes per route, spilling to the least loaded)."""

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

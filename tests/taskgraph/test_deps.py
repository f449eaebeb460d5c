"""Every dependency edge that survives reduction is necessary: deleting any one wait or signal of a
layer is caught by the interpreter (race reported, wrong result, or deadlock)."""

from __future__ import annotations

import pytest
import torch

from mpk_dist.errors import DeviceTimeout
from mpk_dist.taskgraph.interpreter import Interpreter
from mpk_dist.taskgraph.race import RaceError
from mpk_dist.taskgraph.testing import drop_signal, drop_wait, fp32, programs, rows_of_layer, weights

STEPS = 2
FEED = torch.tensor([[5], [-1]])


def _caught(mutated, ws, baseline) -> str | None:
    """How the interpreter notices the mutation (first of up to 3 schedules), or None."""
    for seed in range(3):
        try:  # stop at the first race: that is all this test needs to know
            res = Interpreter(mutated, ws, seed=seed, on_race="raise").run(STEPS, FEED, torch.tensor([0]))
        except DeviceTimeout:
            return "deadlock"
        except RaceError:
            return "race"
        if not torch.equal(res.captured["logits"], baseline):
            return "wrong result"
    return None


@pytest.mark.parametrize("tp,layer", [(1, 1), (2, 0)])
def test_deleting_any_edge_of_a_layer_is_caught(tp, layer):
    cfg = fp32("tiny")
    cgs, ws = programs(cfg, tp), weights(cfg, tp)
    baseline = Interpreter(cgs, ws, seed=0).run(STEPS, FEED, torch.tensor([0])).captured["logits"]
    missed, tried = [], 0
    for what, begin, end, mutate in (("wait", "WAIT_BEGIN", "WAIT_END", drop_wait),
                                     ("signal", "SIGNAL_BEGIN", "SIGNAL_END", drop_signal)):
        rows = rows_of_layer(cgs[0], layer, begin, end)
        assert rows, f"layer {layer} has no {what} rows"
        for k in rows:
            tried += 1
            if _caught([mutate(cg, k) for cg in cgs], ws, baseline) is None:
                missed.append(f"{what} row {k}")
    assert tried >= 40
    assert not missed, f"deleting these edges went unnoticed: {missed}"

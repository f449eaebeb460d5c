"""Dependent task levels from the serialized tables (mpk_dist.taskgraph.levels), and what the
fusions cut: 11 -> 6 levels per layer at tp 1, 13 -> 10 at tp 2 (the all-reduce keeps its push and
reduce levels)."""

from __future__ import annotations

import numpy as np

from mpk_dist.taskgraph.abi import TASK_COLS
from mpk_dist.taskgraph.levels import level_summary, task_levels
from mpk_dist.taskgraph.testing import drop_wait, fp32, programs


def _level_of(cg, levels, text: str) -> int:
    return int(levels[next(i for i in range(cg.num_tasks) if text in cg.task_label(i))])


def test_levels_follow_the_chain_of_one_unfused_layer():
    (cg,) = programs(fp32("tiny"), 1)
    lv = task_levels(cg)
    assert _level_of(cg, lv, "op step_begin") == 1 and _level_of(cg, lv, "op embedding") == 2
    chain = ["L0.attn_norm", "L0.qkv_proj", "L0.qkv_prep", "L0.attention", "L0.o_proj", "L0.attn_reduce",
             "L0.mlp_norm", "L0.gate_up_proj", "L0.silu_mul", "L0.down_proj", "L0.mlp_reduce"]
    assert [_level_of(cg, lv, f"op {name} (") for name in chain] == list(range(3, 14))
    s = level_summary(cg)
    assert s["per_layer"] == [11, 11] and s["layer_increment"] == [11, 11]
    assert sum(s["layer_increment"]) + s["outside"] == s["step"] == int(lv.max())


def test_fusion_cuts_levels_per_layer():
    for tp, before, after in ((1, 11, 6), (2, 13, 10)):
        plain, fused = (level_summary(programs(fp32("tiny"), tp, fuse=f)[0]) for f in (False, True))
        assert plain["per_layer"] == [before] * 2 and fused["per_layer"] == [after] * 2, (tp, plain, fused)
        assert fused["step"] == plain["step"] - 2 * (before - after) - 1  # and the final norm


def test_a_dropped_wait_shortens_the_chain():
    (cg,) = programs(fp32("tiny"), 1)
    t = cg.arrays["tasks"]
    down = next(i for i in range(cg.num_tasks) if "L1.down_proj" in cg.task_label(i))
    mutated = drop_wait(cg, int(t[down, TASK_COLS["WAIT_BEGIN"]]))  # down_proj no longer waits on silu_mul
    assert task_levels(mutated)[down] < task_levels(cg)[down]
    assert np.all(task_levels(cg, within_layer=True) <= task_levels(cg))

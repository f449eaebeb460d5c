"""Summary numbers: bytes per task follow the tiles' shapes."""

from __future__ import annotations

import numpy as np

from mpk_dist.taskgraph.abi import TASK_COLS
from mpk_dist.taskgraph.summary import layer_dot, summarize, task_traffic
from mpk_dist.taskgraph.testing import fp32, programs


def test_linear_tile_bytes_are_weight_block_plus_activations():
    cfg = fp32("tiny")
    cg = programs(cfg, 1, sms=8)[0]
    traffic = task_traffic(cg)
    t = next(i for i in range(cg.num_tasks) if "L0.o_proj" in cg.task_label(i))
    n = cg.arrays["params"][cg.arrays["tasks"][t, TASK_COLS["PARAM_BEGIN"]] + 2]  # N_TILE
    K, B = 4 * 32, 1
    assert traffic[t, 0] == 4 * (n * K + B * K) and traffic[t, 1] == 4 * B * n
    s = summarize(cg)
    assert s["read_bytes"] == int(traffic[:, 0].sum())
    # at batch 1 the weights dominate what a step reads
    weights = sum(4 * int(np.prod(b["shape"])) for b in cg.meta["buffers"] if b["kind"] == "weight")
    assert 0.9 * weights <= s["read_bytes"] <= 1.5 * weights
    assert "digraph" in layer_dot(cg, 0)

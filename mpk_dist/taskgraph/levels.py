"""Dependent task levels of a compiled step: the longest chain of tasks, from the serialized tables.

Level of a task = 1 + the largest level among the tasks it waits on in the same step (offset-0
waits; an event's producers are the tasks that signal it). With one event round trip and one
task's latency per level, the level count bounds a step's latency from below however many SMs
stream weights in parallel, so it is the figure fusions (``mpk_dist.taskgraph.fusion``) cut.
"""

from __future__ import annotations

import numpy as np

from mpk_dist.taskgraph.abi import TASK_COLS
from mpk_dist.taskgraph.serialize import CompiledGraph


def _producers(cg: CompiledGraph) -> list[list[int]]:
    """Per task, the tasks of the same step it waits on (through offset-0 waits)."""
    tasks, waits, signals = cg.arrays["tasks"], cg.arrays["waits"], cg.arrays["signals"]
    by_event: list[list[int]] = [[] for _ in range(cg.num_events)]
    for t, row in enumerate(tasks):
        for k in range(int(row[TASK_COLS["SIGNAL_BEGIN"]]), int(row[TASK_COLS["SIGNAL_END"]])):
            by_event[int(signals[k, 0])].append(t)
    out = []
    for row in tasks:
        ws = range(int(row[TASK_COLS["WAIT_BEGIN"]]), int(row[TASK_COLS["WAIT_END"]]))
        out.append([p for k in ws if int(waits[k, 1]) == 0 for p in by_event[int(waits[k, 0])]])
    return out


def task_levels(cg: CompiledGraph, within_layer: bool = False) -> np.ndarray:
    """Level (1-based) of every task in the step; ``within_layer`` counts only edges between tasks
    of the same layer (the chain one layer adds on its own). Tasks are stored in dependency order."""
    layer = cg.arrays["tasks"][:, TASK_COLS["LAYER"]]
    level = np.zeros(cg.num_tasks, np.int64)
    for t, preds in enumerate(_producers(cg)):
        if within_layer:
            preds = [p for p in preds if layer[p] == layer[t]]
        level[t] = 1 + max((int(level[p]) for p in preds), default=0)
    return level


def level_summary(cg: CompiledGraph) -> dict:
    """Levels of one step and per decoder layer.

    ``step``: the longest chain of the whole step; ``per_layer``: the longest chain inside each layer
    (its own tasks only); ``layer_increment``: how much each layer adds to the step's chain (level of
    the layer's last task minus the previous layer's, or for layer 0 minus the level of the tasks
    before the layers); ``outside``: the levels of tasks outside layers (step_begin, embedding, head),
    so that sum(layer_increment) + outside == step.
    """
    layer = cg.arrays["tasks"][:, TASK_COLS["LAYER"]]
    full, own = task_levels(cg), task_levels(cg, within_layer=True)
    layers = sorted(int(x) for x in set(layer.tolist()) if x >= 0)
    if not layers:
        return {"step": int(full.max()), "per_layer": [], "layer_increment": [], "outside": int(full.max())}
    first = int(np.nonzero(layer >= 0)[0][0])  # tasks are stored in order: before it, only the prologue
    prologue = int(full[:first].max(initial=0))
    ends = [int(full[layer == i].max()) for i in layers]
    inc = [e - (ends[k - 1] if k else prologue) for k, e in enumerate(ends)]
    return {"step": int(full.max()), "per_layer": [int(own[layer == i].max()) for i in layers],
            "layer_increment": inc, "outside": int(full.max()) - sum(inc)}

"""Kernel-graph search: the early shape check of last custom ops drops only impossible ones."""

import time

from mpk_dist.superopt import blocksearch as B
from mpk_dist.superopt.context import Context, SearchConfig
from mpk_dist.superopt.kernelsearch import _input_infos, _may_have_shape
from mpk_dist.superopt.patterns import build
from mpk_dist.superopt.target import analyze


def test_shape_check_drops_only_structures_that_never_have_the_target_shape():
    target = analyze(build("attention_decode", {"H": 4, "D": 64, "S": 256}))
    config = SearchConfig(max_kernel_ops=1, max_block_ops=3, prune=False, max_grid_dims=2)
    ctx = Context(target, config, time.monotonic() + 60)
    infos = _input_infos(target)
    out_shape = target.graph.nodes[target.out_node].shape
    dropped = kept = 0
    for lay in B.layouts(tuple(infos), infos, config.max_grid_dims):
        for st in B.enumerate_layout(ctx, lay, infos, final=True):
            if _may_have_shape(st, infos, out_shape, config):
                kept += 1
                continue
            dropped += 1
            grids, loops = B.count_choices(st, infos, config)
            for grid in grids:
                for loop in (loops or [None]):
                    sizes = {**grid, **({lay.loop_sym: loop} if loop else {})}
                    _, kinfos = B.instantiate(st, sizes, infos, ("@0",), None)
                    assert kinfos is None or kinfos["@0"].shape != out_shape, (st, sizes)
    assert dropped > 0 and kept > 0

"""Block-graph enumeration: the early dangling-tensor bound changes the work, not the graphs."""

import time

import pytest

from mpk_dist.superopt import blocksearch as B
from mpk_dist.superopt.context import Context, SearchConfig
from mpk_dist.superopt.kernelsearch import _input_infos
from mpk_dist.superopt.patterns import build
from mpk_dist.superopt.target import analyze


def _enumerate(target, names, prune: bool, final: bool, early: bool, block_ops: int = 3):
    config = SearchConfig(max_kernel_ops=1, max_block_ops=block_ops, prune=prune)
    ctx = Context(target, config, time.monotonic() + 60)
    infos = _input_infos(target)
    out = []
    for lay in B.layouts(names, infos, 1):
        out += [(lay, s.body, s.post, s.outputs)
                for s in B.enumerate_layout(ctx, lay, infos, final, early_bound=early, dedup=False)]
    return out, ctx.counts["explored"]


@pytest.mark.parametrize("pattern, shape", [
    ("rmsnorm_linear", {"M": 4, "K": 512, "N": 256}),
    ("attention_decode", {"H": 4, "D": 64, "S": 256}),
])
@pytest.mark.parametrize("final", [True, False])
def test_early_bound_finds_the_same_structures(pattern, shape, final):
    target = analyze(build(pattern, shape))
    names = tuple(target.graph.input_names())
    for prune in (False, True):
        late, late_n = _enumerate(target, names, prune, final, early=False)
        early, early_n = _enumerate(target, names, prune, final, early=True)
        assert early == late and len(set(early)) == len(early)
        assert early and early_n < late_n


def test_every_structure_reads_all_inputs_and_has_few_outputs():
    target = analyze(build("silu_mul_linear", {"M": 2, "I": 64, "N": 32}))
    names = tuple(target.graph.input_names())
    structs, _ = _enumerate(target, names, prune=False, final=True, early=True)
    assert structs
    for lay, body, post, outputs in structs:
        read = {a for _, args, _ in body + post for a in args}
        assert {f"i{k}" for k in range(len(names))} <= read, (lay, body, post)
        assert len(outputs) == 1

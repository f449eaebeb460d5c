"""Pruned vs unpruned search: the same best graph, different work (issue 7, item 4)."""

import pytest

from mpk_dist.errors import MpkError
from mpk_dist.superopt import Graph, superoptimize
from mpk_dist.superopt.compare import compare_prune, graph_hash
from mpk_dist.superopt.patterns import build

SMALL = {"M": 2, "I": 256, "N": 64}
BOUNDS = dict(max_kernel_ops=1, max_block_ops=3, cache=False, processes=1)


@pytest.fixture(scope="module")
def silu_cmp():
    return compare_prune(build("silu_mul_linear", SMALL), timeout_s=60, **BOUNDS)


def test_same_best_graph_with_and_without_pruning(silu_cmp):
    on, off = silu_cmp.pruned, silu_cmp.unpruned
    assert silu_cmp.complete and silu_cmp.same_best is True
    assert on.best.key() == off.best.key()
    assert graph_hash(on.best) == graph_hash(off.best) is not None
    assert "best graphs equal: yes" in silu_cmp.verdict()


def test_stats_show_the_difference(silu_cmp):
    on, off = silu_cmp.pruned.stats, silu_cmp.unpruned.stats
    assert on["pruned"] > 0 and on["z3_queries"] > 0
    assert off["pruned"] == 0 and off["z3_queries"] == 0 and off["cache_hits"] == 0
    assert off["explored"] > on["explored"]
    rows = silu_cmp.rows()
    assert [r["prune"] for r in rows] == ["on", "off"]
    assert rows[0]["explored"] == on["explored"] and rows[1]["best_hash"] == rows[0]["best_hash"]
    table = silu_cmp.table().splitlines()
    assert len(table) == 3 and "explored" in table[0] and "z3 queries" in table[0]


def test_two_step_target_with_three_inputs_fits_two_block_ops():
    """(X*G)@W needs 2 block ops reading 3 inputs: the dangling-tensor bound must allow that
    (an op reads up to two unread inputs)."""
    g = Graph()
    x, w_norm, w = g.input("X", (4, 64)), g.input("G", (64,)), g.input("W", (64, 32))
    g.output(g.matmul(g.mul(x, w_norm), w))
    cmp = compare_prune(g, timeout_s=60, max_kernel_ops=1, max_block_ops=2, cache=False,
                        processes=1)
    assert cmp.same_best is True and cmp.complete
    (op,) = cmp.pruned.best.kernel_ops
    assert op.is_custom and len(op.block.ops()) == 2


def test_differing_or_missing_best_is_reported(silu_cmp):
    from dataclasses import replace

    other = superoptimize(build("silu_mul_linear", SMALL), prune=False, keep=2, **BOUNDS)
    swapped = replace(silu_cmp, unpruned=replace(other, best=other.candidates[1]))
    assert swapped.same_best is False and "best graphs equal: NO" in swapped.verdict()
    empty = replace(silu_cmp, unpruned=replace(other, best=None))
    assert empty.same_best is None and "undecided" in empty.verdict()


def test_origin_comments_alone_do_not_make_another_graph(silu_cmp):
    """Two searches may print one graph with different origin comments (``Target.origin_of`` answered in
    the order a process asked until the fifteenth session): the verdict says equal and names both hashes;
    a changed structure is still another graph."""
    from dataclasses import replace

    def reorigin(ug, origin):
        ops = [replace(op, origin=origin, block=None if op.block is None else replace(
            op.block, body=tuple(replace(b, origin=origin) for b in op.block.body),
            post=tuple(replace(b, origin=origin) for b in op.block.post))) for op in ug.kernel_ops]
        return replace(ug, kernel_ops=ops)

    best = silu_cmp.pruned.best
    other = reorigin(best, "elsewhere#9")
    assert other.key() != best.key() and other.structure_key() == best.structure_key()
    assert "# elsewhere#9" in other.text() and "#9" not in other.structure_key()
    cmp = replace(silu_cmp, unpruned=replace(silu_cmp.unpruned, best=other))
    assert cmp.same_best is True
    assert f"one structure; the ops' origin comments differ: pruned {graph_hash(best)}, unpruned " \
           f"{graph_hash(other)}" in cmp.verdict()
    assert graph_hash(best) != graph_hash(other)


def test_prune_argument_is_refused():
    with pytest.raises(MpkError, match="expected no 'prune' argument"):
        compare_prune(build("silu_mul_linear", SMALL), prune=True, **BOUNDS)

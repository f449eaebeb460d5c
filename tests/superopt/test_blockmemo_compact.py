"""blockmemo's compact completions (thirteenth session: a completion is the ascending ids of its op
descriptors, not a frozenset of descriptors mapped to a frozenset of result nodes; a finished
state keeps them in a tuple, under a key of sorted tuples) give exactly
what the op-set form gave: the same graphs in the same order with the same result nodes, the
same counters, and the same structures through ``enumerate_layout`` and ``blockshare``, pruned
and unpruned, last ops and first ops (issue 7, item 4: the unpruned search's memory)."""

import time

import pytest

from mpk_dist.superopt import blockmemo, blockshare
from mpk_dist.superopt import blocksearch as B
from mpk_dist.superopt.blockmemo import FinalFilter, MemoEnumerator
from mpk_dist.superopt.blockshare import _ShapeOnly
from mpk_dist.superopt.context import Context, SearchConfig
from mpk_dist.superopt.bounds import input_infos
from mpk_dist.superopt.patterns import build
from mpk_dist.superopt.target import analyze
from mpk_dist.superopt.ugraph import TensorInfo


class _OpSets(MemoEnumerator):
    """The enumerator with completions as they were before the compact form: every state's
    {frozenset of descriptors: frozenset of result nodes} (``_join`` is the old code)."""

    def run(self) -> dict:
        return self.completions()

    def ops_of(self, key):
        return key

    def _join(self, out: dict, desc: tuple, x: int, child: dict) -> None:
        fpid = self.fpid
        fx = fpid[x]
        dset, xset = frozenset((desc,)), frozenset((x,))
        for ops, nodes in child.items():
            if any(fpid[y] == fx for y in nodes) and self._repeats(x, nodes):
                continue
            out.setdefault(ops | dset, nodes | xset)

    def _unit(self, out: dict, desc: tuple, x: int) -> None:
        out.setdefault(frozenset((desc,)), frozenset((x,)))

    @staticmethod
    def _done(out: dict) -> None:
        out[frozenset()] = frozenset()

    @staticmethod
    def _merge(out: dict, done: dict) -> None:
        out.update(done)

    @staticmethod
    def _finish(out: dict) -> dict:
        return out


CASES = [  # pattern, shapes, block ops, prune, inputs of the custom op (each case ~1-3 s)
    ("qk_norm_rope", {"H": 4, "D": 32}, 3, False, ("Q", "G")),
    ("qk_norm_rope", {"H": 4, "D": 32}, 4, True, ("Q", "G", "C", "S", "R")),
    ("silu_mul_linear", {"M": 2, "I": 64, "N": 32}, 3, False, ("A", "B", "W")),
    ("attention_decode", {"H": 4, "D": 64, "S": 256}, 3, False, ("Q", "Kt", "V")),
]


def _setup(pattern, shape, ops, prune):
    target = analyze(build(pattern, shape))
    config = SearchConfig(max_kernel_ops=2, max_block_ops=ops, prune=prune)
    return target, config, input_infos(target)


def _sizes(lay, infos, config):
    sym_size = {s: x for n in lay.inputs for s, x in zip(infos[n].syms, infos[n].shape) if s}
    return sym_size, B.representative_sizes(lay, infos, sym_size, config)


def _both(cls_new, cls_old, target, config, lay, infos, sizes, outs, accept):
    runs = []
    for cls in (cls_new, cls_old):
        ctx = Context(target, config, time.monotonic() + 60)
        enum = cls(ctx, lay, infos, sizes, outs, accept() if accept else None)
        runs.append((enum, enum.run(), ctx.stats()))
    return runs


@pytest.mark.parametrize("pattern, shape, ops, prune, subset", CASES)
def test_compact_completions_are_the_op_sets(pattern, shape, ops, prune, subset):
    """Per layout, first ops (two outputs, no filter), last ops (``FinalFilter``) and, unpruned,
    ``blockshare``'s opaque inputs (``_ShapeOnly``): ``run`` gives the same {op set: nodes}, in
    the same order, with the same counters (explored, states, deduplicated, mismatched)."""
    target, config, infos = _setup(pattern, shape, ops, prune)
    graphs = 0
    for lay in B.layouts(subset, infos, 1):
        sym_size, sizes = _sizes(lay, infos, config)
        if sizes is None:
            continue
        variants = [(lay, infos, 2, None),
                    (lay, infos, 1, lambda: FinalFilter(target, lay, sym_size))]
        if not prune:
            names = tuple(f"@{k}" for k in range(len(lay.inputs)))
            ainfos = {a: TensorInfo(infos[n].shape, infos[n].syms, ("v", a))
                      for a, n in zip(names, lay.inputs)}
            alay = B.Layout(names, lay.grid_syms, lay.loop_sym)
            variants.append((alay, ainfos, 1, lambda: _ShapeOnly(target, alay, sym_size)))
        for vlay, vinfos, outs, accept in variants:
            (new, got, s_new), (old, want, s_old) = _both(
                MemoEnumerator, _OpSets, target, config, vlay, vinfos, sizes, outs, accept)
            assert list(got.items()) == list(want.items()), vlay
            assert (new.states, new.deduplicated, new.mismatched) == \
                (old.states, old.deduplicated, old.mismatched), vlay
            assert s_new == s_old, vlay
            assert new.structures(got) == old.structures(want), vlay
            graphs += len(got)
    assert graphs > 100  # the cases are not empty


@pytest.mark.parametrize("pattern, shape, ops, prune, subset", CASES[1:])
def test_enumerate_layout_lists_the_same_structures(monkeypatch, pattern, shape, ops, prune,
                                                    subset):
    """The search's paths (``enumerate_layout``: first ops, with and without a ``keep`` filter on
    the outputs, and last ops, through ``blockshare`` when unpruned) list the same structures,
    with the same counters, as with the op-set form."""
    target, config, infos = _setup(pattern, shape, ops, prune)
    out_shape = target.graph.nodes[target.out_node].shape

    def keep(outs):  # a filter that drops some first ops by their outputs
        return all(shape != out_shape for shape, _ in outs)

    def listing(cls):
        monkeypatch.setattr(blockmemo, "MemoEnumerator", cls)   # enumerate_layout's
        monkeypatch.setattr(blockshare, "MemoEnumerator", cls)  # SharedFinal's
        ctx = Context(target, config, time.monotonic() + 60)
        got = []
        for lay in B.layouts(subset, infos, 1):
            for final, kp in ((False, None), (False, keep), (True, None)):
                got.append(B.enumerate_layout(ctx, lay, infos, final, keep=kp))
        return got, ctx.stats()

    new, s_new = listing(MemoEnumerator)
    old, s_old = listing(_OpSets)
    assert new == old
    assert prune or s_new.get("shared_built", 0) > 0  # unpruned last ops went through blockshare
    assert s_new == s_old
    assert sum(map(len, new)) > 100

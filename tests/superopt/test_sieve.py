"""sieve: the 31-bit stripped fingerprint follows the expressions (so its test is a necessary
condition of the exact one), and the vectorized evaluation gives what ``StrippedTable`` computes
node by node in that field."""

import time

import numpy as np
import pytest

from mpk_dist.superopt import blocksearch as B
from mpk_dist.superopt.blockmemo import FinalFilter, Fingerprint, MemoEnumerator, strip_sums
from mpk_dist.superopt.blockshare import SharedFinal, StrippedTable, stripped_table
from mpk_dist.superopt.bounds import input_infos
from mpk_dist.superopt.context import Context, SearchConfig
from mpk_dist.superopt.patterns import build
from mpk_dist.superopt.sieve import FIELD31, StructureSieve
from mpk_dist.superopt.target import analyze
from mpk_dist.superopt.ugraph import TensorInfo

# attention: the exp chain and div; rms_norm -> matmul: the x*x and sqrt chains
CASES = [("attention_decode", {"H": 4, "D": 64, "S": 256}),
         ("rmsnorm_linear", {"M": 2, "K": 64, "N": 32})]


def _layouts(target, infos: dict, n: int):
    for lay in list(B.layouts(tuple(infos), infos, 1))[:n]:
        sym_size = {s: x for k in lay.inputs for s, x in zip(infos[k].syms, infos[k].shape) if s}
        yield lay, sym_size


@pytest.mark.parametrize("name,shape", CASES)
def test_31_bit_stripped_fingerprints_follow_the_expressions(name, shape):
    """For every tensor an enumeration made, the 31-bit stripped fingerprint computed over its
    stripped structure (what the sieve computes) equals the one of its stripped expression: the
    normalization rules hold in that field too."""
    target = analyze(build(name, shape))
    infos = input_infos(target)
    config = SearchConfig(max_kernel_ops=1, max_block_ops=4, prune=False)
    fp31 = Fingerprint(sized=False, field=FIELD31)
    checked = 0
    for lay, sym_size in _layouts(target, infos, 3):
        sizes = B.representative_sizes(lay, infos, sym_size, config)
        enum = MemoEnumerator(Context(target, config, time.monotonic() + 60), lay, infos, sizes,
                              1, FinalFilter(target, lay, sym_size))
        enum.run()
        table, memo, smemo = StrippedTable(fp31), {}, {}
        table.set_leaves(tuple(fp31.of_expr(infos[n].expr) for n in lay.inputs))
        for node in range(len(enum.shape)):
            info = enum._info(node)
            sid = table.sid(enum.recipe, node, memo)
            assert table.value(sid) == fp31.of_expr(strip_sums(info.expr, smemo)), info
            checked += 1
    assert checked > 300
    a, b = fp31.atom(("v", "a")), fp31.atom(("v", "b"))
    assert fp31.mul(a, fp31.inv(a)) != fp31.mul(b, fp31.inv(b)) and fp31.inv(fp31.inv(a)) == a


@pytest.mark.parametrize("name,shape", CASES)
def test_the_sieve_computes_the_tables_values(name, shape):
    """Per signature (opaque inputs, every layout of all inputs plus one made tensor), the
    vectorized values of every output structure equal ``StrippedTable.value`` over the 31-bit
    fingerprint, for two input sets; and the kept set is the structures equal to the target's."""
    target = analyze(build(name, shape))
    infos = dict(input_infos(target))
    first = next(iter(infos))
    # a made tensor beside the inputs: (first input)^2 (an expression the inputs do not have)
    sq = ("mul", (infos[first].expr, infos[first].expr))
    infos["t0"] = TensorInfo(infos[first].shape, infos[first].syms, sq)
    config = SearchConfig(max_kernel_ops=2, max_block_ops=4, prune=False)
    ctx = Context(target, config, time.monotonic() + 120)
    fp31 = Fingerprint(sized=False, field=FIELD31)
    compared = 0
    for lay, sym_size in _layouts(target, infos, 12):
        sizes = B.representative_sizes(lay, infos, sym_size, config)
        if sizes is None:
            continue
        sf = SharedFinal(ctx, lay, infos, sizes, sym_size)
        sids = sf.sids.tolist()
        if not sids:
            continue  # no output of this layout can have the target's shape
        ref = StrippedTable(fp31)
        ref.defs = stripped_table(ctx).defs
        for names in (lay.inputs, lay.inputs[::-1]):
            leaves = tuple(fp31.of_expr(infos[n].expr) for n in names)
            ref.set_leaves(leaves)
            vp, vr = sf.sieve.values(leaves)
            got = list(zip(vp[sf.sieve.roots].tolist(), vr[sf.sieve.roots].tolist()))
            assert got == [ref.value(s) for s in sids], lay
            want = ref.value(sids[0])
            kept = sf.sieve.matches(leaves, want)
            assert kept.tolist() == [ref.value(s) == want for s in sids]
            compared += len(sids)
    assert compared > 100


def test_the_sieve_on_a_hand_made_table():
    """``StructureSieve`` over a hand-made table: x*y, x+y, div, and a chain with exp and sqrt;
    values by hand from ``Fingerprint``'s scalar operations."""
    fp = Fingerprint(sized=False, field=FIELD31)
    table = StrippedTable(fp)
    prog = ("sqrt", ("add", ("exp", "x"), 2.0))
    table.defs = [("in", 0), ("in", 1), ("mul", {}, (0, 1)), ("add", {}, (0, 1)),
                  ("div", {}, (2, 3)), ("chain", {"prog": prog}, (4,))]
    sieve = StructureSieve(table, [5, 4, 2], fp)
    x, y = fp.atom(("v", "x")), fp.atom(("v", "y"))
    d = fp.mul(fp.mul(x, y), fp.inv(fp.add(x, y)))
    c = fp.sqrt(fp.add(fp.exp(d), fp.atom(("c", 2.0))))
    vp, vr = sieve.values((x, y))
    r = sieve.roots
    assert list(zip(vp[r].tolist(), vr[r].tolist())) == [c, d, fp.mul(x, y)]
    assert sieve.matches((x, y), d).tolist() == [False, True, False]
    assert np.all(vp < FIELD31[0]) and np.all(vr < FIELD31[1])


@pytest.mark.parametrize("name,shape", CASES)
def test_matches_from_r_parts_first_is_the_full_test(name, shape, monkeypatch, t0_signature):
    """``matches`` (r parts of every structure, p parts only under the roots whose r part is the
    wanted one) gives the same array as ``matches_full`` (every structure's whole value, the former
    ``matches``) for the target's value and for values some roots have; and it computes far fewer
    p parts: the elements that go through x**K (``_pow_k``, the p part of inv) are counted."""
    target, infos, config, ctx = t0_signature(name, shape)
    fp31 = Fingerprint(sized=False, field=FIELD31)
    powed = [0]
    real = StructureSieve._pow_k

    def counted(self, x):
        powed[0] += x.size
        return real(self, x)

    monkeypatch.setattr(StructureSieve, "_pow_k", counted)
    full_pow = new_pow = compared = matched = 0
    for lay, sym_size in _layouts(target, infos, 12):
        sizes = B.representative_sizes(lay, infos, sym_size, config)
        if sizes is None:
            continue
        sv = SharedFinal(ctx, lay, infos, sizes, sym_size).sieve
        if not len(sv.roots):
            continue
        for names in (lay.inputs, lay.inputs[::-1]):
            leaves = tuple(fp31.of_expr(infos[n].expr) for n in names)
            vp, vr = sv.values(leaves)
            # the r parts alone, in int32 (half the bytes of ``values``'s int64), equal
            r32 = sv.values_r(leaves)
            assert r32.dtype == np.int32 and r32.tolist() == vr.tolist()
            wants = [fp31.of_expr(target.out_expr)] + \
                [(vp[r], vr[r]) for r in sv.roots[::max(1, len(sv.roots) // 5)].tolist()]
            for want in wants:
                powed[0] = 0
                ref = sv.matches_full(leaves, want)
                full_pow += powed[0]
                powed[0] = 0
                got = sv.matches(leaves, want)
                new_pow += powed[0]
                assert got.tolist() == ref.tolist(), lay
                compared += len(ref)
                matched += int(ref.sum())
    assert compared > 1000 and matched > 10
    assert full_pow > 0 and new_pow * 4 < full_pow, (new_pow, full_pow)

"""blockmemo: the deduplicating enumerator of last custom ops finds exactly the block graphs the
prefix-by-prefix enumerator finds (each once, in its smallest-text order), and the search gives
the same best graph and the same verified graphs with and without it (issue 7, item 4)."""

import itertools
import time

import pytest

from mpk_dist.superopt import blocksearch as B
from mpk_dist.superopt import superoptimize
from mpk_dist.superopt.blockmemo import FinalFilter, MemoEnumerator, canonical_order, strip_sums
from mpk_dist.superopt.context import Context, SearchConfig
from mpk_dist.superopt.bounds import input_infos
from mpk_dist.superopt.patterns import build
from mpk_dist.superopt.target import analyze
from mpk_dist.superopt.ugraph import op_call_text


def _descs(body, post, n_inputs: int) -> frozenset:
    """A structure's ops as blockmemo descriptors (refs by position)."""
    ops, ref = set(), {f"i{k}": ("i", k) for k in range(n_inputs)}
    for k, (kind, args, attrs) in enumerate(body):
        ops.add(("b", kind, attrs, tuple(ref[a] for a in args), ("b", k)))
        ref[f"b{k}"], ref[f"a{k}"] = ("b", k), ("a", k)
    for k, (kind, args, attrs) in enumerate(post):
        ops.add(("p", kind, attrs, tuple(ref[a] for a in args), ("p", k)))
        ref[f"p{k}"] = ("p", k)
    return frozenset(ops)


def _canon(st) -> tuple:
    return canonical_order(_descs(st.body, st.post, len(st.layout.inputs)))


def _output_info(st, sizes, infos):
    bg, _ = B.instantiate(st, sizes, infos, ("o",), lambda e: "")
    if bg is None:
        return None
    src = bg.outputs[0].src
    return next(x.info for x in (*bg.accs, *bg.ops()) if x.out == src)


def _layouts(infos: dict, subsets: bool):
    """Layouts of every input (``subsets``: of every non-empty subset of the inputs, as the
    kernel search asks for custom ops that read some of the tensors)."""
    names = tuple(infos)
    sets = [names] if not subsets else [
        c for r in range(1, len(names) + 1) for c in itertools.combinations(names, r)]
    return [lay for c in sets for lay in B.layouts(c, infos, 1)]


def _both(pattern, shape, ops, prune, final, accept, subsets=False):
    """Per layout: (canonical forms of the prefix enumerator's structures, filtered like the
    memo enumerator, and the memo enumerator's structures). Non-last ops go through
    ``enumerate_layout`` (the search's path: ``dedup`` on, up to ``max_block_outputs`` outputs)."""
    target = analyze(build(pattern, shape))
    infos = input_infos(target)
    config = SearchConfig(max_kernel_ops=1, max_block_ops=ops, prune=prune)
    out = []
    for lay in _layouts(infos, subsets):
        old = B.enumerate_layout(Context(target, config, time.monotonic() + 60), lay, infos,
                                 final, dedup=False)
        sym_size = {s: x for n in lay.inputs for s, x in zip(infos[n].syms, infos[n].shape) if s}
        sizes = B.representative_sizes(lay, infos, sym_size, config)
        if sizes is None:
            assert not old
            continue
        filt = FinalFilter(target, lay, sym_size) if accept else None
        ctx = Context(target, config, time.monotonic() + 60)
        enum = MemoEnumerator(ctx, lay, infos, sizes,
                              1 if final else config.max_block_outputs, filt)
        if final:
            new = enum.structures(enum.run())
        else:
            new = B.enumerate_layout(ctx, lay, infos, final=False, dedup=True)
            enum.deduplicated = ctx.counts["deduplicated"]
        if filt is not None:
            keep = []
            for st in old:
                info = _output_info(st, sizes, infos)
                if info is not None and filt(info.shape, info.syms, filt.fp.of_expr(info.expr)) \
                        and filt.exact(info):
                    keep.append(st)
            old = keep
        out.append((lay, {_canon(s) for s in old}, new, enum))
    return out


@pytest.mark.parametrize("pattern, shape, ops, prune, final, accept", [
    ("rmsnorm_linear", {"M": 4, "K": 512, "N": 256}, 3, False, True, False),
    ("silu_mul_linear", {"M": 2, "I": 64, "N": 32}, 3, False, False, False),
    ("attention_decode", {"H": 4, "D": 64, "S": 256}, 3, True, False, False),
    ("silu_mul_linear", {"M": 2, "I": 64, "N": 32}, 3, False, True, True),
    ("attention_decode", {"H": 4, "D": 64, "S": 256}, 4, False, True, True),
    ("rmsnorm_linear", {"M": 4, "K": 512, "N": 256}, 6, True, True, True),
])
def test_same_block_graphs_as_the_prefix_enumerator(pattern, shape, ops, prune, final, accept):
    _check_same(_both(pattern, shape, ops, prune, final, accept))


# Non-last custom ops (first ops of multi-op graphs): up to max_block_outputs (2) outputs, every
# subset of the inputs (the kernel search asks for each), pruned and unpruned.
# (subsets=False: the layouts of all inputs only, to stay fast)
@pytest.mark.parametrize("pattern, shape, ops, prune, subsets", [
    ("attention_decode", {"H": 4, "D": 64, "S": 256}, 3, False, True),
    ("attention_decode", {"H": 4, "D": 64, "S": 256}, 4, True, True),
    ("rmsnorm_linear", {"M": 4, "K": 512, "N": 256}, 3, False, True),
    ("rmsnorm_linear", {"M": 4, "K": 512, "N": 256}, 5, True, True),
    ("qk_norm_rope", {"H": 4, "D": 32}, 4, True, False),
])
def test_same_non_last_block_graphs_as_the_prefix_enumerator(pattern, shape, ops, prune, subsets):
    results = _both(pattern, shape, ops, prune, final=False, accept=False, subsets=subsets)
    _check_same(results)
    # some graph writes two tensors (a split reduction's partials, say): the case only non-last
    # ops have
    assert any(len(s.outputs) == 2 for _, _, new, _ in results for s in new)


def _check_same(results) -> None:
    found = merged = 0
    for lay, old, new, enum in results:
        forms = [(s.body, s.post, s.outputs) for s in new]
        assert len(set(forms)) == len(forms), lay  # each block graph once
        assert all(_canon(s) == f for s, f in zip(new, forms)), lay  # in canonical order
        assert set(forms) == old, (lay, sorted(old - set(forms))[:2], sorted(set(forms) - old)[:2])
        found += len(forms)
        merged += enum.deduplicated
    assert found > 0 and merged > 0


def test_fingerprints_follow_the_expressions():
    """The op-by-op fingerprints of every tensor the enumerator made (sized, and stripped of
    reductions) equal those of its abstract expression: the normalization rules hold for them."""
    target = analyze(build("attention_decode", {"H": 4, "D": 64, "S": 256}))
    infos = input_infos(target)
    config = SearchConfig(max_kernel_ops=1, max_block_ops=4, prune=False)
    checked = 0
    for lay in list(B.layouts(tuple(infos), infos, 1))[:4]:
        sym_size = {s: x for n in lay.inputs for s, x in zip(infos[n].syms, infos[n].shape) if s}
        sizes = B.representative_sizes(lay, infos, sym_size, config)
        filt = FinalFilter(target, lay, sym_size)
        enum = MemoEnumerator(Context(target, config, time.monotonic() + 60), lay, infos, sizes,
                              1, filt)
        enum.run()
        memo: dict = {}
        for node in range(len(enum.shape)):
            info = enum._info(node)
            assert enum.fps[node] == enum.fp.of_expr(info.expr), info
            assert enum.strip[node] == filt.fp.of_expr(strip_sums(info.expr, memo)), info
            checked += 1
        # x / x is not 1 in the abstract expressions, so not in the fingerprints either
        fp = enum.fp
        a, b = fp.atom(("v", "a")), fp.atom(("v", "b"))
        assert fp.mul(a, fp.inv(a)) != fp.mul(b, fp.inv(b)) and fp.inv(fp.inv(a)) == a
    assert checked > 1000


def test_canonical_order_is_the_smallest_text():
    target = analyze(build("rmsnorm_linear", {"M": 4, "K": 512, "N": 256}))
    infos = input_infos(target)
    config = SearchConfig(max_kernel_ops=1, max_block_ops=4, prune=False)
    lay = B.Layout(("X", "G", "W"), ("n",), None)
    structs = B.enumerate_layout(Context(target, config, time.monotonic() + 60), lay, infos,
                                 final=False, dedup=False)
    for st in structs[::50]:
        best = None
        for order in itertools.permutations(range(len(st.post))):
            text = _text_in_order(st.post, order)
            if text is not None and (best is None or text < best):
                best = text
        body, post, _ = _canon(st)
        assert _text_in_order(post, range(len(post))) == best


def _text_in_order(post, order):
    """The post lines' text with ops placed in ``order`` (None if not topological)."""
    names, lines = {}, []
    for k, j in enumerate(order):
        kind, args, attrs = post[j]
        if any(a.startswith("p") and a not in names for a in args):
            return None
        new = tuple(names.get(a, a) for a in args)
        if kind in ("mul", "add"):
            new = tuple(sorted(new, key=lambda a: (a[0] == "p", int(a[1:]))))
        lines.append(f"p{k} = {op_call_text(kind, attrs, new)}")
        names[f"p{j}"] = f"p{k}"
    return "\n".join(lines)


@pytest.mark.parametrize("pattern, shape, bounds", [
    ("silu_mul_linear", {"M": 2, "I": 64, "N": 32}, dict(max_block_ops=3, prune=False)),
    ("rmsnorm_linear", {"M": 4, "K": 512, "N": 256}, dict(max_block_ops=6, prune=True)),
])
def test_search_finds_the_same_graphs_with_and_without_dedup(pattern, shape, bounds):
    """Every complete graph verified (keep=1000): the same best graph, and the same verified
    graphs once each (without dedup some come in several op orders)."""
    g = build(pattern, shape)
    kw = dict(max_kernel_ops=1, keep=1000, cache=False, processes=1, timeout_s=120, **bounds)
    old = superoptimize(g, dedup=False, **kw)
    new = superoptimize(g, dedup=True, **kw)
    assert new.best.key() == old.best.key()
    forms = [_ugraph_form(u) for u in new.candidates]
    assert len(set(forms)) == len(forms)
    assert set(forms) == {_ugraph_form(u) for u in old.candidates}
    assert new.stats["deduplicated"] > 0 and "deduplicated" not in old.stats
    assert new.stats["verified"] == len(forms) <= old.stats["verified"]
    assert new.stats["complete_graphs"] <= old.stats["complete_graphs"]


def _ugraph_form(ug) -> tuple:
    (op,) = ug.kernel_ops
    bg = op.block
    names = {b.local: b.local for b in bg.inputs}
    body = tuple((o.kind, o.inputs, o.attrs) for o in bg.body)
    post = tuple((o.kind, o.inputs, o.attrs) for o in bg.post)
    return bg.grid, bg.loop, canonical_order(_descs(body, post, len(names)))


def _greedy_order(ops) -> tuple:
    """``canonical_order`` as it was written before the texts were built once per op: at each
    step every op is checked for readiness and the text of every ready op is built, the smallest
    placed (the reference for the current code)."""
    from mpk_dist.superopt.blockmemo import _COMMUTATIVE, _rank

    names: dict = {}

    def place(todo, prefix):
        for d in todo:
            for r in d[3]:
                if r[0] == "i":
                    names.setdefault(r, f"i{r[1]}")
        out, todo = [], list(todo)
        while todo:
            best = None
            for d in todo:
                if not all(r in names for r in d[3]):
                    continue
                args = [names[r] for r in d[3]]
                if len(args) == 2 and d[1] in _COMMUTATIVE and _rank(args[1]) < _rank(args[0]):
                    args.reverse()
                text = op_call_text(d[1], d[2], args)
                if best is None or text < best[0]:
                    best = (text, d, args)
            _, d, args = best
            k = len(out)
            names[d[4]] = f"{prefix}{k}"
            if prefix == "b":
                names[("a", d[4][1])] = f"a{k}"
            out.append((d, (d[1], tuple(args), d[2])))
            todo.remove(d)
        return out

    body = place([d for d in ops if d[0] == "b"], "b")
    post = place([d for d in ops if d[0] == "p"], "p")
    read = {r for d in ops for r in d[3]}
    outputs = [f"a{k}" for k, (d, _) in enumerate(body)
               if d[4] not in read and ("a", d[4][1]) not in read]
    outputs += [f"p{k}" for k, (d, _) in enumerate(post) if d[4] not in read]
    return tuple(o for _, o in body), tuple(o for _, o in post), tuple(outputs)


def test_canonical_order_builds_each_text_once_and_places_as_the_greedy_order(count_calls):
    """``canonical_order`` gives the greedy smallest-text order of the former code (every ready
    op's text built at every step) on the graphs of qk_norm_rope's first-op layouts (H=4, D=16,
    unpruned): Q at 4 block ops with no grid and no loop (post ops only), a loop, and a grid and
    a loop (body ops, accumulators), every layout of (Q, G) at 3 block ops; one and two outputs;
    in the enumerator's op order and reversed; and it builds one text per op."""
    from mpk_dist.superopt import blockmemo as M

    target = analyze(build("qk_norm_rope", {"H": 4, "D": 16}))
    infos = input_infos(target)
    texts, _ = count_calls(M, "_ready")
    graphs = ops = 0
    cases = [(4, B.Layout(("Q",), (), None), 5), (4, B.Layout(("Q",), (), "k"), 2),
             (4, B.Layout(("Q",), ("m",), "k"), 2)]
    cases += [(3, lay, 1) for lay in B.layouts(("Q", "G"), infos, 1)]
    for block_ops, lay, step in cases:
        config = SearchConfig(max_kernel_ops=2, max_block_ops=block_ops, prune=False)
        sym_size = {s: x for n in lay.inputs for s, x in zip(infos[n].syms, infos[n].shape) if s}
        sizes = B.representative_sizes(lay, infos, sym_size, config)
        enum = MemoEnumerator(Context(target, config, time.monotonic() + 60), lay, infos,
                              sizes, config.max_block_outputs)
        for key in enum.completions()[::step]:
            g = enum.ops_of(key)
            for order in (g, g[::-1]):
                before = texts[0]
                assert canonical_order(order) == _greedy_order(order), (lay, g)
                assert texts[0] - before == len(g)
                graphs += 1
                ops += len(g)
    assert graphs > 40000 and ops > 3 * graphs, (graphs, ops)


class _CheckEveryJoin(MemoEnumerator):
    """``MemoEnumerator`` with ``_join`` as it was before ``_child_fps``: every completion of
    the child checked on its own (the reference); counts the completions it drops."""

    dropped = 0

    def _join(self, out, desc, x, child):
        if self.ctx.timed_out():
            return
        fx = self.fpid[x]
        di = self._did(desc, x)
        for key in child:
            if any(self.desc_fpid[i] == fx for i in key) and \
                    self._repeats(x, [self.desc_node[i] for i in key]):
                self.dropped += 1
                continue
            out.setdefault(tuple(sorted(key + (di,))), None)


def test_joins_that_keep_a_child_whole_give_the_same_completions():
    """Completions (the same keys, in the same order, the same descriptors) with ``_join``'s
    whole-child path and with every completion checked, on first ops of qk_norm_rope (Q at 4
    block ops: post ops only, a loop, a grid and a loop; (Q, G) at 3) and on last ops of
    attention at 4 block ops (``FinalFilter``); the whole-child path is taken, and the
    checks it skips are ones that drop no completion (the reference drops some: recomputations
    exist in these spaces)."""
    cases = []
    qk = analyze(build("qk_norm_rope", {"H": 4, "D": 16}))
    for lay in (B.Layout(("Q",), (), None), B.Layout(("Q",), (), "k"),
                B.Layout(("Q",), ("m",), "k")):
        cases.append((qk, lay, 4, None))
    cases += [(qk, lay, 3, None) for lay in B.layouts(("Q", "G"), input_infos(qk), 1)]
    att = analyze(build("attention_decode", {"H": 4, "D": 64, "S": 256}))
    infos = input_infos(att)
    cases += [(att, lay, 4, True) for lay in B.layouts(tuple(infos), infos, 1)]
    whole = dropped = keys = 0
    for target, lay, ops, final in cases:
        infos = input_infos(target)
        config = SearchConfig(max_kernel_ops=2, max_block_ops=ops, prune=False)
        sym_size = {s: x for n in lay.inputs for s, x in zip(infos[n].syms, infos[n].shape) if s}
        sizes = B.representative_sizes(lay, infos, sym_size, config)
        if sizes is None:
            continue
        got = []
        for cls in (MemoEnumerator, _CheckEveryJoin):
            accept = FinalFilter(target, lay, sym_size) if final else None
            enum = cls(Context(target, config, time.monotonic() + 60), lay, infos, sizes,
                       1 if final else 2, accept)
            got.append((enum, [enum.ops_of(k) for k in enum.completions()]))
        (new, a), (ref, b) = got
        assert a == b, lay
        whole += new.joined_whole
        dropped += ref.dropped
        keys += len(a)
    assert whole > 1000 and dropped > 0 and keys > 40000, (whole, dropped, keys)

"""Last custom ops of unpruned searches: block graphs enumerated once per input *shapes*.

Without pruning, the kernel search asks for the last custom op's block graphs once per distinct
set of inputs, and a kernel tensor made by a first op is new for almost every first op (its
abstract expression differs), so ``BlockCatalog`` enumerated the same layout again and again
(attention_decode: ~10^5 first ops, 2-9 s per catalog). Here a layout is enumerated once per
*signature* (each input's shape and index symbols, the grid and loop symbols) with every input
an opaque atom (``("v", "@k")``), and each concrete set of inputs then only tests the graphs
found (``SharedFinal``).

Why the result is the same as ``MemoEnumerator`` on the concrete inputs (unpruned only):

* Without pruning the enumeration looks at expressions in two places: the no-recomputation rule
  (no input, body result or post result repeats another's expression; nodes and states are
  identified by expression) and the last op's test (``FinalFilter``). Validity of an op, the
  dangling-tensor bound, phases and accumulators depend on shapes, symbols and names only, and
  the representative counts on shapes only.
* Let s substitute each atom ``@k`` by the concrete input's expression. Every expression is built
  by the canonical constructors (``expr.mk_*``) from the inputs', and their canonical form is a
  function of the equivalence class under the axioms (the assumption every rule of the search
  already makes: ``normalize`` decides equality), and axioms are closed under substitution. So
  abstract-equal tensors are concrete-equal: the abstract no-recomputation rule excludes a subset
  of what the concrete one excludes, abstract state merging only merges states whose concrete
  states also have the same futures, and the abstract enumeration (``accept`` testing shapes
  only) yields a superset of the concrete block graphs.
* Each abstract graph is then tested on the concrete inputs exactly as the concrete enumerator
  would: its output's stripped fingerprint computed op by op from the concrete inputs (a
  necessary condition, as in ``FinalFilter``), then, for the few that pass, the graph instantiated
  with concrete expressions at the representative counts, every input / body / post expression
  pairwise distinct (the no-recomputation rule on the whole graph) and ``FinalFilter.exact`` on
  its output. What passes is exactly the concrete enumerator's set; the structures come out in its
  canonical order and sorted as ``MemoEnumerator.structures`` sorts them
  (tests/superopt/test_blockshare.py compares both on small shapes).

With pruning the oracle judges every prefix's expression, so nothing is shared there.
"""

from __future__ import annotations

import sys
from array import array
from collections import OrderedDict

import numpy as np

from mpk_dist.superopt.blockmemo import FinalFilter, Fingerprint, MemoEnumerator, canonical_order
from mpk_dist.superopt.sieve import FIELD31, StructureSieve
from mpk_dist.superopt.ugraph import TensorInfo

SIGNATURE_CACHE_BYTES = 512 << 20
"""Bound on the bytes of one process's signatures (``SharedFinal.nbytes``: their arrays, their
sieve's and their descriptor heads); past it signatures are dropped (``SignatureCache``).

Why 512 MiB: on the 2-core machine (23 GB) the unpruned attention_decode search's two lanes grew
~0.3 GB a minute each until the run was stopped at 12 GB (fourteenth session: 3.6 and 3.9 GB per
lane at 740 s), and a spilled route puts its signatures in several lanes. A lane's RSS was ~2.2x
its signatures' ``nbytes`` (1,100 MB at 479 MB after 200 s: allocator overhead, the freed memory
of the enumerations, the lane's other memos), so 512 MiB is ~1.2 GB of RSS per lane: 2 lanes here
stay a few GB in all, and 8 lanes on a 16-core, 128 GB machine ~10 GB. A dropped signature is
rebuilt identically when asked again (``signature_rebuilds``), so the bound trades CPU time for
memory and changes no result (docs/SUPEROPT.md, fourteenth session, second part).

NOTE: those ratios were measured when a signature kept dicts of op tuples (~180-195 bytes per
graph by ``sys.getsizeof``, more in fact). With the arrays of ``SharedFinal._store``
(twenty-third session) the same bound holds 4.6x more graphs: qk_norm_rope's lanes had evicted
signatures of 218 and 808 MB under it and rebuilt them (37 and 125 s of CPU each), asked for
again 0.03 s and 18 s after the eviction (docs/SUPEROPT.md, twenty-third session)."""


PASSING_MEMO = 16384
"""How many concrete input sets' cheap-test results (``SharedFinal.passing``: a tuple of
positions of structures in ``SharedFinal.sids``, mostly empty) one signature keeps before it
forgets them all; a forgotten one is computed again, identically."""


class _ShapeOnly(FinalFilter):
    """``FinalFilter`` without the expression test: the abstract enumeration keeps every
    complete graph whose one output can have the target's shape (expressions come later).

    ``exprs`` False: the enumerator skips the last op's own no-recomputation and exact tests
    too. Both look at expressions, and on opaque inputs they can only drop graphs that the
    concrete test (``_concrete_verdict``: every input, body and post expression distinct, then
    ``FinalFilter.exact``) drops as well, since abstract-equal tensors are concrete-equal; every
    graph whose output passes the concrete stripped-fingerprint test gets that concrete test, and
    the others are dropped anyway. So the same structures come out, from a cheaper enumeration
    (building the last op's expression was ~30% of a signature's enumeration)."""

    exprs = False
    stripped = False

    def __call__(self, shape: tuple, syms: tuple, stripped_fp: tuple) -> bool:
        key = (shape, syms)
        hit = self.__dict__.setdefault("_memo", {}).get(key)
        if hit is None:
            hit = self._memo[key] = self.shape_ok(shape, syms)
        return hit

    def exact(self, info: TensorInfo) -> bool:
        return True


def _generic_extents(n: int) -> list:
    """``n`` distinct primes above 10^6 (the generic tile extents of ``Family``: larger than any
    real extent, so they never meet one, and their products factor uniquely)."""
    out, k = [], 1_000_003
    while len(out) < n:
        if all(k % d for d in range(3, int(k ** 0.5) + 1, 2)):
            out.append(k)
        k += 2
    return out


_GENERIC = _generic_extents(64)


def _order(layout, infos: dict) -> tuple:
    """The input positions of ``layout`` in the order a signature lists them: by symbols (then
    by position), so that input sets that are permutations of one another by shape (qk_norm_rope's
    (Q, G, C, S, R) at depth 1 and (G, C, S, R, t0) after a first op that made t0 of Q's shape)
    have one signature. The symbols do not depend on the counts, so every layout of one input set
    gets the same order."""
    return tuple(sorted(range(len(layout.inputs)),
                        key=lambda k: tuple(map(str, infos[layout.inputs[k]].syms))))


def _relabel(layout, infos: dict, sizes: dict, order: tuple | None = None):
    """(generic key, {generic extent: extent}) of ``layout`` over ``infos`` at its
    representative counts ``sizes``, its inputs taken in ``order`` (positions; default
    ``_order``): each distinct tile extent above 1 (and the loop count),
    in order of first appearance (inputs in that order, dims in order, then the loop count), becomes
    the next generic extent (``_GENERIC``); 1 stays. The key is the inputs' generic tiles and
    symbols, the loop symbol and the generic loop count: the layout's tiles up to a renaming of
    their extents. None when there are more distinct extents than generic ones."""
    from mpk_dist.superopt.blocksearch import _tile

    loop = layout.loop_sym
    split = {s: sizes[s] for s in layout.grid_syms}
    values: dict = {}
    tiles = []
    for k in (_order(layout, infos) if order is None else order):
        info = infos[layout.inputs[k]]
        dep = loop is not None and loop in info.syms
        tile = _tile(info, {**split, **({loop: sizes[loop]} if dep else {})})
        tiles.append((tile, info.syms))
        for d in tile:
            if d > 1:
                values.setdefault(d, len(values))
    count = sizes[loop] if loop else None
    if loop and count > 1:
        values.setdefault(count, len(values))
    if len(values) > len(_GENERIC):
        return None, None
    g = {v: _GENERIC[i] for v, i in values.items()}
    key = (tuple((tuple(g.get(d, d) for d in tile), syms) for tile, syms in tiles), loop,
           g.get(count, count))
    return key, {x: v for v, x in g.items()}


class Family:
    """The last-op layouts of one input set that one abstract enumeration serves: those whose
    tiles (and loop count) are the same up to a renaming of extents (``_relabel``), e.g.
    qk_norm_rope's (Q, G, C, S, R) without a grid and with the grid over m (Q's tile (32, 128)
    or (16, 128)): 191,731 states each, identical, and ~60 s each (sixteenth session).

    The enumeration runs once, over opaque inputs whose tiles have the *generic* extents (a
    distinct prime above 10^6 per distinct extent), with no grid and the generic loop count, and
    keeps a graph when its output passes the shape test of some member (``accept``); each
    member then takes the graphs whose output, renamed back to its extents, passes its own test
    (``SharedFinal._view``), and every graph still gets the concrete test per input set.

    Why a member gets exactly what its own enumeration gives (the module docstring's argument
    with one more substitution):

    * Validity of an op looks at extents only through equality and through being 1
      (``inference._broadcast``, matmul's inner dims; a sum makes a 1); the renaming is a
      bijection on the extents that keeps 1, so the same ops are valid on corresponding tiles,
      with corresponding result shapes, and the member's shape test sees its own shapes.
    * Expressions hold extents only as reduction sizes, multiplied together (``expr.mk_sum``,
      ``mk_mul``). Generic sizes are products of distinct primes, so two generic expressions are
      equal only when their sizes are the same products of the same extents: substituting the
      member's extents keeps them equal. So generic-equal tensors are member-equal (as
      opaque-equal tensors are concrete-equal), and the generic enumeration yields a superset
      of the member's graphs (no-recomputation drops and state merges are a subset of the
      member's). The extras are graphs where the member's sizes make two tensors equal that the
      generic ones keep apart (say sum_32(sum_4(x)) and sum_128(x)); the concrete test
      (``_concrete_verdict``: every input, body and post expression distinct at the member's
      counts, then the exact test) drops them, as it drops the graphs opaque inputs let through.
    * Nothing else in ``MemoEnumerator`` looks at extents or at the grid (the dangling bound,
      phases and accumulators look at names and symbols), and the loop symbol is the same for
      every member (part of the key).
    tests/superopt/test_blockshare.py compares every layout with the concrete enumerator."""

    def __init__(self, ctx, layout, infos: dict, sizes: dict, sym_size: dict) -> None:
        from mpk_dist.superopt.blocksearch import Layout, layouts, representative_sizes

        # the enumeration's input k is the layout's input ``order[k]``
        self.order = _order(layout, infos)
        self.key, _ = _relabel(layout, infos, sizes, self.order)
        self.sym_size = sym_size
        # members: (grid, loop) -> {generic extent: the member's extent}
        self.members: dict = {}
        self.layouts: list = []
        cands = layouts(layout.inputs, infos, ctx.config.max_grid_dims) if self.key else ()
        for lay in cands:
            lsizes = representative_sizes(lay, infos, sym_size, ctx.config)
            if lsizes is None:
                continue
            key, back = _relabel(lay, infos, lsizes, self.order)
            if key == self.key:
                self.members[(lay.grid_syms, lay.loop_sym)] = back
                self.layouts.append((lay, tuple(sorted(lsizes.items()))))
        if (layout.grid_syms, layout.loop_sym) not in self.members:
            # no generic form (too many extents): the layout alone, at its own extents
            self.members = {(layout.grid_syms, layout.loop_sym): {}}
            self.layouts = [(layout, tuple(sorted(sizes.items())))]
            self.key = None
            self.order = tuple(range(len(layout.inputs)))
        names = tuple(f"@{k}" for k in range(len(layout.inputs)))
        loop = layout.loop_sym
        if self.key is None:
            self.ainfos = {a: TensorInfo(infos[n].shape, infos[n].syms, ("v", a))
                           for a, n in zip(names, self.inputs(layout))}
            self.alay = Layout(names, layout.grid_syms, loop)
            self.asizes = sizes
        else:
            # generic tiles as whole tensors (no grid); a loop dim is the tile times the count
            gloop = self.key[2]
            self.ainfos = {a: TensorInfo(tuple(d * gloop if s == loop and loop else d
                                               for d, s in zip(shape, syms)), syms, ("v", a))
                           for a, (shape, syms) in zip(names, self.key[0])}
            self.alay = Layout(names, (), loop)
            self.asizes = {loop: gloop} if loop else {}

    def inputs(self, layout) -> tuple:
        """``layout``'s input names in the enumeration's order."""
        return tuple(layout.inputs[k] for k in self.order)

    def cache_key(self, infos: dict, inputs: tuple) -> tuple:
        """The signature cache's key: the inputs' shapes and symbols in the enumeration's order
        (``inputs``: the layout's input names) and every member's grid and counts (which decide
        the generic key and every member's shape test)."""
        return (self.key is None,
                tuple((infos[inputs[k]].shape, infos[inputs[k]].syms) for k in self.order),
                tuple((lay.grid_syms, lay.loop_sym, sizes) for lay, sizes in self.layouts))

    def renamed(self, ops: tuple) -> tuple:
        """The op descriptors ``ops`` of the enumeration with its input positions replaced by
        the layout's (``order``)."""
        order = self.order
        if order == tuple(range(len(order))):
            return ops
        return tuple((*d[:3], tuple(("i", order[r[1]]) if r[0] == "i" else r for r in d[3]),
                      *d[4:]) for d in ops)

    def accept(self, target) -> "_ShapeOnly":
        """The enumeration's test: the output passes some member's shape test."""
        self._tests = [(back, _ShapeOnly(target, lay, self.sym_size))
                       for (lay, _), back in zip(self.layouts, self.members.values())]
        fam = self

        class _Any(_ShapeOnly):
            def shape_ok(self, shape: tuple, syms: tuple) -> bool:
                return fam.shape_ok(shape, syms)

        return _Any(target, self.layouts[0][0], self.sym_size)

    def shape_ok(self, shape: tuple, syms: tuple) -> bool:
        """Does some member's shape test pass an output of (generic) ``shape`` and ``syms``?"""
        return any(test.shape_ok(tuple(back.get(d, d) for d in shape), syms)
                   for back, test in self._tests)


class SharedFinal:
    """One abstract enumeration of the last-op layouts of a ``Family`` (the layouts of one input
    set that differ only in their tile extents): graphs grouped by the stripped structure of
    their output node (``StrippedTable``), whose stripped fingerprint for concrete inputs is the
    last op's cheap test, and by their output's (generic) shape, which decides per layout
    whether a graph can be the target's."""

    def __init__(self, ctx, layout, infos: dict, sizes: dict, sym_size: dict,
                 family: "Family | None" = None) -> None:
        fam = family or Family(ctx, layout, infos, sizes, sym_size)
        self.family = fam
        enum = MemoEnumerator(ctx, fam.alay, fam.ainfos, fam.asizes, 1, fam.accept(ctx.target))
        # a signature none of whose tensors can have an accepted shape has no graph: not
        # enumerated (``MemoEnumerator.reachable_types``; 381,717 states and ~50 s for one of
        # qk_norm_rope's, sixteenth session)
        self.unreachable = not any(fam.shape_ok(*t) for t in enum.reachable_types())
        graphs = () if self.unreachable else enum.completions()
        self.complete = not ctx.timed_out()
        if not self.complete:
            # NOTE: past the deadline every consumer drops what a listing holds
            # (``catalog.layout_options`` and ``KernelSearch._options`` check the deadline before
            # their first structure), so a partial signature would only cost time: its tables
            # and sieve took the lanes ~30 s past the deadline (eighteenth session). Kept empty
            # (and, as before, not cached).
            graphs = ()
        self.states, self.deduplicated = enum.states, enum.deduplicated
        self.n_graphs = len(graphs)
        self._store(ctx, enum, graphs)
        # per layout of the family: (a bool per output type: accepted by its shape test, its
        # number of graphs)
        self.views: dict = {}
        # concrete inputs' stripped fingerprints (61 and 31 bits) -> the positions in ``sids``
        # of the structures whose value is the target's (``structures``); cleared past
        # ``PASSING_MEMO`` entries
        self.passing: dict = {}

    def _store(self, ctx, enum, graphs: tuple) -> None:
        """Keep the completions ``graphs`` (``MemoEnumerator.completions``' keys) compactly,
        grouped by output node and the nodes by stripped structure, and compile the sieve.

        NOTE: until the twenty-third session a signature kept ``{output node: [op tuple]}`` and
        ``{structure id: [output node]}``: ~186 bytes per graph (qk_norm_rope's depth-1
        signature, 1,132,608 graphs: 218 MB of ``nbytes``), so two or three signatures filled
        ``SIGNATURE_CACHE_BYTES`` and a lane whose first ops need more evicted and rebuilt them
        for every first op (~30-50 s per build). Now the graphs are int32 arrays of descriptor
        ids (``ops``, cut by ``graph_at``; a node's graphs are ``node_at[q]:node_at[q + 1]``,
        a structure's nodes ``sid_nodes[sid_at[k]:sid_at[k + 1]]``) over the descriptors the
        graphs use (``_store_descs``, ``desc``), in the same orders as those dicts: each graph's
        ops in its key's order, the graphs of a node and the nodes in the order of enumeration,
        the structures in the order of their first node."""
        # output node -> (its graphs' descriptor indices, concatenated; their op counts), in
        # enumeration order. Descriptors are indexed by identity (the enumerator's graphs share
        # them: ``ops_of``), which needs nothing of the key's form; they are alive while
        # ``graphs`` is, so their ids stay unique.
        by_out: dict = {}
        ids: dict = {}
        descs: list = []
        for key in graphs:
            ops = enum.ops_of(key)
            node = _output_node(ops, enum.acc_of)
            slot = by_out.get(node)
            if slot is None:
                slot = by_out[node] = (array("i"), array("i"))
            for d in ops:
                i = ids.setdefault(id(d), len(descs))
                if i == len(descs):
                    descs.append(d)
                slot[0].append(i)
            slot[1].append(len(ops))
        self._store_descs(descs)
        self.ops = np.concatenate([np.frombuffer(a, np.intc) for a, _ in by_out.values()]
                                  or [np.zeros(0, np.intc)]).astype(np.int32, copy=False)
        self.graph_at = _offsets(n for _, lens in by_out.values() for n in lens)
        self.node_at = _offsets(len(lens) for _, lens in by_out.values())
        # output node -> its (generic shape, syms) as an index into ``types``, and how many
        # graphs each type has
        types: dict = {}
        self.node_type = np.fromiter(
            (types.setdefault((enum.shape[n], enum.syms[n]), len(types)) for n in by_out),
            np.int32, len(by_out))
        self.types = list(types)
        self.type_graphs = np.bincount(self.node_type, np.diff(self.node_at),
                                       len(types)).astype(np.int64)
        # output nodes grouped by their stripped structure (``StrippedTable``): one concrete
        # fingerprint per distinct structure, shared with every other signature of the process.
        # NOTE: the enumerator's recipes (one per node it made) are needed only here, so they are
        # not kept with the signature.
        table, memo = stripped_table(ctx), {}
        by_sid: dict = {}
        for q, node in enumerate(by_out):
            by_sid.setdefault(table.sid(enum.recipe, node, memo), []).append(q)
        self.sids = np.fromiter(by_sid, np.int64, len(by_sid))
        self.sid_at = _offsets(map(len, by_sid.values()))
        self.sid_nodes = np.fromiter((q for qs in by_sid.values() for q in qs), np.int32,
                                     len(by_out))
        # the cheap test of every output structure at once, in a 31-bit field (``sieve``)
        self.sieve = StructureSieve(table, list(by_sid), _sieve_fp(ctx))
        arrays = (self.ops, self.graph_at, self.node_at, self.node_type, self.type_graphs,
                  self.sids, self.sid_at, self.sid_nodes, self.desc_head, self.desc_ints)
        self.nbytes = (sum(a.nbytes for a in arrays) + self.sieve.nbytes
                       + sum(map(sys.getsizeof, self.heads)))

    def _store_descs(self, descs: list) -> None:
        """Keep the op descriptors ``descs`` (``MemoEnumerator._desc``: (phase, kind, attrs,
        operand refs, (phase, result node)), each ref a (letter, int) pair) as a head per
        descriptor (phase, kind, attrs and the refs' letters: few distinct ones, in ``heads``)
        and a row of ints (the refs' ints, then the result node) in ``desc_ints``.

        NOTE: as tuples, qk_norm_rope's depth-1 signature's descriptors were about half of its
        ``nbytes`` after the graphs became arrays (twenty-third session), and more of its real
        memory (``sys.getsizeof`` does not count the nested tuples: ~300 bytes each)."""
        heads: dict = {}
        width = max((len(d[3]) for d in descs), default=0) + 1
        pad = (0,) * width
        rows = []
        head = np.fromiter((heads.setdefault((d[0], d[1], d[2], tuple(r[0] for r in d[3])),
                                             len(heads)) for d in descs), np.int32, len(descs))
        for d in descs:
            rows.append((*(r[1] for r in d[3]), *pad[len(d[3]) + 1:], d[4][1]))
        self.desc_head, self.heads = head, list(heads)
        self.desc_ints = np.array(rows, np.int32).reshape(len(descs), width)

    def desc(self, i: int) -> tuple:
        """Op descriptor ``i`` as ``MemoEnumerator`` made it (an equal tuple, a new object)."""
        phase, kind, attrs, letters = self.heads[self.desc_head[i]]
        row = self.desc_ints[i].tolist()
        return (phase, kind, attrs, tuple(zip(letters, row)), (phase, row[-1]))

    @property
    def n_outputs(self) -> int:
        """How many distinct output nodes the graphs have."""
        return len(self.node_type)

    def graphs_of(self, q: int):
        """The op descriptor tuples of output node ``q``'s graphs (``q``: its position in
        ``node_at``), in the order of enumeration."""
        ops, at, desc = self.ops, self.graph_at, self.desc
        for g in range(int(self.node_at[q]), int(self.node_at[q + 1])):
            yield tuple(desc(i) for i in ops[at[g]:at[g + 1]].tolist())

    def graphs(self):
        """Every graph's op descriptor tuple, node by node (as ``graphs_of``)."""
        for q in range(self.n_outputs):
            yield from self.graphs_of(q)

    def _view(self, ctx, layout, sym_size: dict, fam: "Family") -> tuple:
        """(the output types whose graphs ``layout``'s own enumeration would keep by shape, the
        number of those graphs)."""
        lkey = (layout.grid_syms, layout.loop_sym)
        hit = self.views.get(lkey)
        if hit is None:
            back = fam.members[lkey]
            test = _ShapeOnly(ctx.target, layout, sym_size)
            ok = [test.shape_ok(tuple(back.get(d, d) for d in t[0]), t[1]) for t in self.types]
            hit = self.views[lkey] = (ok, int(self.type_graphs[np.array(ok, bool)].sum())
                                      if ok else 0)
        return hit

    def structures(self, ctx, layout, infos: dict, sizes: dict, sym_size: dict,
                   family: "Family | None" = None) -> tuple:
        """(structures of ``layout`` over the concrete ``infos`` that the concrete enumerator
        keeps, sorted as it sorts them; the number of graphs that failed the last op's test).
        ``family``: ``layout``'s ``Family`` (default: the one this signature was built for); its
        input order maps the enumeration's inputs to ``layout``'s."""
        from mpk_dist.superopt.blocksearch import Structure

        fam = family or self.family
        ok, n_grouped = self._view(ctx, layout, sym_size, fam)
        if not n_grouped:
            return [], 0
        sfp, sfp31 = _stripped_fp(ctx), _sieve_fp(ctx)
        names = fam.inputs(layout)  # the leaves by the enumeration's input positions
        leaves = tuple(sfp.of_expr(infos[n].expr) for n in names)
        leaves31 = tuple(sfp31.of_expr(infos[n].expr) for n in names)
        passing = self.passing.get((leaves, leaves31))
        counts = ctx.counts
        if passing is None:
            # the cheap test of every output structure: its stripped fingerprints are a
            # function of the leaves alone (``StrippedTable``), so inputs with the same stripped
            # fingerprints pass the same structures (first ops that differ only in sum sizes,
            # layouts or forms the stripped fingerprint identifies: qk_norm_rope's 115,522
            # first ops of (G,)'s layout 1 under the bound have 2,691 distinct ones). The 31-bit
            # test (``sieve``, all structures at once) first, then the 61-bit one
            # (``FinalFilter.want``'s fingerprint) on the few structures it keeps; both are
            # necessary conditions of the exact test.
            keep = self.sieve.matches(leaves31, sfp31.of_expr(ctx.target.out_expr))
            table = stripped_table(ctx)
            table.set_leaves(leaves)
            want = sfp.of_expr(ctx.target.out_expr)
            sieved = np.flatnonzero(keep).tolist()  # positions in ``sids``, in its order
            sids = self.sids[sieved].tolist()
            passing = tuple(k for k, sid in zip(sieved, sids) if table.value(sid) == want)
            if len(self.passing) >= PASSING_MEMO:
                self.passing.clear()
            self.passing[(leaves, leaves31)] = passing
            counts["stripped_tested"] = counts.get("stripped_tested", 0) + 1
            counts["sieve_kept"] = counts.get("sieve_kept", 0) + len(sieved)
        else:
            counts["stripped_reused"] = counts.get("stripped_reused", 0) + 1
        out, repeats, filt = [], 0, None
        at, nodes, types = self.sid_at, self.sid_nodes, self.node_type
        graphs = [ops for k in passing for q in nodes[at[k]:at[k + 1]].tolist()
                  if ok[types[q]] for ops in self.graphs_of(q)]
        failed = n_grouped - len(graphs)
        if graphs:
            filt = FinalFilter(ctx.target, layout, sym_size)
            for ops in graphs:
                st = Structure(layout, *canonical_order(fam.renamed(ops)))
                verdict = _concrete_verdict(st, sizes, infos, filt)
                if verdict == "ok":
                    out.append(st)
                else:
                    failed += 1
                    repeats += verdict == "repeats"
        out.sort(key=lambda s: (s.body, s.post, s.outputs))
        ctx.counts["shared_repeats"] = ctx.counts.get("shared_repeats", 0) + repeats
        return out, failed


def _stripped_fp(ctx) -> Fingerprint:
    fp = ctx.__dict__.get("_shared_sfp")
    if fp is None:
        fp = ctx.__dict__["_shared_sfp"] = Fingerprint(sized=False)
    return fp


def _sieve_fp(ctx) -> Fingerprint:
    """The process's 31-bit stripped fingerprint (``sieve.FIELD31``)."""
    fp = ctx.__dict__.get("_sieve_sfp")
    if fp is None:
        fp = ctx.__dict__["_sieve_sfp"] = Fingerprint(sized=False, field=FIELD31)
    return fp


class StrippedTable:
    """Stripped structures of block tensors over opaque inputs, and their stripped fingerprints
    for the current concrete inputs (one table per process, shared by every signature).

    A node's stripped fingerprint (``Fingerprint(sized=False)``, the last op's cheap test) is a
    function of its recipe with every reduction dropped: ``sum`` and accumulators are the identity
    there and ``matmul`` is ``mul``. Two nodes with the same *stripped structure* (the same op
    tree over the same input positions after that map, mul / add operands unordered) therefore
    have the same stripped fingerprint for any concrete inputs: this is the same computation, not
    a fingerprint match, so grouping by structure is exact. The layouts of one input subset (and
    different block graphs of one layout) produce mostly the same few hundred structures, so a
    concrete input set computes each structure's fingerprint once instead of once per output node
    of every layout (before, attention_decode's unpruned last ops spent ~8 ms per layout and input
    set walking each signature's recipes)."""

    def __init__(self, sfp: Fingerprint) -> None:
        self.sfp = sfp
        self.ids: dict = {}        # structure key -> structure id
        self.defs: list = []       # structure id -> ("in", k) or (kind, attrs, arg ids)
        self.leaves = None         # stripped fingerprints of the current concrete inputs
        self.vals: dict = {}       # structure id -> fingerprint for ``leaves``

    def sid(self, recipe: list, node: int, memo: dict) -> int:
        """The structure id of ``node`` of a ``MemoEnumerator`` whose recipes are ``recipe``
        (``memo``: node -> id, for this ``recipe`` only)."""
        hit = memo.get(node)
        if hit is not None:
            return hit
        r = recipe[node]
        if r[0] == "in":
            out = self._intern(("in", r[1]), ("in", r[1]))
        elif r[0] == "acc":
            out = self.sid(recipe, r[1], memo)      # a sum over iterations: dropped
        else:
            kind, attrs, args = r
            ids = tuple(self.sid(recipe, a, memo) for a in args)
            if kind == "sum":
                out = ids[0]                  # a reduction: dropped
            elif kind in ("matmul", "mul", "add"):
                # matmul is a reduction of a product; mul and add are commutative
                k = "add" if kind == "add" else "mul"
                out = self._intern((k, tuple(sorted(ids))), (k, {}, tuple(sorted(ids))))
            elif kind == "div":
                out = self._intern(("div", ids), ("div", {}, ids))
            else:  # a chain: its program decides
                prog = attrs["prog"]
                out = self._intern((kind, id(prog), ids), (kind, {"prog": prog}, ids))
        memo[node] = out
        return out

    def _intern(self, key: tuple, d: tuple) -> int:
        hit = self.ids.get(key)
        if hit is None:
            hit = self.ids[key] = len(self.defs)
            self.defs.append(d)
        return hit

    def set_leaves(self, leaves: tuple) -> None:
        """Concrete inputs' stripped fingerprints (by position); forgets values of other ones."""
        if leaves != self.leaves:
            self.leaves, self.vals = leaves, {}

    def value(self, sid: int) -> tuple:
        """The stripped fingerprint of structure ``sid`` for the current inputs."""
        v = self.vals.get(sid)
        if v is None:
            d = self.defs[sid]
            if d[0] == "in":
                v = self.leaves[d[1]]
            else:
                v = self.sfp.op(d[0], d[1], [self.value(a) for a in d[2]], 1)
            self.vals[sid] = v
        return v


def stripped_table(ctx) -> StrippedTable:
    """The process's ``StrippedTable`` (kept on ``ctx``)."""
    t = ctx.__dict__.get("_shared_table")
    if t is None:
        t = ctx.__dict__["_shared_table"] = StrippedTable(_stripped_fp(ctx))
    return t


def _output_node(ops, acc_of: dict) -> int:
    """The node of the one output of the op set ``ops`` (as ``canonical_order`` finds outputs:
    an unread post result, or the accumulator of a body result nobody reads)."""
    read = {r for d in ops for r in d[3]}
    for d in ops:
        phase, node = d[4]
        if phase == "b" and d[4] not in read and ("a", node) not in read:
            return acc_of[node]
        if phase == "p" and d[4] not in read:
            return node
    raise ValueError(f"block graph output: expected one unread tensor, got none in {ops}")


def _concrete_verdict(st, sizes: dict, infos: dict, filt: FinalFilter) -> str:
    """The concrete enumerator's rules that look at expressions, on one complete graph: every
    input, body and post expression distinct ("repeats" if not), and the output passes
    ``filt.exact`` ("mismatched" if not); "ok" when both hold."""
    from mpk_dist.superopt.blocksearch import instantiate

    bg, _ = instantiate(st, sizes, infos, ("@out",), lambda e: "")
    if bg is None:
        return "mismatched"  # not reached: validity depends on shapes only
    exprs = [infos[n].expr for n in st.layout.inputs] + [o.info.expr for o in bg.ops()]
    if len(set(exprs)) != len(exprs):
        return "repeats"
    src = bg.outputs[0].src
    info = next(x.info for x in (*bg.accs, *bg.ops()) if x.out == src)
    return "ok" if filt.exact(info) else "mismatched"


def _offsets(lengths) -> np.ndarray:
    """[0, l0, l0 + l1, ...]: where each of the runs of ``lengths`` starts in their concatenation,
    and the end; int32 when the end fits (half the bytes of int64)."""
    out = np.concatenate(([0], np.cumsum(np.fromiter(lengths, np.int64))))
    return out.astype(np.int32) if out[-1] < 2**31 else out


class SignatureCache:
    """A process's signatures (``SharedFinal`` by signature key), holding at most
    ``SIGNATURE_CACHE_BYTES`` of ``nbytes`` (the newest one always stays); past the bound the
    signature that is cheapest to build again per byte it frees goes first (GreedyDual-Size:
    each one has a credit, the clock at its last use plus its enumeration's states per byte; the
    lowest credit is dropped and becomes the clock, so signatures not used for a while age out;
    ties go least recently used first).

    NOTE: until the twenty-third session the least recently used signature went first, whatever
    its size and cost: a no-graph family of qk_norm_rope (311,725 states, ~19 s of CPU, 12 bytes)
    was as likely to go as one of 176 MB, and freed nothing. A build's CPU time grows with its
    states (0.06-0.47 ms per state measured), so states per byte is the rebuild cost per byte.

    Counters on ``ctx``: ``signature_evictions`` (signatures dropped) and ``signature_rebuilds``
    (signatures built again after being dropped). A rebuilt signature is the same enumeration of
    the same shapes, so only the counters (built, states, explored) differ from an unbounded
    cache, never the structures."""

    def __init__(self, ctx) -> None:
        self.ctx = ctx
        self.entries: OrderedDict = OrderedDict()  # least recently used first
        self.nbytes = 0
        self.evicted: set = set()  # keys dropped once: a later build of one is a rebuild
        self.clock = 0.0           # the credit of the last signature dropped
        self.credit: dict = {}     # key -> clock at its last use + its states per byte

    def _use(self, key, entry: SharedFinal) -> None:
        self.entries.move_to_end(key)
        self.credit[key] = self.clock + entry.states / max(entry.nbytes, 1)

    def get(self, key):
        """The signature of ``key``, now the most recently used, or None."""
        entry = self.entries.get(key)
        if entry is not None:
            self._use(key, entry)
        return entry

    def put(self, key, entry: SharedFinal) -> None:
        """Keep ``entry``; while over the bound, drop the others by lowest credit."""
        counts = self.ctx.counts
        if key in self.evicted:
            counts["signature_rebuilds"] = counts.get("signature_rebuilds", 0) + 1
        self.entries[key] = entry
        self._use(key, entry)
        self.nbytes += entry.nbytes
        while self.nbytes > SIGNATURE_CACHE_BYTES and len(self.entries) > 1:
            old = min((k for k in self.entries if k != key), key=self.credit.__getitem__)
            self.nbytes -= self.entries.pop(old).nbytes
            self.clock = self.credit.pop(old)
            self.evicted.add(old)
            counts["signature_evictions"] = counts.get("signature_evictions", 0) + 1


def shared_final_structures(ctx, layout, infos: dict, sizes: dict, sym_size: dict) -> list:
    """The last-op structures of ``layout`` over ``infos`` (unpruned), from the abstract
    enumeration of the layout's ``Family`` (built once per process and kept on ``ctx`` while
    ``SignatureCache`` keeps it; built again, identically, when asked for after eviction)."""
    lkey = (tuple((infos[n].shape, infos[n].syms) for n in layout.inputs), layout.grid_syms,
            layout.loop_sym, tuple(sorted(sizes.items())))
    families = ctx.__dict__.setdefault("_families", {})
    fam = families.get(lkey)
    if fam is None:
        fam = families[lkey] = Family(ctx, layout, infos, sizes, sym_size)
    key = fam.cache_key(infos, layout.inputs)
    cache = ctx.__dict__.get("_shared_final")
    if cache is None:
        cache = ctx.__dict__["_shared_final"] = SignatureCache(ctx)
    entry = cache.get(key)
    if entry is None:
        entry = SharedFinal(ctx, layout, infos, sizes, sym_size, fam)
        for k, n in (("deduplicated", entry.deduplicated), ("states", entry.states)):
            ctx.counts[k] = ctx.counts.get(k, 0) + n
        if entry.complete:
            cache.put(key, entry)
        ctx.counts["shared_built"] = ctx.counts.get("shared_built", 0) + 1
        if entry.unreachable:
            ctx.counts["shared_unreachable"] = ctx.counts.get("shared_unreachable", 0) + 1
    else:
        ctx.counts["shared_reused"] = ctx.counts.get("shared_reused", 0) + 1
    out, failed = entry.structures(ctx, layout, infos, sizes, sym_size, fam)
    ctx.counts["mismatched"] = ctx.counts.get("mismatched", 0) + failed
    return out

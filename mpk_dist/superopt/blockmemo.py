"""Block graphs enumerated once per distinct future (observational equivalence of prefixes).

``blocksearch._Builder`` grows a block graph op by op and explores every prefix on its own. Two
prefixes often have the same future: ``(a*b)*c`` and ``a*(b*c)`` leave the same dangling tensor,
and which intermediates made it no longer matters once nobody will read them again. This
enumerator searches *states* instead of prefixes. A state holds only what the remaining ops can
see and what a complete graph still owes:

* the ops used so far and the phase (body of the for-loop, or after it);
* the inputs nobody read yet (inputs themselves stay readable);
* the **dangling** tensors (nobody read them: they must be read or become outputs);
* the **kept** tensors: read already, and read again later. When an op reads a computed tensor
  the search branches: keep it (a promise: it must be read again) or forget it (that was its last
  read). Every block graph has exactly one such sequence of decisions per op order, so nothing
  is lost or invented.

A tensor is its ``TensorInfo`` (shape, index symbols, abstract expression): every enumeration rule
(validity, the pruning oracle, no recomputation) looks at nothing else, so prefixes that reach the
same state have the same completions. Each state's completions are computed once (``memo``); a
prefix that reaches a known state is counted in ``deduplicated`` and reuses them. Tensors are small
ints (nodes), found by recipe or by a fingerprint of the expression (``Fingerprint``) that is
confirmed on the expressions, which are built only when needed. Completions are
sets of ops, so a block graph comes out once however many op orders lead to it, written in its
canonical order (``canonical_order``): of its topological orders, the one whose text
(``UGraph.key``) is smallest, i.e. the one the search's ranking (cost, then text) would prefer.

The no-recomputation rule (no tensor repeats the abstract expression of an input or of another
op) reaches forgotten tensors too: the state checks the tensors it remembers, and a completion is
joined to an op only if none of its results repeats that op's expression.

``accept`` (``FinalFilter`` for the last custom op of a kernel graph) filters complete graphs by
their single output. The kernel search keeps a last custom op only if its output has the target's
abstract expression and shape at the counts the cost model picks; ``FinalFilter`` is a necessary
condition of that test that holds at every count, so the kept graphs are exactly those the later
test could accept; the others are counted (``mismatched``), not stored, costed and discarded one
by one. Every state is still visited. A scalar fingerprint of the output (``Fingerprint``) is
checked before its expression is built: building expressions is most of the cost, and most last
ops fail.
"""

from __future__ import annotations

import itertools
import random
import zlib

from mpk_dist.superopt import expr as E
from mpk_dist.superopt.inference import candidate_ops, infer, intern, is_stack_sym
from mpk_dist.superopt.ugraph import TensorInfo, call_text, op_call_name

_COMMUTATIVE = ("mul", "add")
# ``_join`` keeps a child's completions unchecked when none of their ops has the new op's
# fingerprint (``_child_fps``), for children with at least this many completions (smaller ones
# are checked one by one, which costs about as much as building their set)
_WHOLE_JOIN = 4


# -- the last op's test ------------------------------------------------------------------------
def strip_sums(t: tuple, memo: dict) -> tuple:
    """``t`` with every reduction removed (``sum_n(x)`` -> ``x``), re-normalized.

    Tile and loop counts change reduction sizes, and a reduction over a tile dim of extent 1
    vanishes (``sum_1(x) = x``), but every canonical constructor commutes with this map, so the
    stripped expression of a block tensor is the same at every count: equal stripped expressions
    are necessary for equal expressions at any counts."""
    hit = memo.get(id(t))
    if hit is not None and hit[0] is t:
        return hit[1]
    head = t[0]
    if head in ("v", "c"):
        out = t
    elif head == "sum":
        out = strip_sums(t[2], memo)
    elif head == "add":
        out = E.mk_add([strip_sums(a, memo) for a in t[1]])
    elif head == "mul":
        out = E.mk_mul([strip_sums(a, memo) for a in t[1]])
    else:
        out = {"inv": E.mk_inv, "exp": E.mk_exp, "sqrt": E.mk_sqrt}[head](strip_sums(t[1], memo))
    memo[id(t)] = (t, out)  # keeps t alive, so its id stays unique
    return out


# -- fingerprints -------------------------------------------------------------------------------
# p = 2*R*Q2 + 1 (prime, 61 bits; R and Q2 primes near 2^30), W of order R in Z_p*, and K with
# K = 1 mod 2R, K = -1 mod Q2, so x -> x**K is a multiplicative involution of Z_p* other than the
# inverse: inv(inv(x)) = x and inv(x*y) = inv(x)*inv(y) hold, x*inv(x) = 1 does not (the abstract
# expressions do not simplify x/x either, and a field inverse would give every x/x one value).
P61 = 2305842296249143607
R30 = 1073741789
K61 = 1452152591141073327
W61 = 1647088814001249575
FIELD61 = (P61, R30, W61, K61)


class Fingerprint:
    """A value in Z_p x Z_r per abstract expression, computed op by op without building it.

    Inputs and constants are fixed pseudo-random pairs; add and mul act on both parts; inv is
    x**K on the p part (see K61) and the identity on the r part; exp maps the r part to W**b mod p
    (W of order r, so exp(a + b) = exp(a) * exp(b)) and sets the r part to 1; sqrt is a fixed random
    cubic per part; a reduction over n elements multiplies by n (``sized``) or is the identity
    (stripped, ``sized=False``). Every rewrite ``expr.normalize`` applies (associativity,
    commutativity, distributivity, inverses of products and of inverses, exp of a sum, moving
    factors into reductions, merging and distributing reductions, sum_1(x) = x) holds for these
    values, so equal canonical expressions have equal fingerprints; unequal ones rarely collide.
    ``of_expr`` computes the same value from an expression tuple (a test checks they agree).
    """

    def __init__(self, sized: bool = True, field: tuple = FIELD61) -> None:
        """``field``: (p, r, w, K) of the construction above (``sieve.FIELD31``: the same one
        under 2^31, for numpy's int64)."""
        self.sized = sized
        self.p, self.q, self.w, self.k = field
        rnd = random.Random(7)
        self.sqrt_p = [rnd.randrange(self.p) for _ in range(4)]
        self.sqrt_q = [rnd.randrange(self.q) for _ in range(4)]
        self.inv_memo: dict = {}
        self.atoms: dict = {}
        self.memo: dict = {}

    def atom(self, t: tuple) -> tuple:
        """The pair of an input ``("v", name)`` or constant ``("c", value)`` (fixed per atom)."""
        hit = self.atoms.get(t)
        if hit is None:
            rnd = random.Random(zlib.crc32(repr(t).encode()))
            hit = self.atoms[t] = (rnd.randrange(1, self.p), rnd.randrange(1, self.q))
        return hit

    def add(self, a: tuple, b: tuple) -> tuple:
        return (a[0] + b[0]) % self.p, (a[1] + b[1]) % self.q

    def mul(self, a: tuple, b: tuple) -> tuple:
        return a[0] * b[0] % self.p, a[1] * b[1] % self.q

    def inv(self, a: tuple) -> tuple:
        hit = self.inv_memo.get(a)
        if hit is None:
            hit = self.inv_memo[a] = (pow(a[0], self.k, self.p), a[1])
        return hit

    def exp(self, a: tuple) -> tuple:
        return pow(self.w, a[1], self.p), 1

    def sqrt(self, a: tuple) -> tuple:
        cp, cq = self.sqrt_p, self.sqrt_q
        x, y = a
        return ((cp[0] + x * (cp[1] + x * (cp[2] + x * cp[3]))) % self.p,
                (cq[0] + y * (cq[1] + y * (cq[2] + y * cq[3]))) % self.q)

    def reduce(self, n: int, a: tuple) -> tuple:
        """The fingerprint of a reduction over ``n`` elements of ``a``."""
        return (a[0] * n % self.p, a[1] * n % self.q) if self.sized else a

    def of_expr(self, t: tuple) -> tuple:
        """The fingerprint of an abstract expression tuple."""
        hit = self.memo.get(id(t))
        if hit is not None and hit[0] is t:
            return hit[1]
        head = t[0]
        if head in ("v", "c"):
            out = self.atom(t)
        elif head == "sum":
            out = self.reduce(t[1], self.of_expr(t[2]))
        elif head in ("add", "mul"):
            f = self.add if head == "add" else self.mul
            out = self.of_expr(t[1][0])
            for a in t[1][1:]:
                out = f(out, self.of_expr(a))
        else:
            out = getattr(self, head)(self.of_expr(t[1]))
        self.memo[id(t)] = (t, out)  # keeps t alive, so its id stays unique
        return out

    def chain(self, prog, x: tuple) -> tuple:
        """The fingerprint of a chain program applied to ``x`` (as ``target.chain_expr``)."""
        if prog == "x":
            return x
        if isinstance(prog, float):
            return self.atom(E.const(prog))
        op, *args = prog
        sub = [self.chain(a, x) for a in args]
        if op == "add":
            return self.add(*sub)
        if op == "mul":
            return self.mul(*sub)
        if op == "div":
            return self.mul(sub[0], self.inv(sub[1]))
        return getattr(self, op)(sub[0])

    def op(self, kind: str, attrs: dict, args: list, extent: int) -> tuple:
        """The fingerprint of a block op's result from its operands' fingerprints; ``extent``:
        the reduced extent of a sum or matmul."""
        if kind == "matmul":
            return self.reduce(extent, self.mul(args[0], args[1]))
        if kind == "mul":
            return self.mul(args[0], args[1])
        if kind == "div":
            return self.mul(args[0], self.inv(args[1]))
        if kind == "add":
            return self.add(args[0], args[1])
        if kind == "sum":
            return self.reduce(extent, args[0])
        return self.chain(attrs["prog"], args[0])


class FinalFilter:
    """The test a last custom op's output must pass to be kept: False only when no grid or loop
    count can give it the target's abstract expression and shape (``KernelSearch`` requires both
    of the last op's output, at the counts the cost model picks).

    Shape: without a STACK dim the output shape does not depend on the counts
    (``catalog._may_have_shape``). Expression: counts change reduction sizes (and a
    reduction over a tile dim of extent 1 vanishes), so the sizes are dropped: the output's
    stripped fingerprint (``Fingerprint(sized=False)``) must equal the target's. Equal expressions
    have equal stripped fingerprints at any counts, so nothing that could pass is dropped; a false
    match only costs the full check later."""

    # The last op's own checks that look at its result's expression (no recomputation, the
    # exact test) are applied by the enumerator; False only for ``blockshare``'s opaque inputs,
    # whose graphs get both checks on the concrete inputs afterwards.
    exprs = True
    # The cheap test reads the output's stripped fingerprint (False: shapes only, and the
    # enumerator computes no stripped fingerprints).
    stripped = True

    def __init__(self, target, layout, sym_size: dict) -> None:
        self.fp = Fingerprint(sized=False)
        self.want = self.fp.of_expr(target.out_expr)
        self.strip_memo: dict = {}
        self.want_expr = strip_sums(target.out_expr, self.strip_memo)
        self.out_shape = target.graph.nodes[target.out_node].shape
        self.grid = set(layout.grid_syms)
        self.sym_size = sym_size

    def shape_ok(self, shape: tuple, syms: tuple) -> bool:
        """Can an output of this tile shape be the target's shape at some counts?"""
        if any(g not in syms for g in self.grid) or any(is_stack_sym(s) for s in syms):
            return True  # a STACK dim: its extent is a grid count, left to the full check
        full = tuple(self.sym_size[s] if s in self.grid else d for d, s in zip(shape, syms))
        return full == self.out_shape

    def __call__(self, shape: tuple, syms: tuple, stripped_fp: tuple) -> bool:
        """The cheap test: shape and stripped fingerprint (no expression needed)."""
        return stripped_fp == self.want and self.shape_ok(shape, syms)

    def exact(self, info: TensorInfo) -> bool:
        """The exact test on stripped expressions, for outputs that passed the cheap one."""
        return strip_sums(info.expr, self.strip_memo) == self.want_expr


# -- the enumerator -----------------------------------------------------------------------------
class MemoEnumerator:
    """Complete block graphs of one layout at representative counts (module docstring).

    ``run()`` returns {op set: result nodes} of every complete graph that passes
    ``accept`` (every complete graph when ``accept`` is None), ``completions()`` the same graphs
    in a compact form (``ops_of`` turns a key into its op descriptors); ``structures()`` turns op
    sets into ``blocksearch.Structure`` s. Counters: ``states`` explored, ``deduplicated``
    prefixes that reached an explored state, ``mismatched`` complete graphs ``accept`` rejected.

    Tensors are small ints (nodes), one per distinct TensorInfo; see the comment above ``_add``
    for how they are found without building every expression.
    """

    def __init__(self, ctx, layout, infos: dict, sizes: dict, max_outputs: int,
                 accept: FinalFilter | None = None):
        from mpk_dist.superopt.blocksearch import _tile

        self.ctx = ctx
        self.layout = layout
        self.max_ops = ctx.config.max_block_ops
        self.max_outputs = max_outputs
        self.accept = accept
        self.loop = layout.loop_sym
        self.loop_count = sizes[self.loop] if self.loop else 1
        self.chains = [p for p, _ in ctx.target.chains]
        self.fp = Fingerprint()                       # sized: tells expressions apart
        # stripped fingerprints of every node, for ``accept``'s cheap test (not needed when it
        # tests shapes only: ``blockshare``)
        self.sfp = accept.fp if accept is not None and accept.stripped else None
        # per node: shape, syms, sized fingerprint and its id, stripped fingerprint, recipe,
        # TensorInfo (None until an expression is needed)
        self.shape, self.syms, self.fps, self.fpid, self.strip = [], [], [], [], []
        self.recipe, self.infos = [], []
        self.by_recipe: dict = {}           # (kind, attr key, operand nodes) -> node
        self.by_fp: dict = {}               # (shape, syms, fingerprint) -> [nodes]
        self.by_info: dict = {}             # TensorInfo -> node (eager mode)
        self.fp_ids: dict = {}              # fingerprint (eager: expression) -> id
        # With pruning every new tensor's expression goes to the oracle anyway, so it is built
        # first and identifies the node ("eager"); without pruning nodes are found by fingerprint
        # and expressions are built only to confirm a match. Both give the same nodes.
        self.eager = ctx.config.prune
        grid_split = {s: sizes[s] for s in layout.grid_syms}
        self.inputs = []                    # [(node, loop-dependent)]
        for k, n in enumerate(layout.inputs):
            info = infos[n]
            dep = self.loop is not None and self.loop in info.syms
            split = {**grid_split, **({self.loop: sizes[self.loop]} if dep else {})}
            tile = intern(TensorInfo(_tile(info, split), info.syms, info.expr))
            node = self._add(tile.shape, tile.syms,
                             info.expr if self.eager else self.fp.of_expr(info.expr),
                             self.sfp.of_expr(info.expr) if self.sfp else None, ("in", k), tile)
            self.by_info[tile] = node
            self.inputs.append((node, dep))
        self.input_fpids = {self.fpid[i] for i, _ in self.inputs}
        self.memo: dict = {}
        # Completions are kept compact (``_join``): an op descriptor gets an id on first sight,
        # and a completion is the tuple of its ops' ids in ascending order; a state being built
        # collects them as dict keys (value None, for the order and the deduplication), and the
        # memo keeps a finished state's keys as a tuple (``_finish``), under a key whose sets are
        # sorted tuples (``_tup``). Before, a completion was a frozenset of descriptors mapped to
        # a frozenset of its result nodes: 1.5 KB for a five-op graph (a frozenset of five is 728
        # bytes), and every state holds all of its completions until the layout is done (one
        # last-op layout of qk_norm_rope, 5 block ops: 5.0 M completions, 3.7 GB).
        self.desc_ids: dict = {}            # descriptor -> id
        self.descs: list = []               # id -> descriptor
        self.desc_node: list = []           # id -> the node the op makes
        self.desc_fpid: list = []           # id -> that node's fingerprint id
        self.acc_of: dict = {}              # body node -> accumulator node (None: cannot leave)
        self.child_fps: dict = {}           # id of a state's completions -> (them, ``_child_fps``)
        self.joined_whole = 0               # joins that kept a child's completions unchecked
        # operand shapes -> valid ops and result shapes: depends on the target's chains only,
        # so it is shared by every layout and input subset of one search
        self.shape_ops: dict = ctx.target.__dict__.setdefault("_block_shape_ops", {})
        self.deduplicated = 0
        self.states = 0
        self.mismatched = 0

    def run(self) -> dict:
        """{frozenset of op descriptors: frozenset of the nodes the ops make}: ``completions``
        expanded (the enumerator's paths use the compact form)."""
        return {frozenset(ops): frozenset(d[4][1] for d in ops)
                for ops in map(self.ops_of, self.completions())}

    def completions(self) -> tuple:
        """Every complete graph once, compact: a tuple of keys, a key being the ascending ids of
        the graph's op descriptors (``ops_of`` gives the descriptors), in the order ``run`` lists
        them. The memo of states is dropped at the end: no state is asked for again, and its
        completions were most of the enumeration's memory."""
        allin = frozenset(range(len(self.inputs)))
        if self.loop is None:
            root = self._post(0, allin, frozenset(), frozenset(), frozenset(), frozenset())
        else:
            root = self._body(0, allin, frozenset(), frozenset())
        self.memo = {}
        self.child_fps = {}
        return root

    # NOTE (``_deadline``): ``_body`` and ``_post`` check the deadline before each op, not only
    # before a state's ops, ``_join`` before it copies a child's completions, and ``structures``
    # every 4096 graphs: a state's ops and their child states still ran after the deadline in
    # every frame of the recursion, each frame still joined its child's partial completions, and
    # a finished enumeration was put in canonical order whole (qk_norm_rope's first-op layout
    # "none" of Q: 1.9 M graphs enumerated in 72 s, then more than 70 s of canonical orders; the
    # pool worker ran up to 75 s past the deadline, eighteenth session). Nothing of an
    # enumeration that ran into the deadline is kept: its two callers list nothing from it
    # (``blocksearch.enumerate_layout`` returns no structures, a ``blockshare.SharedFinal`` keeps
    # no graphs), so where it stops changes no listing.

    def ops_of(self, key: tuple) -> tuple:
        """The op descriptors of a completion key (in id order; every use of a graph's op set
        is independent of the order: ``canonical_order`` places ops by their text)."""
        descs = self.descs
        return tuple(descs[i] for i in key)

    def structures(self, graphs, keep=None, part=None) -> list:
        """``Structure`` s of the op sets ``graphs``, each in its canonical order, sorted;
        ``keep``: None, or a callable on a graph's outputs ((shape, syms) of each output tile):
        the graphs it returns False for are left out before their canonical order is built.

        ``part``: None, or (j, n): only the graphs at positions j, j + n, j + 2n, ... of
        ``graphs`` (``catalog.BlockCatalog``'s split listings), as ``(Structure, position)``
        pairs sorted by (structure, position). The whole list is sorted by structure, stably, so
        its order is that of (structure, position) too: merging the n parts by that pair gives
        the whole list (``catalog.merge_parts``)."""
        from mpk_dist.superopt.blocksearch import Structure

        if part is not None:
            return self._part(graphs, keep, part)
        if keep is not None:
            graphs = [ops for ops in graphs if keep(self._output_tiles(ops))]
        out = []
        timed_out = self.ctx.timed_out
        for i, ops in enumerate(graphs):
            if not i & 4095 and timed_out():
                return []  # (``_deadline``) qk_norm_rope's Q, layout "none": 1.9 M graphs
            out.append(Structure(self.layout, *canonical_order(ops)))
        out.sort(key=lambda s: (s.body, s.post, s.outputs))
        return out

    def _part(self, graphs, keep, part: tuple) -> list:
        """``structures``' part (j, n): [(Structure, position in ``graphs``)] sorted."""
        from mpk_dist.superopt.blocksearch import Structure

        pairs = itertools.islice(zip(graphs, itertools.count()), part[0], None, part[1])
        if keep is not None:
            pairs = [(ops, i) for ops, i in pairs if keep(self._output_tiles(ops))]
        out = []
        timed_out = self.ctx.timed_out
        for n, (ops, i) in enumerate(pairs):
            if not n & 4095 and timed_out():
                return []  # as ``structures``
            out.append((Structure(self.layout, *canonical_order(ops)), i))
        out.sort(key=lambda x: (x[0].body, x[0].post, x[0].outputs, x[1]))
        return out

    def _output_tiles(self, ops) -> list:
        """(shape, syms) of the outputs of the op set ``ops`` (as ``canonical_order`` finds
        them: accumulators of unread body results, unread post results; an accumulator has its
        body tensor's shape), at the enumeration's counts."""
        read = {r for d in ops for r in d[3]}
        out = []
        for d in ops:
            ref = d[4]
            if ref not in read and (d[0] == "p" or ("a", ref[1]) not in read):
                out.append((self.shape[ref[1]], self.syms[ref[1]]))
        return out

    # -- tensors ----------------------------------------------------------------------------
    # A node is a TensorInfo. Building abstract expressions is most of the cost of a new tensor,
    # so a node is found by its recipe (the same op on the same nodes) or by its sized
    # fingerprint, and expressions are built only to confirm a fingerprint match (equal
    # expressions have equal fingerprints, not always the converse), for the pruning oracle, and
    # for a last op's exact test.
    def _add(self, shape, syms, fp, sfp, recipe, info=None, findable: bool = True) -> int:
        node = len(self.shape)
        self.shape.append(shape)
        self.syms.append(syms)
        self.fps.append(fp)
        self.fpid.append(self.fp_ids.setdefault(fp, len(self.fp_ids)))
        self.strip.append(sfp)
        self.recipe.append(recipe)
        self.infos.append(info)
        if findable and not self.eager:
            self.by_fp.setdefault((shape, syms, fp), []).append(node)
        return node

    def _find(self, shape, syms, fp, sfp, recipe) -> int:
        """The node with this shape, symbols and expression, made on first sight."""
        same = self.by_fp.get((shape, syms, fp))
        if same:
            info = self._make_info(recipe)
            for node in same:
                if self._info(node) == info:
                    return node
            return self._add(shape, syms, fp, sfp, recipe, info)
        return self._add(shape, syms, fp, sfp, recipe)

    def _new(self, kind: str, attrs: dict, args: tuple, shape: tuple, syms: tuple) -> int:
        """The node of ``kind(args)`` (a valid op with result ``shape`` / ``syms``)."""
        rk = (kind, attrs.get("dim"), id(attrs.get("prog")), args)
        node = self.by_recipe.get(rk)
        if node is None:
            a0 = args[0]
            extent = self.shape[a0][-1] if kind == "matmul" else \
                self.shape[a0][attrs["dim"]] if kind == "sum" else 1
            sfp = None if self.sfp is None else \
                self.sfp.op(kind, attrs, [self.strip[a] for a in args], extent)
            if self.eager:
                node = self._by_info(self._make_info((kind, attrs, args)), sfp,
                                     (kind, attrs, args))
            else:
                fp = self.fp.op(kind, attrs, [self.fps[a] for a in args], extent)
                node = self._find(shape, syms, fp, sfp, (kind, attrs, args))
            self.by_recipe[rk] = node
        return node

    def _leaf(self, kind: str, attrs: dict, args: tuple, shape: tuple, syms: tuple) -> int:
        """The node of a last op's result when the enumerator does not look at its expression
        (``accept.exprs`` False, ``blockshare``): one node per recipe, never matched against
        nodes of equal expression (no expression is built to confirm a fingerprint match).

        Why the graphs are the same as with ``_new``: a last op's result is read by no op and
        is in no state, so its node only names it in its op's descriptor (whose recipe already
        tells it apart) and in the no-recomputation test of the ops before it, which compares
        sized fingerprints and then expressions (``_repeats``), not node ids; its fingerprint is
        computed as ``_new`` computes it. Confirming fingerprint matches of these results was
        ~15% of a ``blockshare`` signature's enumeration."""
        rk = ("leaf", kind, attrs.get("dim"), id(attrs.get("prog")), args)
        node = self.by_recipe.get(rk)
        if node is None:
            a0 = args[0]
            extent = self.shape[a0][-1] if kind == "matmul" else \
                self.shape[a0][attrs["dim"]] if kind == "sum" else 1
            fp = self.fp.op(kind, attrs, [self.fps[a] for a in args], extent)
            node = self.by_recipe[rk] = self._add(shape, syms, fp, None, (kind, attrs, args),
                                                  findable=False)
        return node

    def _leaf_acc(self, b: int) -> int:
        """``_acc`` of a ``_leaf`` node (which never varies with the loop): its own node."""
        acc = self.acc_of.get(b)
        if acc is None:
            acc = self._add(self.shape[b], self.syms[b],
                            self.fp.reduce(self.loop_count, self.fps[b]), None, ("acc", b),
                            findable=False)
            self._keep(acc)  # counted as ``_acc`` counts; never prunes (unpruned only)
            self.acc_of[b] = acc
        return acc

    def _by_info(self, info: TensorInfo, sfp, recipe) -> int:
        node = self.by_info.get(info)
        if node is None:
            node = self.by_info[info] = self._add(info.shape, info.syms, info.expr, sfp, recipe,
                                                  info)
        return node

    def _make_info(self, recipe: tuple) -> TensorInfo:
        if recipe[0] == "acc":
            b = self._info(recipe[1])
            return intern(TensorInfo(b.shape, b.syms, E.mk_sum(self.loop_count, b.expr)))
        kind, attrs, args = recipe
        return infer(kind, [self._info(a) for a in args], attrs)

    def _info(self, node: int) -> TensorInfo:
        """The TensorInfo (with its abstract expression) of a node, built on demand."""
        info = self.infos[node]
        if info is None:
            info = self.infos[node] = self._make_info(self.recipe[node])
        return info

    def _repeats(self, x: int, nodes) -> bool:
        """Does ``x`` repeat the abstract expression of one of ``nodes`` (no recomputation)?"""
        f = self.fpid[x]
        return any(self.fpid[y] == f and self._info(y).expr == self._info(x).expr for y in nodes)

    def _strip_fp(self, kind: str, attrs: dict, args: tuple) -> tuple:
        a0 = args[0]
        extent = self.shape[a0][-1] if kind == "matmul" else \
            self.shape[a0][attrs["dim"]] if kind == "sum" else 1
        return self.sfp.op(kind, attrs, [self.strip[a] for a in args], extent)

    def _exact(self, node: int) -> bool:
        # the exact stripped-expression test (the fingerprint test passed): the accumulator of a
        # body op has the same stripped expression as the op's result
        ok = self.accept.exact(self._info(node))
        if not ok:
            self.mismatched += 1
        return ok

    def _keep(self, node: int) -> bool:
        # the oracle, with the expression built only when it prunes (prune=True)
        return self.ctx.keep(lambda: self._info(node).expr)

    # -- helpers ----------------------------------------------------------------------------
    def _fits(self, unread: int, sinks: int, promises: int, left: int) -> bool:
        """Sound bound: every unread input and every kept tensor must still be read, and at most
        ``max_outputs`` sinks may remain. An op reads at most two tensors and creates one, so it
        settles at most two of these and lowers their total by at most one."""
        return max((unread + promises + 1) // 2,
                   unread + sinks + promises - self.max_outputs) <= left

    def _join(self, out: dict, desc: tuple, x: int, child: dict) -> None:
        """Add ``desc`` (making node ``x``) to every completion of the child state (a tuple of
        keys: ascending op ids, see ``__init__``) that does not recompute its result.

        The same completions as with op sets: two keys are equal exactly when their op sets are
        (ids are per distinct descriptor), they are added in the same order, and a completion's
        result nodes are its ops' nodes. ``desc`` itself is never in a child's completion: its
        node ``x`` would be among the completion's nodes, and then it repeats itself."""
        if self.ctx.timed_out():
            return  # nothing of a run past the deadline is kept (``_deadline``)
        dfp, dnode = self.desc_fpid, self.desc_node
        fx = self.fpid[x]
        di = self._did(desc, x)
        if len(child) >= _WHOLE_JOIN and fx not in self._child_fps(child):
            # no op of any completion has x's fingerprint, so none repeats x's expression (equal
            # expressions have equal fingerprints): every completion is kept, unchecked
            self.joined_whole += 1
            for key in child:
                out.setdefault(tuple(sorted(key + (di,))), None)
            return
        for key in child:
            if fx in map(dfp.__getitem__, key) and self._repeats(x, [dnode[i] for i in key]):
                continue  # no recomputation: a later op repeats this op's expression
            out.setdefault(tuple(sorted(key + (di,))), None)

    def _child_fps(self, child: tuple) -> set:
        """The fingerprint ids of every op of every completion of ``child`` (a state's
        completions from the memo), memoized by identity until ``completions`` ends.

        NOTE: ``_join`` checked every completion of the child for an op with the new op's
        fingerprint, each time the child was joined (qk_norm_rope's first-op layout "none" of Q
        at 5 block ops: 730,960 states, 924,487 prefixes reusing one; about a quarter of a
        profiled enumeration was ``_join``); the answer is almost always no, and one set per
        child answers it for all of its completions at once."""
        hit = self.child_fps.get(id(child))
        if hit is not None and hit[0] is child:
            return hit[1]
        dfp = self.desc_fpid
        fps = {dfp[i] for key in child for i in key}
        self.child_fps[id(child)] = (child, fps)  # keeps child alive, so its id stays unique
        return fps

    def _did(self, desc: tuple, x: int) -> int:
        """The id of op descriptor ``desc`` (whose result is node ``x``)."""
        i = self.desc_ids.get(desc)
        if i is None:
            i = self.desc_ids[desc] = len(self.descs)
            self.descs.append(desc)
            self.desc_node.append(x)
            self.desc_fpid.append(self.fpid[x])
        return i

    def _unit(self, out: dict, desc: tuple, x: int) -> None:
        """Add the one-op completion ``desc`` (the last op of a last custom op)."""
        out.setdefault((self._did(desc, x),), None)

    @staticmethod
    def _done(out: dict) -> None:
        """Add the empty completion (the graph is complete as it is)."""
        out[()] = None

    @staticmethod
    def _merge(out: dict, done) -> None:
        """Add the completions ``done`` of another state (leaving the loop) to ``out``."""
        for key in done:
            out.setdefault(key, None)

    @staticmethod
    def _finish(out: dict) -> tuple:
        """A state's completions as kept in the memo: the keys of ``out`` in their order (a tuple
        of 26 keys is ~250 bytes, the dict ~1.2 KB)."""
        return tuple(out)

    @staticmethod
    def _desc(phase: str, kind: str, attrs: dict, refs: list, node: int) -> tuple:
        """An op as a hashable descriptor: (phase, kind, attrs, operand refs, result ref). mul /
        add operands are sorted, so one op has one descriptor whichever state reached it (else a
        graph could come out twice)."""
        if kind in _COMMUTATIVE:
            refs = sorted(refs)
        return (phase, kind, tuple(sorted(attrs.items())), tuple(refs), (phase, node))

    def _ops_on(self, avail: list, need: int, owed: set):
        """Ops valid on the nodes ``avail`` that read at least ``need`` of the indices in
        ``owed`` (the bound's requirement): (kind, arg indices, attrs, result shape, syms). The
        ops of ``inference.candidate_ops`` whose ``infer`` is not None; validity depends on shapes
        and symbols only, so it is tabulated per operand shapes."""
        if need > 2:
            return
        n = len(avail)
        sh = [(self.shape[x], self.syms[x]) for x in avail]
        for i in range(n):
            if need > 1 or (need == 1 and i not in owed):
                continue
            for kind, attrs, shape, syms in self._valid(sh[i]):
                yield kind, (i,), attrs, shape, syms
        for i in range(n):
            oi = i in owed
            for j in range(i, n):
                if need > 0 and oi + (j in owed and j != i) < need:
                    continue
                for kind, swap, shape, syms in self._valid(sh[i], sh[j]):
                    if swap and i == j:
                        continue  # (a, a) both ways is one op
                    yield kind, ((j, i) if swap else (i, j)), {}, shape, syms

    def _valid(self, *shapes) -> list:
        hit = self.shape_ops.get(shapes)
        if hit is not None:
            return hit
        hit = []
        t = [TensorInfo(s, y, None) for s, y in shapes]
        if len(t) == 1:
            for kind, args, attrs, _ in candidate_ops(t, self.chains):
                if len(args) == 1:
                    r = infer(kind, t, attrs, exprs=False)
                    if r is not None:
                        hit.append((kind, attrs, r.shape, r.syms))
        else:
            # matmul and div both ways, mul and add once (candidate_ops' order for i <= j)
            for swap, x, y in ((False, t[0], t[1]), (True, t[1], t[0])):
                for kind in ("matmul", "div") + (() if swap else _COMMUTATIVE):
                    r = infer(kind, [x, y], {}, exprs=False)
                    if r is not None:
                        hit.append((kind, swap, r.shape, r.syms))
        self.shape_ops[shapes] = hit
        return hit

    def reachable_types(self) -> set:
        """Every (shape, syms) a tensor of this layout's block graphs can have: the input tiles'
        and what ``_valid`` ops make from them, closed up to ``max_block_ops`` rounds.

        An over-approximation: phases, loop dependence and which tensors an op may still read
        are ignored, and an accumulator has its body tensor's shape and symbols, so every node
        the enumeration makes (inputs, body and post results, accumulators) has one of these
        types. ``blockshare`` uses it to skip a signature none of whose types can be the
        target's output (shape only)."""
        types = {(self.shape[i], self.syms[i]) for i, _ in self.inputs}
        for _ in range(self.max_ops):
            cur = list(types)
            new = {(shape, syms) for t in cur for _, _, shape, syms in self._valid(t)}
            new |= {(shape, syms) for a in cur for b in cur
                    for _, _, shape, syms in self._valid(a, b)}
            if new <= types:
                break
            types |= new
        return types

    def _leaf_ok(self, kind: str, attrs: dict, args: tuple, shape: tuple, syms: tuple) -> bool:
        """``accept`` for the result of a last op, from shapes and fingerprints only (building
        the expression is most of the cost of a new tensor, and most last ops fail)."""
        ok = self.accept(shape, syms,
                         None if self.sfp is None else self._strip_fp(kind, attrs, args))
        if not ok:
            self.mismatched += 1
        return ok

    def _seen(self, key: tuple) -> tuple | None:
        """The completions of an explored state (counted as a deduplicated prefix), or None for a new
        state (counted in ``states``; the caller stores its completions under ``key``)."""
        hit = self.memo.get(key)
        if hit is None:
            self.states += 1
        else:
            self.deduplicated += 1
        return hit

    # -- body -------------------------------------------------------------------------------
    def _body(self, nb: int, unread: frozenset, dangling: frozenset, kept: frozenset) -> tuple:
        key = (0, nb, _tup(unread), _tup(dangling), _tup(kept))
        hit = self._seen(key)
        if hit is not None:
            return hit
        out: dict = {}
        if nb >= 1:
            self._merge(out, self._boundary(nb, unread, dangling, kept))
        left = self.max_ops - nb - 1
        if left == 0 and self.accept is not None:
            self._body_last(nb, unread, dangling | kept, out)
        elif left >= 0 and not self.ctx.timed_out():
            n_in = len(self.inputs)
            body_nodes = sorted(dangling | kept)
            avail = [i for i, _ in self.inputs] + body_nodes
            dep = [d for _, d in self.inputs] + [True] * len(body_nodes)
            seen = [i for i, _ in self.inputs] + body_nodes
            seen_f = {self.fpid[y] for y in seen}
            owed = set(unread) | set(range(n_in, len(avail)))
            need = len(unread) + len(body_nodes) + 1 - self.max_outputs - left
            for kind, args, attrs, shape, syms in self._ops_on(avail, need, owed):
                if self.ctx.timed_out():
                    break  # nothing of a run past the deadline is kept (``_deadline``)
                if not any(dep[i] for i in args):
                    continue  # body ops must depend on the loop
                read_in = {i for i in args if i < n_in}
                read_b = {avail[i] for i in args if i >= n_in}
                un2 = unread - read_in
                operands = tuple(avail[i] for i in args)
                refs = [("i", i) if i < n_in else ("b", avail[i]) for i in args]
                x = self._new(kind, attrs, operands, shape, syms)
                if self.fpid[x] in seen_f and self._repeats(x, seen) or not self._keep(x):
                    continue  # no recomputation; the pruning oracle
                desc = self._desc("b", kind, attrs, refs, x)
                base_d = (dangling - read_b) | {x}
                for keep in _subsets(read_b):
                    k2 = (kept - read_b) | keep
                    if not self._fits(len(un2), len(base_d), len(k2), left):
                        continue
                    child = self._body(nb + 1, un2, frozenset(base_d), frozenset(k2))
                    self._join(out, desc, x, child)
        out = self.memo[key] = self._finish(out)
        return out

    def _body_last(self, nb: int, unread: frozenset, body_nodes: frozenset, out: dict) -> None:
        """The last body op of a last custom op (``accept`` set): it must read every unread input
        and every dangling or kept body tensor (``_ops_on`` with ``need`` = all of them: at most
        two), keep nothing, and its accumulator is the one output. Shapes and fingerprints are
        checked first; the expression is built only for results that pass them."""
        n_in = len(self.inputs)
        if nb + 1 < 2 or len(unread) + len(body_nodes) > 2:
            return
        avail = [i for i, _ in self.inputs] + sorted(body_nodes)
        dep = [d for _, d in self.inputs] + [True] * len(body_nodes)
        owed = set(unread) | set(range(n_in, len(avail)))
        for kind, args, attrs, shape, syms in self._ops_on(avail, len(owed), owed):
            if self.loop in syms or not any(dep[i] for i in args):
                continue  # cannot leave the loop; body ops must depend on the loop
            operands = tuple(avail[i] for i in args)
            if not self._leaf_ok(kind, attrs, operands, shape, syms):
                continue
            if not self.accept.exprs:
                x = self._leaf(kind, attrs, operands, shape, syms)
                self._keep(x)
                self._leaf_acc(x)
            else:
                x = self._new(kind, attrs, operands, shape, syms)
                if self._repeats(x, [i for i, _ in self.inputs] + list(body_nodes)) or \
                        not self._exact(x) or not self._keep(x) or self._acc(x) is None:
                    continue
            refs = [("i", i) if i < n_in else ("b", avail[i]) for i in args]
            desc = self._desc("b", kind, attrs, refs, x)
            self._unit(out, desc, x)

    def _acc(self, b: int):
        """The accumulator node of body node ``b`` (sum over iterations), or None when ``b`` varies
        with the loop (cannot leave it) or the oracle prunes the accumulator."""
        if b in self.acc_of:
            return self.acc_of[b]
        acc = None
        if self.loop not in self.syms[b]:
            acc = self.by_recipe.get(("acc", b))
            if acc is None:
                if self.eager:
                    acc = self._by_info(self._make_info(("acc", b)), self.strip[b], ("acc", b))
                else:
                    acc = self._find(self.shape[b], self.syms[b],
                                     self.fp.reduce(self.loop_count, self.fps[b]),
                                     self.strip[b], ("acc", b))
                self.by_recipe[("acc", b)] = acc
            if not self._keep(acc):
                acc = None
        self.acc_of[b] = acc
        return acc

    def _boundary(self, nb: int, unread: frozenset, dangling: frozenset,
                  kept: frozenset) -> tuple:
        """Leave the loop: every loop-dependent input must have been read, and every dangling or
        kept body tensor needs an accumulator (its only way out of the loop)."""
        if any(self.inputs[k][1] for k in unread):
            return ()
        if any(self._acc(b) is None for b in dangling | kept):
            return ()
        return self._post(nb, unread, dangling, kept, frozenset(), frozenset())

    # -- post -------------------------------------------------------------------------------
    def _post(self, n: int, unread: frozenset, acc_d: frozenset, acc_k: frozenset,
              post_d: frozenset, post_k: frozenset) -> tuple:
        """After the loop. ``acc_d`` / ``acc_k``: body nodes whose accumulators are unread / read
        and to be read again; ``post_d`` / ``post_k``: the same for post ops' results."""
        key = (1, n, _tup(unread), _tup(acc_d), _tup(acc_k), _tup(post_d), _tup(post_k))
        hit = self._seen(key)
        if hit is not None:
            return hit
        out: dict = {}
        if n >= 2 and not unread and not acc_k and not post_k:
            outs = len(acc_d) + len(post_d)
            if 1 <= outs <= self.max_outputs:
                if self.accept is None or self._accept_node(
                        self.acc_of[next(iter(acc_d))] if acc_d else next(iter(post_d))):
                    self._done(out)
        left = self.max_ops - n - 1
        if left == 0 and self.accept is not None:
            self._post_last(n, unread, acc_d | acc_k, post_d | post_k, out)
        elif left >= 0 and not self.ctx.timed_out():
            accs = sorted(acc_d | acc_k)
            posts = sorted(post_d | post_k)
            ins = [(k, i) for k, (i, dep) in enumerate(self.inputs) if not dep]
            avail = [i for _, i in ins] + [self.acc_of[b] for b in accs] + posts
            refs_of = [("i", k) for k, _ in ins] + [("a", b) for b in accs] + \
                [("p", x) for x in posts]
            # post results may not repeat an input, a body tensor or an earlier post result
            # (accumulators are not checked, as in blocksearch)
            seen = [i for i, _ in self.inputs] + list(accs) + posts
            seen_f = {self.fpid[y] for y in seen}
            owed = {j for j, (k, _) in enumerate(ins) if k in unread}
            owed |= set(range(len(ins), len(avail)))  # every acc and post here is owed
            need = len(unread) + len(accs) + len(posts) + 1 - self.max_outputs - left
            for kind, args, attrs, shape, syms in self._ops_on(avail, need, owed):
                if self.ctx.timed_out():
                    break  # nothing of a run past the deadline is kept (``_deadline``)
                refs = [refs_of[i] for i in args]
                read_in = {r[1] for r in refs if r[0] == "i"}
                read_a = {r[1] for r in refs if r[0] == "a"}
                read_p = {r[1] for r in refs if r[0] == "p"}
                un2 = unread - read_in
                ad = acc_d - read_a
                operands = tuple(avail[i] for i in args)
                x = self._new(kind, attrs, operands, shape, syms)
                if self.fpid[x] in seen_f and self._repeats(x, seen) or not self._keep(x):
                    continue
                desc = self._desc("p", kind, attrs, refs, x)
                pd = (post_d - read_p) | {x}
                for keep in _subsets(read_a | read_p):
                    ak = (acc_k - read_a) | (keep & read_a)
                    pk = (post_k - read_p) | (keep & read_p)
                    if not self._fits(len(un2), len(ad) + len(pd), len(ak) + len(pk), left):
                        continue
                    child = self._post(n + 1, un2, ad, frozenset(ak), frozenset(pd),
                                       frozenset(pk))
                    self._join(out, desc, x, child)
        out = self.memo[key] = self._finish(out)
        return out

    def _post_last(self, n: int, unread: frozenset, accs: frozenset, posts: frozenset,
                   out: dict) -> None:
        """The last post op of a last custom op (``accept`` set): it reads every unread input and
        every accumulator and post result still owed (at most two), keeps nothing, and its result
        is the one output. As ``_body_last``."""
        if n + 1 < 2 or len(unread) + len(accs) + len(posts) > 2:
            return
        ins = [(k, i) for k, (i, dep) in enumerate(self.inputs) if not dep]
        accs, posts = sorted(accs), sorted(posts)
        avail = [i for _, i in ins] + [self.acc_of[b] for b in accs] + posts
        refs_of = [("i", k) for k, _ in ins] + [("a", b) for b in accs] + [("p", x) for x in posts]
        owed = {j for j, (k, _) in enumerate(ins) if k in unread}
        owed |= set(range(len(ins), len(avail)))
        for kind, args, attrs, shape, syms in self._ops_on(avail, len(owed), owed):
            operands = tuple(avail[i] for i in args)
            if not self._leaf_ok(kind, attrs, operands, shape, syms):
                continue
            if not self.accept.exprs:
                x = self._leaf(kind, attrs, operands, shape, syms)
                self._keep(x)
            else:
                x = self._new(kind, attrs, operands, shape, syms)
                if self._repeats(x, [i for i, _ in self.inputs] + accs + posts) or \
                        not self._exact(x) or not self._keep(x):
                    continue
            desc = self._desc("p", kind, attrs, [refs_of[i] for i in args], x)
            self._unit(out, desc, x)

    def _accept_node(self, node: int) -> bool:
        ok = self.accept(self.shape[node], self.syms[node], self.strip[node]) and \
            self.accept.exact(self._info(node))
        if not ok:
            self.mismatched += 1
        return ok


# -- output -------------------------------------------------------------------------------------
def canonical_order(ops) -> tuple:
    """(body, post, outputs) of the block graph ``ops`` (a set of op descriptors).

    Ops are placed greedily: at each step the ready op (all operands placed) whose printed text
    ``kind[attrs](args)`` is smallest. Lines of ``BlockGraph.text`` differ first in that text, so
    this is the topological order with the smallest text; body ops all come before post ops.
    Operands of mul / add are listed as ``blocksearch`` lists them (inputs, then accumulators, then
    op results, each in order of definition); outputs as ``blocksearch`` orders them (body sinks'
    accumulators, then post sinks)."""
    names: dict = {}
    body_d, post_d, read = [], [], set()
    for d in ops:
        p = _prepared(d)
        (body_d if d[0] == "b" else post_d).append(p)
        read.update(p[1])
    body, body_out = _place(body_d, names, "b")
    post, post_out = _place(post_d, names, "p")
    # a body op's result leaves through its accumulator, unless a later op reads either
    outputs = [f"a{k}" for k, r in enumerate(body_out)
               if r not in read and ("a", r[1]) not in read]
    outputs += [f"p{k}" for k, r in enumerate(post_out) if r not in read]
    outputs = tuple(outputs)
    return tuple(body), tuple(post), _OUTPUTS.setdefault(outputs, outputs)


# few distinct output lists per listing: shared, as the ops are (``_op_tuple``)
_OUTPUTS: dict = {}
_PREPARED: dict = {}


def _prepared(d: tuple) -> tuple:
    """(call name, operand refs, commutative, result ref, kind, attrs) of descriptor ``d``,
    memoized by identity: the enumerator's graphs share their descriptor objects (``ops_of``),
    so an op's call name is looked up once per descriptor, not once per graph."""
    hit = _PREPARED.get(id(d))
    if hit is not None and hit[0] is d:
        return hit[1]
    if len(_PREPARED) > 200_000:  # bound memory (the entries keep their descriptors alive)
        _PREPARED.clear()
    p = (op_call_name(d[1], d[2]), d[3], d[1] in _COMMUTATIVE, d[4], d[1], d[2])
    _PREPARED[id(d)] = (d, p)  # keeps d alive, so its id stays unique
    return p


_CLASS = {"i": 0, "a": 1, "b": 1, "p": 2}


def _rank(name: str) -> tuple:
    # blocksearch's operand index order: inputs, then accumulators / body results, then posts
    return _CLASS[name[0]], int(name[1:])


def _place(todo: list, names: dict, prefix: str) -> tuple:
    """Place the ops ``todo`` (one phase, ``_prepared``) greedily by their text
    (``canonical_order``); name their results ``prefix``0, 1, ... (a body op's accumulator a0, a1,
    ...) in ``names``. Returns ([(kind, arg names, attrs)] in placed order, [result ref]).

    NOTE: ~2·10^6 graphs per first-op layout go through here (qk_norm_rope's Q, layout "none",
    unpruned: 95 s of its 264 s on one core, eighteenth session), so this is the same greedy
    choice with less work: an op's text is final once its operands are placed, so it is built
    once, when its last operand is placed (counted per op; the text of every ready op was built
    again, and every op's operands looked up again, at each step); ties keep ``todo``'s order,
    as the strict minimum over ``todo`` did."""
    ready, waiting, missing = [], {}, []
    for pos, p in enumerate(todo):
        m = 0
        for r in p[1]:
            if r not in names:
                if r[0] == "i":
                    names[r] = f"i{r[1]}"
                    continue
                m += 1
                waiting.setdefault(r, []).append(pos)
        missing.append(m)
        if not m:
            ready.append(_ready(p, pos, names))
    out, results = [], []
    while ready:
        best = min(ready)  # (text, position): texts differ between ops of one graph
        ready.remove(best)
        _, _, p, args = best
        k = len(out)
        r = p[3]
        names[r] = f"{prefix}{k}"
        if prefix == "b":
            names[("a", r[1])] = f"a{k}"
        out.append(_op_tuple(p, args))
        results.append(r)
        for pos in waiting.get(r, ()):
            missing[pos] -= 1
            if not missing[pos]:
                ready.append(_ready(todo[pos], pos, names))
    return out, results


_OPS: dict = {}        # (id of a prepared op, arg names) -> (that op, its structure op)
_OP_VALUES: dict = {}  # structure op -> the one object of its value


def _op_tuple(p: tuple, args: tuple) -> tuple:
    """The structure op (kind, arg names, attrs) of prepared op ``p`` on ``args``, one object per
    distinct value: the structures of a listing share their ops (qk_norm_rope, H=4, D=16, Q's
    first-op layout "none" at 3 block ops: 33 distinct ops in 2,059 structures), so a listing
    takes less memory and pickles to less (``pickle`` writes a shared object once and refers to
    it after). Found by ``p``'s identity first (``_PREPARED`` keeps ``p`` alive), since hashing
    the value hashes its attrs (a chain's program) too."""
    k = (id(p), args)
    hit = _OPS.get(k)
    if hit is None or hit[0] is not p:
        if len(_OPS) > 200_000:  # bound memory
            _OPS.clear()
            _OP_VALUES.clear()
        t = (p[4], args, p[5])
        hit = _OPS[k] = (p, _OP_VALUES.setdefault(t, t))
    return hit[1]


def _ready(p: tuple, pos: int, names: dict) -> tuple:
    """(text, position, prepared op, arg names) of an op whose operands are all named."""
    args = tuple(names[r] for r in p[1])
    if p[2] and len(args) == 2 and _rank(args[1]) < _rank(args[0]):
        args = (args[1], args[0])
    return call_text(p[0], args), pos, p, args


def _tup(items: frozenset) -> tuple:
    """A set of small ints as a memo key part: its sorted tuple (equal exactly when the sets are;
    ~50 bytes where a frozenset takes 216)."""
    return tuple(sorted(items)) if items else ()


_NO_SUBSETS = (frozenset(),)


def _subsets(items: set):
    """Every subset of ``items`` (the tensors an op keeps for a later read), as frozensets."""
    if not items:
        return _NO_SUBSETS  # most ops read no computed tensor: one (empty) choice
    if len(items) == 1:
        return _NO_SUBSETS + (frozenset(items),)
    items = list(items)
    if len(items) == 2:  # an op reads at most two tensors: the general loop below, unrolled
        a, b = items
        return _NO_SUBSETS + (frozenset((a,)), frozenset((b,)), frozenset((a, b)))
    return [frozenset(x for j, x in enumerate(items) if mask >> j & 1)
            for mask in range(1 << len(items))]

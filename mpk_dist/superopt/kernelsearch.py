"""Enumeration of kernel graphs: pre-defined ops and custom ops, in canonical order.

A kernel graph is grown one kernel op at a time up to ``max_kernel_ops``. Candidates for the next
op: every pre-defined op (matmul, add, mul, div, sum, a target chain) valid on the tensors so far,
and every custom op over a subset of them (block graphs from ``BlockCatalog``). Canonical order:
the new op uses a result of the previous op or has a larger key, so a kernel graph is produced
once. A new tensor must pass the pruning oracle and must not repeat an abstract expression the
graph already has. A graph is complete when its newest tensor has the target's abstract
expression and shape and every op contributes to it; complete graphs go to verification.
"""

from __future__ import annotations

import heapq
import itertools
import math
import multiprocessing
from itertools import combinations

from mpk_dist.superopt import blocksearch as B
from mpk_dist.superopt.bounds import RestBound
from mpk_dist.superopt.context import Context
from mpk_dist.superopt.cost import H200, custom_op_cost, graph_cost, prim_op_cost
from mpk_dist.superopt.inference import candidate_ops, infer, is_stack_sym
from mpk_dist.superopt.ugraph import KernelOp, UGraph

# -- worker side of the process pool ------------------------------------------------------------
_WORKER_CTX: Context | None = None


def _init_worker(target, config, deadline) -> None:
    global _WORKER_CTX
    _WORKER_CTX = Context(target, config, deadline)


def _layout_task(args):
    layout, infos, final = args
    ctx = _WORKER_CTX
    before = ctx.stats()
    structs = B.enumerate_layout(ctx, layout, infos, final)
    after = ctx.stats()
    return structs, {k: after[k] - before.get(k, 0) for k in after}


class BlockCatalog:
    """Custom-op options per input subset, memoized; layouts run on a process pool."""

    def __init__(self, ctx: Context, processes: int) -> None:
        self.ctx = ctx
        self.processes = processes
        self.memo: dict = {}
        self.pool = None

    def __enter__(self):
        if self.processes > 1:
            mp = multiprocessing.get_context("fork")
            self.pool = mp.Pool(self.processes, _init_worker,
                                (self.ctx.target, self.ctx.config, self.ctx.deadline))
        return self

    def __exit__(self, *exc) -> None:
        if self.pool is not None:
            self.pool.terminate()
            self.pool.join()

    def options(self, subset: tuple, infos: dict, final: bool = False) -> list:
        """[(Structure, sizes, cost_us)] for custom ops reading exactly ``subset``, best first;
        ``final``: for the last kernel op (one output)."""
        key = (final, *((n, infos[n]) for n in subset))
        if key not in self.memo:
            self.memo[key] = self._build(subset, {n: infos[n] for n in subset}, final)
        return self.memo[key]

    def _structures(self, subset: tuple, infos: dict, final: bool) -> list:
        lays = list(B.layouts(subset, infos, self.ctx.config.max_grid_dims))
        if self.pool is None:
            return [s for lay in lays for s in B.enumerate_layout(self.ctx, lay, infos, final)]
        out = []
        # imap (ordered): the same option order as the one-process path, so results and counters
        # do not depend on the number of processes
        for structs, delta in self.pool.imap(_layout_task, [(lay, infos, final) for lay in lays]):
            out.extend(structs)
            self.ctx.add_remote(delta)
        return out

    def _build(self, subset: tuple, infos: dict, final: bool) -> list:
        options = []
        out_shape = self.ctx.target.graph.nodes[self.ctx.target.out_node].shape
        for st in self._structures(subset, infos, final):
            if self.ctx.timed_out():
                break
            if final and not _may_have_shape(st, infos, out_shape, self.ctx.config):
                self.ctx.counts["shape_skipped"] = self.ctx.counts.get("shape_skipped", 0) + 1
                continue
            best = self._best_counts(st, infos)
            if best is not None and best[1] != math.inf:
                options.append((st, best[0], best[1]))
        options.sort(key=lambda o: o[2])
        return options

    def _best_counts(self, st, infos: dict):
        """(sizes, cost) of the cheapest counts: grid counts first (each at the smallest loop count
        whose tiles fit in shared memory), then the larger loop counts for the best grid.
        NOTE: greedy; cost is close to separable in the two. Shared memory per block falls as the
        loop count grows (fmap'd tiles shrink), so a grid is costed at its first feasible loop
        count: costing every grid at the smallest loop count only dropped every option of a long
        reduction (silu*mul->linear at K=12288: the W tile of 2 iterations alone exceeds 227 KB)."""
        grids, loops = B.count_choices(st, infos, self.ctx.config)
        loop_sym = st.layout.loop_sym
        if loop_sym and not loops:
            return None
        names = tuple(f"@{k}" for k in range(len(st.outputs)))

        def cost(sizes):
            """Cost, or inf; None when the counts make an op invalid (smaller tiles stay invalid)."""
            bg, kinfos = B.instantiate(st, sizes, infos, names, None)
            return None if bg is None else custom_op_cost(bg, {**infos, **kinfos})["time_us"]

        def first_fit(g: dict):
            for n in loops or [None]:
                sizes = {**g, loop_sym: n} if loop_sym else dict(g)
                c = cost(sizes)
                if c is None or c != math.inf:
                    return (math.inf if c is None else c), sizes
            return math.inf, sizes  # no loop count fits

        scored = [(*first_fit(g), i) for i, g in enumerate(grids)]
        if not scored:
            return None
        c, sizes, i = min(scored, key=lambda x: (x[0], x[2]))
        best = (sizes, c)
        rest = loops[loops.index(sizes[loop_sym]) + 1:] if loop_sym else []
        for n in rest:
            c = cost({**grids[i], loop_sym: n})
            if c is not None and c < best[1]:
                best = ({**grids[i], loop_sym: n}, c)
        return best


class KernelSearch:
    """Depth-first growth of kernel graphs (see module docstring)."""

    def __init__(self, ctx: Context, catalog: BlockCatalog, bound: float = math.inf,
                 verify=None) -> None:
        """``bound``: cost of the best verified graph so far; ``verify``: optional callable
        (UGraph -> bool); a complete graph cheaper than ``bound`` is verified as soon as it is
        found, and if it passes, its cost becomes the bound for the rest of the depth."""
        self.ctx = ctx
        self.catalog = catalog
        self.bound = bound  # branch and bound: cost of the best verified graph so far
        self.verify = verify
        t = ctx.target
        self.inputs = {name: info for name, info in _input_infos(t).items()}
        self.out_shape = t.graph.nodes[t.out_node].shape
        self.lower = RestBound(ctx.config, self.out_shape)
        self.candidates: dict = {}

    def run(self, max_ops: int) -> dict:
        """Explore graphs of up to ``max_ops`` kernel ops; returns {key: UGraph}."""
        self._dfs(dict(self.inputs), [], None, max_ops, 0.0)
        return self.candidates

    def _dfs(self, tensors: dict, ops: list, prev, budget: int, spent: float) -> None:
        if budget == 0 or self.ctx.timed_out() or spent + H200.sync_us >= self.bound:
            return
        dangling = _dangling(tensors, ops)
        if len(dangling) > budget * self.ctx.config.max_custom_inputs:
            return  # sound bound: every dangling tensor must still be read by some op
        last = budget == 1
        if last:
            moves = self._moves(tensors, ops, prev, True, dangling, spent)
        else:
            # NOTE: without a verified graph the bounds cut nothing and their order is no better
            # than the canonical one (qk_norm_rope's first graphs came later in it): canonical
            # order then, as before; best-first once a cost bound exists.
            listed = self._moves(tensors, ops, prev, False, set(), spent) \
                if self.bound == math.inf else \
                self._best_first(tensors, ops, prev, dangling, budget, spent)
            moves = (self._build(tensors, len(ops), False, m) for m in listed)
        for move in moves:
            if move is None:
                continue
            op, new, key, cost = move
            tensors.update(new)
            ops.append(op)
            done = [n for n, i in new.items() if self._is_output(i)]
            if done:
                self._record(tensors, ops, done[0])
            elif not last:
                self._dfs(tensors, ops, (key, set(new)), budget - 1, spent + cost)
            ops.pop()
            for n in new:
                del tensors[n]

    def _best_first(self, tensors: dict, ops: list, prev, dangling: set, budget: int,
                    spent: float):
        """The moves of a non-last op, in order of a lower bound of any complete graph through
        them (its cost plus ``RestBound.rest`` of what it leaves unread; shapes only, see
        bounds.py), stopping at the first whose bound exceeds the verified cost ``self.bound``.
        Cheap graphs are found and verified early, and then the bound cuts. An input subset's
        custom ops are listed (their catalog built) only when the subset's own bound (its
        cheapest layout plus the rest bound of the tensors it leaves unread, before its outputs)
        comes up. NOTE: moves are listed without building their block graphs' expressions
        (``_build`` does that for the moves taken): unpruned searches list ~10^6."""
        heap: list = []
        order = itertools.count()
        for move in self._moves(tensors, ops, prev, False, set(), spent, custom=False):
            heapq.heappush(heap, (self._move_bound(tensors, move, dangling, budget, spent),
                                  next(order), move))
        for subset, least in self._subsets(tensors, list(tensors), prev, False, set(), spent):
            # an op that completes the graph reads every unread tensor (else _record drops it)
            rest = 0.0 if dangling <= set(subset) else \
                self.lower.rest(tensors, dangling - set(subset), budget - 1)
            heapq.heappush(heap, (spent + least + rest, next(order), ("s", subset)))
        while heap:
            bound, _, item = heapq.heappop(heap)
            if bound > self.bound or self.ctx.timed_out():
                return  # every later item's bound is at least this one
            if item[0] != "s":
                yield item
                continue
            for move in self._options(tensors, item[1], prev, False, len(ops)):
                heapq.heappush(heap, (self._move_bound(tensors, move, dangling, budget, spent),
                                      next(order), move))

    def _move_bound(self, tensors: dict, move, dangling: set, budget: int,
                    spent: float) -> float:
        args, cost, new = move[1], move[3], self._shapes(tensors, move)
        if any(i.shape == self.out_shape for i in new.values()):
            return spent + cost  # the move may complete the graph
        left = (dangling - set(args)) | set(new)
        return spent + cost + self.lower.rest({**tensors, **new}, left, budget - 1)

    def _shapes(self, tensors: dict, move) -> dict:
        """{new tensor: TensorInfo without expression} of a listed move."""
        if move[0] == "p":
            return move[4][1]
        _, subset, n_ops, _, st, sizes, _ = move
        outs = _out_names(n_ops, len(st.outputs))
        return B.instantiate(st, sizes, tensors, outs, None)[1] or {}

    def _is_output(self, info) -> bool:
        return info.expr == self.ctx.target.out_expr and info.shape == self.out_shape

    def _moves(self, tensors: dict, ops: list, prev, last: bool, must_read: set, spent: float,
               custom: bool = True):
        """Next ops. Last op: (op, new tensors, key, cost), built. Other ops: listed moves
        ``("p", args, key, cost, built)`` (library ops; ``custom=False``: only those) and
        ``("c", subset, n_ops, cost, st, sizes, key)``, for ``_build``."""
        names = list(tensors)
        infos = [tensors[n] for n in names]
        seen = {i.expr for i in infos}
        fresh = f"t{len(ops)}"
        chains = [p for p, _ in self.ctx.target.chains]
        for kind, args, attrs, akey in candidate_ops(infos, chains):
            arg_names = tuple(names[i] for i in args)
            key = ("p", kind, arg_names, akey)
            if not _canonical(key, arg_names, prev):
                continue
            info = infer(kind, [infos[i] for i in args], attrs)
            if info is None or info.expr in seen or (last and not self._is_output(info)):
                continue
            if not self.ctx.keep(info.expr):
                continue
            op = KernelOp(kind, arg_names, (fresh,), tuple(sorted(attrs.items())),
                          origin=self.ctx.target.origin_of(info.expr))
            cost = prim_op_cost([i.shape for i in (infos[j] for j in args)], info.shape)
            built = (op, {fresh: info}, key, cost["time_us"])
            yield built if last else ("p", arg_names, key, cost["time_us"], built)
        if not custom:
            return
        for subset, _ in self._subsets(tensors, names, prev, last, must_read, spent):
            for move in self._options(tensors, subset, prev, last, len(ops)):
                if last:
                    move = self._build(tensors, len(ops), last, move)
                    if move is None:
                        continue
                yield move

    def _subsets(self, tensors: dict, names: list, prev, last: bool, must_read: set,
                 spent: float):
        """(subset, least cost of a custom op over it) for every input subset a custom op may
        read here, in canonical order. A subset none of whose layouts can cost less than what the
        bound leaves is skipped before its catalog is built (``RestBound.layout``: a lower bound
        of every option of a layout)."""
        for r in range(1, self.ctx.config.max_custom_inputs + 1):
            for subset in combinations(names, r):
                if not must_read <= set(subset):
                    continue  # the last op must read every tensor nobody read yet
                if not _canonical(("c", subset, math.inf), subset, prev):
                    continue  # no option of this subset can be canonical here: do not build
                lays = B.layouts(subset, tensors, self.ctx.config.max_grid_dims)
                least = min((self.lower.layout(lay, tensors, last) for lay in lays),
                            default=math.inf)
                if spent + least <= self.bound:
                    yield subset, least

    def _options(self, tensors: dict, subset: tuple, prev, last: bool, n_ops: int):
        """Custom-op moves ("c", subset, n_ops, cost, Structure, sizes, key) of one subset."""
        options = self.catalog.options(subset, tensors, final=last)
        for idx, (st, sizes, cost) in enumerate(options):
            if self.ctx.timed_out():
                return
            key = ("c", subset, idx)
            if _canonical(key, subset, prev):
                yield ("c", subset, n_ops, cost, st, sizes, key)

    def _build(self, tensors: dict, n_ops: int, last: bool, move):
        """(op, new tensors, key, cost) of a listed move; None when its result repeats an
        expression the graph has (or, as the last op, is not the target)."""
        if move[0] == "p":
            return move[4]
        _, subset, _, cost, st, sizes, key = move
        outs = _out_names(n_ops, len(st.outputs))
        bg, kinfos = B.instantiate(st, sizes, tensors, outs, self.ctx.target.origin_of)
        seen = {i.expr for i in tensors.values()}
        if any(i.expr in seen for i in kinfos.values()):
            return None
        if last and not any(self._is_output(i) for i in kinfos.values()):
            return None
        origin = ", ".join(dict.fromkeys(o.origin for o in bg.ops() if o.origin))
        return KernelOp("custom", subset, outs, block=bg, origin=origin), kinfos, key, cost

    def _record(self, tensors: dict, ops: list, out: str) -> None:
        live, need = [], {out}
        for op in reversed(ops):
            if need & set(op.outputs):
                live.append(op)
                need |= set(op.inputs)
        if len(live) != len(ops):
            return  # a dead op: the same graph without it is found on its own
        used = {n for n in need if n in self.inputs}
        ug = UGraph({n: self.inputs[n] for n in self.inputs if n in used}, list(ops),
                    dict(tensors), out)
        if set(used) != set(self.inputs):
            return  # the target reads every input; a graph that ignores one is wrong
        ug.cost = graph_cost(ug)
        key = ug.key()
        if key in self.candidates:
            self.ctx.counts["duplicates"] = self.ctx.counts.get("duplicates", 0) + 1
        self.candidates.setdefault(key, ug)
        cost = ug.cost["time_us"]
        if self.verify is not None and cost < self.bound and self.verify(ug):
            self.bound = cost  # branch and bound inside the depth


def _out_names(n_ops: int, n: int) -> tuple:
    """Kernel names of the ``n`` outputs of the op at position ``n_ops``: t3, t3_1, ..."""
    return tuple(f"t{n_ops}" + ("" if k == 0 else f"_{k}") for k in range(n))


def _may_have_shape(st, infos: dict, shape: tuple, config) -> bool:
    """False when the custom op of ``st`` writes a tensor of another shape than ``shape`` at
    every grid and loop count, so as the last kernel op it can never produce the target.

    NOTE: an output dim carrying a grid symbol is tile x count = the full extent, the others are
    unsplit or 1 (the loop symbol never reaches an accumulator or post op), so without STACK dims
    the output shape does not depend on the counts: checking it at the representative counts is
    the same shape test ``KernelSearch`` applies to the last op, done before the costing. A
    STACK dim's extent is a grid count, so such outputs are kept for the full check.
    """
    sym_size = {s: x for n in st.layout.inputs for s, x in zip(infos[n].syms, infos[n].shape) if s}
    sizes = B.representative_sizes(st.layout, infos, sym_size, config)
    if sizes is None:
        return True
    names = tuple(f"@{k}" for k in range(len(st.outputs)))
    _, kinfos = B.instantiate(st, sizes, infos, names, None)
    if kinfos is None:
        return True
    for info in kinfos.values():
        if any(is_stack_sym(s) for s in info.syms) or info.shape == shape:
            return True
    return False


def _dangling(tensors: dict, ops: list) -> set:
    """Tensors (inputs included) that no op reads yet."""
    read = {a for op in ops for a in op.inputs}
    return {n for n in tensors if n not in read}


def _canonical(key: tuple, args: tuple, prev) -> bool:
    if prev is None:
        return True
    prev_key, prev_outs = prev
    return bool(prev_outs & set(args)) or key > prev_key


def _input_infos(target) -> dict:
    from mpk_dist.superopt.ugraph import TensorInfo

    g = target.graph
    return {n.attrs["name"]: TensorInfo(n.shape, target.syms[i], target.exprs[i])
            for i, n in enumerate(g.nodes) if n.op == "input"}

"""An interpreter for µGraphs and target Graphs over any algebra (float or finite field).

It emulates a µGraph exactly as written: every block of the grid slices its inputs with imap,
every for-loop iteration slices them again with fmap, body ops run on those tiles, accumulators
combine iterations, post ops run once, and omap places each block's output. The verifier runs it
over a finite field, ``UGraph.evaluate`` over float64.
"""

from __future__ import annotations

from itertools import product

import numpy as np

from mpk_dist.superopt.field import FloatAlgebra
from mpk_dist.superopt.graph import Graph
from mpk_dist.superopt.ugraph import STACK, BlockGraph, UGraph


def run_chain(alg, prog, x):
    """Apply a chain program (see target.py) to ``x``."""
    if prog == "x":
        return x
    if isinstance(prog, float):
        return alg.const(prog)
    op, *args = prog
    vals = [run_chain(alg, a, x) for a in args]
    return getattr(alg, op)(*vals)


def run_op(alg, kind: str, args: list, attr):
    """One primitive op (kernel or block level); ``attr(key, default)`` reads its attributes."""
    if kind == "chain":
        return run_chain(alg, attr("prog"), args[0])
    if kind == "sum":
        return alg.sum(args[0], attr("dim"), attr("keepdim", True))
    return getattr(alg, kind)(*args)


def _split(arr, dim: int, index: int, parts: int):
    ext = arr.shape[dim] // parts
    idx = [slice(None)] * len(arr.shape)
    idx[dim] = slice(index * ext, (index + 1) * ext)
    return arr[tuple(idx)]


def _run_one_block(alg, bg: BlockGraph, env: dict, gidx: tuple) -> dict:
    counts = bg.grid_dims
    tiles = {}
    for b in bg.inputs:
        arr = env[b.name]
        for axis, d in enumerate(b.imap):
            if d is not None:
                arr = _split(arr, d, gidx[axis], counts[axis])
        tiles[b.local] = arr
    local = dict(tiles)
    accs: dict = {}
    for it in range(bg.loop_count):
        for b in bg.inputs:
            if b.fmap is not None:
                local[b.local] = _split(tiles[b.local], b.fmap, it, bg.loop_count)
        for op in bg.body:
            local[op.out] = run_op(alg, op.kind, [local[i] for i in op.inputs], op.attr)
        for a in bg.accs:
            v = local[a.src]
            if a.out not in accs or a.kind == "last":
                accs[a.out] = v
            elif a.kind == "sum":
                accs[a.out] = alg.add(accs[a.out], v)
            else:
                accs[a.out] = alg.maximum(accs[a.out], v)
    post = {b.local: tiles[b.local] for b in bg.inputs if b.fmap is None}
    post.update(accs)
    for op in bg.post:
        post[op.out] = run_op(alg, op.kind, [post[i] for i in op.inputs], op.attr)
    return post


def _write(out, tile, omap: tuple, gidx: tuple) -> None:
    idx = [gidx[a] for a, d in enumerate(omap) if d == STACK]
    rest = [slice(None)] * len(tile.shape)
    for a, d in enumerate(omap):
        if d != STACK:
            ext = tile.shape[d]
            rest[d] = slice(gidx[a] * ext, (gidx[a] + 1) * ext)
    out[tuple(idx + rest)] = tile


def run_block(alg, bg: BlockGraph, env: dict, tensors: dict) -> dict:
    """Run a custom op's whole grid; returns {kernel output name: array}."""
    outs = {o.name: alg.zeros(tensors[o.name].shape) for o in bg.outputs}
    for gidx in product(*(range(c) for c in bg.grid_dims)):
        vals = _run_one_block(alg, bg, env, gidx)
        for o in bg.outputs:
            omap = o.omap if bg.grid else ()
            _write(outs[o.name], vals[o.src], omap, gidx)
    return outs


def run_ugraph(alg, ug: UGraph, feeds: dict):
    """Evaluate ``ug`` on ``feeds`` (arrays of ``alg``); returns the output array."""
    env = dict(feeds)
    for op in ug.kernel_ops:
        if op.is_custom:
            env.update(run_block(alg, op.block, env, ug.tensors))
        else:
            env[op.outputs[0]] = run_op(alg, op.kind, [env[i] for i in op.inputs], op.attr)
    return env[ug.output]


def run_float(ug: UGraph, feeds: dict, dtype=np.float64) -> list:
    """Float semantics of ``ug`` (the implementation of ``UGraph.evaluate``)."""
    missing = sorted(set(ug.inputs) - set(feeds))
    if missing:
        from mpk_dist.superopt.graph import GraphError

        raise GraphError(f"evaluate: expected arrays for inputs {sorted(ug.inputs)}, "
                         f"got none for {missing}")
    alg = FloatAlgebra(dtype)
    arrays = {k: np.asarray(feeds[k], dtype=dtype) for k in ug.inputs}
    for k, info in ug.inputs.items():
        if arrays[k].shape != info.shape:
            from mpk_dist.superopt.graph import GraphError

            raise GraphError(f"evaluate: expected {k} of shape {info.shape}, "
                             f"got {arrays[k].shape}")
    with np.errstate(all="ignore"):  # NaN/inf are results too (the caller compares them)
        return [run_ugraph(alg, ug, arrays)]


def run_graph(alg, g: Graph, feeds: dict):
    """Evaluate a target Graph node by node; returns the output array."""
    vals: list = []
    for n in g.nodes:
        if n.op == "input":
            vals.append(feeds[n.attrs["name"]])
        elif n.op == "const":
            vals.append(alg.const(n.attrs["value"]))
        else:
            attrs = dict(n.attrs)
            vals.append(run_op(alg, n.op, [vals[i] for i in n.inputs],
                               lambda k, d=None, a=attrs: a.get(k, d)))
    return vals[g.outputs[0]]

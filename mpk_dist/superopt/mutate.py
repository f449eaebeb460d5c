"""Small edits of a µGraph, for testing that verification rejects wrong graphs.

``mutants(ug)`` yields (description, mutant) pairs: perturbed imap / fmap / omap, swapped
inputs and operands, dropped ops, wrong accumulators, other chains and reduction dims, other loop
and grid counts. Most mutants compute something else; some are equivalent by accident (a loop
count change under a sum accumulator, say), so a test decides which are wrong by an independent
float64 evaluation before asking the verifier.
"""

from __future__ import annotations

from dataclasses import replace

from mpk_dist.superopt.ugraph import STACK, BlockGraph, UGraph


def _with_block(ug: UGraph, k: int, bg: BlockGraph) -> UGraph:
    ops = list(ug.kernel_ops)
    ops[k] = replace(ops[k], block=bg)
    return ug.with_kernel_ops(ops)


def _map_edits(bg: BlockGraph):
    for i, b in enumerate(bg.inputs):
        rank = len(b.tile)
        for axis in range(len(b.imap)):
            for d in [None, *range(rank)]:
                if d != b.imap[axis]:
                    imap = b.imap[:axis] + (d,) + b.imap[axis + 1:]
                    yield f"imap {b.local}[{axis}]={d}", i, replace(b, imap=imap)
        if bg.loop is not None:
            for d in [None, *range(rank)]:
                if d != b.fmap:
                    yield f"fmap {b.local}={d}", i, replace(b, fmap=d)


def _block_edits(bg: BlockGraph):
    """(description, edited BlockGraph) for one block graph."""
    for desc, i, nb in _map_edits(bg):
        yield desc, replace(bg, inputs=bg.inputs[:i] + (nb,) + bg.inputs[i + 1:])
    for i in range(len(bg.inputs)):
        for j in range(i + 1, len(bg.inputs)):
            a, b = bg.inputs[i], bg.inputs[j]
            if a.tile == b.tile:
                swapped = list(bg.inputs)
                swapped[i], swapped[j] = replace(a, name=b.name), replace(b, name=a.name)
                yield f"swap inputs {a.name},{b.name}", replace(bg, inputs=tuple(swapped))
    for k, o in enumerate(bg.outputs):
        for axis in range(len(o.omap)):
            for d in [STACK, 0, 1, 2]:
                if d != o.omap[axis]:
                    omap = o.omap[:axis] + (d,) + o.omap[axis + 1:]
                    outs = bg.outputs[:k] + (replace(o, omap=omap),) + bg.outputs[k + 1:]
                    yield f"omap {o.src}[{axis}]={d}", replace(bg, outputs=outs)
    for k, a in enumerate(bg.accs):
        for kind in ("last", "max"):
            accs = bg.accs[:k] + (replace(a, kind=kind),) + bg.accs[k + 1:]
            yield f"acc {a.out}={kind}", replace(bg, accs=accs)
    yield from _op_edits(bg)
    if bg.loop is not None:
        sym, n = bg.loop
        for m in (n * 2, n // 2):
            if m >= 2:
                yield f"loop {m}", replace(bg, loop=(sym, m))
    for axis, (sym, n) in enumerate(bg.grid):
        if n % 2 == 0:
            grid = bg.grid[:axis] + ((sym, n // 2),) + bg.grid[axis + 1:]
            yield f"grid {sym}/{n // 2}", replace(bg, grid=grid)


def _op_edits(bg: BlockGraph):
    for phase in ("body", "post"):
        ops = getattr(bg, phase)
        for k, op in enumerate(ops):
            rest = ops[:k] + ops[k + 1:]
            if op.inputs:  # drop the op: its readers read its first operand instead
                src = op.inputs[0]
                rewired = tuple(replace(o, inputs=tuple(src if a == op.out else a
                                                        for a in o.inputs)) for o in rest)
                accs = tuple(replace(a, src=src) if a.src == op.out else a for a in bg.accs)
                outs = tuple(replace(o, src=src) if o.src == op.out else o for o in bg.outputs)
                yield (f"drop {op.out}", replace(bg, **{phase: rewired}, accs=accs,
                                                     outputs=outs))
            if len(op.inputs) == 2 and op.inputs[0] != op.inputs[1]:
                flipped = replace(op, inputs=op.inputs[::-1])
                yield f"swap operands {op.out}", replace(
                    bg, **{phase: ops[:k] + (flipped,) + ops[k + 1:]})
            if op.kind in ("mul", "add", "div"):
                for other in ("mul", "add", "div"):
                    if other != op.kind:
                        new = replace(op, kind=other)
                        yield f"{op.out} {op.kind}->{other}", replace(
                            bg, **{phase: ops[:k] + (new,) + ops[k + 1:]})


def mutants(ug: UGraph):
    """Every single-edit mutant of every custom op of ``ug``."""
    for k, op in enumerate(ug.kernel_ops):
        if op.is_custom:
            for desc, bg in _block_edits(op.block):
                yield f"op{k}: {desc}", _with_block(ug, k, bg)

"""In-memory form of one rank's program while it is built: buffers and task-ops (ops made of tiles).

A task-op (``TaskOp``) is one graph op lowered to one task kind (an all_reduce becomes two task-ops,
push and reduce). Each tile of it is one task. Every tile declares the rectangles it reads and
writes in a 2-D view of each buffer; ``mpk_dist.taskgraph.deps`` turns overlaps into events.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from mpk_dist.taskgraph.abi import BUFFER_KINDS, DTYPES, NULL_BUFFER
from mpk_dist.taskgraph.tasks.base import TaskKind

EMPTY = (0, 0, 0, 0)
"""A rectangle that touches nothing (tiles of a task-op that skip a footprint entry)."""


@dataclass
class Buffer:
    """One buffer of the program: a graph tensor or one the compiler adds (receive buffers, ...)."""

    id: int
    name: str
    shape: tuple[int, ...]
    dtype: str
    kind: str
    view: tuple[int, int]  # (rows, cols) of the 2-D view footprints use
    data: np.ndarray | None = None  # const buffers only

    @property
    def numel(self) -> int:
        """Element count."""
        return int(np.prod(self.shape)) if self.shape else 1


@dataclass
class Footprint:
    """Rectangles [r0, r1) x [c0, c1) of buffer ``buf``'s 2-D view, one per tile ([tiles, 4])."""

    buf: int
    rects: np.ndarray
    remote: bool = False


@dataclass
class TaskOp:
    """One graph op lowered to one task kind: per-tile arguments, parameters and footprints."""

    name: str
    kind: TaskKind
    layer: int
    graph_op: str
    args: list[list[tuple[int, int, int]]] = field(default_factory=list)
    params: list[list[int]] = field(default_factory=list)
    reads: list[Footprint] = field(default_factory=list)
    writes: list[Footprint] = field(default_factory=list)

    @property
    def tiles(self) -> int:
        """Number of tiles (tasks)."""
        return len(self.args)

    def add_tile(self, args: dict[str, tuple[int, int, int] | None], params: dict) -> None:
        """Append a tile; ``args`` maps every declared argument name to (buffer, offset, count) or None."""
        row = []
        for a in self.kind.args:
            v = args.get(a.name, False)
            if v is None and a.optional:
                v = (NULL_BUFFER, 0, 0)
            elif v is None or v is False:
                raise ValueError(f"{self.name}: argument {a.name} missing or not optional")
            row.append((int(v[0]), int(v[1]), int(v[2])))
        if len(args) != len(self.kind.args):
            raise ValueError(f"{self.name}: unknown arguments {sorted(set(args) - {a.name for a in self.kind.args})}")
        self.args.append(row)
        self.params.append(self.kind.pack_params(params))


class Program:
    """Buffers and task-ops of one rank, in a topological order of one step."""

    def __init__(self, rank: int, world: int, batch: int, max_steps: int):
        self.rank, self.world, self.batch, self.max_steps = rank, world, batch, max_steps
        self.buffers: list[Buffer] = []
        self.by_name: dict[str, Buffer] = {}
        self.ops: list[TaskOp] = []
        self.special: dict[str, int] = {}

    def buffer(self, name: str, shape, dtype: str, kind: str, view: tuple[int, int] | None = None,
               data: np.ndarray | None = None) -> int:
        """Declare a buffer; ``view`` defaults to (numel / last dim, last dim)."""
        if name in self.by_name:
            raise ValueError(f"buffer {name!r} declared twice")
        if dtype not in DTYPES or kind not in BUFFER_KINDS:
            raise ValueError(f"buffer {name}: bad dtype {dtype!r} or kind {kind!r}")
        shape = tuple(int(s) for s in shape)
        numel = int(np.prod(shape)) if shape else 1
        last = shape[-1] if shape else 1
        b = Buffer(len(self.buffers), name, shape, dtype, kind, view or (numel // last, last), data)
        self.buffers.append(b)
        self.by_name[name] = b
        return b.id

    def id(self, name: str) -> int:
        """Buffer id of a name."""
        return self.by_name[name].id

    def op(self, name: str, kind: TaskKind, layer: int | None, graph_op: str) -> TaskOp:
        """Start a task-op; fill it with ``add_tile`` and footprints."""
        op = TaskOp(name, kind, -1 if layer is None else layer, graph_op)
        self.ops.append(op)
        return op

    def num_tasks(self) -> int:
        """Tasks over all task-ops."""
        return sum(op.tiles for op in self.ops)

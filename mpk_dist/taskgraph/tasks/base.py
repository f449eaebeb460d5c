"""What every task kind declares: opcode, pointer arguments and parameters in ABI order, CPU reference.

A task kind is a pair: this Python side (tasks/<kind>.py: argument/parameter order, element accesses,
a CPU reference of one tile) and the CUDA body csrc/tasks/<kind>.cuh, which reads its arguments and
parameters through the index constants that ``mpk_dist.taskgraph.abi.render_cuda_abi_header``
generates from these declarations. Nothing is hand-copied between the two.

Addressing convention (all kinds): a pointer argument is (buffer id, element offset, element
count). The offset is the tile's BASE element (e.g. column n0 of row 0); the count is the extent
from that base to one past the last element the tile may touch, so ``offset + count <= numel``
bounds-checks every access. Strides and tile sizes are parameters, in elements.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch


@dataclass(frozen=True)
class ArgSpec:
    """One pointer argument of a task kind.

    ``mode``: 'r' (read), 'w' (written), 'rw', 'a' (added into atomically by every tile of the op: the adds
    commute). ``remote``: the task writes this (symmetric) buffer on EVERY rank of the TP group at the same
    offset, through the peer pointer table.
    ``optional``: the buffer id may be NULL_BUFFER (-1), meaning "absent" (e.g. no residual).
    """

    name: str
    mode: str
    doc: str
    remote: bool = False
    optional: bool = False

    @property
    def writes(self) -> bool:
        """Whether the task writes this buffer (plainly or by accumulating into it)."""
        return "w" in self.mode or "a" in self.mode


@dataclass(frozen=True)
class ParamSpec:
    """One int32 parameter. ``is_float``: the int32 holds the bits of a float32."""

    name: str
    doc: str
    is_float: bool = False


@dataclass
class Access:
    """Elements one tile touches in one buffer (flat element indices), for race detection."""

    arg: int
    mode: str  # 'r', 'w' or 'a' (an accumulating write: atomic adds, unordered among themselves)
    index: np.ndarray
    remote: bool = False  # a write landing on every rank's copy


def f2i(x: float) -> int:
    """Bits of a float32 as a signed int32 (how float parameters travel in the parameter table)."""
    return struct.unpack("<i", struct.pack("<f", float(x)))[0]


def i2f(x: int) -> float:
    """Inverse of ``f2i``."""
    return struct.unpack("<f", struct.pack("<i", int(x)))[0]


def rect(offset: int, rows: int, cols: int, row_stride: int) -> np.ndarray:
    """Flat indices of a rows x cols block starting at ``offset`` with ``row_stride`` between rows."""
    return (offset + np.arange(rows)[:, None] * row_stride + np.arange(cols)[None, :]).reshape(-1)


def view2d(flat: torch.Tensor, offset: int, rows: int, cols: int, row_stride: int) -> torch.Tensor:
    """A [rows, cols] strided view of a flat buffer (writes through to the buffer)."""
    return flat.as_strided((rows, cols), (row_stride, 1), flat.storage_offset() + offset)


class TileContext:
    """What the CPU reference of one tile sees: its arguments and parameters, step, rank.

    ``buf(i)`` is argument i's buffer on this rank (flat tensor) and ``off(i)`` its element offset;
    ``peer_bufs(i)`` is the same buffer on every rank (rank order), for remote writes.
    """

    def __init__(self, kind: "TaskKind", bufs: list, offsets: list[int], counts: list[int],
                 params: list[int], step: int, rank: int, world: int, peer_bufs: Callable[[int], list]):
        self.kind, self._bufs, self._offsets, self._counts = kind, bufs, offsets, counts
        self._params, self.step, self.rank, self.world = params, step, rank, world
        self._peer = peer_bufs

    def buf(self, name: str) -> torch.Tensor | None:
        """This rank's flat buffer of a named argument (None for an absent optional one)."""
        return self._bufs[self.kind.arg_index(name)]

    def off(self, name: str) -> int:
        """Element offset of a named argument."""
        return self._offsets[self.kind.arg_index(name)]

    def count(self, name: str) -> int:
        """Element count (extent) of a named argument."""
        return self._counts[self.kind.arg_index(name)]

    def p(self, name: str) -> int:
        """An int parameter."""
        return int(self._params[self.kind.param_index(name)])

    def f(self, name: str) -> float:
        """A float parameter (bit-cast from its int32)."""
        return i2f(self._params[self.kind.param_index(name)])

    def peers(self, name: str) -> list[torch.Tensor]:
        """The named argument's buffer on every rank, in rank order."""
        return self._peer(self.kind.arg_index(name))


class TaskKind:
    """Base class; one instance per kind module, named ``KIND``."""

    name: str = ""
    opcode: int = -1
    doc: str = ""
    args: tuple[ArgSpec, ...] = ()
    params: tuple[ParamSpec, ...] = ()

    def arg_index(self, name: str) -> int:
        """Position of a named pointer argument in the argument range."""
        pos = self.__dict__.get("_arg_pos") or self.__dict__.setdefault("_arg_pos", {a.name: i for i, a in enumerate(self.args)})
        try:
            return pos[name]
        except KeyError:
            raise KeyError(f"task kind {self.name}: no argument {name!r}") from None

    def param_index(self, name: str) -> int:
        """Position of a named parameter in the parameter range."""
        pos = self.__dict__.get("_par_pos") or self.__dict__.setdefault("_par_pos", {p.name: i for i, p in enumerate(self.params)})
        try:
            return pos[name]
        except KeyError:
            raise KeyError(f"task kind {self.name}: no parameter {name!r}") from None

    def pack_params(self, values: dict[str, Any]) -> list[int]:
        """Parameters in ABI order as int32 (floats bit-cast); every declared parameter is required."""
        if len(values) != len(self.params):
            extra = sorted(set(values) - {p.name for p in self.params})
            raise ValueError(f"task kind {self.name}: parameters expected {[p.name for p in self.params]}, "
                             f"unknown {extra}")
        try:
            return [f2i(values[p.name]) if p.is_float else int(values[p.name]) for p in self.params]
        except KeyError as exc:
            raise ValueError(f"task kind {self.name}: parameter {exc} missing") from None

    def run_tile(self, t: TileContext) -> None:  # pragma: no cover - interface
        """Execute one tile on the CPU (writes through to the buffers)."""
        raise NotImplementedError

    def accesses(self, t: TileContext) -> list[Access]:  # pragma: no cover - interface
        """The exact elements this tile reads and writes (given the step's inputs)."""
        raise NotImplementedError

    def ticket(self, t: TileContext) -> tuple[str, int] | None:
        """(argument, group size) when this tile ends by adding 1 to a ticket word (the argument's element,
        a buffer of kind 'ticket') with an acquire-release RMW: the tile that brings the count to the group
        size runs ``run_last`` and resets the word. None (the default): no ticket."""
        return None

    def run_last(self, t: TileContext) -> None:  # pragma: no cover - interface
        """The follow-up work of the last tile of a ticket group (after its own ``run_tile``)."""
        raise NotImplementedError

    def last_accesses(self, t: TileContext) -> list[Access]:
        """The elements ``run_last`` reads and writes."""
        return []

    def traffic(self, counts: list[int], elem_bytes: list[int], params: list[int], world: int) -> tuple[int, int]:
        """(bytes read, bytes written) of one tile in device memory; remote writes count per rank.

        Default: every argument's whole extent; kinds with sparse or strided access override.
        """
        rd = wr = 0
        for a, n, eb in zip(self.args, counts, elem_bytes):
            if "r" in a.mode:
                rd += n * eb
            if a.writes:
                wr += n * eb * (world if a.remote else 1)
        return rd, wr


def sub_tile(t: TileContext, kind: TaskKind, args: dict, params: dict) -> TileContext:
    """A tile of another kind run inside ``t`` (fused kinds' CPU references reuse the unfused ones):
    ``args`` maps that kind's argument names to (flat tensor, element offset), absent ones to None."""
    bufs = [None if args.get(a.name) is None else args[a.name][0] for a in kind.args]
    offs = [0 if args.get(a.name) is None else args[a.name][1] for a in kind.args]
    counts = [0] * len(kind.args)  # the references index by parameters, not by counts
    return TileContext(kind, bufs, offs, counts, kind.pack_params(params), t.step, t.rank, t.world,
                       lambda k: [bufs[k]])

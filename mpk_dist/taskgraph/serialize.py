"""Serialized form: one rank's program as flat numpy arrays + JSON metadata; save and load a directory.

``CompiledGraph.arrays`` holds exactly the arrays of ``abi.ARRAY_NAMES`` (what the GPU runtime
copies); ``meta`` holds names, shapes and ids for messages and for allocating buffers; ``consts``
the data of const buffers. The interpreter runs from this form only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mpk_dist.errors import InputError
from mpk_dist.taskgraph.abi import (ABI_VERSION, ARRAY_NAMES, BUFFER_COLS, BUFFER_KINDS, DTYPES, EVENT_COLS,
                                    TASK_COLS)
from mpk_dist.taskgraph.deps import EventGraph
from mpk_dist.taskgraph.program import Program


@dataclass
class CompiledGraph:
    """One rank's compiled program (arrays as in docs/TASKGRAPH.md)."""

    arrays: dict[str, np.ndarray]
    meta: dict
    consts: dict[str, np.ndarray] = field(default_factory=dict)

    def __getattr__(self, name: str) -> np.ndarray:
        arrays = self.__dict__.get("arrays", {})
        if name in arrays:
            return arrays[name]
        raise AttributeError(name)

    @property
    def num_tasks(self) -> int:
        """Rows of the task table."""
        return int(self.arrays["tasks"].shape[0])

    @property
    def num_events(self) -> int:
        """Rows of the event table."""
        return int(self.arrays["events"].shape[0])

    def task_label(self, i: int) -> str:
        """'op L0.o_proj (linear), layer 0, tile 3' for messages."""
        row = self.arrays["tasks"][i]
        op = self.meta["ops"][int(row[TASK_COLS["OP_INDEX"]])]
        layer = int(row[TASK_COLS["LAYER"]])
        where = f"layer {layer}" if layer >= 0 else "no layer"
        return f"op {op['name']} ({op['kind']}), {where}, tile {int(row[TASK_COLS['TILE']])}"

    def copy(self) -> "CompiledGraph":
        """A deep copy (for mutation tests)."""
        return CompiledGraph({k: v.copy() for k, v in self.arrays.items()}, json.loads(json.dumps(self.meta)),
                             dict(self.consts))


def assign_workers(prog: Program, workers: int) -> np.ndarray:
    """AOT worker of each task: an op's tiles go round-robin, continuing where the last op stopped."""
    return round_robin_workers([(op.tiles, op.layer) for op in prog.ops], workers)


def round_robin_workers(ops: list[tuple[int, int]], workers: int, layer_aligned: bool = False) -> np.ndarray:
    """Worker of each task of ``ops`` ([(tiles, layer)] in program order): round-robin, each op continuing where
    the last one stopped. ``layer_aligned``: the cursor goes back to worker 0 at the first op of every layer
    (layer >= 0), so an op's tiles sit on the same workers in every layer (a narrow op, e.g. the 8 unsplit batch-1
    attention tiles, then runs on the same 8 SMs each layer, which may still hold its code) instead of moving by
    (tiles a layer) mod workers; measured no faster on an H100 (docs/PERF.md v0.39), so not the default."""
    out, cursor, prev = [], 0, None
    for tiles, layer in ops:
        if layer_aligned and layer >= 0 and layer != prev:
            cursor = 0
        prev = layer
        out.extend((cursor + i) % workers for i in range(tiles))
        cursor = (cursor + tiles) % workers
    return np.asarray(out, np.int32)


def with_workers(cg: "CompiledGraph", worker: np.ndarray) -> "CompiledGraph":
    """A copy of ``cg`` whose aot worker of task t is ``worker[t]`` (the WORKER column and the per-worker task lists
    rebuilt as serialize builds them); the events, waits and signals are unchanged."""
    out = CompiledGraph(dict(cg.arrays), cg.meta, cg.consts)
    workers = int(cg.meta["workers"])
    worker = np.asarray(worker, np.int64)
    if worker.shape != (cg.arrays["tasks"].shape[0],) or (worker.size and not 0 <= worker.min() <= worker.max() < workers):
        raise ValueError(f"with_workers: expected one worker in [0, {workers}) per task, got shape {worker.shape}")
    tasks = cg.arrays["tasks"].copy()
    tasks[:, TASK_COLS["WORKER"]] = worker
    offsets, order = _worker_lists(worker, workers)
    out.arrays.update(tasks=tasks, worker_offsets=offsets, worker_tasks=order)
    return out


def _worker_lists(worker: np.ndarray, workers: int) -> tuple[np.ndarray, np.ndarray]:
    """(worker_offsets [workers + 1], worker_tasks): each worker's tasks, in task order, one list after another."""
    counts = np.bincount(worker, minlength=workers)
    return (np.concatenate([[0], np.cumsum(counts)]).astype(np.int32),
            np.argsort(worker, kind="stable").astype(np.int32))


def layer_aligned_workers(cg: "CompiledGraph") -> "CompiledGraph":
    """``cg`` with its ops' tiles placed by ``round_robin_workers(..., layer_aligned=True)`` (MPK_LAYER_ALIGNED_WORKERS)."""
    ops = [(int(o["tiles"]), int(o["layer"])) for o in cg.meta["ops"]]  # layer -1: outside the layers (Program.op)
    return with_workers(cg, round_robin_workers(ops, int(cg.meta["workers"]), layer_aligned=True))


def _ranges(lists: list[list], width: int) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate per-task lists into [N, width] rows plus [T+1] offsets."""
    lens = np.fromiter((len(x) for x in lists), np.int64, len(lists))
    offs = np.zeros(len(lists) + 1, np.int64)
    np.cumsum(lens, out=offs[1:])
    flat = [row for x in lists for row in x]
    arr = np.asarray(flat, np.int64).reshape(-1, width) if flat else np.zeros((0, width), np.int64)
    return arr, offs


def serialize(prog: Program, eg: EventGraph, graph_info: dict, workers: int) -> CompiledGraph:
    """Build the arrays of one rank from its program and (shared) event graph."""
    kinds, op_idx, layers, tiles, args, params = [], [], [], [], [], []
    for i, op in enumerate(prog.ops):
        n = op.tiles
        kinds += [op.kind.opcode] * n
        op_idx += [i] * n
        layers += [op.layer] * n
        tiles += list(range(n))
        args += op.args
        params += op.params
    T = len(kinds)
    waits, w_off = _ranges(eg.waits, 2)
    sigs = [[(e, eg.target[e]) for e in s] for s in eg.signals]
    signals, s_off = _ranges(sigs, 2)
    arg_arr, a_off = _ranges(args, 3)
    par_arr, p_off = _ranges([[(v,) for v in p] for p in params], 1)
    worker = assign_workers(prog, workers)
    tasks = np.zeros((T, len(TASK_COLS)), np.int64)
    for name, col in (("OPCODE", kinds), ("OP_INDEX", op_idx), ("LAYER", layers), ("TILE", tiles),
                      ("WAIT_BEGIN", w_off[:-1]), ("WAIT_END", w_off[1:]), ("SIGNAL_BEGIN", s_off[:-1]),
                      ("SIGNAL_END", s_off[1:]), ("ARG_BEGIN", a_off[:-1]), ("ARG_END", a_off[1:]),
                      ("PARAM_BEGIN", p_off[:-1]), ("PARAM_END", p_off[1:]), ("WORKER", worker)):
        tasks[:, TASK_COLS[name]] = col
    events = np.zeros((len(eg.triggers), len(EVENT_COLS)), np.int64)
    events[:, EVENT_COLS["TRIGGERS"]] = eg.triggers
    events[:, EVENT_COLS["SCOPE"]] = eg.scope
    events[:, EVENT_COLS["OP_INDEX"]] = eg.op_index
    buffers = np.array([(DTYPES[b.dtype], BUFFER_KINDS[b.kind], b.numel) for b in prog.buffers], np.int64)
    worker_offsets, worker_tasks = _worker_lists(worker, workers)
    arrays = {
        "tasks": tasks.astype(np.int32), "events": events.astype(np.int32), "waits": waits.astype(np.int32),
        "signals": signals.astype(np.int32), "args": arg_arr.astype(np.int32), "params": par_arr.reshape(-1).astype(np.int32),
        "buffers": buffers.reshape(-1, len(BUFFER_COLS)),
        "worker_offsets": worker_offsets, "worker_tasks": worker_tasks,
    }
    meta = {
        "abi_version": ABI_VERSION, **graph_info, "rank": prog.rank, "world_size": prog.world, "batch": prog.batch,
        "max_steps": prog.max_steps, "workers": workers,
        "ops": [{"name": op.name, "kind": op.kind.name, "layer": op.layer, "graph_op": op.graph_op, "tiles": op.tiles}
                for op in prog.ops],
        "events": list(eg.names),
        "buffers": [{"name": b.name, "shape": list(b.shape), "dtype": b.dtype, "kind": b.kind} for b in prog.buffers],
        "special": dict(prog.special),
    }
    consts = {b.name: b.data for b in prog.buffers if b.kind == "const"}
    return CompiledGraph(arrays, meta, consts)


def save(cg: CompiledGraph, out_dir: str | Path) -> Path:
    """Write <name>.npy for every array, consts.npz and meta.json into ``out_dir``."""
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    for name in ARRAY_NAMES:
        np.save(d / f"{name}.npy", cg.arrays[name])
    np.savez(d / "consts.npz", **cg.consts)
    (d / "meta.json").write_text(json.dumps(cg.meta, indent=1) + "\n")
    return d


def load(in_dir: str | Path) -> CompiledGraph:
    """Read a directory written by ``save``; checks the ABI version."""
    d = Path(in_dir)
    if not (d / "meta.json").is_file():
        raise InputError(f"{d}: expected a compiled task graph (meta.json), found none; run `mpk-dist compile --dump`")
    meta = json.loads((d / "meta.json").read_text())
    if meta.get("abi_version") != ABI_VERSION:
        raise InputError(f"{d}: ABI version: expected {ABI_VERSION}, got {meta.get('abi_version')}; recompile it")
    arrays = {name: np.load(d / f"{name}.npy") for name in ARRAY_NAMES}
    with np.load(d / "consts.npz") as z:
        consts = {k: z[k] for k in z.files}
    return CompiledGraph(arrays, meta, consts)


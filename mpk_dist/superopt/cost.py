"""Cost model: estimated microseconds of a µGraph on one H200-class GPU.

Per kernel op: one sync point (a kernel boundary, or an event in the mega-kernel) plus the larger
of (a) device-memory bytes / HBM bandwidth and (b) the slowest block's bytes / one SM's bandwidth,
times the number of waves. A replicated input read by many blocks costs device-memory bytes once
when it fits in L2 (later blocks hit L2) but each block still moves it. A for-loop lets the next
tile's load overlap the current tile's compute: without one, a block waits for its whole tile
(the pipeline "fill" is the first iteration's bytes). Block graphs whose shared memory does not
fit are infeasible. ``MachineModel`` holds the constants (defaults: DESIGN.md's H200 numbers).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mpk_dist.superopt.ugraph import DTYPE_BYTES, SMEM_LIMIT, BlockGraph, UGraph, _numel


@dataclass(frozen=True)
class MachineModel:
    """Constants of the cost model."""

    hbm_bytes_per_us: float = 4.3e6     # 4.3 TB/s
    sm_bytes_per_us: float = 8.0e4      # ~80 GB/s one SM can stream
    sm_count: int = 132
    sync_us: float = 2.0                # kernel boundary / grid-wide dependency
    loop_iter_us: float = 0.01          # block-wide barrier per for-loop iteration
    l2_bytes: int = 50 * 1024 * 1024
    smem_limit: int = SMEM_LIMIT


H200 = MachineModel()


def _bytes(shape: tuple) -> int:
    return _numel(shape) * DTYPE_BYTES


def custom_op_cost(bg: BlockGraph, tensors: dict, m: MachineModel = H200) -> dict:
    """Cost of one custom op: {time_us, dram_bytes, smem, feasible}."""
    smem = bg.smem_bytes()
    if smem > m.smem_limit:
        return {"time_us": math.inf, "dram_bytes": 0, "smem": smem, "feasible": False}
    dram, per_block, fill = 0, 0, 0
    for b in bg.inputs:
        whole = _bytes(tensors[b.name].shape)
        tile = _bytes(b.tile)
        reps = bg.num_blocks * _numel(b.tile) // max(1, _numel(tensors[b.name].shape))
        dram += whole if (reps <= 1 or whole <= m.l2_bytes) else whole * reps
        per_block += tile
        fill += tile // bg.loop_count if b.fmap is not None else tile
    for o in bg.outputs:
        dram += _bytes(tensors[o.name].shape)
        per_block += _bytes(tensors[o.name].shape) // bg.num_blocks
    waves = math.ceil(bg.num_blocks / m.sm_count)
    block_us = (per_block + fill) / m.sm_bytes_per_us + bg.loop_count * m.loop_iter_us
    t = m.sync_us + max(dram / m.hbm_bytes_per_us, waves * block_us)
    return {"time_us": t, "dram_bytes": dram, "smem": smem, "feasible": True}


def prim_op_cost(in_shapes: list, out_shape: tuple, m: MachineModel = H200) -> dict:
    """Cost of a pre-defined library kernel: reads its inputs and writes its output once."""
    dram = sum(_bytes(s) for s in in_shapes) + _bytes(out_shape)
    return {"time_us": m.sync_us + dram / m.hbm_bytes_per_us, "dram_bytes": dram, "smem": 0,
            "feasible": True}


def graph_cost(ug: UGraph, m: MachineModel = H200) -> dict:
    """Total cost of a µGraph: sums over kernel ops; sync points = kernel ops."""
    total = {"time_us": 0.0, "dram_bytes": 0, "sync_points": len(ug.kernel_ops), "smem": 0}
    for op in ug.kernel_ops:
        if op.is_custom:
            c = custom_op_cost(op.block, ug.tensors, m)
        else:
            c = prim_op_cost([ug.tensors[i].shape for i in op.inputs],
                             ug.tensors[op.outputs[0]].shape, m)
        total["time_us"] += c["time_us"]
        total["dram_bytes"] += c["dram_bytes"]
        total["smem"] = max(total["smem"], c["smem"])
    return total

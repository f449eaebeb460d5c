"""Task kinds: one module per kind (ABI order of arguments and parameters, CPU reference of a tile).

``KINDS`` lists them by opcode; the opcode numbering is part of the ABI (abi.ABI_VERSION).
"""

from __future__ import annotations

from mpk_dist.taskgraph.tasks import (add, allgather_push, allreduce_push, allreduce_reduce, argmax_nucleus_cut,
                                      argmax_nucleus_hist, argmax_partial, argmax_reduce, argmax_select, attention, attention_merge,
                                      attention_prep,
                                      attention_split, attention_split_prep, embedding, gather_rows, linear, linear_residual,
                                      norm_linear, norm_linear_silu, page_alloc, paged_attention, qkv_prep, qkv_prep_paged, rms_norm, silu_linear,
                                      silu_mul, step_begin)
from mpk_dist.taskgraph.tasks.base import TaskKind

KINDS: tuple[TaskKind, ...] = tuple(sorted(
    (m.KIND for m in (step_begin, embedding, rms_norm, linear, qkv_prep, attention, silu_mul, add, allreduce_push,
                      allreduce_reduce, argmax_partial, argmax_reduce, allgather_push, argmax_select,
                      # paged KV cache (opt-in graphs; docs/SERVING.md): appended, earlier opcodes unchanged
                      qkv_prep_paged, paged_attention,
                      # fused linears (opt-in: compile_rank_programs(fuse=...); docs/TASKGRAPH.md)
                      norm_linear, linear_residual, silu_linear,
                      # split-KV attention (opt-in: compile_rank_programs(attn_splits=...); docs/TASKGRAPH.md)
                      attention_split, attention_merge,
                      # top-p sampling (opt-in: compile_rank_programs(nucleus=True); docs/TASKGRAPH.md)
                      argmax_nucleus_hist, argmax_nucleus_cut,
                      # the paged head over sequences, not tokens (compile_paged_programs; docs/SERVING.md)
                      gather_rows,
                      # qkv_prep folded into the attention tiles (opt-in: fuse=[..., 'attn_prep']; docs/TASKGRAPH.md)
                      attention_prep,
                      # the paged KV cache's page allocator on the device (compile_paged_programs; docs/SERVING.md)
                      page_alloc,
                      # the attn_prep fusion in split-KV programs (opt-in: fuse=[..., 'attn_prep']; docs/TASKGRAPH.md)
                      attention_split_prep,
                      # silu_mul as the gate|up projection's epilogue (opt-in: fuse=[..., 'silu_epi']; docs/TASKGRAPH.md)
                      norm_linear_silu)),
    key=lambda k: k.opcode))

BY_NAME: dict[str, TaskKind] = {k.name: k for k in KINDS}
BY_OPCODE: dict[int, TaskKind] = {k.opcode: k for k in KINDS}

assert [k.opcode for k in KINDS] == list(range(len(KINDS))), "opcodes must be 0..n-1 without gaps"


def kind_params(cg, kind_name: str, *names: str) -> list | None:
    """The named parameters (int64 arrays, one entry per task) of compiled program ``cg``'s tasks of kind
    ``kind_name``, in the order asked; None when the program has no such task."""
    import numpy as np

    from mpk_dist.taskgraph.abi import TASK_COLS  # here: abi imports this package

    kind = BY_NAME[kind_name]
    tasks, params = cg.arrays["tasks"], cg.arrays["params"]
    rows = tasks[tasks[:, TASK_COLS["OPCODE"]] == kind.opcode]
    if not len(rows):
        return None
    p0 = rows[:, TASK_COLS["PARAM_BEGIN"]].astype(np.int64)
    return [params[p0 + kind.param_index(n)].astype(np.int64) for n in names]


__all__ = ["KINDS", "BY_NAME", "BY_OPCODE", "TaskKind", "kind_params"]

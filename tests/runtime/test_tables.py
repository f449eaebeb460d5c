"""CPU tests of the runtime's derived tables and support checks on real compiled task graphs."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from mpk_dist.errors import InputError
from mpk_dist.models.presets import get_preset
from mpk_dist.runtime import params, tables
from mpk_dist.taskgraph.abi import TASK_COLS, WAIT_COLS
from mpk_dist.taskgraph.compiler import compile_rank_programs


@pytest.fixture(scope="module")
def cg():
    return compile_rank_programs(get_preset("tiny"), tp=1, batch=2, sms=8, max_seq_len=32)[0]


def test_dependents_invert_the_wait_list(cg):
    ptr, task, off = tables.dependents(cg)
    tasks, waits = cg.arrays["tasks"], cg.arrays["waits"]
    want = set()
    for t in range(tasks.shape[0]):
        for k in range(tasks[t, TASK_COLS["WAIT_BEGIN"]], tasks[t, TASK_COLS["WAIT_END"]]):
            want.add((int(waits[k, WAIT_COLS["EVENT"]]), t, int(waits[k, WAIT_COLS["STEP_OFFSET"]])))
    got = {(e, int(task[i]), int(off[i])) for e in range(len(ptr) - 1) for i in range(ptr[e], ptr[e + 1])}
    assert got == want and ptr[-1] == waits.shape[0]
    assert any(o == -1 for _, _, o in got), "step_begin's wait on the previous step must appear"


def test_final_task_is_argmax_select(cg):
    t = tables.final_task(cg)
    assert "argmax_select" in cg.task_label(t)


def test_check_supported_rejects_what_the_kernel_cannot_run(cg):
    tables.check_supported(cg)
    bad = cg.copy()
    bad.meta["buffers"][2]["dtype"] = "f32"  # a weight that is not bf16
    with pytest.raises(InputError, match="expected bf16"):
        tables.check_supported(bad)
    big = compile_rank_programs(get_preset("tiny"), tp=1, batch=17, sms=8, max_seq_len=32, check=False)[0]
    with pytest.raises(InputError, match="batch: expected 1..16"):
        tables.check_supported(big)


def test_smem_covers_attention_merge(cg):
    # tiny: GROUP 2, head_dim 32, 8 warps -> 8 * 2 * 34 * 4 bytes
    assert tables.smem_bytes(cg, 256) >= 8 * 2 * 34 * 4
    assert tables.smem_bytes(cg, 256) % 128 == 0


def test_smem_has_room_for_the_mma_partials_above_the_staged_rows():
    """Tensor-core linears get room for their split-K partials above the largest staged operand rows (a
    norm_linear tile's normalised x): with MPK_MMA_PARTIAL_EXACT=0 a fixed MMA_PARTIAL_PAIRS_PER_WARP partials a
    warp, by default the least that keeps each tile's slices (mpk_dist/runtime/mma_room.py), never more; without
    tensor cores the launch is as before."""
    from mpk_dist.taskgraph.fusion import staging_bytes

    cg8 = compile_rank_programs(get_preset("tiny"), tp=1, batch=8, sms=8, max_seq_len=32,
                                fuse=frozenset({"norm", "residual"}))[0]
    limit = tables.HOPPER_MAX_DYNAMIC_SMEM - tables.SMEM_RESERVE
    staged = staging_bytes(cg8, limit)
    assert staged >= 8 * get_preset("tiny").hidden_size * 2  # the fused kinds stage B x K bf16
    for threads in (256, 512):
        partials = tables.MMA_PARTIAL_PAIRS_PER_WARP * tables.MMA_PARTIAL_BYTES * (threads // 32)
        plain = tables.smem_bytes(cg8, threads)
        fixed = tables.smem_bytes(cg8, threads, linear_mma=True, exact_partials=False)
        exact = tables.smem_bytes(cg8, threads, linear_mma=True)
        assert fixed >= staged + partials and fixed % 128 == 0
        assert plain < staged + partials  # the partials need the extra room: without it they overlap the rows
        assert plain <= exact <= fixed and exact % 128 == 0
        ring = tables.smem_bytes(cg8, threads, weight_ring=True, linear_mma=True, exact_partials=False)
        assert ring == fixed + tables.WEIGHT_RING_BYTES  # the ring stays after the partials


def test_param_struct_layout_matches_the_cuda_rules():
    """Pointers and u64 fields are 8-aligned; the struct has no implicit tail padding surprises."""
    for name, ct in params.PARAM_FIELDS:
        off = getattr(params.RuntimeParams, name).offset
        assert off % ctypes.alignment(ct) == 0, name
    assert ctypes.sizeof(params.RuntimeParams) % 8 == 0
    assert ctypes.sizeof(params.ErrorRecord) == 64  # 48 + peer, peer_sent, peer_expected, pad
    assert params.TRACE_DTYPE.itemsize == 56  # csrc/runtime/params.cuh TraceRecord, 6 phase marks
    raw = params.to_bytes(params.RuntimeParams(num_tasks=7))
    assert np.frombuffer(raw, np.int32)[params.RuntimeParams.num_tasks.offset // 4] == 7


@pytest.mark.parametrize("model,batch,tp,want", [("qwen3-8b", 1, 1, 16), ("llama3-8b", 1, 1, 16), ("qwen3-1.7b", 1, 1, 4),
                                                 ("qwen3-0.6b", 1, 1, 4), ("qwen3-8b", 8, 1, 8), ("qwen3-8b", 1, 2, 8)])
def test_default_unroll_follows_the_smallest_batch_1_tile(model, batch, tp, want):
    """At batch 1 the widest unroll whose rounds fit twice into every linear tile: qwen3-8b's smallest, o_proj
    (32 rows x 4096 x 2 B = 256 KB), takes 16 at 512 threads; at tp 2 (128 KB) 8; qwen3-1.7b's 64 KB tiles 4,
    qwen3-0.6b's 32 KB the narrowest, 4; batch 8 keeps 8. The kernel shape takes it when no MPK_LINEAR_UNROLL is
    set, and the variable still wins."""
    from mpk_dist.models.presets import get_preset
    from mpk_dist.runtime.megakernel_backend import fusions_for_batch, fusions_from_env, tuning_from_env
    from mpk_dist.runtime.session import kernel_shape
    from mpk_dist.runtime.tables import default_linear_unroll
    from mpk_dist.taskgraph.compiler import compile_rank_programs

    cg = compile_rank_programs(get_preset(model), tp=tp, batch=batch, ranks=[0],
                               fuse=fusions_for_batch(fusions_from_env(True), batch), attn_splits="auto")[0]
    assert default_linear_unroll(cg, 512) == want
    tuning = tuning_from_env(512, {})
    wt = tuning.pop("worker_threads")
    assert kernel_shape(cg, wt, "aot", **tuning).linear_unroll == want
    tuning = tuning_from_env(512, {"MPK_LINEAR_UNROLL": "8"})
    wt = tuning.pop("worker_threads")
    assert kernel_shape(cg, wt, "aot", **tuning).linear_unroll == 8


@pytest.mark.parametrize("model,batch,tp,want", [("qwen3-0.6b", 1, 1, 256), ("qwen3-1.7b", 1, 1, 512),
                                                 ("qwen3-8b", 1, 1, 512), ("qwen3-0.6b", 4, 1, 512),
                                                 ("qwen3-1.7b", 1, 2, 256)])
def test_default_worker_threads_narrow_only_below_two_narrow_rounds(model, batch, tp, want):
    """256 worker threads only for a batch-1 program whose smallest linear tile is below two rounds of 4 loads at
    512 threads (64 KB): qwen3-0.6b's 32 KB tiles, qwen3-1.7b's at tp 2; 512 otherwise. The kernel shape takes it
    (then the unroll for those threads: 4 for qwen3-0.6b) when MPK_WORKER_THREADS is unset, and the variable wins."""
    from mpk_dist.models.presets import get_preset
    from mpk_dist.runtime.megakernel_backend import fusions_for_batch, fusions_from_env, tuning_from_env
    from mpk_dist.runtime.session import kernel_shape
    from mpk_dist.runtime.tables import default_worker_threads
    from mpk_dist.taskgraph.compiler import compile_rank_programs

    cg = compile_rank_programs(get_preset(model), tp=tp, batch=batch, ranks=[0],
                               fuse=fusions_for_batch(fusions_from_env(True), batch), attn_splits="auto")[0]
    assert default_worker_threads(cg) == want
    tuning = tuning_from_env(None, {})
    shape = kernel_shape(cg, tuning.pop("worker_threads"), "aot", **tuning)
    assert shape.worker_threads == want
    if model == "qwen3-0.6b" and batch == 1:
        assert shape.linear_unroll == 4
    tuning = tuning_from_env(None, {"MPK_WORKER_THREADS": "512"})
    assert kernel_shape(cg, tuning.pop("worker_threads"), "aot", **tuning).worker_threads == 512


@pytest.mark.parametrize("batch,want", [(1, False), (2, False), (4, True), (8, True), (32, True)])
def test_default_linear_mma_from_batch_4(batch, want):
    """Tensor-core linear tiles by default from MMA_MIN_BATCH rows a tile (batch 32 runs 16-row tiles); the kernel
    shape takes the default when MPK_LINEAR_MMA is unset, and the variable wins either way."""
    from mpk_dist.models.presets import get_preset
    from mpk_dist.runtime.megakernel_backend import tuning_from_env
    from mpk_dist.runtime.session import kernel_shape
    from mpk_dist.runtime.tables import default_linear_mma
    from mpk_dist.taskgraph.compiler import compile_rank_programs

    cg = compile_rank_programs(get_preset("tiny"), tp=1, batch=batch, ranks=[0])[0]
    assert default_linear_mma(cg) == want
    for env, mma in (({}, want), ({"MPK_LINEAR_MMA": "0"}, False), ({"MPK_LINEAR_MMA": "1"}, True)):
        tuning = tuning_from_env(512, env)
        wt = tuning.pop("worker_threads")
        assert kernel_shape(cg, wt, "aot", **tuning).linear_mma == mma, env




@pytest.mark.parametrize("model,batch,want", [("qwen3-0.6b", 1, True), ("qwen3-1.7b", 1, True), ("qwen3-8b", 1, False),
                                              ("llama3-8b", 1, False), ("qwen3-0.6b", 4, False)])
def test_default_compact_code_at_batch_1_and_unroll_4(model, batch, want):
    """The code-size variants by default only in batch-1 programs at unroll 4 (the small presets: qwen3-1.7b 1.1%
    faster, qwen3-0.6b even; the 8B presets' unroll 16 was slower with them): the kernel shape takes the default
    when MPK_COMPACT_CODE is unset, renders each variant under #ifndef (a -D of the build still decides), names the
    binary _cc, and the variable wins either way."""
    from mpk_dist.models.presets import get_preset
    from mpk_dist.runtime.codegen import CODE_SIZE_DEFINES, render_source
    from mpk_dist.runtime.megakernel_backend import fusions_for_batch, fusions_from_env, tuning_from_env
    from mpk_dist.runtime.session import kernel_shape
    from mpk_dist.runtime.tables import default_compact_code, default_linear_unroll, default_worker_threads
    from mpk_dist.taskgraph.compiler import compile_rank_programs

    cg = compile_rank_programs(get_preset(model), tp=1, batch=batch, ranks=[0],
                               fuse=fusions_for_batch(fusions_from_env(True), batch), attn_splits="auto")[0]
    assert default_compact_code(cg, default_linear_unroll(cg, default_worker_threads(cg))) == want
    for env, on in (({}, want), ({"MPK_COMPACT_CODE": "0"}, False), ({"MPK_COMPACT_CODE": "1"}, True)):
        tuning = tuning_from_env(None, env)
        shape = kernel_shape(cg, tuning.pop("worker_threads"), "aot", **tuning)
        src = render_source(shape)
        assert shape.compact_code == on and shape.name().endswith("_cc") == on, env
        for d in CODE_SIZE_DEFINES:
            assert (f"#ifndef {d}\n#define {d} 1\n#endif" in src) == on, (env, d)
    with pytest.raises(InputError, match="MPK_COMPACT_CODE: expected one of 0, 1"):
        tuning_from_env(None, {"MPK_COMPACT_CODE": "yes"})

"""The weight preload of batch-1 tiles behind a narrow op (MPK_WEIGHT_PRELOAD_KB, csrc/tasks/weight_preload.cuh):
the knob's checks, the kernel's name and defines, the shared-memory accounting, and (with nvcc) a spill-free build.
The bitwise GPU check is tests/runtime/test_code_variants_gpu.py test_weight_preload_leaves_the_logits_bitwise."""

from __future__ import annotations

import re
import shutil

import pytest

from mpk_dist.errors import InputError
from mpk_dist.runtime import tables
from mpk_dist.runtime.codegen import WEIGHT_PRELOAD_MAX_KB, KernelShape, render_source
from mpk_dist.runtime.megakernel_backend import tuning_from_env

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")


@pytest.fixture(scope="module")
def program_8b():
    """qwen3-8b's batch-1 program at a 576-position cache (attention unsplit: its o_proj tiles wait on 8 tiles)."""
    from mpk_dist.models.presets import get_preset
    from mpk_dist.runtime.megakernel_backend import fusions_for_batch, fusions_from_env
    from mpk_dist.taskgraph.compiler import compile_rank_programs

    return compile_rank_programs(get_preset("qwen3-8b"), tp=1, batch=1, ranks=[0],
                                 fuse=fusions_for_batch(fusions_from_env(), 1), attn_splits="auto", max_seq_len=576)[0]


def test_env_knob_is_read_and_checked():
    assert "weight_preload_kb" not in tuning_from_env(512, {})  # unset: the default kernel as it was
    assert "weight_preload_kb" not in tuning_from_env(512, {"MPK_WEIGHT_PRELOAD_KB": "0"})
    assert tuning_from_env(512, {"MPK_WEIGHT_PRELOAD_KB": "176"})["weight_preload_kb"] == 176
    for bad in ("100", "-16", "abc", str(WEIGHT_PRELOAD_MAX_KB + 16)):
        with pytest.raises(InputError, match="MPK_WEIGHT_PRELOAD_KB: expected a multiple of 16"):
            tuning_from_env(512, {"MPK_WEIGHT_PRELOAD_KB": bad})


def test_kernel_source_and_name_carry_the_window():
    shape = KernelShape(batch=1, worker_threads=512, weight_preload_kb=176)
    assert shape.name().endswith("_wp176") and "_wp" not in KernelShape(batch=1).name()
    assert "#define MPK_WEIGHT_PRELOAD_KB 176" in render_source(shape)
    assert "#define MPK_WEIGHT_PRELOAD_KB 0" in render_source(KernelShape(batch=1))


@pytest.mark.parametrize("shape, message", [
    (KernelShape(batch=4, weight_preload_kb=64), "batch-1 kernels only"),
    (KernelShape(batch=1, weight_preload_kb=64, linear_tma=True), "exclude each other"),
    (KernelShape(batch=1, weight_preload_kb=40), "multiple of 16"),
])
def test_render_refuses_what_the_kernel_cannot_build(shape, message):
    with pytest.raises(ValueError, match=message):
        render_source(shape)


def test_kernel_shape_drops_the_window_above_batch_1(program_8b):
    from mpk_dist.models.presets import get_preset
    from mpk_dist.runtime.session import kernel_shape
    from mpk_dist.taskgraph.compiler import compile_rank_programs

    assert kernel_shape(program_8b, 512, "aot", weight_preload_kb=176).weight_preload_kb == 176
    b4 = compile_rank_programs(get_preset("tiny"), tp=1, batch=4, ranks=[0], max_seq_len=64)[0]
    assert kernel_shape(b4, 256, "aot", weight_preload_kb=176).weight_preload_kb == 0


def test_smem_adds_the_window_and_names_what_fits(program_8b):
    base = tables.smem_bytes(program_8b, 512)
    assert tables.smem_bytes(program_8b, 512, preload_bytes=176 * 1024) == base + 176 * 1024
    room = (tables.HOPPER_MAX_DYNAMIC_SMEM - tables.SMEM_RESERVE - base) // 1024 // 16 * 16
    assert room == 176  # 33 KB of attention partials at 512 threads leave 176 KB
    with pytest.raises(InputError, match=rf"at most {room} KB fit"):
        tables.smem_bytes(program_8b, 512, preload_bytes=192 * 1024)


def test_the_8b_o_proj_tiles_are_the_ones_planned_whole(program_8b):
    """The window is filled only for tiles with a whole-tile plan (REC_PREFETCH > 0): at qwen3-8b batch 1 those are
    the o_proj tiles behind the unsplit attention, 256 KB each (the window holds 22 of their 32 rows)."""
    from mpk_dist.runtime.prefetch_plan import prefetch_plan
    from mpk_dist.taskgraph.abi import TASK_COLS
    from mpk_dist.taskgraph.tasks import BY_NAME

    plan = prefetch_plan(program_8b, int(program_8b.meta["workers"]), 50 << 20)
    ops = program_8b.arrays["tasks"][:, TASK_COLS["OPCODE"]]
    planned = {int(o) for o in ops[plan > 0]}
    assert planned == {BY_NAME["linear_residual"].opcode}
    assert int(plan.max()) == 32 * 4096 * 2  # n_tile rows x K bf16


@needs_nvcc
def test_preloading_kernel_builds_without_spills(tmp_path, monkeypatch):
    """The batch-1 kernel at 16 loads a lane with a 176 KB window: the GEMV tile and its shared-memory row group
    spill nothing (v0.23's preload, one loop choosing its source per row group, spilled 68-100 B there)."""
    from mpk_dist.runtime.kernel import build_kernel

    monkeypatch.setenv("MPK_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("MPK_NVCC_EXTRA_FLAGS", "-Xptxas -v -DMPK_SILU_LINEAR_KIND=0")
    _, res = build_kernel(KernelShape(batch=1, worker_threads=512, schedule="aot", linear_unroll=16,
                                      weight_preload_kb=176), compiler="nvcc")
    assert "weight_preload.cuh" in {p.name for p in res.headers}
    spills = {m.group(1): (int(m.group(2)), int(m.group(3))) for m in re.finditer(
        r"Function properties for (\S+)\n[^\n]*?(\d+) bytes spill stores, (\d+) bytes spill loads", res.log)}
    gemv = {k: v for k, v in spills.items() if "gemv_tile" in k or "gemv_row_group_preloaded" in k}
    assert any("gemv_row_group_preloaded" in k for k in gemv) and any("gemv_tile" in k for k in gemv), sorted(gemv)
    assert all(v == (0, 0) for v in gemv.values()), f"GEMV functions spill: {gemv}"

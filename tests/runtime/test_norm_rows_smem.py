"""The norm prologue's rows copied into shared memory (MPK_NORM_ROWS_SMEM, KernelShape.norm_rows_smem): the knob,
the kernel source and the launch's shared memory, on the CPU. The GPU's bitwise check is
tests/runtime/test_code_variants_gpu.py (-k NORM_ROWS_SMEM)."""

import pytest

from mpk_dist.errors import InputError
from mpk_dist.models.presets import get_preset
from mpk_dist.runtime import tables
from mpk_dist.runtime.codegen import KernelShape, render_source
from mpk_dist.runtime.megakernel_backend import fusions_for_batch, fusions_from_env, tuning_from_env
from mpk_dist.taskgraph import fusion
from mpk_dist.taskgraph.compiler import compile_rank_programs


def test_shape_renders_the_define_only_when_asked():
    off, on = KernelShape(batch=8), KernelShape(batch=8, norm_rows_smem=True)
    assert "MPK_NORM_ROWS_SMEM" not in render_source(off)  # the default source (and its cache key) as before
    assert "#define MPK_NORM_ROWS_SMEM 1" in render_source(on)
    assert on.name().endswith("_nrs") and not off.name().endswith("_nrs")


def test_knob_is_parsed_and_refused_with_the_allowed_values():
    assert "norm_rows_smem" not in tuning_from_env(None, environ={})
    assert tuning_from_env(None, environ={"MPK_NORM_ROWS_SMEM": "1"})["norm_rows_smem"] is True
    with pytest.raises(InputError, match=r"MPK_NORM_ROWS_SMEM: expected one of 0, 1, got 'yes'"):
        tuning_from_env(None, environ={"MPK_NORM_ROWS_SMEM": "yes"})


@pytest.fixture(scope="module")
def qwen3_8b_b8():
    """The program a batch-8 run compiles (the backend's fusions at batch 8: silu_mul its own level)."""
    return compile_rank_programs(get_preset("qwen3-8b"), tp=1, batch=8, sms=132, ranks=[0],
                                 fuse=fusions_for_batch(fusions_from_env(), 8, environ={}), max_seq_len=544)[0]


def test_launch_makes_room_for_the_fp32_rows_above_the_staged_ones(qwen3_8b_b8):
    """qwen3-8b batch 8: the norm tiles' 8 x 4096 rows copied as fp32 (128 KB) after two bf16 rows (the parameter's
    copies, 16 KB), which the 64 KB of staged bf16 rows overwrite; the launch grows to hold them (144 KB, not the
    192 KB of copies beside the staged rows), within the per-block maximum."""
    B, K = 8, 4096
    limit = tables.HOPPER_MAX_DYNAMIC_SMEM - tables.SMEM_RESERVE
    need = fusion.STAGE_OFFSET_BYTES + 2 * 2 * K + 4 * B * K
    assert fusion.rows_smem_bytes(qwen3_8b_b8, limit) == need
    base = tables.smem_bytes(qwen3_8b_b8, 512, linear_mma=True)
    grown = tables.smem_bytes(qwen3_8b_b8, 512, linear_mma=True, norm_rows_smem=True)
    assert base < need <= grown < need + 128 and grown <= tables.HOPPER_MAX_DYNAMIC_SMEM
    # a limit below the need: no room asked (the tiles keep reading global memory)
    assert fusion.rows_smem_bytes(qwen3_8b_b8, need - 1) == 0


def test_batch_one_programs_ask_for_nothing():
    cg = compile_rank_programs(get_preset("qwen3-0.6b"), tp=1, batch=1, sms=132, ranks=[0], fuse=True,
                               max_seq_len=64)[0]
    assert fusion.rows_smem_bytes(cg, 1 << 20) == 0

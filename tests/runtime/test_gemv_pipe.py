"""CPU tests of the software-pipelined linear loads (csrc/tasks/gemv_pipe.cuh, MPK_LINEAR_PIPE): the switch
changes the plain and the fused linear bodies only when on (the pipelined loop has three load sites: the
first chunk and one per register buffer), and the knob travels from the environment to the kernel shape,
to bench-linear and to the knob sweep. Bitwise equality with the register path is a GPU test
(tests/runtime/test_linear_variants_gpu.py)."""

from __future__ import annotations

import shutil

import pytest

from mpk_dist.bench import linear_alone as LA
from mpk_dist.errors import InputError
from mpk_dist.runtime.build import CSRC
from mpk_dist.runtime.codegen import KernelShape, render_source
from tests.runtime.test_linear_mma import ptx_of
from tests.runtime.test_weight_stream import FUSED

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH (CI installs CUDA 13.0)")
WEIGHT_LOAD = "ld.global.nc.L1::no_allocate.v4.u32"


@needs_nvcc
@pytest.mark.parametrize("source", [LA.HARNESS, FUSED], ids=["plain", "fused"])
def test_switch_pipelines_plain_and_fused_linears(tmp_path, source):
    unroll = 4
    loads = {}
    for pipe in (0, 1):
        ptx = ptx_of(source, {"MPK_BATCH": 1, "MPK_WORKER_THREADS": 512, "MPK_LINEAR_UNROLL": unroll,
                              "MPK_LINEAR_PIPE": pipe}, tmp_path)
        loads[pipe] = ptx.count(WEIGHT_LOAD)
    # off: one site of U loads per GEMV instance (the fused body also loads its norm weights); on: three
    # sites, so 2U more per instance
    extra = loads[1] - loads[0]
    assert extra >= 2 * unroll and extra % (2 * unroll) == 0, loads


def test_pipelined_loop_issues_the_next_chunk_before_summing():
    src = (CSRC / "tasks" / "gemv_pipe.cuh").read_text()
    body = src[src.index("void gemv_pipelined"):]
    # each half of the hand-unrolled loop: load the other buffer, then sum this one
    assert body.index("pipe_load<U>(c,") < body.index("pipe_sum<B, U>(acc, a,") < body.index("pipe_load<U>(a, w + (size_t)n3")
    assert body.index("pipe_load<U>(a, w + (size_t)n3") < body.index("pipe_sum<B, U>(acc, c,")


@pytest.mark.parametrize("field,var,suffix", [("linear_pipe", "MPK_LINEAR_PIPE", "_pipe"),
                                               ("linear_tma", "MPK_LINEAR_TMA", "_tma")])
def test_linear_load_switches_reach_the_kernel_shape(field, var, suffix):
    """The bit-identical load variants (pipelined loads, weight stream): environment -> tuning -> KernelShape
    -> a define in the generated source and a file-name suffix; bad values are refused."""
    from mpk_dist.runtime.megakernel_backend import tuning_from_env

    on = KernelShape(batch=1, **{field: True})
    assert f"#define {var} 1" in render_source(on) and on.name().endswith(suffix)
    assert f"#define {var} 0" in render_source(KernelShape(batch=1))
    base = tuning_from_env(512, {})
    assert field not in base and tuning_from_env(512, {var: "1"}) == {**base, field: True}
    with pytest.raises(InputError, match=f"{var}: expected one of 0, 1"):
        tuning_from_env(512, {var: "2"})


def test_bench_linear_and_sweep_offer_the_pipelined_loads(tune_sweep):
    opts = LA.BenchOptions(batches=[1, 8], variants=["scalar", "pipe"])
    assert LA.cases(opts) == [(1, "scalar"), (1, "pipe"), (8, "scalar"), (8, "pipe")]
    assert tune_sweep.parse_variant("l1,t512") == ({"MPK_LINEAR_PIPE": "1", "MPK_WORKER_THREADS": "512"}, {})

"""CPU checks of the fused linears' CUDA side: the mega-kernel with the fused task bodies builds for
sm_90a (nvcc), every fused kind has a dispatch case and a weight prefetch, and the shared-memory
layout constant matches the Python side that sizes the staging."""

from __future__ import annotations

import re
import shutil

import pytest

from mpk_dist.runtime.build import CSRC
from mpk_dist.runtime.codegen import KernelShape
from mpk_dist.runtime.kernel import build_kernel
from mpk_dist.taskgraph import fusion
from mpk_dist.taskgraph.tasks import BY_NAME

FUSED = ("norm_linear", "linear_residual", "silu_linear")
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH (CI installs CUDA 13.0)")


@needs_nvcc
def test_kernel_with_fused_kinds_compiles_for_sm90a(tmp_path, monkeypatch):
    """Batch 4 with MPK_LINEAR_ROWS=2: the multi-row GEMV variant the fused kinds share (the default
    one-row builds are test_build.py's)."""
    monkeypatch.setenv("MPK_CACHE_DIR", str(tmp_path))
    _, res = build_kernel(KernelShape(batch=4, schedule="aot", linear_rows=2), compiler="nvcc")
    assert res.cubin[:4] == b"\x7fELF"
    names = {p.name for p in res.headers}
    assert {"fused_gemv.cuh", *(f"{k}.cuh" for k in FUSED)} <= names, "fused bodies missing from the build"


def test_every_fused_kind_is_dispatched_and_prefetched():
    text = (CSRC / "runtime" / "dispatch.cuh").read_text()
    run_task = text[text.index("__device__ bool run_task("):text.index("__device__ void prefetch_task(")]
    prefetch = text[text.index("__device__ void prefetch_task("):]
    for k in FUSED:
        op = f"OP_{k.upper()}"
        assert re.search(rf"case {op}: return run_{k}\(", run_task), f"{op} has no dispatch case"
        assert op in prefetch and f"{k.upper()}_ARG_W" in prefetch, f"{op}: weights not prefetched"
        assert BY_NAME[k].opcode >= 16, "fused opcodes are appended after the existing ones"


def test_stage_offset_matches_the_python_side():
    text = (CSRC / "tasks" / "fused_gemv.cuh").read_text()
    floats = int(re.search(r"constexpr int kStageOffset = (\d+);", text).group(1))
    assert floats * 4 == fusion.STAGE_OFFSET_BYTES

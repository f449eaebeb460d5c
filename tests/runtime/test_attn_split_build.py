"""CPU checks of split-KV attention's CUDA side: the mega-kernel with the attention_split /
attention_merge bodies builds for sm_90a (nvcc), both kinds have dispatch cases, a split program
passes the runtime's pre-launch checks, and the staged path's shared-memory formula is the one the
Python side reports."""

from __future__ import annotations

import re
import shutil

import pytest

from mpk_dist.models.presets import get_preset
from mpk_dist.runtime import tables
from mpk_dist.runtime.build import CSRC
from mpk_dist.runtime.codegen import KernelShape
from mpk_dist.runtime.kernel import build_kernel
from mpk_dist.taskgraph.compiler import compile_rank_programs
from mpk_dist.taskgraph.lowering_attention import split_smem_bytes

KINDS = ("attention_split", "attention_merge")
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH (CI installs CUDA 13.0)")


@needs_nvcc
def test_kernel_with_split_attention_compiles_for_sm90a(tmp_path, monkeypatch):
    """Batch 2, jit: the task graph travels as data, so this binary runs split programs."""
    monkeypatch.setenv("MPK_CACHE_DIR", str(tmp_path))
    _, res = build_kernel(KernelShape(batch=2, schedule="jit"), compiler="nvcc")
    assert res.cubin[:4] == b"\x7fELF"
    assert {f"{k}.cuh" for k in KINDS} <= {p.name for p in res.headers}, "split attention bodies missing"


def test_both_kinds_are_dispatched():
    text = (CSRC / "runtime" / "dispatch.cuh").read_text()
    run_task = text[text.index("__device__ bool run_task("):text.index("__device__ void prefetch_task(")]
    for k in KINDS:
        assert re.search(rf"case OP_{k.upper()}: return run_{k}\(", run_task), f"OP_{k.upper()} has no dispatch case"


def test_split_program_passes_the_runtime_checks():
    # 16 ranges: what 'auto' gave 3 sequences here before batches above 1 ran unsplit (AUTO_SPLIT_MAX_BATCH)
    cg = compile_rank_programs(get_preset("qwen3-0.6b"), 1, batch=3, sms=132, max_seq_len=1024, attn_splits=16)[0]
    tables.check_supported(cg)
    kinds = [o["kind"] for o in cg.meta["ops"]]
    assert kinds.count("attention_split") == 28 and "attention" not in kinds
    # qwen3-0.6b: 8 warps x GROUP 2 x (128 + 2) floats, as attention_smem_bytes(8, 2, 128) in attention.cuh
    assert split_smem_bytes(cg, 256) == 8 * 2 * 130 * 4
    text = (CSRC / "tasks" / "attention.cuh").read_text()
    assert "return nwarps * G * (D + 2) * 4;" in text

"""MPK_SPLIT_PREP_SEQ_OUTLINED (csrc/runtime/dispatch.cuh split_prep_sequence) where it is not the default: a build with
128 registers a thread and the function outlined (two worker blocks an SM) keeps the split prep's spill loads within
SPLIT_PREP_SPILL_LOADS_MAX (ptxas -v, no GPU). Which builds outline it by default is checked by test_build.py (256
threads: outlined) and test_attn_prep_build.py (512 threads: inlined)."""

from __future__ import annotations

import re
import shutil

import pytest

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH (CI installs CUDA 13.0)")

SPLIT_PREP_SPILL_LOADS_MAX = 48
"""Spill loads (bytes) of run_attention_split_prep and of split_prep_sequence, each, at 128 registers a thread with
the per-sequence function outlined: 44 each with this nvcc; 212 in run_attention_split_prep when one function held
the prep, the walk and the merge (docs/PERF.md v0.37). A tripwire."""


@needs_nvcc
def test_outlined_split_prep_spills_little_at_128_registers(tmp_path, monkeypatch):
    from mpk_dist.runtime.codegen import KernelShape
    from mpk_dist.runtime.kernel import build_kernel

    monkeypatch.setenv("MPK_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("MPK_NVCC_EXTRA_FLAGS", "-Xptxas -v -DMPK_SILU_LINEAR_KIND=0 -DMPK_SPLIT_PREP_SEQ_OUTLINED=1")
    _, res = build_kernel(KernelShape(batch=1, worker_threads=256, schedule="aot", linear_unroll=4, compact_code=True,
                                      blocks_per_sm=2), compiler="nvcc")
    spills = {m.group(1): (int(m.group(2)), int(m.group(3))) for m in re.finditer(
        r"Function properties for (\S+)\n[^\n]*?(\d+) bytes spill stores, (\d+) bytes spill loads", res.log)}
    split_prep = {k: v for k, v in spills.items() if re.search(r"run_attention_split_prep|split_prep_sequence", k)}
    assert len(split_prep) == 2, sorted(split_prep)
    for k, (stores, loads) in split_prep.items():
        assert loads <= SPLIT_PREP_SPILL_LOADS_MAX, f"{k}: ptxas spills (stores, loads) = {(stores, loads)}"

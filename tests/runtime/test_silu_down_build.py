"""The folded down projection (fusion 'silu_down', MPK_SILU_DOWN, csrc/tasks/down_partial.cuh): with nvcc, the batch-1
kernel of qwen3-0.6b's shape (256 worker threads, unroll 4, compact code) and of qwen3-1.7b's (512 threads) built
for such a program compiles with no spills in the gate|up body that now also runs the down partial or in
linear_residual (its copy output); at 256 threads the kernel entry has no spills either and its frame stays within the
default programs' bound (at 512 the default entry already spills, docs/PERF.md v0.31). Its speed is the GPU's to
measure (scripts/tune_sweep.py variant n1, docs/PERF.md)."""

from __future__ import annotations

import re

import pytest

from tests.runtime.test_attn_prep_build import ENTRY_FRAME_BYTES_MAX, _frame, _spills, needs_nvcc


@needs_nvcc
@pytest.mark.parametrize("threads", [256, 512])
def test_silu_down_build_without_spills(tmp_path, monkeypatch, threads):
    from mpk_dist.runtime.codegen import KernelShape
    from mpk_dist.runtime.kernel import build_kernel

    monkeypatch.setenv("MPK_CACHE_DIR", str(tmp_path))
    # the defines kernel.kind_defines renders for a batch-1 silu_down program
    monkeypatch.setenv("MPK_NVCC_EXTRA_FLAGS", "-Xptxas -v -DMPK_SILU_LINEAR_KIND=0 -DMPK_SILU_DOWN=1")
    shape = KernelShape(batch=1, worker_threads=threads, schedule="aot", linear_unroll=4, compact_code=True)
    _, res = build_kernel(shape, compiler="nvcc")
    assert res.cubin[:4] == b"\x7fELF"
    spills = _spills(res.log)
    touched = {k: v for k, v in spills.items() if re.search(r"run_norm_linear|run_linear_residual", k)}
    assert len(touched) == 3, f"expected run_norm_linear(_silu), run_linear_residual, got {sorted(touched)}"
    assert all(v == (0, 0) for v in touched.values()), f"spills (stores, loads): {touched}"
    down = {k: v for k, v in spills.items() if "down_partial" in k}
    assert len(down) == 2 and all(v == (0, 0) for v in down.values()), f"down_partial(_prefetch): {down}"
    if threads == 512:
        return
    assert spills.get("mpk_megakernel") == (0, 0), f"the kernel entry spills: {spills.get('mpk_megakernel')}"
    frame = _frame(res.log, "mpk_megakernel")
    assert frame <= ENTRY_FRAME_BYTES_MAX, f"the entry's stack frame is {frame} B, expected <= {ENTRY_FRAME_BYTES_MAX}"


def test_python_limits_match_the_cuda_constants():
    from pathlib import Path

    from mpk_dist.taskgraph import lowering_fused

    text = (Path(__file__).resolve().parents[2] / "csrc" / "tasks" / "down_partial.cuh").read_text()
    assert int(re.search(r"constexpr int kDownVec = (\d+);", text).group(1)) == lowering_fused.DOWN_VEC
    assert int(re.search(r"constexpr int kDownMaxCols = (\d+);", text).group(1)) == lowering_fused.DOWN_MAX_COLS

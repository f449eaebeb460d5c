"""The one-round norm prologue (-DMPK_NORM_ONE_ROUND=1, csrc/tasks/fused_gemv.cuh stage_row_fetch_first; the default
since docs/PERF.md v0.32, named here all the same): with nvcc, the batch-1 kernel of qwen3-0.6b's shape (256 worker
threads, unroll 4, the generated norm_linear body) builds with no spills in the fused norm bodies or the kernel entry
and the entry's stack frame within the default programs' bound. Why a test: the task bodies share the worker loop's
registers (253 of 255 at this shape), and the first form of the variant, holding the norm weights in registers across
the row statistic, spilled 6-112 B there. Its speed and bits are measured on the GPU (test_code_variants_gpu.py,
docs/PERF.md)."""

from __future__ import annotations

import re

from tests.runtime.test_attn_prep_build import ENTRY_FRAME_BYTES_MAX, _frame, _spills, needs_nvcc


@needs_nvcc
def test_one_round_prologue_builds_without_spills(tmp_path, monkeypatch):
    from mpk_dist.runtime.codegen import KernelShape
    from mpk_dist.runtime.kernel import build_kernel

    monkeypatch.setenv("MPK_CACHE_DIR", str(tmp_path))
    # the default batch-1 programs run norm_linear_silu and leave the silu_linear kind out (kernel.kind_defines)
    monkeypatch.setenv("MPK_NVCC_EXTRA_FLAGS", "-Xptxas -v -DMPK_SILU_LINEAR_KIND=0 -DMPK_NORM_ONE_ROUND=1")
    _, res = build_kernel(KernelShape(batch=1, worker_threads=256, schedule="aot", linear_unroll=4), compiler="nvcc")
    assert res.cubin[:4] == b"\x7fELF"
    spills = _spills(res.log)
    fused = {k: v for k, v in spills.items() if re.search(r"run_norm_linear", k)}
    assert len(fused) == 2, f"expected run_norm_linear and run_norm_linear_silu in the log, got {sorted(fused)}"
    assert all(v == (0, 0) for v in fused.values()), f"the norm bodies spill (stores, loads): {fused}"
    assert spills.get("mpk_megakernel") == (0, 0), f"the kernel entry spills: {spills.get('mpk_megakernel')}"
    frame = _frame(res.log, "mpk_megakernel")
    assert frame <= ENTRY_FRAME_BYTES_MAX, f"the kernel entry's stack frame is {frame} B, expected <= {ENTRY_FRAME_BYTES_MAX}"

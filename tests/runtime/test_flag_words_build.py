"""Flagged words (mpk_dist/taskgraph/flag_words.py, MPK_FLAG_WORDS): with nvcc, the batch-1 kernel of qwen3-0.6b's
shape (256 worker threads, unroll 4, compact code, the generated norm bodies) built for a flagged program compiles
with no spills in the bodies that read or write the words (the gather, the norm and linear_residual tiles, the split
attention tiles whose head merge writes the attention output's copy) or the kernel entry, whose frame stays within
the default programs' bound (a build without flags has none of this code: the define is rendered only for flagged
programs, tests/taskgraph/test_flag_words.py). Its speed and bits are the GPU's to measure
(test_code_variants_gpu.py, docs/PERF.md)."""

from __future__ import annotations

import re

from tests.runtime.test_attn_prep_build import ENTRY_FRAME_BYTES_MAX, _frame, _spills, needs_nvcc


@needs_nvcc
def test_flag_words_build_without_spills(tmp_path, monkeypatch):
    from mpk_dist.runtime.codegen import KernelShape
    from mpk_dist.runtime.kernel import build_kernel

    monkeypatch.setenv("MPK_CACHE_DIR", str(tmp_path))
    # the default batch-1 programs run norm_linear_silu and leave the silu_linear kind out (kernel.kind_defines)
    monkeypatch.setenv("MPK_NVCC_EXTRA_FLAGS", "-Xptxas -v -DMPK_SILU_LINEAR_KIND=0")
    shape = KernelShape(batch=1, worker_threads=256, schedule="aot", linear_unroll=4, compact_code=True,
                        flag_words=True)
    _, res = build_kernel(shape, compiler="nvcc")
    assert res.cubin[:4] == b"\x7fELF"
    spills = _spills(res.log)
    touched = {k: v for k, v in spills.items()
               if re.search(r"flag_gather|run_norm_linear|run_linear_residual|run_attention_split", k)}
    assert len(touched) == 6, ("expected flag_gather, run_norm_linear(_silu), run_linear_residual, "
                               f"run_attention_split(_prep), got {sorted(touched)}")
    assert all(v == (0, 0) for v in touched.values()), f"spills (stores, loads): {touched}"
    assert spills.get("mpk_megakernel") == (0, 0), f"the kernel entry spills: {spills.get('mpk_megakernel')}"
    frame = _frame(res.log, "mpk_megakernel")
    assert frame <= ENTRY_FRAME_BYTES_MAX, f"the entry's stack frame is {frame} B, expected <= {ENTRY_FRAME_BYTES_MAX}"

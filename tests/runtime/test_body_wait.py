"""The wait inside the body (-DMPK_LOAD_BEFORE_WAIT=1, csrc/runtime/body_wait.cuh): which tasks the host flags
(prefetch_plan.load_before_wait, the records' FLAG_LOAD_BEFORE_WAIT) and, with nvcc, that the variant builds
without spills in the GEMV tile. The GPU checks are tests/runtime/test_body_wait_gpu.py."""

from __future__ import annotations

import re
import shutil

import numpy as np
import pytest

from mpk_dist.models.presets import get_preset
from mpk_dist.runtime.megakernel_backend import fusions_for_batch, fusions_from_env
from mpk_dist.runtime.prefetch_plan import load_before_wait
from mpk_dist.runtime.task_records import FLAG_LOAD_BEFORE_WAIT, REC_FLAGS, build_records
from mpk_dist.taskgraph.abi import TASK_COLS
from mpk_dist.taskgraph.compiler import compile_rank_programs
from mpk_dist.taskgraph.tasks import BY_OPCODE

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
SMS = 132


def _program(model: str, batch: int, attn_splits, max_seq_len: int = 512):
    return compile_rank_programs(get_preset(model), tp=1, batch=batch, sms=SMS, max_seq_len=max_seq_len,
                                 fuse=fusions_for_batch(fusions_from_env(True), batch), attn_splits=attn_splits)[0]


def test_batch_1_o_proj_tiles_behind_unsplit_attention_are_flagged():
    """qwen3-8b batch 1 (attention unsplit): every o_proj tile but those on the 8 attention workers is flagged, and
    nothing else; at batch 2 nothing is (the plan's batch bound)."""
    cg = _program("qwen3-8b", 1, "auto")
    flags = load_before_wait(cg, SMS)
    tasks = cg.arrays["tasks"]
    names = {cg.meta["ops"][int(tasks[t, TASK_COLS["OP_INDEX"]])]["name"].split(".")[-1] for t in np.flatnonzero(flags)}
    kinds = {BY_OPCODE[int(tasks[t, TASK_COLS["OPCODE"]])].name for t in np.flatnonzero(flags)}
    assert names == {"o_proj"} and kinds == {"linear_residual"}, (names, kinds)
    layers = get_preset("qwen3-8b").num_layers
    per_layer = sum(1 for t in range(tasks.shape[0]) if cg.task_label(t).startswith("op L0.o_proj"))
    # the o_proj tiles whose own worker ran an attention tile of the layer first are left out (their input is ready)
    assert layers * (per_layer - 8) <= int(flags.sum()) < layers * per_layer
    assert not load_before_wait(_program("qwen3-8b", 2, "auto"), SMS).any()


def test_split_attention_is_not_narrow_so_nothing_is_flagged():
    """qwen3-0.6b batch 1 'auto' at context 512 splits attention into 128 tiles: not a narrow op."""
    assert not load_before_wait(_program("qwen3-0.6b", 1, "auto"), SMS).any()
    assert load_before_wait(_program("qwen3-0.6b", 1, 1), SMS).any()  # unsplit: flagged


def test_records_carry_the_flag_exactly_there():
    cg = _program("qwen3-0.6b", 1, 1)
    flags = load_before_wait(cg, SMS)
    rec, task_rec = build_records(cg, np.zeros(cg.arrays["args"].shape[0], np.uint64), before_wait=flags)
    on = (rec[task_rec, REC_FLAGS] & FLAG_LOAD_BEFORE_WAIT) != 0
    assert (on == flags).all() and on.any()
    plain, task_rec2 = build_records(cg, np.zeros(cg.arrays["args"].shape[0], np.uint64))
    assert not ((plain[task_rec2, REC_FLAGS] & FLAG_LOAD_BEFORE_WAIT) != 0).any()


@needs_nvcc
def test_variant_builds_without_spills_in_the_gemv_tile(tmp_path, monkeypatch):
    """The batch-1 kernel at 16 loads a lane with -DMPK_LOAD_BEFORE_WAIT=1: the GEMV tile with the wait hook and the
    flagged body's function spill nothing, and the kernel entry's frame stays within 608 B (the default build's
    592 B plus the worker loop's branch; a tripwire like test_attn_prep_build's)."""
    from mpk_dist.runtime.codegen import KernelShape
    from mpk_dist.runtime.kernel import build_kernel

    monkeypatch.setenv("MPK_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("MPK_NVCC_EXTRA_FLAGS", "-Xptxas -v -DMPK_SILU_LINEAR_KIND=0 -DMPK_LOAD_BEFORE_WAIT=1")
    _, res = build_kernel(KernelShape(batch=1, worker_threads=512, schedule="aot", linear_unroll=16), compiler="nvcc")
    assert "body_wait.cuh" in {p.name for p in res.headers}
    props = {m.group(1): (int(m.group(2)), int(m.group(3)), int(m.group(4))) for m in re.finditer(
        r"Function properties for (\S+)\n\s*(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads",
        res.log)}
    hooked = [k for k in props if "gemv_tile" in k and "BodyWait" in k]
    body = [k for k in props if "run_linear_residual_before_wait" in k]
    assert len(hooked) == 1 and len(body) == 1, sorted(k for k in props if "gemv" in k or "before_wait" in k)
    for k in hooked + body:
        assert props[k][1:] == (0, 0), f"{k}: ptxas spills (stores, loads) = {props[k][1:]}"
    assert props["mpk_megakernel"][0] <= 608, f"kernel entry frame {props['mpk_megakernel'][0]} B"

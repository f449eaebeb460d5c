"""CPU checks of the fused linears' CUDA side: the mega-kernel with the fused task bodies builds for
sm_90a (nvcc), every fused kind has a dispatch case and a weight prefetch, and the shared-memory
layout constant matches the Python side that sizes the staging; and of the backend's fusion choice
(the MPK_FUSE_* switches, silu_mul unfused above SILU_FUSE_MAX_BATCH rows)."""

from __future__ import annotations

import re
import shutil

import pytest

from mpk_dist.errors import InputError
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
        assert re.search(rf"case {op}: return (MPK_\w+_KIND && )?run_{k}\(", run_task), f"{op} has no dispatch case"
        assert op in prefetch and f"{k.upper()}_ARG_W" in prefetch, f"{op}: weights not prefetched"
        assert BY_NAME[k].opcode >= 16, "fused opcodes are appended after the existing ones"


def test_stage_offset_matches_the_python_side():
    text = (CSRC / "tasks" / "fused_gemv.cuh").read_text()
    floats = int(re.search(r"constexpr int kStageOffset = (\d+);", text).group(1))
    assert floats * 4 == fusion.STAGE_OFFSET_BYTES


def test_linear_fusion_knobs_drop_one_fusion(fake_gpu, monkeypatch):
    """MPK_FUSE_SILU=0 (and its norm / residual siblings) drops that one fusion from the default set and the
    program then has the unfused silu_mul level; a bad value is refused by name."""
    from mpk_dist.model_source import open_model

    m = open_model("tiny")
    for var in ("MPK_FUSE_NORM", "MPK_FUSE_SILU", "MPK_FUSE_RESIDUAL", "MPK_FUSE_ATTN_PREP", "MPK_FUSE_ATTN_MERGE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MPK_FUSE_SILU", "0")
    monkeypatch.setenv("MPK_FUSE_SILU_EPI", "0")
    b = fake_gpu.MegakernelBackend(m.config, m.weights, device="cpu", max_seq_len=16, sms=4)
    assert b.fuse == frozenset({"norm", "residual", "attn_prep", "attn_merge"})
    kinds = {o["kind"] for o in b.session(1).cg.meta["ops"]}
    assert "silu_mul" in kinds and "silu_linear" not in kinds and "norm_linear" in kinds
    monkeypatch.setenv("MPK_FUSE_SILU", "1")
    assert "silu" in fake_gpu.MegakernelBackend(m.config, m.weights, device="cpu", max_seq_len=16, sms=4).fuse
    monkeypatch.setenv("MPK_FUSE_NORM", "off")
    with pytest.raises(InputError, match=r"MPK_FUSE_NORM: expected one of 0, 1, got 'off'"):
        fake_gpu.MegakernelBackend(m.config, m.weights, device="cpu", max_seq_len=16, sms=4)


def test_silu_fusion_stops_above_its_batch(fake_gpu, monkeypatch):
    """Above SILU_FUSE_MAX_BATCH rows the backend's programs keep silu_mul as its own level (the fused down tile
    would recompute it in every tile); at or below it, and with MPK_FUSE_SILU=1 at any batch, the fusion stays."""
    from mpk_dist.model_source import open_model
    from mpk_dist.runtime.megakernel_backend import SILU_FUSE_MAX_BATCH, fusions_for_batch

    m = open_model("tiny")
    for var in ("MPK_FUSE_NORM", "MPK_FUSE_SILU", "MPK_FUSE_RESIDUAL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MPK_FUSE_SILU_EPI", "0")  # (the default epilogue takes silu_mul at scalar batches)
    b = fake_gpu.MegakernelBackend(m.config, m.weights, device="cpu", max_seq_len=16, sms=4)
    kinds = lambda batch: {o["kind"] for o in b.group(batch).sessions[0].cg.meta["ops"]}  # noqa: E731
    assert "silu_linear" in kinds(SILU_FUSE_MAX_BATCH) and "silu_mul" not in kinds(SILU_FUSE_MAX_BATCH)
    above = kinds(2 * SILU_FUSE_MAX_BATCH)
    assert "silu_mul" in above and "silu_linear" not in above and "norm_linear" in above
    assert fusions_for_batch(b.fuse, 2 * SILU_FUSE_MAX_BATCH, {"MPK_FUSE_SILU": "1"}) == b.fuse
    assert fusions_for_batch(b.fuse, 2 * SILU_FUSE_MAX_BATCH, {}) == b.fuse - {"silu"}



def test_silu_epilogue_kind_is_dispatched_and_prefetched():
    """norm_linear_silu runs through run_norm_linear (a case of its own grew the kernel entry's frame) and its
    two weight blocks are prefetched; -DMPK_SILU_EPI_KIND=0 leaves it out."""
    text = (CSRC / "runtime" / "dispatch.cuh").read_text()
    run_task = text[text.index("__device__ bool run_task("):text.index("__device__ void prefetch_task(")]
    assert re.search(r"case OP_NORM_LINEAR_SILU: return run_norm_linear\(", run_task)
    body = text[text.index("__device__ __noinline__ bool run_norm_linear("):]
    assert "OP_NORM_LINEAR_SILU) return MPK_SILU_EPI_KIND && run_norm_linear_silu(" in body[:600]
    prefetch = text[text.index("__device__ void prefetch_task("):]
    assert "second = (long long)t.param(NORM_LINEAR_SILU_PARAM_UP_ROWS) * K;" in prefetch  # its up rows' block too
    assert BY_NAME["norm_linear_silu"].opcode == len(BY_NAME) - 1, "appended after the existing opcodes"


def test_pair_align_matches_the_python_side():
    text = (CSRC / "tasks" / "norm_linear_silu.cuh").read_text()
    assert int(re.search(r"constexpr uint32_t kPairAlign = (\d+);", text).group(1)) == fusion.PAIR_ALIGN


def test_silu_epilogue_switch_and_its_batches(fake_gpu, monkeypatch):
    """'silu_epi' is in the backend's default (MPK_FUSE_SILU_EPI=0 takes it out): a batch-1 program's gate|up tiles
    write the activation (norm_linear_silu, no silu_linear); above SILU_EPI_MAX_BATCH rows only MPK_FUSE_SILU_EPI=1
    keeps it, on scalar and tensor-core linear tiles alike."""
    from mpk_dist.model_source import open_model
    from mpk_dist.runtime.megakernel_backend import SILU_EPI_MAX_BATCH, fusions_for_batch
    from mpk_dist.runtime.tables import MMA_MIN_BATCH

    m = open_model("tiny")
    for var in ("MPK_FUSE_NORM", "MPK_FUSE_SILU", "MPK_FUSE_RESIDUAL", "MPK_LINEAR_MMA"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MPK_FUSE_SILU_EPI", "0")
    assert "silu_epi" not in fake_gpu.MegakernelBackend(m.config, m.weights, device="cpu", max_seq_len=16, sms=4).fuse
    monkeypatch.delenv("MPK_FUSE_SILU_EPI")
    b = fake_gpu.MegakernelBackend(m.config, m.weights, device="cpu", max_seq_len=16, sms=4)
    assert "silu_epi" in b.fuse
    kinds = {o["kind"] for o in b.group(1).sessions[0].cg.meta["ops"]}
    assert "norm_linear_silu" in kinds and "silu_linear" not in kinds and "silu_mul" not in kinds
    assert "silu_epi" not in fusions_for_batch(b.fuse, SILU_EPI_MAX_BATCH + 1, {})  # measured slower at 2 and 3
    assert "silu_epi" in fusions_for_batch(b.fuse, SILU_EPI_MAX_BATCH + 1, {"MPK_FUSE_SILU_EPI": "1"})
    # tensor-core programs take it when asked (their gate|up pair tiles run on the MMA tile), as scalar ones do
    assert "silu_epi" not in fusions_for_batch(b.fuse, MMA_MIN_BATCH, {})
    assert "silu_epi" in fusions_for_batch(b.fuse, MMA_MIN_BATCH, {"MPK_FUSE_SILU_EPI": "1"})
    assert "silu_epi" in fusions_for_batch(b.fuse, MMA_MIN_BATCH, {"MPK_LINEAR_MMA": "0", "MPK_FUSE_SILU_EPI": "1"})
    assert "silu_epi" in fusions_for_batch(b.fuse, 2, {"MPK_LINEAR_MMA": "1", "MPK_FUSE_SILU_EPI": "1"})


def test_kernel_leaves_out_the_silu_kind_its_program_does_not_run():
    """kind_defines: a program with norm_linear_silu tiles builds without silu_linear and the other way round (a
    kernel that can reach both has a larger entry frame); a program with neither leaves both out."""
    from mpk_dist.runtime.kernel import kind_defines
    from mpk_dist.taskgraph.testing import fp32, programs

    epi = programs(fp32("tiny"), 1, fuse="norm,silu,residual,silu_epi")[0]
    pro = programs(fp32("tiny"), 1, fuse=True)[0]
    assert kind_defines(epi) == {"MPK_SILU_LINEAR_KIND": 0}
    assert kind_defines(pro) == {"MPK_SILU_EPI_KIND": 0}
    assert kind_defines(programs(fp32("tiny"), 1, fuse=False)[0]) == {"MPK_SILU_LINEAR_KIND": 0, "MPK_SILU_EPI_KIND": 0}


def test_batch_switches_are_taken_when_the_backend_is_made(fake_gpu, monkeypatch):
    """A backend made while MPK_FUSE_SILU_EPI=1 / MPK_FLAG_WORDS=1 are set keeps them for a batch compiled after the
    environment was restored (megakernel_with_env's pattern): its batch-2 program still has the gate|up epilogue and
    flags the buffers the down projection reads; one made without them compiles neither at batch 2."""
    from mpk_dist.model_source import open_model
    from mpk_dist.runtime.megakernel_backend import SILU_EPI_MAX_BATCH, scoped_env

    m = open_model("tiny")
    for var in ("MPK_FUSE_NORM", "MPK_FUSE_SILU", "MPK_FUSE_RESIDUAL", "MPK_FUSE_SILU_EPI", "MPK_FLAG_WORDS"):
        monkeypatch.delenv(var, raising=False)
    with scoped_env({"MPK_FUSE_SILU_EPI": "1", "MPK_FLAG_WORDS": "1"}):
        asked = fake_gpu.MegakernelBackend(m.config, m.weights, device="cpu", max_seq_len=16, sms=4)
    plain = fake_gpu.MegakernelBackend(m.config, m.weights, device="cpu", max_seq_len=16, sms=4)
    batch = SILU_EPI_MAX_BATCH + 1
    meta = asked.group(batch).sessions[0].cg.meta
    assert "norm_linear_silu" in {o["kind"] for o in meta["ops"]}
    assert meta.get("flag_words"), "the flagged words were lost with the restored environment"
    meta = plain.group(batch).sessions[0].cg.meta
    assert "norm_linear_silu" not in {o["kind"] for o in meta["ops"]} and not meta.get("flag_words")


def test_silu_down_switch(fake_gpu, monkeypatch):
    """MPK_FUSE_SILU_DOWN=1 adds 'silu_down' to the backend's fusions (off by default): its batch-1 program has no
    down level and its kernel gets MPK_SILU_DOWN=1; with the flagged words as well the compile is refused by name."""
    from mpk_dist.errors import InputError
    from mpk_dist.model_source import open_model
    from mpk_dist.runtime.kernel import kind_defines

    m = open_model("tiny")
    for var in ("MPK_FUSE_NORM", "MPK_FUSE_SILU", "MPK_FUSE_RESIDUAL", "MPK_FUSE_SILU_EPI", "MPK_FLAG_WORDS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.delenv("MPK_FUSE_SILU_DOWN", raising=False)
    plain = fake_gpu.MegakernelBackend(m.config, m.weights, device="cpu", max_seq_len=16, sms=4)
    assert "silu_down" not in plain.fuse and "MPK_SILU_DOWN" not in kind_defines(plain.group(1).sessions[0].cg)
    monkeypatch.setenv("MPK_FUSE_SILU_DOWN", "1")
    b = fake_gpu.MegakernelBackend(m.config, m.weights, device="cpu", max_seq_len=16, sms=4)
    cg = b.group(1).sessions[0].cg
    assert "silu_down" in b.fuse and kind_defines(cg).get("MPK_SILU_DOWN") == 1
    assert [o["kind"] for o in cg.meta["ops"] if o["layer"] == 0][-1] == "norm_linear_silu"
    monkeypatch.setenv("MPK_FLAG_WORDS", "1")
    with pytest.raises(InputError, match="silu_down"):
        fake_gpu.MegakernelBackend(m.config, m.weights, device="cpu", max_seq_len=16, sms=4).group(1)

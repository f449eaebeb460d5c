"""CPU tests of the tensor-core linear tiles (csrc/tasks/linear_mma.cuh, MPK_LINEAR_MMA): both variants
build for sm_90a, the switch selects tensor-core code only for batch >= 2 (in the plain linear and
in the generated fused bodies), and the knob travels from the environment to the kernel shape."""

from __future__ import annotations

import shutil
import subprocess
import types
from pathlib import Path

import pytest

from mpk_dist.errors import InputError
from mpk_dist.runtime.codegen import KernelShape, render_source

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH (CI installs CUDA 13.0)")
MMA = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MPK_CACHE_DIR", str(tmp_path))
    return tmp_path


def ptx_of(source: str, defines: dict, tmp_path: Path) -> str:
    """PTX of ``source`` with the kernel's include path and flags (nvcc -ptx, sm_90a)."""
    from mpk_dist.runtime.build import BASE_FLAGS, CSRC

    src, out = tmp_path / "k.cu", tmp_path / "k.ptx"
    src.write_text(source)
    incs = [f"-I{d}" for d in (CSRC / "runtime", CSRC / "tasks", CSRC / "comm", CSRC)]
    cmd = ["nvcc", *BASE_FLAGS, "-arch=sm_90a", "-ptx", "-o", str(out), *incs,
           *(f"-D{k}={v}" for k, v in defines.items()), str(src)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    return out.read_text()


@needs_nvcc
@pytest.mark.parametrize("batch,mma,want_mma", [(1, 1, False), (2, 0, False), (2, 1, True), (16, 1, True)])
def test_plain_linear_switch_selects_tensor_cores(tmp_path, batch, mma, want_mma):
    """MPK_LINEAR_MMA=1 puts mma.sync in the linear body for batch >= 2; batch 1 and MMA=0 stay scalar."""
    from mpk_dist.bench.linear_alone import HARNESS

    ptx = ptx_of(HARNESS, {"MPK_BATCH": batch, "MPK_WORKER_THREADS": 512, "MPK_LINEAR_MMA": mma}, tmp_path)
    assert (MMA in ptx) == want_mma, f"batch {batch} MMA={mma}: mma.sync present={MMA in ptx}"


@needs_nvcc
@pytest.mark.parametrize("kind", ["norm_linear", "silu_linear"])
def test_generated_fused_bodies_use_the_mma_primitive(tmp_path, kind):
    """tile::gemv_acc (the generated fused bodies' GEMV) takes the tensor-core tile under MPK_LINEAR_MMA=1."""
    from mpk_dist.superopt.profile import harness_source

    src = harness_source(kind, generated=True)
    assert MMA in ptx_of(src, {"MPK_BATCH": 4, "MPK_LINEAR_MMA": 1}, tmp_path)
    assert MMA not in ptx_of(src, {"MPK_BATCH": 4, "MPK_LINEAR_MMA": 0}, tmp_path)


@needs_nvcc
def test_megakernel_with_mma_tiles_compiles(cache):
    """The whole mega-kernel builds with the tensor-core tiles, under its own name and define."""
    from mpk_dist.runtime.kernel import build_kernel

    shape = KernelShape(batch=8, worker_threads=512, linear_mma=True)
    src, res = build_kernel(shape, compiler="nvcc")
    assert "#define MPK_LINEAR_MMA 1" in src and res.cubin[:4] == b"\x7fELF"
    assert "linear_mma.cuh" in {p.name for p in res.headers}, "the MMA header must be in the cache key"


def test_kernel_shape_field_renders_the_define():
    """Off by default (define 0, old name); on: define 1, '_m' in the file name, another cache key."""
    from mpk_dist.runtime.codegen import source_for_key

    off, on = KernelShape(4), KernelShape(4, linear_mma=True)
    assert "#define MPK_LINEAR_MMA 0" in render_source(off) and not off.name().endswith("_m")
    assert "#define MPK_LINEAR_MMA 1" in render_source(on) and on.name().endswith("_m")
    assert source_for_key(render_source(off)) != source_for_key(render_source(on))


def test_env_knob_is_checked():
    """Unset leaves linear_mma out (the program's batch decides: tables.default_linear_mma); 1 and 0 force it
    on and off; else one error."""
    from mpk_dist.runtime.megakernel_backend import tuning_from_env

    base = tuning_from_env(256, {})
    assert "linear_mma" not in base
    assert tuning_from_env(256, {"MPK_LINEAR_MMA": "0"}) == {**base, "linear_mma": False}
    assert tuning_from_env(256, {"MPK_LINEAR_MMA": "1"}) == {**base, "linear_mma": True}
    for bad in ("2", "yes", "on"):
        with pytest.raises(InputError, match="MPK_LINEAR_MMA: expected one of 0, 1"):
            tuning_from_env(256, {"MPK_LINEAR_MMA": bad})


def test_tune_sweep_has_the_m_token(tune_sweep):
    """scripts/tune_sweep.py: 'm1' sets MPK_LINEAR_MMA=1 next to the other knobs."""
    assert tune_sweep.parse_variant("t512,m1") == ({"MPK_WORKER_THREADS": "512", "MPK_LINEAR_MMA": "1"}, {})


def test_tune_sweep_has_the_attention_split_token(tune_sweep):
    """scripts/tune_sweep.py: 'k<N>' / 'kauto' pass attn_splits to the backend; k0 and kx are refused."""
    mod = tune_sweep
    assert mod.parse_variant("k4,a1") == ({"MPK_FUSE_ATTN_PREP": "1"}, {"attn_splits": 4})
    assert mod.parse_variant("kauto") == ({}, {"attn_splits": "auto"})
    assert mod.parse_variant("kauto,v0") == ({"MPK_ATTN_PREFETCH": "0"}, {"attn_splits": "auto"})
    assert mod.parse_variant("d1") == ({"MPK_WEIGHT_EVICT_FIRST": "1"}, {})
    for bad in ("k0", "kx"):
        with pytest.raises(SystemExit, match="k<N>"):
            mod.parse_variant(bad)


def test_tune_sweep_has_compile_time_defines(tune_sweep):
    """scripts/tune_sweep.py: -D parts become the variant's MPK_NVCC_EXTRA_FLAGS, space-joined in order."""
    assert tune_sweep.parse_variant("-DMPK_ROPE_SINCOS=0,v0,-DMPK_PREP_POS_LATE=0") == (
        {"MPK_NVCC_EXTRA_FLAGS": "-DMPK_ROPE_SINCOS=0 -DMPK_PREP_POS_LATE=0", "MPK_ATTN_PREFETCH": "0"}, {})
    with pytest.raises(SystemExit, match="-D<NAME>"):
        tune_sweep.parse_variant("-D")


def test_env_knob_reaches_the_kernel_shape(fake_gpu, monkeypatch):
    """MPK_LINEAR_MMA=1 in the environment builds a kernel shape with linear_mma=True."""
    from mpk_dist.model_source import open_model
    from mpk_dist.runtime import session as S

    shapes = []

    def capture(shape, *a, **k):  # the fake build of conftest.fake_gpu, recording the shape
        shapes.append(shape)
        return "src", types.SimpleNamespace(cubin=b"", cached=True, compiler="fake", path="x")

    monkeypatch.setattr(S, "build_kernel", capture)
    monkeypatch.setenv("MPK_LINEAR_MMA", "1")
    m = open_model("tiny")
    fake_gpu.MegakernelBackend(m.config, m.weights, device="cpu", max_seq_len=16, sms=4).session(2)
    assert shapes and shapes[-1].linear_mma is True

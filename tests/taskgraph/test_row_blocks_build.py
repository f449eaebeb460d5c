"""The mega-kernel side of row blocks on the CPU: a batch-64 qwen3-0.6b program passes the runtime's
support checks, a Session built for it asks for a kernel of MPK_BATCH 16 (``tables.kernel_batch``)
and sizes its staging for 16-row tiles, the backend pads a batch of 20 to 32 rows and returns 20,
and that kernel compiles with nvcc for sm_90a."""

from __future__ import annotations

import shutil
import types

import pytest
import torch

from mpk_dist.models.presets import get_preset
from mpk_dist.runtime import tables
from mpk_dist.taskgraph.compiler import compile_rank_programs
from mpk_dist.taskgraph.fusion import STAGE_OFFSET_BYTES

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH (CI installs CUDA 13.0)")


@pytest.fixture(scope="module")
def qwen_b64():
    (cg,) = compile_rank_programs(get_preset("qwen3-0.6b"), 1, batch=64, sms=132, max_seq_len=256, max_steps=4,
                                  fuse=True)
    return cg


def test_batch_64_program_passes_the_runtime_checks(qwen_b64):
    cg = qwen_b64
    tables.check_supported(cg)
    assert cg.meta["batch"] == 64 and tables.kernel_batch(cg) == 16
    cfg = get_preset("qwen3-0.6b")
    K = max(cfg.hidden_size, cfg.intermediate_size)  # norm prologues stage hidden, silu ones intermediate
    # Fused prologues stage the 16 rows of their block, not 64.
    assert tables.smem_bytes(cg, 256) >= STAGE_OFFSET_BYTES + 2 * 16 * K
    assert tables.smem_bytes(cg, 256) < STAGE_OFFSET_BYTES + 2 * 32 * K


def test_session_builds_the_kernel_for_16_rows(qwen_b64, monkeypatch):
    """Session passes kernel_batch (16), not the program's 64, as KernelShape.batch; buffers keep 64 rows."""
    from mpk_dist.runtime import session as S

    shapes = []

    def fake_build(shape, **kw):
        shapes.append(shape)
        raise RuntimeError("stop after the build request")

    monkeypatch.setattr(S, "build_kernel", fake_build)
    with pytest.raises(RuntimeError, match="stop after"):
        S.Session(qwen_b64, {}, torch.device("cpu"), superopt=False)
    assert [s.batch for s in shapes] == [16]


def test_backend_pads_a_batch_of_20_to_32(monkeypatch):
    """MegakernelBackend compiles a batch of 20 as 32 rows (row blocks of 16), feeds the padding rows
    a copy of the last prompt and returns 20 sequences."""
    from mpk_dist.backends.base import GenerateRequest, SamplingParams
    from mpk_dist.model_source import open_model
    from mpk_dist.runtime import megakernel_backend as MB
    from mpk_dist.runtime import session as S

    seen = {}

    def fake_wait(self, on_step=None):
        s0, s1 = self._steps
        seen["forced"] = self.bufs[self.cg.meta["special"]["forced_tokens"]][:2].clone()
        self.pinned["token_out"][s0:s1] = torch.arange(32, dtype=torch.int32)[None, :] + 100 * torch.arange(s0, s1)[:, None]
        self.pinned["step_end_ns"][s0:s1 + 1] = torch.arange(s0, s1 + 1) * 1_000_000
        self.pinned["progress"][0] = s1

    monkeypatch.setattr(S, "build_kernel", lambda *a, **k: ("src", types.SimpleNamespace(cubin=b"", cached=True,
                                                                                          compiler="fake", path="x")))
    monkeypatch.setattr(S, "LoadedKernel", lambda *a, **k: types.SimpleNamespace(blocks_per_sm=1, num_sms=8,
                                                                             launch=lambda *a, **k: None))
    monkeypatch.setattr(S, "host_device_pointer", lambda p: p)
    monkeypatch.setattr(S.Session, "_stream", lambda self: types.SimpleNamespace(cuda_stream=0, query=lambda: True,
                                                                                 synchronize=lambda: None))
    monkeypatch.setattr(S.Session, "wait", fake_wait)
    monkeypatch.setattr(S.Session, "finished", lambda self: fake_wait(self) or True)
    monkeypatch.setattr(MB.MegakernelBackend, "_check_device", lambda self: None)
    monkeypatch.setattr(MB.MegakernelBackend, "_num_sms", lambda self: 8)
    m = open_model("tiny")
    be = MB.MegakernelBackend(m.config, m.weights, device="cpu", max_seq_len=16, sms=4, comm_profile=False,
                              superopt=False)
    prompts = [[i + 1, i + 2] for i in range(20)]
    res = be.generate(GenerateRequest(prompts, 2, SamplingParams()))
    assert be.last_session.batch == 32 and len(res.tokens) == 20
    assert res.tokens[5] == [105, 205], "sequence 5's tokens (token_out rows 1, 2, column 5)"
    assert seen["forced"][0, :20].tolist() == [p[0] for p in prompts]
    assert seen["forced"][0, 20:].tolist() == [prompts[-1][0]] * 12, "padding rows repeat the last prompt"


@needs_nvcc
def test_kernel_for_the_batch_64_program_compiles_for_sm90a(qwen_b64, tmp_path, monkeypatch):
    from mpk_dist.runtime.codegen import KernelShape, render_source
    from mpk_dist.runtime.kernel import build_kernel

    monkeypatch.setenv("MPK_CACHE_DIR", str(tmp_path))
    src, res = build_kernel(KernelShape(tables.kernel_batch(qwen_b64), superopt=False), compiler="nvcc",
                            program=qwen_b64)
    assert "#define MPK_BATCH 16" in src and res.cubin[:4] == b"\x7fELF" and not res.cached
    with pytest.raises(ValueError, match=r"batch: expected MPK_BATCH 1\.\.16"):
        render_source(KernelShape(64))

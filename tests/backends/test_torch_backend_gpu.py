"""GPU: the CUDA-graph and torch.compile modes compute what eager computes (bf16, real shapes)."""

from __future__ import annotations

import pytest
import torch

from mpk_dist.backends.base import GenerateRequest
from mpk_dist.backends.torch_backend import TorchBackend
from mpk_dist.model_source import open_model

pytestmark = pytest.mark.gpu

STEPS = 32


@pytest.fixture(scope="module")
def qwen06():
    assert torch.cuda.is_available(), "gpu tests need a CUDA GPU"
    return open_model("qwen3-0.6b", device="cuda")


@pytest.mark.parametrize("mode", ["graph", "compile"])
def test_mode_matches_eager(qwen06, mode):
    src = qwen06
    force = [(37 * i + 11) % 1000 for i in range(STEPS)]
    req = GenerateRequest([[1, 2, 3, 4]] * 2, STEPS, force_tokens=force, want_logits=True)
    ref = TorchBackend(src.config, src.weights, device="cuda", max_seq_len=128).generate(req)
    got = TorchBackend(src.config, src.weights, device="cuda", max_seq_len=128, mode=mode).generate(req)
    err = (got.logits - ref.logits).abs().amax(dim=-1)  # [steps, B]
    std = ref.logits.std(dim=-1)
    assert bool((err <= 0.03 * std).all()), f"max err/std {float((err / std).max()):.3f}"
    agree = (got.logits.argmax(-1) == ref.logits.argmax(-1)).float().mean().item()
    assert agree >= 0.99

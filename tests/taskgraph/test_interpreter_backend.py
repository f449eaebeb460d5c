"""``--backend interpreter`` through the backend registry: same tokens and logits as the torch backend."""

from __future__ import annotations

import pytest
import torch

from mpk_dist.backends.base import GenerateRequest
from mpk_dist.backends.registry import create_backend
from mpk_dist.errors import BackendUnavailable, InputError
from mpk_dist.taskgraph.interpreter_backend import InterpreterBackend
from mpk_dist.taskgraph.testing import MAX_SEQ, fp32
from mpk_dist.weights import SyntheticSource


@pytest.mark.parametrize("schedule", ["jit", "aot"])
def test_generate_matches_torch_backend(schedule):
    cfg = fp32("tiny-llama")
    src = SyntheticSource(cfg, seed=2)
    req = GenerateRequest(prompts=[[1, 2, 3], [4, 5, 6]], max_new_tokens=5, want_logits=True)
    mine = create_backend("interpreter", cfg, src, tp=2, max_seq_len=MAX_SEQ, schedule=schedule).generate(req)
    ref = create_backend("torch", cfg, src, tp=2, max_seq_len=MAX_SEQ).generate(req)
    assert mine.tokens == ref.tokens
    assert float((mine.logits - ref.logits).abs().max() / ref.logits.abs().max()) <= 1e-5


def test_refuses_gpu_device_and_long_sequences():
    cfg = fp32("tiny")
    with pytest.raises(BackendUnavailable, match="expected device cpu"):
        InterpreterBackend(cfg, SyntheticSource(cfg), device="cuda")
    be = InterpreterBackend(cfg, SyntheticSource(cfg), tp=1, max_seq_len=8)
    be.reset(1)
    with pytest.raises(InputError, match="sequence length"):
        be.prefill(torch.ones(1, 9, dtype=torch.int32), torch.arange(9, dtype=torch.int32)[None])

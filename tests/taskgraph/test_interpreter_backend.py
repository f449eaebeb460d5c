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


def _sampled(be, seed: int, temperature: float = 0.8, top_p: float = 1.0, n: int = 6):
    from mpk_dist.backends.base import SamplingParams

    req = GenerateRequest(prompts=[[1, 2, 3], [4, 5, 6]], max_new_tokens=n, want_logits=True,
                          sampling=SamplingParams(temperature, top_p, seed))
    return be.generate(req)


def test_in_graph_sampling_is_seeded_and_equals_the_numpy_twin():
    """temperature > 0 samples inside the task graph (one launch): same seed -> same tokens, another
    seed -> other tokens, tp 1 == tp 2 (the noise depends on the global vocabulary id only), and each
    token is what sampling_rng.sample_tokens draws from that step's captured logits."""
    from mpk_dist.taskgraph import sampling_rng as R

    cfg = fp32("tiny-llama")  # untied head: spread-out logits (tiny's are too peaked to sample from)
    src = SyntheticSource(cfg, seed=2)
    be = {tp: create_backend("interpreter", cfg, src, tp=tp, max_seq_len=MAX_SEQ) for tp in (1, 2)}
    a, b, c = _sampled(be[2], 1), _sampled(be[2], 1), _sampled(be[2], 2)
    assert a.tokens == b.tokens and a.tokens != c.tokens and a.extra["sampling"] == "in-graph"
    assert _sampled(be[1], 1).tokens == a.tokens
    greedy = [x.tolist() for x in a.logits.argmax(-1)]
    assert [list(r) for r in zip(*a.tokens)] != greedy, "temperature 0.8 on these logits should not be greedy"
    for i, logits in enumerate(a.logits):  # step of generated token i = prompt length - 1 + i
        assert R.sample_tokens(logits.numpy(), 0.8, 1, 2 + i).tolist() == [t[i] for t in a.tokens]


def test_in_graph_sampling_refuses_what_it_cannot_do():
    cfg = fp32("tiny-llama")
    be = create_backend("interpreter", cfg, SyntheticSource(cfg, seed=2), tp=1, max_seq_len=MAX_SEQ)
    with pytest.raises(InputError, match="top-p"):
        _sampled(be, 1, top_p=0.5)
    with pytest.raises(InputError, match="seed"):
        _sampled(be, -3)

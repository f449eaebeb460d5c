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


def test_in_graph_top_p_draws_only_from_the_nucleus():
    """top_p < 1 runs the nucleus program (tp 2, jit and aot schedules, races checked): every token is
    what the numpy twin draws from the captured logits, lies in the device's nucleus, and that
    nucleus is torch's sort-based one plus at most the rest of torch's last bin."""
    from mpk_dist.taskgraph import sampling_rng as R

    cfg = fp32("tiny-llama")
    src = SyntheticSource(cfg, seed=2)
    runs = {sched: _sampled(create_backend("interpreter", cfg, src, tp=2, max_seq_len=MAX_SEQ, schedule=sched), 7,
                            top_p=0.5) for sched in ("jit", "aot")}
    res = runs["jit"]
    assert runs["aot"].tokens == res.tokens
    for i, logits in enumerate(res.logits):
        x = logits.numpy()
        tok = [t[i] for t in res.tokens]
        assert R.sample_tokens(x, 0.8, 7, 2 + i, top_p=0.5).tolist() == tok
        keep = R.nucleus_keep(x, 0.8, 0.5)
        assert all(keep[b, tok[b]] for b in range(2)) and keep.sum() < keep.size // 4
        probs = torch.softmax(logits / 0.8, -1)
        sp, order = probs.sort(-1, descending=True)
        ref = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, sp.cumsum(-1) - sp < 0.5).numpy()
        assert (keep | ~ref).all(), "the device nucleus must contain torch's"
        bins = R.nucleus_bin(R.nucleus_z(x, x.max(-1, keepdims=True), R.inv_temperature(0.8)))
        for b in range(2):  # the extra tokens all sit in torch's last bin
            assert set(bins[b][keep[b] & ~ref[b]].tolist()) <= {int(bins[b][ref[b]].max())}
    assert _sampled(create_backend("interpreter", cfg, src, tp=1, max_seq_len=MAX_SEQ), 7, top_p=0.5).tokens == res.tokens


def test_in_graph_sampling_refuses_bad_values():
    cfg = fp32("tiny-llama")
    be = create_backend("interpreter", cfg, SyntheticSource(cfg, seed=2), tp=1, max_seq_len=MAX_SEQ)
    with pytest.raises(InputError, match="top-p"):
        _sampled(be, 1, top_p=0.0)
    with pytest.raises(InputError, match="seed"):
        _sampled(be, -3)

"""GPU tests of batches above 16 rows (row blocks: linear tiles of 16 rows, kernel MPK_BATCH 16;
docs/TASKGRAPH.md "Row blocks"). Run on a machine with an NVIDIA GPU:

    python -m pytest -q -s -m gpu tests/runtime/test_megakernel_b64_gpu.py

qwen3-0.6b at batch 32 and 64 (a different prompt per sequence): teacher-forced logits within
compare_logits' ERR_TOL / AGREE_MIN of the torch backend at every step, greedy tokens equal (and a
batch of 20, run as 32 padded rows); one paged serving run with 64 tokens a pass and 32 sequences
(batched prefill of prompts up to 60 tokens next to decodes) whose every request equals it alone.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

from mpk_dist.backends.base import GenerateRequest  # noqa: E402
from mpk_dist.runtime.megakernel_backend import MegakernelBackend  # noqa: E402
from mpk_dist.runtime.testing import AGREE_MIN, ERR_TOL, MAX_SEQ, compare_logits, model, rand_ids, ref  # noqa: E402

torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False  # the reference accumulates in fp32

NAME = "qwen3-0.6b"
FORCED_STEPS = 32
_BACKEND: list = []


def _mk() -> MegakernelBackend:
    if not _BACKEND:
        m = model(NAME)
        _BACKEND.append(MegakernelBackend(m.config, m.weights, tp=1, device="cuda", max_seq_len=MAX_SEQ))
    return _BACKEND[0]


def _prompts(batch: int, vocab: int, plen: int = 4) -> list[list[int]]:
    return [rand_ids(plen, vocab, 500 + b) for b in range(batch)]


@pytest.mark.parametrize("batch", [32, 64])
def test_teacher_forced_logits_b32_b64(batch, gpu_results):
    vocab = model(NAME).config.vocab_size
    req = GenerateRequest(_prompts(batch, vocab), FORCED_STEPS + 1, force_tokens=rand_ids(FORCED_STEPS, vocab, 3),
                          want_logits=True)
    got = _mk().generate(req)
    want = ref(NAME).generate(req)
    assert got.logits.shape == want.logits.shape, (got.logits.shape, want.logits.shape)
    err, agree = compare_logits(got.logits, want.logits)
    ok = err <= ERR_TOL and agree >= AGREE_MIN
    ms = sorted(got.per_token_ms)[len(got.per_token_ms) // 2] if got.per_token_ms else float("nan")
    gpu_results.append({"case": f"forced {NAME} b{batch} (row blocks)", "steps": got.logits.shape[0],
                        "max_err/std": f"{err:.4f}", "argmax_agree": f"{agree:.4f}", "ms/token": f"{ms:.3f}", "ok": ok})
    assert err <= ERR_TOL, f"max |err| / std = {err:.4f} > {ERR_TOL}"
    assert agree >= AGREE_MIN, f"argmax agreement {agree:.4f} < {AGREE_MIN}"


@pytest.mark.parametrize("batch", [20, 32, 64])
def test_greedy_tokens_b20_b32_b64(batch, gpu_results):
    """32 greedy tokens per sequence equal the torch backend's (20: compiled as 32 padded rows)."""
    vocab = model(NAME).config.vocab_size
    req = GenerateRequest(_prompts(batch, vocab, 8), 32)
    got = _mk().generate(req)
    want = ref(NAME).generate(req)
    assert len(got.tokens) == batch
    diff = [b for b in range(batch) if got.tokens[b] != want.tokens[b]]
    ms = sorted(got.per_token_ms)[len(got.per_token_ms) // 2]
    gpu_results.append({"case": f"greedy {NAME} b{batch} (row blocks)", "steps": 32, "tokens_equal": not diff,
                        "ms/token": f"{ms:.3f}", "ok": not diff})
    assert not diff, f"{len(diff)} sequences differ, first {diff[0]}: " \
                     f"{[(i, a, b) for i, (a, b) in enumerate(zip(got.tokens[diff[0]], want.tokens[diff[0]])) if a != b][:3]}"


def test_paged_serving_64_tokens_a_pass(gpu_results):
    """Continuous batching with 64 tokens a pass (row blocks of 16), 32 sequences: every request's
    greedy tokens equal it alone on the torch backend, logits within the tolerance."""
    from mpk_dist.serving.server import Server, VirtualClock

    m = model(NAME)
    vocab = m.config.vocab_size
    srv = Server(m, backend="megakernel", tp=1, max_batch=32, page_size=16, max_seq_len=96, max_tokens_per_step=64,
                 device="cuda", clock=VirtualClock(0.01))
    reqs = []
    for i in range(40):
        plen = (60, 33, 17)[i] if i < 3 else 2 + (i * 7) % 12
        prompt = rand_ids(plen, vocab, 700 + i)
        srv.submit(prompt, 12, 0.01 * (i % 4), want_logits=True)
        reqs.append(prompt)
    outs = srv.run(check_pages=True)
    bad, worst, agree_min = [], 0.0, 1.0
    for i, (prompt, o) in enumerate(zip(reqs, outs)):
        alone = ref(NAME).generate(GenerateRequest([prompt], 12, want_logits=True))
        err, agree = compare_logits(o.logits.unsqueeze(1).cuda(), alone.logits.cuda())
        worst, agree_min = max(worst, err), min(agree_min, agree)
        if o.tokens != alone.tokens[0]:
            bad.append(i)
    wide = max(p["tokens"] for p in srv.passes)
    ok = not bad and worst <= ERR_TOL and agree_min >= AGREE_MIN
    gpu_results.append({"case": f"paged {NAME} 64 tok/pass, 32 seqs", "steps": len(srv.passes),
                        "max_err/std": f"{worst:.4f}", "argmax_agree": f"{agree_min:.4f}", "tokens_equal": not bad,
                        "ok": ok})
    assert wide > 16 and max(p["seqs"] for p in srv.passes) > 16, "passes wider than one row block"
    assert not bad, f"requests whose tokens differ from alone: {bad[:5]}"
    assert worst <= ERR_TOL and agree_min >= AGREE_MIN, (worst, agree_min)

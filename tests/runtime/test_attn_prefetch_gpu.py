"""GPU tests of the attention tiles' L2 prefetch of their cache rows before their wait (MPK_ATTN_PREFETCH,
csrc/tasks/attention.cuh, prefetch_task in csrc/runtime/dispatch.cuh): a hint that must leave every bit of
the logits as they are without it. Checked on qwen3-0.6b with a 200-token prompt, at batch 1 and 4, with
one attention tile per kv head and with split-KV attention ('auto': each split prefetches its own range),
each also against torch (compare_logits).
Run: ``python -m pytest -q -m gpu tests/runtime/test_attn_prefetch_gpu.py`` (about 2 minutes on an H200).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

from mpk_dist.backends.base import GenerateRequest  # noqa: E402
from mpk_dist.runtime.testing import MAX_SEQ, compare_logits, median, model, rand_ids, ref  # noqa: E402

torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
NAME = "qwen3-0.6b"
PROMPT = 200
STEPS = 48
_BACKENDS: dict = {}


def mk(prefetch: int, splits):
    """The qwen3-0.6b mega-kernel with MPK_ATTN_PREFETCH=prefetch and attn_splits=splits, cached per key."""
    from mpk_dist.runtime.megakernel_backend import MegakernelBackend

    key = (prefetch, splits)
    if key not in _BACKENDS:
        m = model(NAME)
        mp = pytest.MonkeyPatch()
        mp.setenv("MPK_ATTN_PREFETCH", str(prefetch))
        try:
            _BACKENDS[key] = MegakernelBackend(m.config, m.weights, device="cuda", max_seq_len=MAX_SEQ,
                                               attn_splits=splits)
        finally:
            mp.undo()
    return _BACKENDS[key]


@pytest.mark.parametrize("splits", [1, "auto"])
@pytest.mark.parametrize("batch", [1, 4])
def test_prefetch_leaves_the_logits_bitwise(batch, splits, gpu_results):
    assert PROMPT + STEPS < MAX_SEQ
    vocab = model(NAME).config.vocab_size
    req = GenerateRequest([rand_ids(PROMPT, vocab, 60 + b) for b in range(batch)], STEPS + 1,
                          force_tokens=rand_ids(STEPS, vocab, 70), want_logits=True)
    got, base = mk(1, splits).generate(req), mk(0, splits).generate(req)
    assert "#define MPK_ATTN_PREFETCH 0" in mk(0, splits).session(batch).source, "the variant did not run"
    same = bool(torch.equal(got.logits, base.logits))
    err, agree = compare_logits(got.logits, ref(NAME).generate(req).logits)
    gpu_results.append({"case": f"attn prefetch on/off, splits {splits}, {NAME} b{batch} prompt {PROMPT}",
                        "steps": got.logits.shape[0], "max_err/std": f"{err:.4f}", "argmax_agree": f"{agree:.4f}",
                        "tokens_equal": same,
                        "ms/token": f"{median(got.per_token_ms):.3f}/{median(base.per_token_ms):.3f}",
                        "ok": same and err <= 0.03 and agree >= 0.99})
    assert same, "attention prefetch on and off give different logits (a hint: designed bit-identical)"
    assert err <= 0.03 and agree >= 0.99, f"vs torch: {err:.4f} / {agree:.4f}"

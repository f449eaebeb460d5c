"""GPU tests of the attention tiles' rows in flight (MPK_ATTN_UNROLL, csrc/tasks/attention.cuh): a warp
loads the k and v rows of up to N cache positions before it scores the first, and scores them in the
order one row at a time did, so every N must give BITWISE the logits of N = 1. Checked on qwen3-0.6b
(GROUP 2, head dim 128: the vector-load path) with a 200-token prompt so each warp walks several
chunks of rows and a partial last one, at batch 1 and 4, with one attention tile per kv head and with
split-KV attention ('auto': attention_split's staged path), each also against torch (compare_logits).
Run: ``python -m pytest -q -m gpu tests/runtime/test_attn_unroll_gpu.py`` (about 2 minutes on an H200).
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


def mk(unroll: int, splits):
    """The qwen3-0.6b mega-kernel with MPK_ATTN_UNROLL=unroll and attn_splits=splits, cached per key."""
    from mpk_dist.runtime.megakernel_backend import MegakernelBackend

    key = (unroll, splits)
    if key not in _BACKENDS:
        m = model(NAME)
        mp = pytest.MonkeyPatch()
        mp.setenv("MPK_ATTN_UNROLL", str(unroll))
        try:
            _BACKENDS[key] = MegakernelBackend(m.config, m.weights, device="cuda", max_seq_len=MAX_SEQ,
                                               attn_splits=splits)
        finally:
            mp.undo()
    return _BACKENDS[key]


@pytest.mark.parametrize("splits", [1, "auto"])
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("unroll", [4, 8])
def test_rows_in_flight_give_the_logits_of_one_row(unroll, batch, splits, gpu_results):
    assert PROMPT + STEPS < MAX_SEQ
    vocab = model(NAME).config.vocab_size
    req = GenerateRequest([rand_ids(PROMPT, vocab, 60 + b) for b in range(batch)], STEPS + 1,
                          force_tokens=rand_ids(STEPS, vocab, 70), want_logits=True)
    got, base = mk(unroll, splits).generate(req), mk(1, splits).generate(req)
    assert f"#define MPK_ATTN_UNROLL {unroll}" in mk(unroll, splits).session(batch).source, "the variant did not run"
    same = bool(torch.equal(got.logits, base.logits))
    err, agree = compare_logits(got.logits, ref(NAME).generate(req).logits)
    gpu_results.append({"case": f"attn rows {unroll} vs 1, splits {splits}, {NAME} b{batch} prompt {PROMPT}",
                        "steps": got.logits.shape[0], "max_err/std": f"{err:.4f}", "argmax_agree": f"{agree:.4f}",
                        "tokens_equal": same,
                        "ms/token": f"{median(got.per_token_ms):.3f}/{median(base.per_token_ms):.3f}",
                        "ok": same and err <= 0.03 and agree >= 0.99})
    assert same, f"MPK_ATTN_UNROLL={unroll} and 1 give different logits (designed bit-identical)"
    assert err <= 0.03 and agree >= 0.99, f"vs torch: {err:.4f} / {agree:.4f}"

"""GPU tests of the opt-in attn_merge fusion (split-KV attention merged by the last split tile of each kv head,
counted on a ticket word: csrc/tasks/attention_merge.cuh attention_merge_last, sync.cuh ticket_last): the
mega-kernel with the fusion against the same split program with its merge tiles, bit for bit (the same
sums in the same order), with the unfused split tiles and with attn_prep's attention_split_prep tiles, and
against the torch backend. qwen3-0.6b (8 kv heads) at batch 1 and 4, a 150-token prompt so that several
KV ranges of each head hold positions, 48 teacher-forced steps; greedy tokens equal.
Run: ``python -m pytest -q -m gpu tests/runtime/test_attn_merge_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

from mpk_dist.backends.base import GenerateRequest  # noqa: E402
from mpk_dist.runtime.megakernel_backend import MegakernelBackend  # noqa: E402
from mpk_dist.runtime.testing import (MAX_SEQ, compare_logits, median, model, rand_ids, ref,  # noqa: E402
                                      split_attn_splits)
from mpk_dist.taskgraph.fusion import FUSIONS  # noqa: E402

torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False

NAME = "qwen3-0.6b"
PROMPT, STEPS = 150, 48
_CACHE: dict = {}


@pytest.fixture(autouse=True)
def _plain_env(monkeypatch):
    """The backends below name their fusions; the environment's opt-ins must not add to them."""
    monkeypatch.delenv("MPK_FUSE_ATTN_PREP", raising=False)
    monkeypatch.delenv("MPK_FUSE_ATTN_MERGE", raising=False)


def mk(extra: tuple[str, ...], splits="auto") -> MegakernelBackend:
    """qwen3-0.6b on one GPU, split-KV attention (``splits``), the default fused linears plus ``extra`` (cached)."""
    if (extra, splits) not in _CACHE:
        m = model(NAME)
        _CACHE[extra, splits] = MegakernelBackend(m.config, m.weights, device="cuda", max_seq_len=MAX_SEQ,
                                                  fuse=sorted(FUSIONS) + list(extra), attn_splits=splits)
    return _CACHE[extra, splits]


def requests(batch: int) -> tuple[GenerateRequest, GenerateRequest]:
    vocab = model(NAME).config.vocab_size
    prompts = [rand_ids(PROMPT, vocab, 40 + b) for b in range(batch)]
    return (GenerateRequest(prompts, STEPS + 1, force_tokens=rand_ids(STEPS, vocab, 50), want_logits=True),
            GenerateRequest(prompts, STEPS))


@pytest.mark.parametrize("prep", [False, True])
@pytest.mark.parametrize("batch", [1, 4])
def test_merge_in_last_tile_equals_merge_tiles(batch, prep, gpu_results):
    assert PROMPT + STEPS < MAX_SEQ
    base = ("attn_prep",) if prep else ()
    on, off = mk(base + ("attn_merge",), split_attn_splits(batch)), mk(base, split_attn_splits(batch))
    kinds = {o["kind"] for o in on.session(batch).cg.meta["ops"]}
    assert "attention_merge" not in kinds and "attention_merge" in {o["kind"] for o in off.session(batch).cg.meta["ops"]}
    assert any(b["kind"] == "ticket" for b in on.session(batch).cg.meta["buffers"])
    forced, greedy = requests(batch)
    got, want = on.generate(forced), off.generate(forced)
    same = bool(torch.equal(got.logits, want.logits))
    err, agree = compare_logits(got.logits, ref(NAME).generate(forced).logits)
    g_on, g_off = on.generate(greedy), off.generate(greedy)
    toks = g_on.tokens == g_off.tokens
    gpu_results.append({"case": f"attn_merge vs merge tiles{' (attn_prep)' if prep else ''} {NAME} b{batch} prompt {PROMPT}",
                        "steps": got.logits.shape[0], "bit_identical": same, "max_err/std": f"{err:.4f}",
                        "argmax_agree": f"{agree:.4f}", "tokens_equal": toks,
                        "ms/token": f"{median(g_on.per_token_ms):.3f}/{median(g_off.per_token_ms):.3f}",
                        "ok": same and toks and err <= 0.03 and agree >= 0.99})
    assert same, "merge in the last split tile vs merge tiles: logits differ"
    assert toks, "merge in the last split tile vs merge tiles: greedy tokens differ"
    assert err <= 0.03 and agree >= 0.99, f"vs torch: {err:.4f} / {agree:.4f}"


def test_repeated_launches_keep_the_tickets_straight():
    """Ticket words return to 0 at every step's end; a second and third launch on the same session give the
    first launch's tokens (a count left behind would make the wrong tile merge, or none)."""
    _, greedy = requests(1)
    b = mk(("attn_merge",))
    first = b.generate(greedy).tokens
    assert b.generate(greedy).tokens == first and b.generate(greedy).tokens == first
    s = b.session(1)
    for info, t in zip(s.cg.meta["buffers"], s.bufs):
        if info["kind"] == "ticket":
            assert int(t.abs().sum().item()) == 0, f"{info['name']} left at {t.tolist()}"

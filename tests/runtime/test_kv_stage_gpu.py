"""GPU test of the split-KV tiles' cache-row stage (MPK_ATTN_STAGE_KV, default on; csrc/tasks/attention_split.cuh
KvStage): each split tile copies its range's k and v rows into shared memory at once (cp.async) and walks them
there instead of loading one row per position from the cache. The walk reads the same values in the same order,
so the logits must equal those of the same kernel with the stage off, bit for bit, and stay within tolerance of
torch. Checked on qwen3-0.6b with a 200-token prompt (ranges partly and fully below the position, the range
holding it, ranges above it), at batch 1 and 4, for the backend's default tiles (attention_split_prep: the rows
below the position fly during the q/k prep) and the plain attention_split kind (MPK_FUSE_ATTN_PREP=0).
Run: ``python -m pytest -q -m gpu tests/runtime/test_kv_stage_gpu.py`` (about 2 minutes on an H200).
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


def mk(stage: int, attn_prep: int):
    """The qwen3-0.6b mega-kernel (default fusions and split-KV attention) with MPK_ATTN_STAGE_KV=stage and
    MPK_FUSE_ATTN_PREP=attn_prep, cached per key."""
    from mpk_dist.runtime.megakernel_backend import MegakernelBackend

    key = (stage, attn_prep)
    if key not in _BACKENDS:
        m = model(NAME)
        mp = pytest.MonkeyPatch()
        mp.setenv("MPK_ATTN_STAGE_KV", str(stage))
        mp.setenv("MPK_FUSE_ATTN_PREP", str(attn_prep))
        try:
            _BACKENDS[key] = MegakernelBackend(m.config, m.weights, device="cuda", max_seq_len=MAX_SEQ)
        finally:
            mp.undo()
    return _BACKENDS[key]


def request(batch: int, seed: int) -> GenerateRequest:
    """Teacher-forced: PROMPT-token prompts (one per sequence), then STEPS forced tokens, with logits."""
    assert PROMPT + STEPS < MAX_SEQ
    vocab = model(NAME).config.vocab_size
    return GenerateRequest([rand_ids(PROMPT, vocab, seed + b) for b in range(batch)], STEPS + 1,
                           force_tokens=rand_ids(STEPS, vocab, seed + 10), want_logits=True)


@pytest.mark.parametrize("attn_prep", [1, 0])
@pytest.mark.parametrize("batch", [1, 4])
def test_stage_leaves_the_logits_bitwise(batch, attn_prep, gpu_results):
    from mpk_dist.runtime.task_records import FLAG_STAGE_KV, REC_FLAGS
    from mpk_dist.taskgraph.abi import TASK_COLS
    from mpk_dist.taskgraph.tasks import BY_NAME

    on, off = mk(1, attn_prep), mk(0, attn_prep)
    s_on, s_off = on.session(batch), off.session(batch)
    kind = BY_NAME["attention_split_prep" if attn_prep else "attention_split"]
    ops = s_on.cg.arrays["tasks"][:, TASK_COLS["OPCODE"]]
    assert (ops == kind.opcode).any(), f"the program has no {kind.name} tiles: not the case under test"
    rec = s_on.records.cpu().numpy()
    assert s_on.stage_kv and not s_off.stage_kv and (rec[:, REC_FLAGS] & FLAG_STAGE_KV).any(), \
        "the staged variant's records do not carry the flag"
    assert s_on.smem > s_off.smem, "the launch has no room for the stage"
    assert s_on.build.path == s_off.build.path, "a record switch must not change the binary"
    req = request(batch, 90 + attn_prep)
    got, base = on.generate(req), off.generate(req)
    same = bool(torch.equal(got.logits, base.logits))
    err, agree = compare_logits(got.logits, ref(NAME).generate(req).logits)
    gpu_results.append({"case": f"kv stage on/off, {kind.name}, {NAME} b{batch} prompt {PROMPT}",
                        "steps": got.logits.shape[0], "max_err/std": f"{err:.4f}", "argmax_agree": f"{agree:.4f}",
                        "tokens_equal": same,
                        "ms/token": f"{median(got.per_token_ms):.3f}/{median(base.per_token_ms):.3f}",
                        "ok": same and err <= 0.03 and agree >= 0.99})
    assert same, "the stage on and off give different logits (designed bit-identical)"
    assert err <= 0.03 and agree >= 0.99, f"vs torch: {err:.4f} / {agree:.4f}"

"""GPU tests of the L2 prefetch hints: the attention tiles' prefetch of their cache rows before their wait
(MPK_ATTN_PREFETCH, csrc/tasks/attention.cuh, prefetch_task in csrc/runtime/dispatch.cuh), and the record
switches MPK_BULK_PREFETCH (bulk-copy prefetches, common.cuh prefetch_l2_bulk) and MPK_PREFETCH_AHEAD (an
o_proj tile's weights prefetched during its worker's attention task, prefetch_plan.hoist_ahead). Hints must
leave every bit of the logits as they are without them. Checked on qwen3-0.6b with a 200-token prompt, at
batch 1 and 4, with one attention tile per kv head and with split-KV attention ('auto': each split prefetches
its own range), each also against torch (compare_logits).
Run: ``python -m pytest -q -m gpu tests/runtime/test_attn_prefetch_gpu.py`` (about 2 minutes on an H200).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

from mpk_dist.backends.base import GenerateRequest  # noqa: E402
from mpk_dist.runtime.testing import MAX_SEQ, compare_logits, median, model, rand_ids, ref  # noqa: E402
from mpk_dist.taskgraph.fusion import FUSIONS  # noqa: E402

torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
NAME = "qwen3-0.6b"
PROMPT = 200
STEPS = 48
_BACKENDS: dict = {}


def mk(prefetch: int, splits, bulk: int = 0, ahead: int = 0):
    """The qwen3-0.6b mega-kernel with MPK_ATTN_PREFETCH=prefetch, MPK_BULK_PREFETCH=bulk,
    MPK_PREFETCH_AHEAD=ahead and attn_splits=splits, cached per key. The fused linears only (an explicit
    list: no attention fusions): o_proj then waits on the 8 attention or merge tiles, a narrow wait the
    prefetch plan marks and hoist_ahead moves (after the backend's default split tiles, which merge in
    their last tile, 72 signallers are not narrow and nothing is hoisted)."""
    from mpk_dist.runtime.megakernel_backend import MegakernelBackend

    key = (prefetch, splits, bulk, ahead)
    if key not in _BACKENDS:
        m = model(NAME)
        mp = pytest.MonkeyPatch()
        mp.setenv("MPK_ATTN_PREFETCH", str(prefetch))
        mp.setenv("MPK_BULK_PREFETCH", str(bulk))
        mp.setenv("MPK_PREFETCH_AHEAD", str(ahead))
        try:
            _BACKENDS[key] = MegakernelBackend(m.config, m.weights, device="cuda", max_seq_len=MAX_SEQ, fuse=sorted(FUSIONS),
                                               attn_splits=splits)
        finally:
            mp.undo()
    return _BACKENDS[key]


def request(batch: int, seed: int) -> GenerateRequest:
    """Teacher-forced: PROMPT-token prompts (one per sequence), then STEPS forced tokens, with logits."""
    assert PROMPT + STEPS < MAX_SEQ
    vocab = model(NAME).config.vocab_size
    return GenerateRequest([rand_ids(PROMPT, vocab, seed + b) for b in range(batch)], STEPS + 1,
                           force_tokens=rand_ids(STEPS, vocab, seed + 10), want_logits=True)


def check_bitwise(what: str, on, off, req: GenerateRequest, gpu_results) -> None:
    """``on`` and ``off`` give the same logits bit for bit, and ``on``'s are within tolerance of torch."""
    got, base = on.generate(req), off.generate(req)
    same = bool(torch.equal(got.logits, base.logits))
    err, agree = compare_logits(got.logits, ref(NAME).generate(req).logits)
    gpu_results.append({"case": f"{what} on/off, {NAME} b{len(req.prompts)} prompt {PROMPT}",
                        "steps": got.logits.shape[0], "max_err/std": f"{err:.4f}", "argmax_agree": f"{agree:.4f}",
                        "tokens_equal": same,
                        "ms/token": f"{median(got.per_token_ms):.3f}/{median(base.per_token_ms):.3f}",
                        "ok": same and err <= 0.03 and agree >= 0.99})
    assert same, f"{what} on and off give different logits (a hint: designed bit-identical)"
    assert err <= 0.03 and agree >= 0.99, f"vs torch: {err:.4f} / {agree:.4f}"


@pytest.mark.parametrize("splits", [1, "auto"])
@pytest.mark.parametrize("batch", [1, 4])
def test_prefetch_leaves_the_logits_bitwise(batch, splits, gpu_results):
    assert "#define MPK_ATTN_PREFETCH 0" in mk(0, splits).session(batch).source, "the variant did not run"
    check_bitwise(f"attn prefetch, splits {splits}", mk(1, splits), mk(0, splits), request(batch, 60), gpu_results)


@pytest.mark.parametrize("splits", [1, "auto"])
@pytest.mark.parametrize("batch", [1, 4])
def test_bulk_and_ahead_prefetch_leave_the_logits_bitwise(batch, splits, gpu_results):
    """Bulk-copy prefetches and the hoisted o_proj prefetch (same kernel binary, other task records) against
    the line prefetches issued at each task's own turn: the same logits, bit for bit."""
    from mpk_dist.runtime.task_records import FLAG_BULK_PREFETCH, REC_FLAGS, REC_PREFETCH_NEXT

    on, off = mk(1, splits, bulk=1, ahead=1), mk(1, splits)
    rec = on.session(batch).records.cpu().numpy()
    assert (rec[:, REC_FLAGS] & FLAG_BULK_PREFETCH).all() and (rec[:, REC_PREFETCH_NEXT] > 0).any(), \
        "the variant's records do not carry the switches"
    assert on.session(batch).build.path == off.session(batch).build.path, "record switches must not change the binary"
    check_bitwise(f"bulk+ahead prefetch, splits {splits}", on, off, request(batch, 80), gpu_results)

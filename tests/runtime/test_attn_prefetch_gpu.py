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

from mpk_dist.runtime.testing import check_bitwise, forced_request, megakernel_with_env, split_attn_splits  # noqa: E402
from mpk_dist.taskgraph.fusion import FUSIONS  # noqa: E402

torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
NAME = "qwen3-0.6b"
PROMPT = 200
STEPS = 48


def mk(prefetch: int, splits, bulk: int = 0, ahead: int = 0):
    """The qwen3-0.6b mega-kernel with MPK_ATTN_PREFETCH=prefetch, MPK_BULK_PREFETCH=bulk,
    MPK_PREFETCH_AHEAD=ahead and attn_splits=splits. The fused linears only (an explicit list: no attention
    fusions): o_proj then waits on the 8 attention or merge tiles, a narrow wait the prefetch plan marks and
    hoist_ahead moves from batch 2 (batch 1 plans nothing behind attention, prefetch_plan.py; after the backend's
    default split tiles, which merge in their last tile, 72 signallers are not narrow and nothing is hoisted)."""
    return megakernel_with_env(NAME, {"MPK_ATTN_PREFETCH": str(prefetch), "MPK_BULK_PREFETCH": str(bulk),
                                      "MPK_PREFETCH_AHEAD": str(ahead)}, fuse=sorted(FUSIONS), attn_splits=splits)


def request(batch: int, seed: int):
    """Teacher-forced: PROMPT-token prompts (one per sequence), then STEPS forced tokens, with logits."""
    return forced_request(NAME, PROMPT, STEPS, batch, seed)


@pytest.mark.parametrize("splits", [1, "auto"])
@pytest.mark.parametrize("batch", [1, 4])
def test_prefetch_leaves_the_logits_bitwise(batch, splits, gpu_results):
    splits = split_attn_splits(batch) if splits == "auto" else splits
    assert "#define MPK_ATTN_PREFETCH 0" in mk(0, splits).session(batch).source, "the variant did not run"
    check_bitwise(f"attn prefetch on/off, splits {splits}, {NAME} b{batch} prompt {PROMPT}", NAME, mk(1, splits),
                  mk(0, splits), request(batch, 60), gpu_results)


@pytest.mark.parametrize("splits", [1, "auto"])
@pytest.mark.parametrize("batch", [1, 4])
def test_bulk_and_ahead_prefetch_leave_the_logits_bitwise(batch, splits, gpu_results):
    """Bulk-copy prefetches and the hoisted o_proj prefetch (same kernel binary, other task records) against
    the line prefetches issued at each task's own turn: the same logits, bit for bit."""
    from mpk_dist.runtime.task_records import FLAG_BULK_PREFETCH, REC_FLAGS, REC_PREFETCH_NEXT

    splits = split_attn_splits(batch) if splits == "auto" else splits
    on, off = mk(1, splits, bulk=1, ahead=1), mk(1, splits)
    rec = on.session(batch).records.cpu().numpy()
    assert (rec[:, REC_FLAGS] & FLAG_BULK_PREFETCH).all() and (rec[:, REC_PREFETCH_NEXT] > 0).any(), \
        "the variant's records do not carry the switches"
    assert on.session(batch).build.path == off.session(batch).build.path, "record switches must not change the binary"
    check_bitwise(f"bulk+ahead prefetch on/off, splits {splits}, {NAME} b{batch} prompt {PROMPT}", NAME, on, off,
                  request(batch, 80), gpu_results)

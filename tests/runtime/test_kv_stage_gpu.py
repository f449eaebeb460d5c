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

from mpk_dist.runtime.testing import check_bitwise, forced_request, megakernel_with_env, split_attn_splits  # noqa: E402

torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
NAME = "qwen3-0.6b"
PROMPT = 200
STEPS = 48


def mk(stage: int, attn_prep: int, batch: int):
    """The qwen3-0.6b mega-kernel (default fusions and split-KV attention) with MPK_ATTN_STAGE_KV=stage and
    MPK_FUSE_ATTN_PREP=attn_prep, split at every batch (testing.split_attn_splits)."""
    return megakernel_with_env(NAME, {"MPK_ATTN_STAGE_KV": str(stage), "MPK_FUSE_ATTN_PREP": str(attn_prep)},
                               attn_splits=split_attn_splits(batch))


@pytest.mark.parametrize("attn_prep", [1, 0])
@pytest.mark.parametrize("batch", [1, 4])
def test_stage_leaves_the_logits_bitwise(batch, attn_prep, gpu_results):
    from mpk_dist.runtime.task_records import FLAG_STAGE_KV, REC_FLAGS
    from mpk_dist.taskgraph.abi import TASK_COLS
    from mpk_dist.taskgraph.tasks import BY_NAME

    on, off = mk(1, attn_prep, batch), mk(0, attn_prep, batch)
    s_on, s_off = on.session(batch), off.session(batch)
    kind = BY_NAME["attention_split_prep" if attn_prep else "attention_split"]
    ops = s_on.cg.arrays["tasks"][:, TASK_COLS["OPCODE"]]
    assert (ops == kind.opcode).any(), f"the program has no {kind.name} tiles: not the case under test"
    rec = s_on.records.cpu().numpy()
    assert s_on.stage_kv and not s_off.stage_kv and (rec[:, REC_FLAGS] & FLAG_STAGE_KV).any(), \
        "the staged variant's records do not carry the flag"
    assert s_on.smem > s_off.smem, "the launch has no room for the stage"
    assert s_on.build.path == s_off.build.path, "a record switch must not change the binary"
    check_bitwise(f"kv stage on/off, {kind.name}, {NAME} b{batch} prompt {PROMPT}", NAME, on, off,
                  forced_request(NAME, PROMPT, STEPS, batch, 90 + attn_prep), gpu_results)

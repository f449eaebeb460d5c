"""GPU test of two worker blocks per SM (MPK_BLOCKS_PER_SM=2; csrc/runtime/worker_index.cuh): qwen3-0.6b batch 1, a
200-token prompt and 48 forced steps, the logits within the torch reference's acceptance and close to the default
build's (another tiling, so not bit for bit); the program has two workers per SM, and every worker of the launch
ran its tasks (a duplicate or missing worker index would hang a step or leave an op's tiles unrun).
Run: ``python -m pytest -q -m gpu tests/runtime/test_blocks_per_sm_gpu.py``."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

from mpk_dist.runtime.testing import check_near, forced_request, megakernel_with_env  # noqa: E402

NAME, PROMPT, STEPS = "qwen3-0.6b", 200, 48


def test_two_blocks_per_sm_logits_match_torch(gpu_results):
    two, default = megakernel_with_env(NAME, {"MPK_BLOCKS_PER_SM": "2"}), megakernel_with_env(NAME, {})
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    sess = two.session(1)
    assert sess.workers == 2 * sms and int(sess.cg.meta["workers"]) == 2 * sms
    assert sess.kernel.blocks_per_sm >= 2 and sess.build.path.name.split("-")[0].endswith("_bs2")
    check_near(f"MPK_BLOCKS_PER_SM=2 vs torch, {NAME} b1 prompt {PROMPT}", NAME, two, default,
               forced_request(NAME, PROMPT, STEPS, 1, 70), gpu_results)

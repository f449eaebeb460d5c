"""GPU test of two worker blocks per SM (MPK_BLOCKS_PER_SM=2; csrc/runtime/worker_index.cuh): qwen3-0.6b batch 1, a
200-token prompt and 48 forced steps, the logits within the torch reference's acceptance and close to the default
build's (another tiling, so not bit for bit); the program has two workers per SM, and every worker of the launch
ran its tasks (a duplicate or missing worker index would hang a step or leave an op's tiles unrun).
Run: ``python -m pytest -q -m gpu tests/runtime/test_blocks_per_sm_gpu.py``."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

from mpk_dist.runtime.testing import (AGREE_MIN, ERR_TOL, compare_logits, forced_request, median,  # noqa: E402
                                      megakernel_with_env, ref)

NAME, PROMPT, STEPS = "qwen3-0.6b", 200, 48


def test_two_blocks_per_sm_logits_match_torch(gpu_results):
    two, default = megakernel_with_env(NAME, {"MPK_BLOCKS_PER_SM": "2"}), megakernel_with_env(NAME, {})
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    sess = two.session(1)
    assert sess.workers == 2 * sms and int(sess.cg.meta["workers"]) == 2 * sms
    assert sess.kernel.blocks_per_sm >= 2 and sess.build.path.name.split("-")[0].endswith("_bs2")
    req = forced_request(NAME, PROMPT, STEPS, 1, 70)
    got, base = two.generate(req), default.generate(req)
    err, agree = compare_logits(got.logits, ref(NAME).generate(req).logits)
    near, _ = compare_logits(got.logits, base.logits)
    gpu_results.append({"case": f"MPK_BLOCKS_PER_SM=2 vs torch, {NAME} b1 prompt {PROMPT}",
                        "steps": got.logits.shape[0], "max_err/std": f"{err:.4f}", "argmax_agree": f"{agree:.4f}",
                        "tokens_equal": f"vs default {near:.4f}",
                        "ms/token": f"{median(got.per_token_ms):.3f}/{median(base.per_token_ms):.3f}",
                        "ok": err <= ERR_TOL and agree >= AGREE_MIN})
    assert err <= ERR_TOL and agree >= AGREE_MIN, f"vs torch {err:.4f} / {agree:.4f}"
    assert near <= ERR_TOL, f"vs the default build {near:.4f}"

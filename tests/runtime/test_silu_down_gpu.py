"""GPU test of the folded down projection (fusion 'silu_down', MPK_FUSE_SILU_DOWN=1; csrc/tasks/down_partial.cuh):
qwen3-0.6b batch 1, a 200-token prompt and 48 forced steps, the logits within the torch reference's acceptance
(max error / std, argmax agreement) and close to the default build's. Not bit for bit: the down product is summed in
fp32 over the tiles by atomic adds in no fixed order, where the default rounds it once to bf16. The program must
have no down level and the kernel the MPK_SILU_DOWN code.
Run: ``python -m pytest -q -m gpu tests/runtime/test_silu_down_gpu.py``."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu

from mpk_dist.runtime.testing import check_near, forced_request, megakernel_with_env  # noqa: E402

NAME, PROMPT, STEPS = "qwen3-0.6b", 200, 48


def test_silu_down_logits_match_torch(gpu_results):
    fused, default = megakernel_with_env(NAME, {"MPK_FUSE_SILU_DOWN": "1"}), megakernel_with_env(NAME, {})
    sess = fused.session(1)
    kinds = [o["kind"] for o in sess.cg.meta["ops"] if o["layer"] == 0]
    assert kinds[-1] == "norm_linear_silu" and kinds.count("linear_residual") == 1, kinds
    from mpk_dist.runtime.kernel import kind_defines

    assert kind_defines(sess.cg).get("MPK_SILU_DOWN") == 1
    assert sess.build.path != default.session(1).build.path, "the same binary as the default program's"
    check_near(f"MPK_FUSE_SILU_DOWN=1 vs torch, {NAME} b1 prompt {PROMPT}", NAME, fused, default,
               forced_request(NAME, PROMPT, STEPS, 1, 70), gpu_results)

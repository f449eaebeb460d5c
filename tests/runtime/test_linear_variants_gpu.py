"""GPU tests of the linear tiles' load variants that are designed to sum exactly as the register-load
path does: the shared-memory weight stream (MPK_LINEAR_TMA=1, csrc/tasks/weight_stream.cuh), the
software-pipelined loads (MPK_LINEAR_PIPE=1, csrc/tasks/gemv_pipe.cuh), and the batch-1 x vectors loaded
inside the sum loop (MPK_LOAD_AHEAD=0, the path before linear.cuh load_x_round). The mega-kernel with each is
checked for BITWISE equal logits against the same kernel without it (and against torch with
compare_logits), at batch 1 and 4, fused (norm_linear / silu_linear / linear_residual, generated bodies
included) and unfused (plain linear); then ms/token of both in one process (reported).
Run: ``python -m pytest -q -m gpu tests/runtime/test_linear_variants_gpu.py`` (about 3 minutes on an H200).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

from mpk_dist.backends.base import GenerateRequest  # noqa: E402
from mpk_dist.runtime.testing import (check_bitwise, compare_logits, forced_request, median,  # noqa: E402
                                      megakernel_with_env, model, rand_ids, ref)

torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
NAME = "qwen3-0.6b"
STEPS = 64
KNOBS = {"tma": "MPK_LINEAR_TMA", "pipe": "MPK_LINEAR_PIPE"}
"""variant -> the switch that turns it on (megakernel_backend.SWITCHES)."""


def mk(variant: str | None, fuse: bool, x_ahead: bool = True):
    """The qwen3-0.6b mega-kernel with one load variant on (None: the register path) and MPK_LOAD_AHEAD
    = x_ahead."""
    env = {var: "1" if v == variant else "0" for v, var in KNOBS.items()}
    # MPK_LINEAR_MMA=0: the variants are of the scalar tile, which batch 4 would otherwise leave for tensor cores
    return megakernel_with_env(NAME, {**env, "MPK_LOAD_AHEAD": "1" if x_ahead else "0", "MPK_LINEAR_MMA": "0"},
                               fuse=fuse)


@pytest.mark.parametrize("variant", sorted(KNOBS))
@pytest.mark.parametrize("batch,fuse", [(1, True), (4, True), (1, False)])
def test_variant_logits_are_bitwise_the_register_path(variant, batch, fuse, gpu_results):
    vocab = model(NAME).config.vocab_size
    req = GenerateRequest([rand_ids(6, vocab, 20 + b) for b in range(batch)], STEPS + 1,
                          force_tokens=rand_ids(STEPS, vocab, 30), want_logits=True)
    got, base = mk(variant, fuse).generate(req), mk(None, fuse).generate(req)
    assert f"#define {KNOBS[variant]} 1" in mk(variant, fuse).session(batch).source, f"the {variant} kernel did not run"
    same = bool(torch.equal(got.logits, base.logits))
    err, agree = compare_logits(got.logits, ref(NAME).generate(req).logits)
    gpu_results.append({"case": f"{variant} forced {NAME} b{batch} fuse={fuse}", "steps": got.logits.shape[0],
                        "max_err/std": f"{err:.4f}", "argmax_agree": f"{agree:.4f}", "tokens_equal": same,
                        "ms/token": f"{median(got.per_token_ms):.3f}/{median(base.per_token_ms):.3f}",
                        "ok": same and err <= 0.03 and agree >= 0.99})
    assert same, f"{variant} and register-load logits differ (designed bit-identical)"
    assert err <= 0.03 and agree >= 0.99, f"vs torch: {err:.4f} / {agree:.4f}"


@pytest.mark.parametrize("variant", sorted(KNOBS))
def test_variant_vs_register_ms_per_token(variant, gpu_results):
    """Interleaved runs, median of 3 each, batch 1, fused; reported only (docs/PERF.md records it)."""
    vocab = model(NAME).config.vocab_size
    req = GenerateRequest([rand_ids(8, vocab, 40)], 128)
    ms = {variant: [], None: []}
    for _ in range(3):
        for v in (variant, None):
            ms[v].append(median(mk(v, True).generate(req).per_token_ms))
    a, b = median(ms[variant]), median(ms[None])
    gpu_results.append({"case": f"{variant}/register ms/token {NAME} b1", "steps": 128,
                        "ms/token": f"{a:.4f}/{b:.4f}={a / b:.3f}", "ok": True})
    print(f"\n{variant} {a:.4f} ms/token, register loads {b:.4f} ms/token, ratio {a / b:.3f}")


@pytest.mark.parametrize("fuse", [True, False])
def test_x_ahead_logits_are_bitwise_the_in_loop_loads(fuse, gpu_results):
    """Batch 1: x loaded before any use with the +0 products past K (load_x_round) against x loaded inside
    the sum loop behind its k < K test: the same logits, bit for bit (qwen3-0.6b's K = 1024 leaves half of
    each round's vectors past K, so the +0 terms are exercised)."""
    old = mk(None, fuse, x_ahead=False)
    assert "#define MPK_LOAD_AHEAD 0" in old.session(1).source, "the in-loop kernel did not run"
    check_bitwise(f"x ahead vs in-loop forced {NAME} b1 fuse={fuse}", NAME, mk(None, fuse), old,
                  forced_request(NAME, 6, STEPS, 1, 40), gpu_results)


@pytest.mark.parametrize("unroll", [16, 4])
@pytest.mark.parametrize("fuse", [True, False])
def test_unroll_logits_are_bitwise_unroll_8(unroll, fuse, gpu_results):
    """Batch 1: 16 or 4 weight loads in flight per lane (the defaults for qwen3-8b-sized and small tiles,
    tables.default_linear_unroll) against 8: the same logits, bit for bit (qwen3-0.6b's K = 1024 leaves most of
    a 16-load round past K, so the +0 terms are exercised)."""
    other = megakernel_with_env(NAME, {"MPK_LINEAR_UNROLL": str(unroll)}, fuse=fuse)
    eight = megakernel_with_env(NAME, {"MPK_LINEAR_UNROLL": "8"}, fuse=fuse)
    assert f"#define MPK_LINEAR_UNROLL {unroll}" in other.session(1).source, f"the {unroll}-load kernel did not run"
    assert "#define MPK_LINEAR_UNROLL 8" in eight.session(1).source
    check_bitwise(f"unroll {unroll} vs 8 forced {NAME} b1 fuse={fuse}", NAME, other, eight,
                  forced_request(NAME, 6, STEPS, 1, 41), gpu_results)

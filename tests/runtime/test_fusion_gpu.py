"""GPU tests of the fused linears (``MegakernelBackend(fuse=True)``, mpk_dist.taskgraph.fusion), run by
``scripts/gpu_check.sh --fusion``. Same acceptance as tests/runtime/test_megakernel_gpu.py: >= 256
teacher-forced steps with logits within 3% of the logits' std of the torch reference at every step
and >= 99% argmax agreement; greedy qwen3-0.6b tokens equal torch's for 64 steps. Besides: the fused
kernel against the unfused one (its rounding points are the same, so the logits should agree to the
bit; the test allows 1e-3 of the std and reports whether they are identical) and ms/token of both.

Batch 4 and 16 also run the per-element fallback of a prologue whose staging does not fit the
launch's shared memory (until the runtime sizes it with ``fusion.staging_bytes``).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

from mpk_dist.backends.base import GenerateRequest  # noqa: E402
from mpk_dist.runtime.megakernel_backend import MegakernelBackend  # noqa: E402
from mpk_dist.runtime.testing import MAX_SEQ, compare_logits, median, model, rand_ids, ref  # noqa: E402

# The reference's "fp32 accumulation" (as in test_megakernel_gpu.py): no reduced-precision split-K.
torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False

FORCED_STEPS = 256
_CACHE: dict = {}


def mk(name: str, schedule: str = "aot", fuse: bool = True, tp: int = 1) -> MegakernelBackend:
    """A mega-kernel backend, fused or not (cached)."""
    key = ("mk", name, schedule, fuse, tp)
    if key not in _CACHE:
        m = model(name)
        opts = {"transport": "local"} if tp > 1 else {}
        _CACHE[key] = MegakernelBackend(m.config, m.weights, tp=tp, device="cuda", max_seq_len=MAX_SEQ,
                                        schedule=schedule, fuse=fuse, **opts)
    return _CACHE[key]


def forced_request(name: str, batch: int) -> GenerateRequest:
    vocab = model(name).config.vocab_size
    return GenerateRequest([rand_ids(4, vocab, 2)] * batch, FORCED_STEPS + 1, force_tokens=rand_ids(FORCED_STEPS, vocab, 3),
                           want_logits=True)


def test_fused_program_is_what_runs():
    """The backend compiled the fused kinds (a silently unfused run would prove nothing below)."""
    cg = mk("tiny").session(1).cg  # batch 1: silu_mul is the gate|up projection's epilogue (norm_linear_silu)
    kinds = {o["kind"] for o in cg.meta["ops"]}
    assert {"norm_linear", "linear_residual", "norm_linear_silu"} <= kinds and not kinds & {"rms_norm", "silu_mul", "add"}


@pytest.mark.parametrize("name,batch,schedule", [
    ("tiny", 1, "aot"), ("tiny", 1, "jit"), ("tiny", 4, "aot"), ("tiny-llama", 1, "aot"), ("tiny-llama", 16, "jit"),
    ("qwen3-0.6b", 1, "aot"), ("qwen3-0.6b", 1, "jit"), ("qwen3-0.6b", 4, "aot"), ("qwen3-0.6b", 16, "aot"),
])
def test_fused_teacher_forced_logits(name, batch, schedule, gpu_results):
    """>= 256 teacher-forced steps: logits within 3% of their std at every step, argmax >= 99%."""
    req = forced_request(name, batch)
    got = mk(name, schedule).generate(req)
    want = ref(name).generate(req)
    assert got.logits.shape == want.logits.shape, (got.logits.shape, want.logits.shape)
    err, agree = compare_logits(got.logits, want.logits)
    ok = err <= 0.03 and agree >= 0.99
    gpu_results.append({"case": f"fused forced {name} b{batch} {schedule}", "steps": got.logits.shape[0],
                        "max_err/std": f"{err:.4f}", "argmax_agree": f"{agree:.4f}",
                        "ms/token": f"{median(got.per_token_ms):.3f}", "ok": ok})
    assert got.logits.shape[0] >= FORCED_STEPS
    assert err <= 0.03, f"max |err| / std = {err:.4f} > 0.03"
    assert agree >= 0.99, f"argmax agreement {agree:.4f} < 0.99"


@pytest.mark.parametrize("name,batch", [("qwen3-0.6b", 1), ("qwen3-0.6b", 4), ("tiny-llama", 16)])
def test_fused_equals_unfused_kernel(name, batch, gpu_results):
    """Same rounding points: fused and unfused kernels agree (bit-identical expected; 1e-3 of the std
    allowed, tokens must be equal); ms/token of both recorded (the speed the fusion buys)."""
    req = forced_request(name, batch)
    fused, plain = mk(name, fuse=True).generate(req), mk(name, fuse=False).generate(req)
    err, agree = compare_logits(fused.logits, plain.logits)
    same = bool(torch.equal(fused.logits, plain.logits))
    ms_f, ms_p = median(fused.per_token_ms), median(plain.per_token_ms)
    gpu_results.append({"case": f"fused vs unfused {name} b{batch}", "steps": fused.logits.shape[0],
                        "max_err/std": f"{err:.2e}", "argmax_agree": f"{agree:.4f}", "tokens_equal": same,
                        "ms/token": f"{ms_f:.3f}/{ms_p:.3f}", "ok": err <= 1e-3 and agree == 1.0})
    assert err <= 1e-3 and agree == 1.0, f"fused vs unfused kernel: max |err| / std {err:.2e}, argmax {agree:.4f}"


@pytest.mark.parametrize("schedule", ["aot", "jit"])
def test_fused_greedy_tokens_qwen3_0p6b(schedule, gpu_results):
    """Greedy decoding: the first 64 tokens equal the torch backend's."""
    vocab = model("qwen3-0.6b").config.vocab_size
    req = GenerateRequest([rand_ids(8, vocab, 10)], 64)
    got = mk("qwen3-0.6b", schedule).generate(req)
    want = ref("qwen3-0.6b").generate(req)
    same = got.tokens == want.tokens
    gpu_results.append({"case": f"fused greedy qwen3-0.6b b1 {schedule}", "steps": 64, "tokens_equal": same,
                        "ms/token": f"{median(got.per_token_ms):.3f}", "ok": same})
    assert same, f"first mismatch: {[(i, a, b) for i, (a, b) in enumerate(zip(got.tokens[0], want.tokens[0])) if a != b][:3]}"


def test_fused_tp2_teacher_forced_logits(gpu_results):
    """tp 2 (local transport): norm and silu prologues fused, the all-reduce adds the residual."""
    req = forced_request("tiny", 1)
    got = mk("tiny", tp=2).generate(req)
    want = ref("tiny").generate(req)
    err, agree = compare_logits(got.logits, want.logits)
    ok = err <= 0.03 and agree >= 0.99
    gpu_results.append({"case": "fused forced tiny b1 tp2", "steps": got.logits.shape[0], "max_err/std": f"{err:.4f}",
                        "argmax_agree": f"{agree:.4f}", "ok": ok})
    assert ok, f"tp 2 fused: max |err| / std {err:.4f}, argmax {agree:.4f}"

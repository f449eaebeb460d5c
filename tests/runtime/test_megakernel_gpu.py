"""GPU tests of the mega-kernel backend against the torch reference (run by scripts/gpu_check.sh).

Teacher-forced logits over >= 256 steps (max |err| <= 3% of the logits' std at every step, argmax
agreement >= 99%), greedy tokens, one-step mode, EOS stop, streaming, the watchdog, the trace.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

pytestmark = pytest.mark.gpu

from mpk_dist.backends.base import GenerateRequest, StepBackend  # noqa: E402
from mpk_dist.backends.torch_backend import run_graphs  # noqa: E402
from mpk_dist.errors import DeviceTimeout  # noqa: E402
from mpk_dist.runtime.megakernel_backend import MegakernelBackend  # noqa: E402
from mpk_dist.runtime.testing import MAX_SEQ, compare_logits, model, rand_ids, ref, written_buffers  # noqa: E402

# The op semantics say "fp32 accumulation"; cuBLAS's reduced-precision (bf16) split-K reductions,
# which torch allows by default, would make the reference itself deviate from that.
torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False

FORCED_STEPS = 256
_BACKENDS: dict = {}


def mk(name: str, schedule: str = "aot", **kw) -> MegakernelBackend:
    """A mega-kernel backend (cached per model/schedule when no extra options)."""
    key = (name, schedule)
    if kw or key not in _BACKENDS:
        m = model(name)
        b = MegakernelBackend(m.config, m.weights, tp=1, device="cuda", max_seq_len=MAX_SEQ, schedule=schedule, **kw)
        if kw:
            return b
        _BACKENDS[key] = b
    return _BACKENDS[key]


@pytest.mark.parametrize("name,batch,schedule", [
    ("tiny", 1, "aot"), ("tiny", 1, "jit"), ("tiny", 4, "aot"), ("tiny-llama", 1, "aot"), ("tiny-llama", 16, "jit"),
    ("qwen3-0.6b", 1, "aot"),
])
def test_first_step_buffers_match_torch(name, batch, schedule, gpu_results):
    """After one step, every activation buffer equals the torch graph's tensor (names the first op off)."""
    mkb = mk(name, schedule)
    mkb.reset(batch)
    vocab = model(name).config.vocab_size
    toks = rand_ids(batch, vocab, 1)
    mkb.prefill(torch.tensor([toks]).T, torch.zeros(batch, 1, dtype=torch.int32))
    s = mkb.session(batch)
    r = ref(name)
    r.reset(batch)
    env = {**r.weights[0], **r.states[0], "tokens": torch.tensor(toks, dtype=torch.int32, device="cuda"),
           "positions": torch.zeros(batch, dtype=torch.int32, device="cuda"), "__dtypes__": r._dtypes}
    run_graphs(r.graphs, [env])
    bad, checked = [], 0
    written = written_buffers(s.cg)
    for op in r.graphs[0].ops:
        for out in op.outputs:
            # Fused kinds never materialise their intermediates (the normed rows, silu·mul, q in split
            # attention): only buffers some task of the program writes are compared, as in the TP variant.
            if out in ("argmax_cands",) or out not in env or out not in written:
                continue
            checked += 1
            got, want = s.buffer(out).float(), env[out].float()
            if want.shape != got.shape:
                want = want.reshape(got.shape)
            tol = 2e-2 * float(want.abs().max()) + 1e-3
            if float((got - want).abs().max()) > tol:
                bad.append(f"{op.name}->{out}: max err {float((got - want).abs().max()):.4g} (tol {tol:.3g})")
    gpu_results.append({"case": f"buffers {name} b{batch} {schedule}", "steps": 1, "ok": not bad})
    assert not bad, "first differing ops: " + "; ".join(bad[:4])
    assert checked >= 3, f"only {checked} buffers compared (expected every layer's materialised outputs)"


FORCED_CASES = [("tiny", 1, "aot"), ("tiny", 1, "jit"), ("tiny", 4, "aot"), ("tiny-llama", 1, "aot"),
                ("tiny-llama", 16, "aot"), ("qwen3-0.6b", 1, "aot"), ("qwen3-0.6b", 1, "jit"),
                ("qwen3-0.6b", 2, "aot"), ("qwen3-0.6b", 3, "aot"), ("qwen3-0.6b", 4, "aot"), ("qwen3-0.6b", 16, "aot")]
"""Batches 2 and 3 run 'auto''s unsplit tensor-core walk with 4 and 6 rows a kv head; batch 3 the tensor-core
linear tiles at their smallest batch (tables.MMA_MIN_BATCH)."""


@pytest.mark.parametrize("name,batch,schedule", FORCED_CASES)
def test_teacher_forced_logits(name, batch, schedule, gpu_results):
    """>= 256 teacher-forced steps: logits within 3% of their std at every step, argmax >= 99%."""
    if os.environ.get("MPK_GPU_QUICK") == "1" and name == "qwen3-0.6b" and batch > 1:
        pytest.skip("MPK_GPU_QUICK=1: large-batch qwen3-0.6b cases left out of this run")
    vocab = model(name).config.vocab_size
    prompt = rand_ids(4, vocab, 2)
    force = rand_ids(FORCED_STEPS, vocab, 3)
    req = GenerateRequest([prompt] * batch, FORCED_STEPS + 1, force_tokens=force, want_logits=True)
    got = mk(name, schedule).generate(req)
    want = ref(name).generate(req)
    assert got.logits.shape == want.logits.shape, (got.logits.shape, want.logits.shape)
    err, agree = compare_logits(got.logits, want.logits)
    ok = err <= 0.03 and agree >= 0.99
    ms = sorted(got.per_token_ms)[len(got.per_token_ms) // 2] if got.per_token_ms else float("nan")
    gpu_results.append({"case": f"forced {name} b{batch} {schedule}", "steps": got.logits.shape[0],
                    "max_err/std": f"{err:.4f}", "argmax_agree": f"{agree:.4f}", "ms/token": f"{ms:.3f}", "ok": ok})
    assert got.logits.shape[0] >= FORCED_STEPS
    assert err <= 0.03, f"max |err| / std = {err:.4f} > 0.03"
    assert agree >= 0.99, f"argmax agreement {agree:.4f} < 0.99"


def test_reference_noise_floor_qwen3_0p6b(gpu_results, monkeypatch):
    """Context for the tolerances: torch eager against itself with linear layers accumulated in
    fp32 and rounded once (what the mega-kernel's linear tiles do) instead of cuBLAS's bf16 GEMM.
    Both are valid bf16 implementations; their distance is the floor any other one can expect."""
    from mpk_dist.backends import torch_ops as T

    vocab = model("qwen3-0.6b").config.vocab_size
    req = GenerateRequest([rand_ids(4, vocab, 2)], FORCED_STEPS + 1, force_tokens=rand_ids(FORCED_STEPS, vocab, 3),
                          want_logits=True)
    cublas = ref("qwen3-0.6b").generate(req)

    def linear_fp32(x, w, out_dtype=None):
        y = (x.float() @ w.float().t()).to(w.dtype)
        return y if out_dtype is None else y.to(out_dtype)

    monkeypatch.setattr(T, "linear", linear_fp32)
    exact = ref("qwen3-0.6b").generate(req)
    err, agree = compare_logits(exact.logits, cublas.logits)
    gpu_results.append({"case": "torch: fp32-acc linear vs cuBLAS", "steps": cublas.logits.shape[0],
                        "max_err/std": f"{err:.4f}", "argmax_agree": f"{agree:.4f}", "ok": "info"})
    got = mk("qwen3-0.6b").generate(req)
    err2, agree2 = compare_logits(got.logits, exact.logits)
    gpu_results.append({"case": "megakernel vs fp32-acc torch", "steps": got.logits.shape[0],
                        "max_err/std": f"{err2:.4f}", "argmax_agree": f"{agree2:.4f}", "ok": "info"})
    assert torch.isfinite(cublas.logits).all() and torch.isfinite(exact.logits).all()


@pytest.mark.parametrize("batch,schedule", [(1, "aot"), (1, "jit"), (4, "aot"), (16, "aot")])
def test_greedy_tokens_qwen3_0p6b(batch, schedule, gpu_results):
    """Greedy decoding: the first 64 tokens equal the torch backend's."""
    vocab = model("qwen3-0.6b").config.vocab_size
    prompts = [rand_ids(8, vocab, 10 + b) for b in range(batch)]
    req = GenerateRequest(prompts, 64)
    got = mk("qwen3-0.6b", schedule).generate(req)
    want = ref("qwen3-0.6b").generate(req)
    same = got.tokens == want.tokens
    ms = sorted(got.per_token_ms)[len(got.per_token_ms) // 2]
    gpu_results.append({"case": f"greedy qwen3-0.6b b{batch} {schedule}", "steps": 64, "tokens_equal": same,
                    "ms/token": f"{ms:.3f}", "ok": same})
    assert same, f"first mismatch: {[(i, a, b) for i, (a, b) in enumerate(zip(got.tokens[0], want.tokens[0])) if a != b][:3]}"


def test_one_step_mode_equals_one_launch(gpu_results):
    """StepBackend's loop over prefill/decode (a launch per step) gives the one-launch tokens."""
    b = mk("tiny")
    vocab = model("tiny").config.vocab_size
    req = GenerateRequest([rand_ids(5, vocab, 4), rand_ids(5, vocab, 5)], 20)
    one = b.generate(req)
    steps = StepBackend.generate(b, req)
    gpu_results.append({"case": "one-step mode == one launch", "steps": 20, "tokens_equal": one.tokens == steps.tokens,
                    "ok": one.tokens == steps.tokens})
    assert one.tokens == steps.tokens


def test_eos_stops_early_and_streams(gpu_results):
    """A stop id ends the launch on the device; streamed tokens arrive in order."""
    b = mk("tiny")
    vocab = model("tiny").config.vocab_size
    prompt = rand_ids(3, vocab, 6)
    full = b.generate(GenerateRequest([prompt], 40))
    stop = full.tokens[0][10]
    first = full.tokens[0].index(stop)
    seen: list[tuple[int, list[int]]] = []
    b.on_token = lambda i, toks: seen.append((i, toks))
    try:
        res = b.generate(GenerateRequest([prompt], 40, stop_ids=(stop,)))
    finally:
        b.on_token = None
    ok = res.tokens[0] == full.tokens[0][:first + 1] and res.extra["steps"] == 3 + first
    ok = ok and [i for i, _ in seen] == list(range(first + 1)) and [t[0] for _, t in seen] == res.tokens[0]
    gpu_results.append({"case": "EOS stop + streaming", "steps": res.extra["steps"], "ok": ok})
    assert res.tokens[0] == full.tokens[0][:first + 1]
    assert res.extra["steps"] == 3 + first, "the kernel must stop at the stop id, not run to max tokens"
    assert [t[0] for _, t in seen] == res.tokens[0]


@pytest.mark.parametrize("schedule", ["aot", "jit"])
def test_watchdog_names_task_event_step_sm(schedule, gpu_results):
    """A task that never signals: the host error names the waiting task, the event, step and SM."""
    probe = mk("tiny", schedule)
    cg = probe.session(1).cg
    victim = next(t for t in range(cg.arrays["tasks"].shape[0]) if "qkv_proj" in cg.task_label(t))
    b = mk("tiny", schedule, timeout_s=0.5, inject_hang_task=victim)
    t0 = time.perf_counter()
    with pytest.raises(DeviceTimeout) as info:
        b.generate(GenerateRequest([[1, 2, 3]], 8))
    msg = str(info.value)
    took = time.perf_counter() - t0
    ok = all(w in msg for w in ("task", "event", "step", "SM")) and took < 30
    gpu_results.append({"case": f"watchdog {schedule}", "steps": "-", "ok": ok})
    print(msg)
    assert "waited on event" in msg and "at step 0" in msg and " SM " in msg, msg
    assert f"root cause: {cg.task_label(victim)}" in msg, msg
    assert took < 30


def test_trace_and_summary(tmp_path, gpu_results):
    """--trace writes a Chrome trace with one event per task and step; trace-summary reads it."""
    from mpk_dist.cli import main

    path = tmp_path / "trace.json"
    b = mk("tiny", trace=str(path))
    res = b.generate(GenerateRequest([[1, 2, 3]], 5))
    import json

    evs = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X" and e.get("cat") != "wait"]
    n_tasks = b.session(1).cg.arrays["tasks"].shape[0]
    ok = len(evs) == n_tasks * res.extra["steps"] and main(["trace-summary", str(path)]) == 0
    gpu_results.append({"case": "trace + trace-summary", "steps": res.extra["steps"], "ok": ok})
    assert len(evs) == n_tasks * res.extra["steps"]

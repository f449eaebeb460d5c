"""Helpers shared by the mega-kernel's GPU tests (tests/runtime/*_gpu.py): the acceptance metric
against the torch reference, seeded token ids, a median. Kept in the package because the tests
run with --import-mode=importlib and cannot import each other."""

from __future__ import annotations

import torch


def rand_ids(n: int, vocab: int, seed: int) -> list[int]:
    """``n`` reproducible token ids below ``vocab``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


# The GPU tests' acceptance: max|a-b| / std(ref) <= ERR_TOL and argmax agreement >= AGREE_MIN.
ERR_TOL = 0.03
AGREE_MIN = 0.99


def compare_logits(a: torch.Tensor, b: torch.Tensor, tie_tol: float = ERR_TOL) -> tuple[float, float]:
    """(worst over steps of max|a-b| / std(b), share of (step, seq) whose argmax agrees); b is the reference.

    A different argmax still agrees when it is a near-tie of the reference: the reference rates
    ``a``'s pick at most ``2 * tie_tol * std(b)`` below its own top logit, a gap that two results
    each within the accepted error of the truth can flip (random-weight models have such ties).
    Any other difference counts against. The acceptance is err <= ERR_TOL and agreement >= AGREE_MIN.
    """
    a, b = a.float(), b.float()
    std = b.flatten(1).std(dim=1)
    err = (a - b).abs().flatten(1).max(dim=1).values / std
    pick_a, pick_b = a.argmax(-1), b.argmax(-1)
    gap = (b.gather(-1, pick_b.unsqueeze(-1)) - b.gather(-1, pick_a.unsqueeze(-1))).squeeze(-1)
    tol = (2 * tie_tol * std).view(-1, *([1] * (gap.dim() - 1)))
    agree = (pick_a == pick_b) | (gap <= tol)
    return float(err.max()), float(agree.float().mean())


def median(xs) -> float:
    """Median (upper middle) of a list, NaN when empty."""
    return sorted(xs)[len(xs) // 2] if xs else float("nan")


# KV-cache length of every GPU test model: >= 256 teacher-forced steps plus a short prompt.
MAX_SEQ = 320
SPLITS_ABOVE_AUTO = 5
"""KV ranges per kv head for a split test program above lowering_attention.AUTO_SPLIT_MAX_BATCH sequences: what
'auto' gave batches 2-4 at MAX_SEQ before v0.28 / v0.29 (ranges of 64 positions, under 132 SMs // 8 kv heads)."""


def split_attn_splits(batch: int):
    """attn_splits that keep a GPU test's batch-``batch`` program split: 'auto' up to AUTO_SPLIT_MAX_BATCH
    sequences (the test presets' o_proj is below the batch-1 unsplit rule's bytes: 'auto' splits them),
    SPLITS_ABOVE_AUTO ranges above ('auto' leaves those unsplit)."""
    from mpk_dist.taskgraph.lowering_attention import AUTO_SPLIT_MAX_BATCH

    return "auto" if batch <= AUTO_SPLIT_MAX_BATCH else SPLITS_ABOVE_AUTO
# Shared by all GPU test modules of one pytest process, so a preset's weights are made once.
_MODELS: dict = {}
_REFS: dict = {}


def model(name: str):
    """Random-weight preset on the GPU (small ones are HF checkpoints written to $MPK_CACHE_DIR); cached."""
    assert torch.cuda.is_available(), "gpu tests need a CUDA GPU (run them with scripts/gpu_check.sh on the device)"
    from mpk_dist.model_source import open_model

    if name not in _MODELS:
        _MODELS[name] = open_model(name, seed=0, device="cuda")
    return _MODELS[name]


def ref(name: str, tp: int = 1):
    """The torch eager reference at ``tp`` (all ranks in this process, MAX_SEQ cache); cached."""
    from mpk_dist.backends.torch_backend import TorchBackend

    if (name, tp) not in _REFS:
        m = model(name)
        _REFS[name, tp] = TorchBackend(m.config, m.weights, tp=tp, device="cuda", max_seq_len=MAX_SEQ, mode="eager")
    return _REFS[name, tp]


_ENV_BACKENDS: dict = {}


def megakernel_with_env(name: str, env: dict[str, str], **kwargs):
    """The mega-kernel backend of preset ``name`` (MAX_SEQ cache, ``kwargs`` passed on) made while the
    variables ``env`` are set (the MPK_* switches are read when the backend is made), then the environment
    as it was; cached per (name, env, kwargs), so a test module's variants are built once."""
    from mpk_dist.runtime.megakernel_backend import MegakernelBackend, scoped_env

    key = (name, tuple(sorted(env.items())), repr(sorted(kwargs.items())))
    if key not in _ENV_BACKENDS:
        m = model(name)
        with scoped_env(env):
            _ENV_BACKENDS[key] = MegakernelBackend(m.config, m.weights, device="cuda", max_seq_len=MAX_SEQ, **kwargs)
    return _ENV_BACKENDS[key]


def forced_request(name: str, prompt_len: int, steps: int, batch: int, seed: int):
    """A teacher-forced request on preset ``name``: ``prompt_len``-token prompts (sequence b from seed + b),
    then ``steps`` forced tokens (from seed + 10), logits wanted; within the MAX_SEQ cache."""
    from mpk_dist.backends.base import GenerateRequest

    assert prompt_len + steps < MAX_SEQ, f"{prompt_len} + {steps} positions do not fit the {MAX_SEQ}-token cache"
    vocab = model(name).config.vocab_size
    return GenerateRequest([rand_ids(prompt_len, vocab, seed + b) for b in range(batch)], steps + 1,
                           force_tokens=rand_ids(steps, vocab, seed + 10), want_logits=True)


def check_bitwise(case: str, name: str, on, off, req, gpu_results: list) -> None:
    """Backends ``on`` and ``off`` (two builds or records of one design, meant to sum identically) give logits
    with the same bytes for ``req`` (raw bits: a -0 where the other has +0 counts as a difference), and
    ``on``'s are within the acceptance of the torch reference of preset ``name``; one report row ``case``."""
    got, base = on.generate(req), off.generate(req)
    a, b = got.logits.contiguous(), base.logits.contiguous()
    same = a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a.view(torch.uint8), b.view(torch.uint8)))
    err, agree = compare_logits(got.logits, ref(name).generate(req).logits)
    gpu_results.append({"case": case, "steps": got.logits.shape[0], "max_err/std": f"{err:.4f}",
                        "argmax_agree": f"{agree:.4f}", "tokens_equal": same,
                        "ms/token": f"{median(got.per_token_ms):.3f}/{median(base.per_token_ms):.3f}",
                        "ok": same and err <= ERR_TOL and agree >= AGREE_MIN})
    assert same, f"{case}: the two give different logits (designed bit-identical)"
    assert err <= ERR_TOL and agree >= AGREE_MIN, f"{case}: vs torch {err:.4f} / {agree:.4f}"


def check_near(case: str, name: str, on, off, req, gpu_results: list) -> None:
    """Backend ``on`` (a design that sums in another order than ``off``, the default build) gives logits for ``req``
    within the acceptance of the torch reference of preset ``name`` and within ERR_TOL of ``off``'s; one report row
    ``case`` (the non-bitwise counterpart of check_bitwise)."""
    got, base = on.generate(req), off.generate(req)
    err, agree = compare_logits(got.logits, ref(name).generate(req).logits)
    near, near_agree = compare_logits(got.logits, base.logits)
    gpu_results.append({"case": case, "steps": got.logits.shape[0], "max_err/std": f"{err:.4f}",
                        "argmax_agree": f"{agree:.4f}", "tokens_equal": f"vs default {near:.4f} / {near_agree:.4f}",
                        "ms/token": f"{median(got.per_token_ms):.3f}/{median(base.per_token_ms):.3f}",
                        "ok": err <= ERR_TOL and agree >= AGREE_MIN and near <= ERR_TOL})
    assert err <= ERR_TOL and agree >= AGREE_MIN, f"{case}: vs torch {err:.4f} / {agree:.4f}"
    assert near <= ERR_TOL, f"{case}: vs the default build {near:.4f}"


def written_buffers(cg) -> set[str]:
    """Names of the buffers some task of compiled program ``cg`` writes: a buffer only declared (q under
    attn_prep in a split program, kept in the tiles' shared memory) holds nothing to compare."""
    from mpk_dist.taskgraph.abi import ARG_COLS, TASK_COLS
    from mpk_dist.taskgraph.tasks import BY_OPCODE

    tasks, args, names = cg.arrays["tasks"], cg.arrays["args"], [x["name"] for x in cg.meta["buffers"]]
    out = set()
    for row in tasks:
        spec = BY_OPCODE[int(row[TASK_COLS["OPCODE"]])].args
        for i, k in enumerate(range(int(row[TASK_COLS["ARG_BEGIN"]]), int(row[TASK_COLS["ARG_END"]]))):
            b = int(args[k, ARG_COLS["BUFFER"]])
            if b >= 0 and spec[i].writes:
                out.add(names[b])
    return out

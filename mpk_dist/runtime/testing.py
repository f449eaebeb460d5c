"""Helpers shared by the mega-kernel's GPU tests (tests/runtime/*_gpu.py): the acceptance metric
against the torch reference, seeded token ids, a median. Kept in the package because the tests
run with --import-mode=importlib and cannot import each other."""

from __future__ import annotations

import torch


def rand_ids(n: int, vocab: int, seed: int) -> list[int]:
    """``n`` reproducible token ids below ``vocab``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def compare_logits(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(worst over steps of max|a-b| / std(b), share of (step, seq) with equal argmax); b is the reference.

    The acceptance of the GPU tests is err <= 0.03 and agreement >= 0.99.
    """
    a, b = a.float(), b.float()
    err = (a - b).abs().flatten(1).max(dim=1).values / b.flatten(1).std(dim=1)
    return float(err.max()), float((a.argmax(-1) == b.argmax(-1)).float().mean())


def median(xs) -> float:
    """Median (upper middle) of a list, NaN when empty."""
    return sorted(xs)[len(xs) // 2] if xs else float("nan")


# KV-cache length of every GPU test model: >= 256 teacher-forced steps plus a short prompt.
MAX_SEQ = 320
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

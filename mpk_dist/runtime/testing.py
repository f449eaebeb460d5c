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

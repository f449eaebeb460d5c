"""CPU tests of the GPU tests' acceptance metric (mpk_dist.runtime.testing.compare_logits)."""

import torch

from mpk_dist.runtime.testing import compare_logits


def _ref(steps=8, batch=2, vocab=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(steps, batch, vocab, generator=g)


def test_equal_logits_agree_fully():
    b = _ref()
    assert compare_logits(b.clone(), b) == (0.0, 1.0)


def test_near_tie_within_error_counts_as_agreeing():
    b = _ref()
    top = b.argmax(-1)
    b[0, 0, 7] = b[0, 0, top[0, 0]] - 1e-3  # token 7 is a near-tie at step 0, sequence 0
    a = b.clone()
    a[0, 0, 7] += 2e-3  # error 2e-3 flips the pick to the near-tie
    err, agree = compare_logits(a, b)
    assert a[0, 0].argmax() == 7 and err > 0
    assert agree == 1.0


def test_clear_wrong_pick_counts_against():
    b = _ref()
    a = b.clone()
    low = b[3, 1].argmin()
    a[3, 1, low] = b[3, 1].max() + 0.5  # a far-from-top token wins: error 0.5 + (top - min) is not a tie
    err, agree = compare_logits(a, b)
    assert agree == 1 - 1 / 16
    assert err > 0.5 / b[3].std()

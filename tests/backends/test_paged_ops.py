"""Paged op semantics (torch_ops) against the static-cache ops on the same keys and values."""

from __future__ import annotations

import torch

from mpk_dist.backends import torch_ops as T

ATTRS = dict(q_heads=4, kv_heads=2, head_dim=8, scale=8 ** -0.5)


def _scatter_to_pages(cache: torch.Tensor, P: int, perm: torch.Tensor):
    """Static caches [B, S, Hkv, D] -> a page pool (pages in ``perm`` order) and a page table."""
    B, S = cache.shape[:2]
    npp = S // P
    pool = torch.zeros(B * npp, P, *cache.shape[2:])
    table = perm.reshape(B, npp).to(torch.int32)
    for b in range(B):
        for j in range(npp):
            pool[table[b, j]] = cache[b, j * P:(j + 1) * P]
    return pool, table


def test_paged_attention_equals_static_attention_for_decode_and_prefill():
    g = torch.Generator().manual_seed(0)
    B, S, P = 3, 16, 4
    kc, vc = torch.randn(B, S, 2, 8, generator=g), torch.randn(B, S, 2, 8, generator=g)
    perm = torch.randperm(B * S // P, generator=g)
    kp, table = _scatter_to_pages(kc, P, perm)
    vp, _ = _scatter_to_pages(vc, P, perm)
    # ragged pass: sequence 2 has a 5-token chunk at 3..7, sequences 0 and 1 one decode token each
    slots = torch.tensor([0, 2, 2, 2, 2, 2, 1, -1], dtype=torch.int32)
    pos = torch.tensor([9, 3, 4, 5, 6, 7, 14, 0], dtype=torch.int32)
    q = torch.randn(8, 32, generator=g)
    out = T.paged_attention(q, kp, vp, pos, slots, table, ATTRS)
    for i in range(7):
        b = int(slots[i])
        ref = T.attention(q[i:i + 1], kc[b:b + 1], vc[b:b + 1], pos[i:i + 1], ATTRS)
        torch.testing.assert_close(out[i:i + 1], ref, rtol=1e-6, atol=1e-6)
    assert (out[7] == 0).all()  # padding token


def test_write_kv_paged_lands_in_the_right_page_row_and_skips_padding():
    P = 4
    kp, vp = torch.zeros(6, P, 1, 2), torch.zeros(6, P, 1, 2)
    table = torch.tensor([[5, 2, -1], [0, 3, 1]], dtype=torch.int32)
    k = torch.arange(1, 7, dtype=torch.float32).reshape(3, 1, 2)
    slots, pos = torch.tensor([1, 0, -1], dtype=torch.int32), torch.tensor([9, 6, 0], dtype=torch.int32)
    T.write_kv_paged(kp, vp, k, -k, pos, slots, table)
    assert torch.equal(kp[1, 1, 0], k[0, 0]) and torch.equal(vp[1, 1, 0], -k[0, 0])  # slot 1 pos 9 -> page 1 row 1
    assert torch.equal(kp[2, 2, 0], k[1, 0])  # slot 0 pos 6 -> table[0, 1] = 2, row 2
    assert int((kp != 0).any(-1).any(-1).sum()) == 2  # the padding token wrote nothing


def test_gather_rows():
    x = torch.arange(12.0).reshape(4, 3)
    y = T.gather_rows(x, torch.tensor([3, 0, -1], dtype=torch.int32))
    assert torch.equal(y, torch.tensor([[9.0, 10, 11], [0, 1, 2], [0, 0, 0]]))


def test_host_layout_gives_the_same_result_as_deriving_it():
    g = torch.Generator().manual_seed(1)
    kp, vp = torch.randn(10, 4, 2, 8, generator=g), torch.randn(10, 4, 2, 8, generator=g)
    table = torch.tensor([[3, 7, 1], [0, 9, -1]], dtype=torch.int32)
    slots = torch.tensor([1, 0, 0, 0, -1], dtype=torch.int32)
    pos = torch.tensor([5, 8, 9, 10, 0], dtype=torch.int32)
    q = torch.randn(5, 32, generator=g)
    lay = T.paged_layout(pos.numpy(), slots.numpy(), 4, "cpu")
    assert lay.single.tolist() == [0] and lay.single_pages == 2 and [c[1] for c in lay.chunks] == [0]
    assert lay.live.tolist() == [0, 1, 2, 3]
    assert torch.equal(T.paged_attention(q, kp, vp, pos, slots, table, ATTRS, layout=lay),
                       T.paged_attention(q, kp, vp, pos, slots, table, ATTRS))

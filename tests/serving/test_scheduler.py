"""Continuous batching without a model: admission, reservations, chunked prefill, retirement."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mpk_dist.errors import InputError
from mpk_dist.serving.pages import PagePool
from mpk_dist.serving.request import Request
from mpk_dist.serving.scheduler import Scheduler

V = 32


def _logits(batch) -> torch.Tensor:
    """Fake model: the next token of a sequence is (its position + 1) % V."""
    out = torch.zeros(len(batch.logit_rows), V)
    for r, row in enumerate(batch.logit_rows):
        out[r, (int(batch.positions[row]) + 1) % V] = 1.0
    return out


def _drive(sched: Scheduler, t_end: float = 100.0, dt: float = 1.0):
    """Run passes on the fake model; returns the batches."""
    t, batches = 0.0, []
    while not sched.idle and t < t_end:
        b = sched.plan(t)
        if b.num_tokens:
            sched.commit(b, _logits(b), t + dt)
            batches.append((t, b))
        t += dt
        sched.pool.check()
    return batches


def test_chunked_prefill_and_decode_layout():
    pool = PagePool(num_pages=20, page_size=4, max_seqs=2, max_pages_per_seq=8)
    sched = Scheduler(pool, max_tokens=8)
    sched.submit(Request(0, tuple(range(20)), 3))
    sched.submit(Request(1, (1, 2), 2))
    b0 = sched.plan(0.0)
    # both prefilling: request 0 takes the whole budget of 8 tokens, request 1 waits for budget
    assert b0.tokens.tolist() == list(range(8)) and b0.positions.tolist() == list(range(8))
    assert len(b0.logit_rows) == 0
    sched.commit(b0, _logits(b0), 1.0)
    b1 = sched.plan(1.0)
    assert b1.tokens.tolist() == list(range(8, 16))
    sched.commit(b1, _logits(b1), 2.0)
    b2 = sched.plan(2.0)
    # the last 4 prompt tokens of request 0, then request 1's whole prompt; both emit
    assert b2.tokens.tolist() == [16, 17, 18, 19, 1, 2]
    assert b2.logit_rows.tolist() == [3, 5] and [st.req.id for st in b2.emitters] == [0, 1]
    sched.commit(b2, _logits(b2), 3.0)
    b3 = sched.plan(3.0)
    # decode: each request feeds its last output at its next position
    assert b3.tokens.tolist() == [20 % V, 2] and b3.positions.tolist() == [20, 2]
    assert b3.slots.tolist() == [sched.running[0].slot, sched.running[1].slot]


def test_outputs_follow_the_model_and_pages_all_return():
    pool = PagePool(num_pages=12, page_size=4, max_seqs=3, max_pages_per_seq=6)
    sched = Scheduler(pool, max_tokens=6)
    for i, (plen, out, t) in enumerate([(5, 4, 0.0), (9, 6, 0.0), (2, 3, 2.5), (7, 5, 1.0), (3, 8, 6.0)]):
        sched.submit(Request(i, tuple(range(plen)), out, arrival_time=t))
    _drive(sched)
    outs = sched.drain()
    assert [o.id for o in outs] == [0, 1, 2, 3, 4]
    for o in outs:
        assert o.tokens == [(o.prompt_len + j) % V for j in range(len(o.tokens))]
        assert o.token_times[0] > o.arrival_time and o.finish_reason == "length"
    assert pool.num_free == pool.num_pages and pool.num_free_slots == pool.max_seqs


def test_admission_waits_for_arrival_slot_and_reserved_pages():
    # 4 pages of 4: request 0 reserves ceil((8 + 5 - 1) / 4) = 3 pages; request 1 needs 2 -> must wait
    pool = PagePool(num_pages=4, page_size=4, max_seqs=2, max_pages_per_seq=4)
    sched = Scheduler(pool, max_tokens=16)
    sched.submit(Request(0, tuple(range(8)), 5))
    sched.submit(Request(1, (1, 2, 3), 4, arrival_time=0.5))
    sched.plan(0.0)
    assert [st.req.id for st in sched.running] == [0]  # request 1 has not arrived
    batches = _drive(sched)
    first_1 = min(t for t, b in batches if any(st.req.id == 1 for st, _ in b.scheduled))
    last_0 = max(t for t, b in batches if any(st.req.id == 0 for st, _ in b.scheduled))
    assert first_1 > last_0, "request 1 was admitted before request 0's reserved pages came back"
    assert len(sched.drain()) == 2


def test_stop_token_finishes_early():
    pool = PagePool(num_pages=8, page_size=4, max_seqs=1, max_pages_per_seq=8)
    sched = Scheduler(pool, max_tokens=8)
    sched.submit(Request(0, (0, 1, 2), 10, stop_ids=(5,)))  # the fake model emits 3, 4, 5
    _drive(sched)
    (o,) = sched.drain()
    assert o.tokens == [3, 4, 5] and o.finish_reason == "stop"


def test_bad_requests_and_sizes():
    pool = PagePool(num_pages=4, page_size=4, max_seqs=2, max_pages_per_seq=2)
    with pytest.raises(InputError, match="max_tokens_per_step"):
        Scheduler(pool, max_tokens=1)
    sched = Scheduler(pool, max_tokens=8)
    with pytest.raises(InputError, match="max_seq_len"):
        sched.submit(Request(0, tuple(range(8)), 2))
    with pytest.raises(InputError, match="non-empty prompt"):
        sched.submit(Request(1, (), 2))


def test_step_batch_padding_for_fixed_shape_backends():
    pool = PagePool(num_pages=8, page_size=4, max_seqs=2, max_pages_per_seq=4)
    sched = Scheduler(pool, max_tokens=8)
    sched.submit(Request(0, (3, 4, 5), 2))
    t = sched.plan(0.0).tensors(pad_tokens=8, pad_rows=2)
    assert t["seq_slots"].tolist() == [0, 0, 0] + [-1] * 5 and t["logit_rows"].tolist() == [2, -1]
    assert t["page_table"].dtype == torch.int32 and t["page_table"].shape == (2, 4)
    assert np.array_equal(t["page_table"][0, :1].numpy(), pool.page_table[0, :1])

"""The page/slot pool: no leak, no double allocation, clear errors, invariants under random churn."""

from __future__ import annotations

import random

import numpy as np
import pytest

from mpk_dist.errors import InputError
from mpk_dist.serving.pages import PagePool


def test_grow_takes_pages_lazily_and_release_returns_them():
    pool = PagePool(num_pages=10, page_size=4, max_seqs=3, max_pages_per_seq=5)
    s = pool.acquire_slot()
    pool.grow(s, 1)
    assert pool.pages_used[s] == 1 and pool.num_free == 9
    pool.grow(s, 4)  # still one page
    assert pool.pages_used[s] == 1
    pool.grow(s, 5)
    assert pool.pages_used[s] == 2 and pool.num_free == 8
    row = pool.page_table[s]
    assert (row[:2] >= 0).all() and (row[2:] == -1).all() and row[0] != row[1]
    pool.check()
    pool.release_slot(s)
    assert pool.num_free == 10 and pool.num_free_slots == 3 and (pool.page_table == -1).all()
    pool.check()


def test_errors_name_the_limit():
    pool = PagePool(num_pages=3, page_size=4, max_seqs=1, max_pages_per_seq=4)
    s = pool.acquire_slot()
    with pytest.raises(InputError, match="expected a free sequence slot"):
        pool.acquire_slot()
    with pytest.raises(InputError, match="expected at most 16 tokens"):
        pool.grow(s, 17)
    with pytest.raises(InputError, match="expected 4 free pages"):
        pool.grow(s, 16)
    with pytest.raises(InputError, match="expected a slot in use"):
        pool.release_slot(5)
    with pytest.raises(InputError, match="expected >= 1"):
        PagePool(0, 4, 1, 1)


def test_check_catches_corruption():
    pool = PagePool(num_pages=6, page_size=2, max_seqs=2, max_pages_per_seq=3)
    a, b = pool.acquire_slot(), pool.acquire_slot()
    pool.grow(a, 4)
    pool.grow(b, 2)
    pool.check()
    leaked = PagePool(6, 2, 2, 3)
    leaked.acquire_slot()
    leaked.num_free -= 1  # a page vanishes from the free list
    with pytest.raises(AssertionError, match="leaked"):
        leaked.check()
    pool.page_table[b, 0] = pool.page_table[a, 0]  # two sequences share a page
    with pytest.raises(AssertionError):
        pool.check()


def test_random_churn_never_leaks_or_double_allocates():
    rng = random.Random(0)
    pool = PagePool(num_pages=40, page_size=3, max_seqs=8, max_pages_per_seq=10)
    lengths: dict[int, int] = {}
    for _ in range(2000):
        op = rng.random()
        if op < 0.3 and pool.num_free_slots:
            lengths[pool.acquire_slot()] = 0
        elif op < 0.5 and lengths:
            s = rng.choice(sorted(lengths))
            pool.release_slot(s)
            del lengths[s]
        elif lengths:
            s = rng.choice(sorted(lengths))
            want = min(lengths[s] + rng.randint(1, 5), pool.max_len)
            if pool.pages_for(want) - pool.pages_used[s] <= pool.num_free:
                pool.grow(s, want)
                lengths[s] = want
        pool.take_releases()  # each step is a pass: it carries the releases to the device
        pool.check()
        held = np.concatenate([pool.page_table[s, : pool.pages_used[s]] for s in lengths] or [np.zeros(0, np.int32)])
        assert len(set(held.tolist())) == len(held)
        for s, n in lengths.items():
            assert pool.pages_used[s] == pool.pages_for(n)
    for s in list(lengths):
        pool.release_slot(s)
    assert pool.num_free == pool.num_pages and pool.num_free_slots == pool.max_seqs
    pool.check()


def test_counts_mirror_the_pool_and_queue_releases_for_the_next_pass():
    """PageCounts (the device backends' host side: no page ids) keeps PagePool's numbers under the same
    churn, and flags each slot released since the last pass once (a never-grown slot frees nothing)."""
    from mpk_dist.serving.pages import PageCounts

    rng = random.Random(1)
    pool, counts = PagePool(30, 4, 6, 6), PageCounts(30, 4, 6, 6)
    lengths: dict[int, int] = {}
    for _ in range(500):
        op = rng.random()
        if op < 0.3 and pool.num_free_slots:
            s = pool.acquire_slot()
            assert counts.acquire_slot() == s
            lengths[s] = 0
        elif op < 0.5 and lengths:
            s = rng.choice(sorted(lengths))
            pool.release_slot(s)
            counts.release_slot(s)
            del lengths[s]
        elif lengths:
            s = rng.choice(sorted(lengths))
            want = min(lengths[s] + rng.randint(1, 6), pool.max_len)
            if pool.pages_for(want) - pool.pages_used[s] <= pool.num_free:
                pool.grow(s, want)
                counts.grow(s, want)
                lengths[s] = want
        assert np.array_equal(pool.take_releases(), counts.take_releases())
        assert counts.num_free == pool.num_free and np.array_equal(counts.pages_used, pool.pages_used)
        counts.check()
    assert not hasattr(counts, "page_table"), "no page ids on the host"
    c = PageCounts(8, 4, 2, 2)
    a, b = c.acquire_slot(), c.acquire_slot()
    c.grow(a, 5)
    c.release_slot(a)
    c.release_slot(b)  # never grown: nothing for the device to free
    assert c.take_releases().tolist() == [1, 0] and c.take_releases().tolist() == [0, 0]
    with pytest.raises(InputError, match="expected a slot in use"):
        c.release_slot(a)  # released twice
    a = c.acquire_slot()
    c.grow(a, 1)
    c.release_slot(a)
    a = c.acquire_slot()
    c.grow(a, 1)
    with pytest.raises(AssertionError, match="released twice before a pass took the first release"):
        c.release_slot(a)

"""Paged KV-cache bookkeeping: a free list of pages, a page table per sequence slot, slot free list.

Everything is a flat int32 array plus a few integer counters, never Python objects per page, so
the same state can live in device memory later and be updated by the mega-kernel's retire/admit
tasks with atomics (docs/SERVING.md):

* ``free_pages`` [NP]: a stack; entries ``[0, num_free)`` are the free page ids. Allocation pops
  from the top (``num_free -= n``), freeing pushes (``num_free += n``).
* ``page_table`` [MB, MP]: ``page_table[s, j]`` = page holding positions ``j*P .. j*P+P-1`` of the
  sequence in slot ``s``; -1 = none. This array is the ``page_table`` input of a paged graph.
* ``pages_used`` [MB]: pages held by slot s (its first ``pages_used[s]`` columns are valid).
* ``owner`` [NP]: slot holding each page, -1 = free (catches double allocation and leaks).
* ``free_slots`` [MB] with ``num_free_slots``: the same stack discipline for sequence slots.

The host is the only writer in this implementation; every mutation checks its invariants, and
``check()`` verifies all of them at once (used by tests after every step).
"""

from __future__ import annotations

import numpy as np

from mpk_dist.errors import InputError


class PagePool:
    """Pages and slots of one paged KV cache (shared by all layers and ranks: same ids everywhere)."""

    def __init__(self, num_pages: int, page_size: int, max_seqs: int, max_pages_per_seq: int):
        for name, v in (("num_pages", num_pages), ("page_size", page_size), ("max_seqs", max_seqs),
                        ("max_pages_per_seq", max_pages_per_seq)):
            if int(v) < 1:
                raise InputError(f"page pool {name}: expected >= 1, got {v}")
        self.num_pages, self.page_size = int(num_pages), int(page_size)
        self.max_seqs, self.max_pages_per_seq = int(max_seqs), int(max_pages_per_seq)
        # Stacks pop from the end: reverse order so page 0 / slot 0 are handed out first.
        self.free_pages = np.arange(self.num_pages - 1, -1, -1, dtype=np.int32)
        self.num_free = self.num_pages
        self.page_table = np.full((self.max_seqs, self.max_pages_per_seq), -1, dtype=np.int32)
        self.pages_used = np.zeros(self.max_seqs, dtype=np.int32)
        self.owner = np.full(self.num_pages, -1, dtype=np.int32)
        self.free_slots = np.arange(self.max_seqs - 1, -1, -1, dtype=np.int32)
        self.num_free_slots = self.max_seqs
        self.slot_live = np.zeros(self.max_seqs, dtype=bool)

    @property
    def max_len(self) -> int:
        """Longest sequence (prompt + output) one slot can hold."""
        return self.page_size * self.max_pages_per_seq

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold ``num_tokens`` positions."""
        return -(-int(num_tokens) // self.page_size)

    # -- slots ----------------------------------------------------------------------------------------
    def acquire_slot(self) -> int:
        """Pop a free sequence slot (its page-table row is empty)."""
        if self.num_free_slots == 0:
            raise InputError(f"page pool: expected a free sequence slot, got all {self.max_seqs} in use; "
                             "retire a sequence first or raise max_batch")
        self.num_free_slots -= 1
        slot = int(self.free_slots[self.num_free_slots])
        assert not self.slot_live[slot] and self.pages_used[slot] == 0, f"slot {slot} handed out twice"
        self.slot_live[slot] = True
        return slot

    def release_slot(self, slot: int) -> None:
        """Return all of the slot's pages to the free list, then the slot itself."""
        self._check_live(slot)
        n = int(self.pages_used[slot])
        pages = self.page_table[slot, :n]
        assert (self.owner[pages] == slot).all(), f"slot {slot}: page table names pages it does not own"
        self.owner[pages] = -1
        self.free_pages[self.num_free: self.num_free + n] = pages
        self.num_free += n
        self.page_table[slot, :n] = -1
        self.pages_used[slot] = 0
        self.slot_live[slot] = False
        self.free_slots[self.num_free_slots] = slot
        self.num_free_slots += 1

    # -- pages ----------------------------------------------------------------------------------------
    def grow(self, slot: int, num_tokens: int) -> None:
        """Make slot ``slot`` hold at least ``num_tokens`` positions, popping pages as needed."""
        self._check_live(slot)
        need = self.pages_for(num_tokens)
        if need > self.max_pages_per_seq:
            raise InputError(f"sequence length: expected at most {self.max_len} tokens "
                             f"({self.max_pages_per_seq} pages of {self.page_size}), got {num_tokens}")
        have = int(self.pages_used[slot])
        n = need - have
        if n <= 0:
            return
        if n > self.num_free:
            raise InputError(f"page pool: expected {n} free pages for slot {slot}, got {self.num_free}; "
                             "the scheduler admits only what fits, so this is a reservation bug")
        pages = self.free_pages[self.num_free - n: self.num_free][::-1].copy()
        self.num_free -= n
        assert (self.owner[pages] == -1).all(), f"pages {pages[self.owner[pages] != -1].tolist()} allocated twice"
        self.owner[pages] = slot
        self.page_table[slot, have:need] = pages
        self.pages_used[slot] = need

    def _check_live(self, slot: int) -> None:
        if not (0 <= slot < self.max_seqs) or not self.slot_live[slot]:
            raise InputError(f"page pool slot: expected a slot in use (0..{self.max_seqs - 1}), got {slot}")

    def check(self) -> None:
        """Verify every invariant: each page is free xor owned by exactly one live slot's table."""
        free = self.free_pages[: self.num_free]
        if len(np.unique(free)) != self.num_free:
            raise AssertionError("page pool: a page is on the free list twice")
        if (self.owner[free] != -1).any():
            raise AssertionError("page pool: a free page has an owner")
        held = np.concatenate([self.page_table[s, : self.pages_used[s]] for s in range(self.max_seqs)])
        if len(np.unique(held)) != len(held):
            raise AssertionError("page pool: a page is in two page-table entries")
        if len(held) + self.num_free != self.num_pages:
            raise AssertionError(f"page pool: {self.num_pages - len(held) - self.num_free} pages leaked")
        for s in range(self.max_seqs):
            row, n = self.page_table[s], int(self.pages_used[s])
            if (row[n:] != -1).any() or (self.owner[row[:n]] != s).any() or (n and not self.slot_live[s]):
                raise AssertionError(f"page pool: slot {s}'s page-table row disagrees with the owners")
        live = int(self.slot_live.sum())
        if live + self.num_free_slots != self.max_seqs or self.slot_live[self.free_slots[: self.num_free_slots]].any():
            raise AssertionError("page pool: slot free list and live slots disagree")

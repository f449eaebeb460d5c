"""Paged KV-cache bookkeeping: a free list of pages, a page table per sequence slot, slot free list.

Everything is a flat int32 array plus a few integer counters, never Python objects per page:

* ``free_pages`` [NP]: a stack; entries ``[0, num_free)`` are the free page ids. Allocation pops
  from the top (``num_free -= n``), freeing pushes (``num_free += n``).
* ``page_table`` [MB, MP]: ``page_table[s, j]`` = page holding positions ``j*P .. j*P+P-1`` of the
  sequence in slot ``s``; -1 = none. This array is the ``page_table`` input of a paged graph.
* ``pages_used`` [MB]: pages held by slot s (its first ``pages_used[s]`` columns are valid).
* ``owner`` [NP]: slot holding each page, -1 = free (catches double allocation and leaks).
* ``free_slots`` [MB] with ``num_free_slots``: the same stack discipline for sequence slots.

Two host classes share the slot logic and the counts:

* ``PagePool`` holds the page ids too (the torch backend feeds its ``page_table`` to the graph).
* ``PageCounts`` holds only the counts (``num_free``, ``pages_used``): the mega-kernel and interpreter
  backends keep the page ids on the device (task kind page_alloc, docs/SERVING.md "The device free
  list"), and the host needs just the numbers to admit requests. Each release is also queued for the
  next pass (``take_releases``: the pass's ``release_slots`` flags, which tell page_alloc to push that
  slot's pages back). The device applies a pass's releases, then its allocations, in slot order; the
  scheduler drives the host pool in the same order, so a ``PagePool`` holds the very ids the device
  computes (tests/taskgraph/test_page_alloc.py).

The host is the only writer of these objects; every mutation checks its invariants, and ``check()``
verifies all of them at once (used by tests after every step).
"""

from __future__ import annotations

import numpy as np

from mpk_dist.errors import InputError


class PageCounts:
    """Slots and page COUNTS of one paged KV cache (shared by all layers and ranks); no page ids.

    ``grow`` and ``release_slot`` move only numbers; ``take_releases`` hands the slots released since
    the last pass to that pass (the device's page_alloc frees their pages)."""

    def __init__(self, num_pages: int, page_size: int, max_seqs: int, max_pages_per_seq: int):
        for name, v in (("num_pages", num_pages), ("page_size", page_size), ("max_seqs", max_seqs),
                        ("max_pages_per_seq", max_pages_per_seq)):
            if int(v) < 1:
                raise InputError(f"page pool {name}: expected >= 1, got {v}")
        self.num_pages, self.page_size = int(num_pages), int(page_size)
        self.max_seqs, self.max_pages_per_seq = int(max_seqs), int(max_pages_per_seq)
        self.num_free = self.num_pages
        self.pages_used = np.zeros(self.max_seqs, dtype=np.int32)
        # Stacks pop from the end: reverse order so slot 0 is handed out first.
        self.free_slots = np.arange(self.max_seqs - 1, -1, -1, dtype=np.int32)
        self.num_free_slots = self.max_seqs
        self.slot_live = np.zeros(self.max_seqs, dtype=bool)
        self.released = np.zeros(self.max_seqs, dtype=np.int32)  # released since the last pass (flags)

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
        """Return all of the slot's pages to the free list, then the slot itself; the release is
        queued for the next pass (when the slot held pages: the device refuses to release an empty slot,
        which is what a page released twice looks like)."""
        self._check_live(slot)
        if self.released[slot]:
            # a second request in this slot finished before any pass carried the first release: the
            # device would free only the second one's pages (no pass can run in between in the scheduler)
            raise AssertionError(f"page pool: slot {slot} released twice before a pass took the first release")
        n = int(self.pages_used[slot])
        self._push(slot, n)
        self.num_free += n
        self.pages_used[slot] = 0
        self.slot_live[slot] = False
        self.free_slots[self.num_free_slots] = slot
        self.num_free_slots += 1
        self.released[slot] = n > 0  # a slot that never got a page has nothing for the device to free

    def take_releases(self) -> np.ndarray:
        """The slots released since the last call, as int32 flags [max_seqs] (a pass's ``release_slots``)."""
        out, self.released = self.released, np.zeros(self.max_seqs, dtype=np.int32)
        return out

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
        self._pop(slot, have, n)
        self.num_free -= n
        self.pages_used[slot] = need

    def _push(self, slot: int, n: int) -> None:
        """Hook: the slot's ``n`` pages go back on the free stack (ids: PagePool)."""

    def _pop(self, slot: int, have: int, n: int) -> None:
        """Hook: ``n`` pages off the free stack into the slot's columns ``have..have+n-1`` (ids: PagePool)."""

    def _check_live(self, slot: int) -> None:
        if not (0 <= slot < self.max_seqs) or not self.slot_live[slot]:
            raise InputError(f"page pool slot: expected a slot in use (0..{self.max_seqs - 1}), got {slot}")

    def check(self) -> None:
        """Verify the count invariants: free + held pages = all pages; slots consistent."""
        held = int(self.pages_used.sum())
        if held + self.num_free != self.num_pages:
            raise AssertionError(f"page pool: {self.num_pages - held - self.num_free} pages leaked")
        if (self.pages_used[~self.slot_live] != 0).any():
            raise AssertionError("page pool: a free slot holds pages")
        live = int(self.slot_live.sum())
        if live + self.num_free_slots != self.max_seqs or self.slot_live[self.free_slots[: self.num_free_slots]].any():
            raise AssertionError("page pool: slot free list and live slots disagree")


class PagePool(PageCounts):
    """Pages and slots of one paged KV cache with the page ids (shared by all layers and ranks: same
    ids everywhere). Pops and pushes in the order of the device's page_alloc (tasks/page_alloc.py)."""

    def __init__(self, num_pages: int, page_size: int, max_seqs: int, max_pages_per_seq: int):
        super().__init__(num_pages, page_size, max_seqs, max_pages_per_seq)
        # Stacks pop from the end: reverse order so page 0 is handed out first.
        self.free_pages = np.arange(self.num_pages - 1, -1, -1, dtype=np.int32)
        self.page_table = np.full((self.max_seqs, self.max_pages_per_seq), -1, dtype=np.int32)
        self.owner = np.full(self.num_pages, -1, dtype=np.int32)

    def _push(self, slot: int, n: int) -> None:
        """The slot's pages onto the free stack in column order (its last page ends on top)."""
        pages = self.page_table[slot, :n]
        assert (self.owner[pages] == slot).all(), f"slot {slot}: page table names pages it does not own"
        self.owner[pages] = -1
        self.free_pages[self.num_free: self.num_free + n] = pages
        self.page_table[slot, :n] = -1

    def _pop(self, slot: int, have: int, n: int) -> None:
        """The top ``n`` pages, top first, into columns ``have..have+n-1``."""
        pages = self.free_pages[self.num_free - n: self.num_free][::-1].copy()
        assert (self.owner[pages] == -1).all(), f"pages {pages[self.owner[pages] != -1].tolist()} allocated twice"
        self.owner[pages] = slot
        self.page_table[slot, have: have + n] = pages

    def check(self) -> None:
        """Verify every invariant: each page is free xor owned by exactly one live slot's table."""
        check_page_ids(self.free_pages, self.num_free, self.page_table, self.pages_used, self.owner, self.slot_live)
        super().check()


def check_page_ids(free_pages: np.ndarray, num_free: int, page_table: np.ndarray, pages_used: np.ndarray,
                   owner: np.ndarray, live: np.ndarray) -> None:
    """AssertionError unless each page is free xor in exactly one live slot's page-table row, and the
    owners agree: the invariants of a ``PagePool`` and of the device allocator's state (whose rows may
    outnumber the host's slots: ``live`` is False there)."""
    free = free_pages[:num_free]
    if len(np.unique(free)) != num_free:
        raise AssertionError("page pool: a page is on the free list twice")
    if (owner[free] != -1).any():
        raise AssertionError("page pool: a free page has an owner")
    held = np.concatenate([page_table[s, : pages_used[s]] for s in range(len(pages_used))])
    if len(np.unique(held)) != len(held):
        raise AssertionError("page pool: a page is in two page-table entries")
    if len(held) + num_free != len(owner):
        raise AssertionError(f"page pool: {len(owner) - len(held) - num_free} pages leaked")
    for s in range(len(pages_used)):
        row, n = page_table[s], int(pages_used[s])
        if (row[n:] != -1).any() or (owner[row[:n]] != s).any() or (n and not live[s]):
            raise AssertionError(f"page pool: slot {s}'s page-table row disagrees with the owners")


def check_device_pages(states: list[dict[str, np.ndarray]], pool: PageCounts) -> None:
    """AssertionError unless every rank's device allocator state (``tasks.page_alloc.STATE_BUFFERS`` by
    name, after a pass) is the same, keeps the ``PagePool`` invariants, and has the host's counts:
    ``num_free`` and each slot's ``pages_used`` (rows past the host's slots hold nothing)."""
    ref = states[0]
    for r, st in enumerate(states[1:], start=1):
        for name, a in st.items():
            if not np.array_equal(a, ref[name]):
                raise AssertionError(f"device pages: rank {r}'s {name} differs from rank 0's (ranks must agree)")
    used, mb = ref["pages_used"].reshape(-1), pool.max_seqs
    live = np.zeros(len(used), dtype=bool)
    live[:mb] = pool.slot_live
    check_page_ids(ref["free_pages"].reshape(-1), int(ref["num_free"].reshape(-1)[0]),
                   ref["page_table"].reshape(len(used), -1), used, ref["page_owner"].reshape(-1), live)
    if int(ref["num_free"].reshape(-1)[0]) != pool.num_free or not np.array_equal(used[:mb], pool.pages_used) \
            or used[mb:].any():
        raise AssertionError(f"device pages: expected the host's counts (free {pool.num_free}, used "
                             f"{pool.pages_used.tolist()}), got free {int(ref['num_free'].reshape(-1)[0])}, used "
                             f"{used.tolist()}")

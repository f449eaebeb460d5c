"""page_alloc: the paged KV cache's page allocator, on the device (docs/SERVING.md "The device free list").

One task per step (one block), right after step_begin: before any task reads the page table, it
updates the allocator state that lives in device buffers of the paged program:

* ``FREE_PAGES`` [NP] a stack (entries [0, NUM_FREE) are free page ids) and ``NUM_FREE`` [1];
* ``PAGE_TABLE`` [MB, MP]: ``PAGE_TABLE[s, j]`` = page of positions j*P .. j*P+P-1 of slot s, -1 = none;
* ``PAGES_USED`` [MB]: pages slot s holds (its first PAGES_USED[s] columns);
* ``OWNER`` [NP]: the slot holding each page, -1 = free (catches a page released twice).

from the pass's inputs: ``RELEASE`` [MB] (host-written; nonzero = the request in slot s finished
since the last pass: its pages go back) and the pass's tokens (``SLOTS`` [N], ``POSITIONS`` [N]): a
slot's new length is its highest position in the pass + 1, so it holds exactly the pages its tokens
write. The rule, in slot order so every TP rank computes the same page ids without talking:

1. for s = 0..MB-1 with RELEASE[s]: push its pages (column order) onto the stack, clear its row;
2. for s = 0..MB-1: pop pages (top first, one per new column) until it holds ceil(len / P).

This is exactly ``serving.pages.PagePool`` driven in slot order (``release_slot`` then ``grow``),
so the host keeps only a count (``serving.pages.PageCounts``) and still admits by the same numbers.
Faults (the CUDA body records them in the watchdog's error record, ``FAULT_CODES``; the CPU
reference raises ``PageAllocError`` with the same text, ``fault_message``): the stack runs dry, a
release of a slot holding no pages or of a page it does not own (a page released twice), a slot
longer than its page-table row. The CPU reference checks before it writes (a popped page that is still
owned, found while popping, is the one exception); the kernel aborts on any fault.
"""

from __future__ import annotations

import numpy as np
import torch

from mpk_dist.errors import InputError
from mpk_dist.taskgraph.tasks.base import Access, ArgSpec, ParamSpec, TaskKind, TileContext

FAULT_EMPTY, FAULT_RELEASE, FAULT_TOO_LONG = 6, 7, 8
"""Watchdog error codes of the three faults (csrc/runtime/watchdog.cuh kErrPagesExhausted,
kErrPageRelease, kErrPageTableFull; tests/runtime/test_pass_begin.py checks they agree)."""

FAULT_NAMES = {FAULT_EMPTY: "page pool empty", FAULT_RELEASE: "page released twice",
               FAULT_TOO_LONG: "page table full"}
"""Short names (mpk_dist.runtime.params.ERROR_CODES takes them)."""

HEADER_WORDS = 8
"""Shared-memory words the CUDA body keeps before its per-slot arrays (the fault record;
kPageHeaderWords in page_alloc.cuh)."""

STATE_BUFFERS = ("free_pages", "num_free", "page_table", "pages_used", "page_owner")
"""The allocator's device buffers (kind ``state``), in argument order FREE_PAGES .. OWNER."""


class PageAllocError(InputError):
    """page_alloc found the allocator state or the pass's release flags inconsistent."""


def fault_message(code: int, slot: int, seen: int, expected: int) -> str:
    """The error text of a page_alloc fault; ``seen`` / ``expected`` as the error record holds them
    (empty: free pages / pages needed; release: page id (-1 = none held) / its owner; too long:
    pages needed / page-table columns)."""
    if code == FAULT_EMPTY:
        return (f"page_alloc: expected {expected} free pages for slot {slot}, got {seen} on the free stack; the host "
                "admits only what its reservation covers, so host and device page counts disagree (a pass's release "
                "flags were lost or a page leaked)")
    if code == FAULT_RELEASE:
        what = ("it holds no pages" if seen < 0 else
                f"its page {seen} is owned by {'no slot (free)' if expected < 0 else f'slot {expected}'}")
        return (f"page_alloc: expected released slot {slot} to own its pages, got {what}: a page released twice "
                "(a release flag repeated for a slot already released) or a corrupt page table")
    if code == FAULT_TOO_LONG:
        return (f"page_alloc: expected at most {expected} pages (the page-table row) for slot {slot}, got a position "
                f"needing {seen}; keep prompt + output within max_seq_len")
    return f"page_alloc: unknown fault code {code}"


def initial_state(num_pages: int, rows: int, max_pages: int) -> dict[str, np.ndarray]:
    """The allocator's state at server start (int32 arrays by buffer name): every page free, stacked
    so page 0 is popped first (as PagePool), empty page-table rows."""
    return {"free_pages": np.arange(num_pages - 1, -1, -1, dtype=np.int32),
            "num_free": np.array([num_pages], np.int32),
            "page_table": np.full((rows, max_pages), -1, np.int32),
            "pages_used": np.zeros(rows, np.int32),
            "page_owner": np.full(num_pages, -1, np.int32)}


def smem_words(batch: int, max_seqs: int) -> int:
    """Shared-memory int32 words of the CUDA body (page_alloc_smem_words in page_alloc.cuh)."""
    return HEADER_WORDS + 4 * max_seqs + 2 * batch


def slot_pages(slots: np.ndarray, positions: np.ndarray, max_seqs: int, page_size: int) -> np.ndarray:
    """Pages each slot needs after the pass: (highest position of its tokens + 1) / P rounded up; 0 for
    slots without a token (padding tokens have slot -1)."""
    need = np.zeros(max_seqs, np.int64)
    live = slots >= 0
    np.maximum.at(need, slots[live].astype(np.int64), positions[live].astype(np.int64) // page_size + 1)
    return need


def allocate(state: dict[str, np.ndarray], release: np.ndarray, need: np.ndarray, max_pages: int) -> None:
    """Apply one pass's releases and allocations to ``state`` (arrays of ``initial_state``, updated in
    place) by the slot-order rule of the module docstring; raises PageAllocError before any write."""
    free, table, used, owner = state["free_pages"], state["page_table"], state["pages_used"], state["page_owner"]
    nf = int(state["num_free"][0])
    rel = [s for s in range(len(release)) if release[s]]
    for s in rel:  # checks first: a fault leaves the state untouched
        n = int(used[s])
        pages = table[s, :n]
        if n == 0:
            raise PageAllocError(fault_message(FAULT_RELEASE, s, -1, -1))
        bad = [int(p) for p in pages if not 0 <= p < len(owner) or owner[p] != s]
        if bad:
            raise PageAllocError(fault_message(FAULT_RELEASE, s, bad[0], int(owner[bad[0]]) if 0 <= bad[0] < len(owner)
                                               else -1))
    top = nf + sum(int(used[s]) for s in rel)
    for s in range(len(need)):
        have = 0 if release[s] else int(used[s])
        if need[s] > max_pages:
            raise PageAllocError(fault_message(FAULT_TOO_LONG, s, int(need[s]), max_pages))
        n = int(need[s]) - have
        if n > top:
            raise PageAllocError(fault_message(FAULT_EMPTY, s, top, n))
        top -= max(0, n)
    for s in rel:
        n = int(used[s])
        free[nf: nf + n] = table[s, :n]
        owner[table[s, :n]] = -1
        nf += n
        table[s, :n] = -1
        used[s] = 0
    for s in range(len(need)):
        have, n = int(used[s]), int(need[s]) - int(used[s])
        if n <= 0:
            continue
        pages = free[nf - n: nf][::-1].copy()  # top of the stack first, as PagePool.grow
        if (owner[pages] != -1).any():
            p = int(pages[owner[pages] != -1][0])
            raise PageAllocError(fault_message(FAULT_RELEASE, s, p, int(owner[p])))
        nf -= n
        owner[pages] = s
        table[s, have: have + n] = pages
        used[s] = have + n
    state["num_free"][0] = nf


class PageAlloc(TaskKind):
    """Release finished slots' pages and take pages for the pass's new positions (one tile)."""

    name = "page_alloc"
    opcode = 25
    doc = "push the pages of RELEASE slots, then pop pages for each slot's new positions, in slot order"
    args = (
        ArgSpec("RELEASE", "r", "i32 [MB] host-written: nonzero = the slot's request finished, its pages go back"),
        ArgSpec("POSITIONS", "r", "i32 [N] positions of the pass's tokens (step_begin)"),
        ArgSpec("SLOTS", "r", "i32 [N] slot of each token; -1 = padding"),
        ArgSpec("FREE_PAGES", "rw", "i32 [NP] free-page stack, entries [0, NUM_FREE) free"),
        ArgSpec("NUM_FREE", "rw", "i32 [1] pages on the stack"),
        ArgSpec("PAGE_TABLE", "rw", "i32 [MB, MP] page ids, -1 = none"),
        ArgSpec("PAGES_USED", "rw", "i32 [MB] pages each slot holds"),
        ArgSpec("OWNER", "rw", "i32 [NP] slot holding each page, -1 = free"),
    )
    params = (
        ParamSpec("BATCH", "N, tokens in the pass"),
        ParamSpec("MAX_SEQS", "MB, slots (page-table rows)"),
        ParamSpec("MAX_PAGES", "MP, page-table columns"),
        ParamSpec("NUM_PAGES", "NP, pages in a pool"),
        ParamSpec("PAGE_SIZE", "P, positions per page"),
    )

    def _view(self, t: TileContext, name: str, n: int) -> torch.Tensor:
        return t.buf(name)[t.off(name): t.off(name) + n]

    def run_tile(self, t: TileContext) -> None:
        B, MB, MP, NP = t.p("BATCH"), t.p("MAX_SEQS"), t.p("MAX_PAGES"), t.p("NUM_PAGES")
        sizes = {"FREE_PAGES": NP, "NUM_FREE": 1, "PAGE_TABLE": MB * MP, "PAGES_USED": MB, "OWNER": NP}
        views = {k: self._view(t, k, n) for k, n in sizes.items()}
        state = {b: views[k].numpy().copy() for b, k in zip(STATE_BUFFERS, sizes)}
        state["page_table"] = state["page_table"].reshape(MB, MP)
        slots, pos = (self._view(t, k, B).numpy() for k in ("SLOTS", "POSITIONS"))
        if (slots >= MB).any():
            raise PageAllocError(f"page_alloc: expected token slots < {MB}, got {int(slots.max())}")
        allocate(state, self._view(t, "RELEASE", MB).numpy(), slot_pages(slots, pos, MB, t.p("PAGE_SIZE")), MP)
        for b, k in zip(STATE_BUFFERS, sizes):
            views[k].copy_(torch.from_numpy(state[b].reshape(-1)))

    def accesses(self, t: TileContext) -> list[Access]:
        B, MB, MP, NP = t.p("BATCH"), t.p("MAX_SEQS"), t.p("MAX_PAGES"), t.p("NUM_PAGES")
        out = [Access(0, "r", t.off("RELEASE") + np.arange(MB)), Access(1, "r", t.off("POSITIONS") + np.arange(B)),
               Access(2, "r", t.off("SLOTS") + np.arange(B))]
        # NOTE: the whole state, read and written: which entries depends on the pass (a superset is safe).
        for i, (name, n) in enumerate((("FREE_PAGES", NP), ("NUM_FREE", 1), ("PAGE_TABLE", MB * MP),
                                       ("PAGES_USED", MB), ("OWNER", NP)), start=3):
            idx = t.off(name) + np.arange(n)
            out += [Access(i, "r", idx), Access(i, "w", idx)]
        return out


KIND = PageAlloc()

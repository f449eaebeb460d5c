"""Lowering of the device page allocator of paged graphs (task kind page_alloc; docs/SERVING.md
"The device free list").

A paged graph's ``page_table`` is a graph input (the torch backend feeds it from the host pool); the
task-graph programs keep it in a ``state`` buffer instead, next to the rest of the allocator state
(``tasks.page_alloc.STATE_BUFFERS``), and add one host-written input, ``release_slots`` [MB]. One
page_alloc task runs right after step_begin: it reads ``positions`` (written by step_begin: that
read is its wait on step_begin, so in a persistent launch it also runs after pass_begin copied the
pass's ``release_slots`` and ``seq_slots`` in) and writes the page table that every kv tile and
attention tile of the step then reads (their page-table footprints make them wait on it). The next
step's page_alloc comes after this step's readers through step_begin's wait on argmax_select.
"""

from __future__ import annotations

from mpk_dist.taskgraph.lowering import Lowerer, _all_fp
from mpk_dist.taskgraph.tasks import BY_NAME
from mpk_dist.taskgraph.tasks.page_alloc import STATE_BUFFERS

RELEASE_INPUT = "release_slots"
"""The per-pass input of the allocator: i32 [MB], nonzero = release that slot's pages first."""


def is_paged(lw: Lowerer) -> bool:
    """True for a paged graph (it has a page table)."""
    return "page_table" in lw.g.tensors


def declare_page_state(lw: Lowerer) -> None:
    """The allocator's state buffers (page_table is declared with the graph's tensors) and its input."""
    MB, _ = lw.g.tensors["page_table"].shape
    NP = lw.g.meta["paged"].num_pages
    for name, shape in (("free_pages", (NP,)), ("num_free", (1,)), ("pages_used", (MB,)), ("page_owner", (NP,))):
        lw.p.buffer(name, shape, "i32", "state")
    lw.p.buffer(RELEASE_INPUT, (MB,), "i32", "input")


def page_alloc(lw: Lowerer) -> None:
    """The one page_alloc task of a step (after step_begin, before any reader of the page table)."""
    p, B = lw.p, lw.B
    MB, MP = lw.g.tensors["page_table"].shape
    spec = lw.g.meta["paged"]
    ids = {n: p.id(n) for n in (RELEASE_INPUT, "positions", "seq_slots", *STATE_BUFFERS)}
    t = p.op("page_alloc", BY_NAME["page_alloc"], None, "")
    t.add_tile({"RELEASE": (ids[RELEASE_INPUT], 0, MB), "POSITIONS": (ids["positions"], 0, B),
                "SLOTS": (ids["seq_slots"], 0, B), "FREE_PAGES": (ids["free_pages"], 0, spec.num_pages),
                "NUM_FREE": (ids["num_free"], 0, 1), "PAGE_TABLE": (ids["page_table"], 0, MB * MP),
                "PAGES_USED": (ids["pages_used"], 0, MB), "OWNER": (ids["page_owner"], 0, spec.num_pages)},
               {"BATCH": B, "MAX_SEQS": MB, "MAX_PAGES": MP, "NUM_PAGES": spec.num_pages,
                "PAGE_SIZE": spec.page_size})
    state = [ids[n] for n in STATE_BUFFERS]
    t.reads = [_all_fp(ids["positions"], p, 1), *(_all_fp(b, p, 1) for b in state)]
    t.writes = [_all_fp(b, p, 1) for b in state]

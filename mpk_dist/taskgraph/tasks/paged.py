"""Addressing shared by the paged task kinds (qkv_prep_paged, paged_attention).

Position p of the sequence in slot s lives in page ``PAGE_TABLE[s * MAX_PAGES + p // PAGE_SIZE]``,
row ``p % PAGE_SIZE``; element d of kv head h of it is at
``base + page * PAGE_STRIDE + (p % PAGE_SIZE) * POS_STRIDE + d`` where the argument's offset (base)
selects head h. A pool is [NUM_PAGES, PAGE_SIZE, Hkv, D], so PAGE_STRIDE = PAGE_SIZE * Hkv * D and
POS_STRIDE = Hkv * D.
"""

from __future__ import annotations

import numpy as np

from mpk_dist.errors import InputError
from mpk_dist.taskgraph.tasks.base import ParamSpec, TileContext

PAGE_PARAMS = (
    ParamSpec("PAGE_SIZE", "P, positions per page"),
    ParamSpec("PAGE_STRIDE", "elements between pages of a pool (P Hkv D)"),
    ParamSpec("POS_STRIDE", "elements between positions inside a page (Hkv D)"),
    ParamSpec("MAX_PAGES", "MP, columns of the page table (pages one sequence may hold)"),
    ParamSpec("NUM_PAGES", "NP, pages in a pool (bounds check of page ids)"),
)
"""Page-addressing parameters, in this order, appended to both paged kinds' parameters."""


def token_inputs(t: TileContext) -> tuple[list[int], list[int]]:
    """(positions, slots) of the BATCH tokens of the pass."""
    B = t.p("BATCH")
    pos = t.buf("POSITIONS")[t.off("POSITIONS"): t.off("POSITIONS") + B].tolist()
    slots = t.buf("SLOTS")[t.off("SLOTS"): t.off("SLOTS") + B].tolist()
    return pos, slots


def page_rows(t: TileContext, slot: int, positions: np.ndarray) -> np.ndarray:
    """Element offset (relative to a pool argument's base) of each position of sequence ``slot``."""
    P, mp = t.p("PAGE_SIZE"), t.p("MAX_PAGES")
    if int(positions.max()) // P >= mp:
        raise InputError(f"position: expected < {P * mp} (page table width x page size), got {int(positions.max())}")
    table = t.buf("PAGE_TABLE")[t.off("PAGE_TABLE") + slot * mp: t.off("PAGE_TABLE") + (slot + 1) * mp]
    pages = table[positions // P].numpy().astype(np.int64)
    if (pages < 0).any() or (pages >= t.p("NUM_PAGES")).any():
        raise InputError(f"page table row {slot}: expected page ids in [0, {t.p('NUM_PAGES')}) for positions "
                         f"up to {int(positions.max())}, got {pages.tolist()}")
    return pages * t.p("PAGE_STRIDE") + (positions % P) * t.p("POS_STRIDE")


def table_reads(t: TileContext, pos: list[int], slots: list[int], prefix: bool) -> np.ndarray:
    """Flat PAGE_TABLE indices a tile reads: the column of each live token's position, or (``prefix``:
    attention) every column up to it (what paged_tokens_ok in qkv_prep_paged.cuh reads)."""
    P, mp, base = t.p("PAGE_SIZE"), t.p("MAX_PAGES"), t.off("PAGE_TABLE")
    idx = [base + s * mp + np.arange(0 if prefix else p // P, min(p // P, mp - 1) + 1)
           for s, p in zip(slots, pos) if s >= 0 and p >= 0]
    return np.unique(np.concatenate(idx)) if idx else np.zeros(0, np.int64)

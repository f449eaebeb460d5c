"""The rope table argument shared by the q/k prep kinds (qkv_prep, qkv_prep_paged, attention_prep,
attention_split_prep): ``ROPE`` = [rows, D/2, 2] bf16, row p = (cos, sin) of position p's angles
(mpk_dist.taskgraph.const_recipes). A kernel reads the row of its position instead of evaluating the trig;
it clamps the row to the table, and the interpreter refuses a position outside it."""

from __future__ import annotations

import numpy as np

from mpk_dist.backends import torch_ops as T
from mpk_dist.errors import InputError
from mpk_dist.taskgraph.tasks.base import Access, ArgSpec, TileContext

ROPE_ARG = ArgSpec("ROPE", "r", "bf16 [rows, D/2, 2] (cos, sin) per position (constant buffer, the rope table)")


def rope_rows(t: TileContext, pos, D: int, valid=None):
    """cos and sin [len(pos), D/2] (the table's dtype) of positions ``pos`` from the tile's ROPE argument.
    ``valid`` (bool per position, default all): a valid position outside the table is an InputError; the
    others (padding tokens) read the clamped row, as the kernels do."""
    rows = t.count("ROPE") // D
    p = np.asarray(pos, dtype=np.int64).reshape(-1)
    ok = np.ones(p.shape, bool) if valid is None else np.asarray(valid, bool).reshape(-1)
    bad = ok & ((p < 0) | (p >= rows))
    if bad.any():
        raise InputError(f"position: expected 0 <= pos < {rows} (the rope table's rows), got {p[bad].tolist()}")
    p = np.clip(p, 0, rows - 1)
    tab = t.buf("ROPE")[t.off("ROPE"): t.off("ROPE") + rows * D].view(rows, D // 2, 2)
    sel = tab[p]
    return sel[..., 0], sel[..., 1]


def apply_rope_rows(t: TileContext, x, pos, D: int, valid=None):
    """Rope of x [N, heads, D] at positions ``pos`` [N] with the table's cos / sin (as torch_ops.apply_rope);
    ``valid`` as in ``rope_rows``."""
    cos, sin = rope_rows(t, pos, D, valid)
    return T.apply_rope_cos_sin(x, cos.to(x.dtype), sin.to(x.dtype))


def rope_access(t: TileContext, index: int, pos, D: int):
    """Access record of the table rows a tile reads (positions ``pos``); ``index``: ROPE's argument index."""
    rows = t.count("ROPE") // D
    p = np.clip(np.asarray(pos, dtype=np.int64).reshape(-1), 0, max(rows - 1, 0))
    return Access(index, "r", np.concatenate([t.off("ROPE") + int(q) * D + np.arange(D) for q in p])
                  if p.size else np.zeros(0, np.int64))

"""Constant buffers that are made on the device that runs the program, from a recipe in the program's meta.

Why: the rope table holds cos / sin of every position's angles rounded to bf16, as the torch reference forms
them on the device it runs on (fp32 angle, the device's fp32 cos / sin, then bf16). The lowering ships host
values computed on the CPU (for the interpreter and for inspection); a CUDA session remakes the table on its
GPU, so the mega-kernel's rope uses the same cos / sin values as torch on that GPU, which the trig the kernel
evaluated before the table (CUDA's sincosf) also gave.

A recipe is plain JSON in the buffer's meta entry: ``{"name": "rope_table", "inv_freq": [...], "rows": S,
"dtype": "bf16"}``.
"""

from __future__ import annotations

import numpy as np
import torch

ROPE_TABLE = "rope_table"
"""Recipe name of the rope table: [rows, D/2, 2] in the activation dtype, row p = (cos, sin) of position p's D/2
angles."""


DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}
"""Recipe dtype names (the program's buffer dtypes) -> torch dtypes."""


def rope_table_recipe(inv_freq: np.ndarray, rows: int, dtype: str) -> dict:
    """The recipe of the rope table for fp32 inverse frequencies ``inv_freq`` [D/2], positions 0 .. rows-1 and the
    activation dtype ``dtype`` (cos / sin rounded to it; fp32 values are exact as Python floats, so the recipe
    round-trips through JSON)."""
    if dtype not in DTYPES:
        raise ValueError(f"rope table: expected an activation dtype in {sorted(DTYPES)}, got {dtype!r}")
    return {"name": ROPE_TABLE, "inv_freq": [float(v) for v in np.asarray(inv_freq, np.float32)], "rows": int(rows),
            "dtype": dtype}


def make(recipe: dict, device: torch.device | str) -> torch.Tensor:
    """The tensor a recipe describes, computed on ``device``."""
    from mpk_dist.backends import torch_ops as T

    if recipe.get("name") != ROPE_TABLE:
        raise ValueError(f"const recipe: expected name {ROPE_TABLE!r}, got {recipe.get('name')!r}")
    inv = torch.tensor(recipe["inv_freq"], dtype=torch.float32, device=device)
    return T.rope_table(inv, recipe["rows"], DTYPES[recipe["dtype"]])


def const_tensor(info: dict, host_data: np.ndarray, device: torch.device | str, dtype: torch.dtype) -> torch.Tensor:
    """A const buffer's contents on ``device`` as ``dtype``, in its declared shape: made there from its recipe
    when it has one (the buffer's meta entry ``info``), else the shipped host values."""
    shape = tuple(info["shape"])
    if info.get("recipe"):
        t = make(info["recipe"], device)
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise ValueError(f"const {info['name']}: its recipe made {tuple(t.shape)} {t.dtype}, "
                             f"expected {shape} {dtype}")
        return t
    return torch.from_numpy(np.ascontiguousarray(host_data)).to(device, dtype).reshape(shape)

"""The rope table (mpk_dist.taskgraph.const_recipes, tasks/rope_args.py): what the q/k prep kinds read instead of
evaluating the trig. Its rows are torch_ops.apply_rope's cos / sin, the recipe remakes the shipped values, and the
kinds' rope through the table is the reference rope bit for bit."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from mpk_dist.backends import torch_ops as T
from mpk_dist.errors import InputError
from mpk_dist.models.presets import get_preset
from mpk_dist.taskgraph import const_recipes as CR
from mpk_dist.taskgraph.tasks.base import TileContext
from mpk_dist.taskgraph.tasks.qkv_prep import KIND as QKV_PREP
from mpk_dist.taskgraph.tasks.rope_args import apply_rope_rows, rope_rows
from mpk_dist.taskgraph.testing import programs

D, ROWS = 64, 300
INV = T.rope_inv_freq(D, 1e6)


def _table_ctx(table: torch.Tensor) -> TileContext:
    """A qkv_prep tile whose only argument that matters is ROPE = ``table`` (flat)."""
    flat = table.reshape(-1)
    bufs = [flat if a.name == "ROPE" else None for a in QKV_PREP.args]
    counts = [flat.numel() if a.name == "ROPE" else 0 for a in QKV_PREP.args]
    return TileContext(QKV_PREP, bufs, [0] * len(bufs), counts, [0] * len(QKV_PREP.params), 0, 0, 1, lambda k: [bufs[k]])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_table_rows_are_the_reference_cos_sin(dtype):
    """Row p holds cos / sin of position p as apply_rope forms them (fp32 angle, then the activation dtype)."""
    tab = T.rope_table(INV, ROWS, dtype)
    pos = torch.tensor([0, 1, 77, ROWS - 1])
    cos, sin = T.rope_cos_sin(pos, INV, dtype)
    assert tab.shape == (ROWS, D // 2, 2) and tab.dtype == dtype
    assert torch.equal(tab[pos, :, 0], cos) and torch.equal(tab[pos, :, 1], sin)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rope_through_the_table_is_apply_rope_bitwise(dtype):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(5, 3, D, generator=g) * 3).to(dtype)
    pos = torch.tensor([0, 9, 150, 299, 42])
    got = apply_rope_rows(_table_ctx(T.rope_table(INV, ROWS, dtype)), x, pos, D)
    assert torch.equal(got, T.apply_rope(x, pos, INV))


def test_positions_outside_the_table_are_refused_unless_padding():
    ctx = _table_ctx(T.rope_table(INV, ROWS))
    with pytest.raises(InputError, match=r"0 <= pos < 300"):
        rope_rows(ctx, [5, ROWS], D)
    with pytest.raises(InputError, match=r"got \[-1\]"):
        rope_rows(ctx, [-1], D)
    cos, _ = rope_rows(ctx, [5, ROWS + 7], D, valid=[True, False])  # padding: the clamped row, as the kernels read
    assert torch.equal(cos[1], T.rope_table(INV, ROWS)[ROWS - 1, :, 0])


def test_recipe_round_trips_json_and_remakes_the_shipped_values():
    recipe = CR.rope_table_recipe(INV.numpy(), ROWS, "bf16")
    back = json.loads(json.dumps(recipe))
    assert back == recipe
    assert np.array_equal(np.asarray(back["inv_freq"], np.float32), INV.numpy())
    info = {"name": "rope_table", "shape": [ROWS, D // 2, 2], "recipe": back}
    host = T.rope_table(INV, ROWS).float().numpy()
    made = CR.const_tensor(info, host, "cpu", torch.bfloat16)
    assert torch.equal(made, T.rope_table(INV, ROWS))
    with pytest.raises(ValueError, match="expected"):
        CR.const_tensor(dict(info, shape=[ROWS + 1, D // 2, 2]), host, "cpu", torch.bfloat16)
    with pytest.raises(ValueError, match="activation dtype"):
        CR.rope_table_recipe(INV.numpy(), ROWS, "i32")


def test_programs_ship_the_table_with_its_recipe():
    """The compiled program's rope table: max_seq_len rows of the model's frequencies, in the activation dtype,
    its host values the recipe's."""
    cg = programs(get_preset("tiny"), 1)[0]
    info = next(b for b in cg.meta["buffers"] if b["name"] == "rope_table")
    assert info["kind"] == "const" and info["recipe"]["rows"] == cg.meta["max_seq_len"] == info["shape"][0]
    assert info["dtype"] == info["recipe"]["dtype"]
    made = CR.make(info["recipe"], "cpu")
    assert np.array_equal(made.float().numpy(), cg.consts["rope_table"])

"""Row pools (mpk_dist/runtime/row_pool.py): which wide batch-1 levels share their tiles' last rows, what the task
records carry for the kernel (csrc/tasks/row_pool.cuh), and that every row of a pooled op is summed exactly once."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from mpk_dist.errors import InputError
from mpk_dist.models.presets import get_preset
from mpk_dist.runtime.row_pool import MAX_PERCENT, chunk_rows, row_pool_plan
from mpk_dist.taskgraph.abi import ARG_COLS, EVENT_COLS, SIGNAL_COLS, TASK_COLS
from mpk_dist.taskgraph.compiler import compile_rank_programs
from mpk_dist.taskgraph.tasks import BY_OPCODE

SMS = 132
SMEM = 200 << 10  # a launch's dynamic shared memory, room for any staged row here


def _program(model: str, batch: int = 1):
    from mpk_dist.runtime.megakernel_backend import fusions_for_batch, fusions_from_env

    return compile_rank_programs(get_preset(model), tp=1, batch=batch, sms=SMS, max_seq_len=512,
                                 fuse=fusions_for_batch(fusions_from_env(True), batch), attn_splits="auto")[0]


@pytest.fixture(scope="module")
def qwen3_8b_b1():
    return _program("qwen3-8b")


def _op_name(cg, t: int) -> str:
    return cg.meta["ops"][int(cg.arrays["tasks"][t, TASK_COLS["OP_INDEX"]])]["name"].split(".")[-1]


def _pooled(cg, plan) -> dict[str, set[tuple[int, int]]]:
    """{op name (layer dropped): {(tiles, rows)}} of the pooled tasks."""
    out: dict = {}
    for t in np.flatnonzero(plan.tiles > 0).tolist():
        out.setdefault(_op_name(cg, t), set()).add((int(plan.tiles[t]), int(plan.rows[t])))
    return out


def _chunk_first(tile: int, rows: int, c: int, n: int, chunk: int) -> int:
    """The first row of chunk c relative to tile ``tile``'s first row: row_pool.cuh pool_chunk_first."""
    per_tile = rows // chunk
    return (c // per_tile - tile) * n + (n - rows) + (c % per_tile) * chunk


def test_the_8b_presets_wide_levels_pool_and_qkv_does_not(qwen3_8b_b1):
    """qwen3-8b batch 1 at 512 threads: at 50% o_proj, gate|up and down pool in every layer (16 rows of o_proj's and
    down's 32, 48 of gate|up's 96 columns); qkv (each attention tile waits on its own heads' tiles), the attention
    and the lm_head never do. At 15% only gate|up (one chunk of 8 columns: o_proj's and down's 15% is under their
    16-row chunk)."""
    cg = qwen3_8b_b1
    plan = row_pool_plan(cg, 512, 50, SMEM)
    assert _pooled(cg, plan) == {"o_proj": {(128, 16)}, "down_proj": {(128, 16)}, "gate_up_proj": {(128, 48)}}
    assert plan.ops == 3 * cg.meta["num_layers"]
    assert _pooled(cg, row_pool_plan(cg, 512, 15, SMEM)) == {"gate_up_proj": {(128, 8)}}
    # one counter per op, each op's tiles numbered 0..tiles-1 in the order of their weight rows
    tasks = cg.arrays["tasks"]
    for c in range(plan.ops):
        tiles = np.flatnonzero(plan.counter == c)
        assert len({int(tasks[t, TASK_COLS["OP_INDEX"]]) for t in tiles}) == 1
        assert sorted(plan.tile[tiles].tolist()) == list(range(len(tiles)))
        kind = BY_OPCODE[int(tasks[tiles[0], TASK_COLS["OPCODE"]])]
        w = cg.arrays["args"][tasks[tiles, TASK_COLS["ARG_BEGIN"]] + kind.arg_index("W"), ARG_COLS["OFFSET"]]
        assert np.array_equal(np.argsort(w), np.argsort(plan.tile[tiles]))
    assert (plan.counter[plan.tiles == 0] == -1).all()
    # 30%: gate|up pools 3 chunks (24 of 96 columns); at 90% o_proj and down still keep one chunk of their two static
    assert _pooled(cg, row_pool_plan(cg, 512, 30, SMEM))["gate_up_proj"] == {(128, 24)}
    assert _pooled(cg, row_pool_plan(cg, 512, 90, SMEM))["down_proj"] == {(128, 16)}


def test_every_row_of_a_pooled_op_is_summed_once(qwen3_8b_b1):
    """Each tile's static rows [0, n - rows) and the chunks the kernel hands out (pool_chunk_first, whichever tile
    claims them) cover the op's tiles x n rows exactly once."""
    cg = qwen3_8b_b1
    for percent in (15, 50, MAX_PERCENT):
        plan = row_pool_plan(cg, 512, percent, SMEM)
        for t in np.flatnonzero(plan.counter == 0).tolist()[:1] + np.flatnonzero(plan.counter == 1).tolist()[:1]:
            kind = BY_OPCODE[int(cg.arrays["tasks"][t, TASK_COLS["OPCODE"]])]
            n_tile = int(cg.arrays["params"][int(cg.arrays["tasks"][t, TASK_COLS["PARAM_BEGIN"]]) +
                                             kind.param_index("N_TILE")])
            n = n_tile // 2 if kind.name == "norm_linear_silu" else n_tile
            tiles, rows, chunk = int(plan.tiles[t]), int(plan.rows[t]), chunk_rows(kind.name, 512)
            assert rows % chunk == 0 and 0 < rows < n
            count = np.zeros(tiles * n, np.int64)
            for i in range(tiles):
                count[i * n:i * n + n - rows] += 1
            claimer = int(plan.tile[t])  # any tile reaches a chunk from its own rows
            for c in range(tiles * rows // chunk):
                first = claimer * n + _chunk_first(claimer, rows, c, n, chunk)
                count[first:first + chunk] += 1
            assert (count == 1).all(), (kind.name, percent)


def test_off_and_bad_percents(qwen3_8b_b1):
    """0 pools nothing; a percent above MAX_PERCENT is refused; MPK_ROW_POOL reaches the session's keywords only
    when set above 0, and a bad value names what is accepted."""
    from mpk_dist.runtime.megakernel_backend import tuning_from_env

    plan = row_pool_plan(qwen3_8b_b1, 512, 0, SMEM)
    assert plan.ops == 0 and not plan.tiles.any()
    with pytest.raises(ValueError, match="percent: expected 0..90"):
        row_pool_plan(qwen3_8b_b1, 512, 91, SMEM)
    assert tuning_from_env(512, {"MPK_ROW_POOL": "20"})["row_pool"] == 20
    assert "row_pool" not in tuning_from_env(512, {"MPK_ROW_POOL": "0"})
    assert "row_pool" not in tuning_from_env(512, {})
    for bad in ("-5", "95", "half"):
        with pytest.raises(InputError, match="MPK_ROW_POOL: expected a percent of each tile's rows, 0..90"):
            tuning_from_env(512, {"MPK_ROW_POOL": bad})


def test_an_op_whose_tiles_are_not_uniform_or_are_waited_on_alone_does_not_pool(qwen3_8b_b1):
    """Moving one o_proj tile's weight rows, or giving its tiles' event another signaller, takes that op (only) out."""
    cg = copy.deepcopy(qwen3_8b_b1)
    base = row_pool_plan(cg, 512, 50, SMEM)
    tasks = cg.arrays["tasks"]
    o_proj = [t for t in np.flatnonzero(base.counter == 0).tolist()]
    assert _op_name(cg, o_proj[0]) == "o_proj"
    kind = BY_OPCODE[int(tasks[o_proj[0], TASK_COLS["OPCODE"]])]
    moved = copy.deepcopy(cg)
    moved.arrays["args"][tasks[o_proj[5], TASK_COLS["ARG_BEGIN"]] + kind.arg_index("W"), ARG_COLS["OFFSET"]] += 4096
    plan = row_pool_plan(moved, 512, 50, SMEM)
    assert (plan.tiles[o_proj] == 0).all() and plan.ops == base.ops - 1
    shared = copy.deepcopy(cg)
    e = int(shared.arrays["signals"][tasks[o_proj[0], TASK_COLS["SIGNAL_BEGIN"]], SIGNAL_COLS["EVENT"]])
    shared.arrays["events"][e, EVENT_COLS["TRIGGERS"]] += 1
    plan = row_pool_plan(shared, 512, 50, SMEM)
    assert (plan.tiles[o_proj] == 0).all() and plan.ops == base.ops - 1


def test_pair_tiles_pool_only_where_their_staged_row_fits(qwen3_8b_b1):
    """gate|up's pool reuses the normalised row its static part staged: with less shared memory than the row and the
    tile's sums need (K = 4096: 8 KB + 256 B scratch + 192 sums), those ops drop out and the others stay."""
    cg = qwen3_8b_b1
    assert set(_pooled(cg, row_pool_plan(cg, 512, 50, 8 << 10))) == {"o_proj", "down_proj"}
    assert "gate_up_proj" in _pooled(cg, row_pool_plan(cg, 512, 50, 256 + 8192 + 2 * 192))


def test_batch_2_pools_nothing():
    """Pools are for batch 1 (the pool loops sum one row a warp; larger batches run other tiles)."""
    cg = _program("qwen3-0.6b", batch=2)
    assert row_pool_plan(cg, 256, 30, SMEM).ops == 0


def test_records_carry_the_pool(qwen3_8b_b1):
    """build_records writes each pooled task's tiles, tile index, rows and its op's counter address (REC_POOL_*);
    every other task's words stay zero, and a plan without enough counter addresses is refused."""
    from mpk_dist.runtime.task_records import (REC_POOL_COUNTER, REC_POOL_ROWS, REC_POOL_TILE, REC_POOL_TILES,
                                               build_records)

    cg = qwen3_8b_b1
    plan = row_pool_plan(cg, 512, 50, SMEM)
    addr = np.zeros(cg.arrays["args"].shape[0], np.uint64)
    counters = (1 << 40) + 4 * np.arange(plan.ops, dtype=np.uint64)
    rec, task_rec = build_records(cg, addr, row_pool=plan, pool_counter_addr=counters)
    mine = rec[task_rec]  # back in task order
    assert np.array_equal(mine[:, REC_POOL_TILES], plan.tiles) and np.array_equal(mine[:, REC_POOL_ROWS], plan.rows)
    assert np.array_equal(mine[:, REC_POOL_TILE], plan.tile)
    got = np.ascontiguousarray(mine[:, REC_POOL_COUNTER:REC_POOL_COUNTER + 2]).view(np.uint64).ravel()
    pooled = plan.tiles > 0
    assert np.array_equal(got[pooled], counters[plan.counter[pooled]]) and not got[~pooled].any()
    plain, _ = build_records(cg, addr)
    assert not plain[:, REC_POOL_TILES:REC_POOL_COUNTER + 2].any()
    with pytest.raises(InputError, match=f"expected {plan.ops} row-pool counter addresses, got 3"):
        build_records(cg, addr, row_pool=plan, pool_counter_addr=counters[:3])

"""Fused linears (mpk_dist.taskgraph.fusion): the pass rewrites only what it should, the fused graph
computes exactly what the unfused one does (fp32 against the torch backend over random schedules,
bf16 bit for bit against the unfused interpreter), and every dependency edge of a fused layer is
necessary."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mpk_dist.errors import InputError
from mpk_dist.models import build_graph
from mpk_dist.models.presets import get_preset
from mpk_dist.taskgraph import fusion
from mpk_dist.taskgraph.interpreter import Interpreter
from mpk_dist.taskgraph.testing import (fp32, max_rel_err, programs, reference,
                                        uncaught_edge_deletions, weights)

SCHEDULES = 8
LONG, SHORT = 12, 2


def _layer_kinds(cg, layer: int) -> list[str]:
    return [o["kind"] for o in cg.meta["ops"] if o["layer"] == layer]


def test_fuse_off_keeps_the_program_identical():
    cfg = fp32("tiny")
    a, b = programs(cfg, 2), programs(cfg, 2, fuse=False)
    for x, y in zip(a, b):
        assert x.meta == y.meta
        for k in x.arrays:
            np.testing.assert_array_equal(x.arrays[k], y.arrays[k])


def test_tp1_layer_is_four_fused_linears_and_two_attention_ops():
    (cg,) = programs(fp32("tiny"), 1, fuse=True)
    assert _layer_kinds(cg, 0) == ["norm_linear", "qkv_prep", "attention", "linear_residual", "norm_linear",
                                   "silu_linear"]
    head = [o["kind"] for o in cg.meta["ops"] if o["layer"] == -1]
    assert head[-5] == "norm_linear" and "rms_norm" not in head  # final_norm fused into the lm_head
    names = {b["name"] for b in cg.meta["buffers"]}
    assert not names & {"L0.h_attn", "L0.h_mlp", "L0.act", "L0.o_partial", "L0.down_partial", "h_final"}
    assert {"L0.x_mid", "L0.x_out", "L0.gate_up", "L0.ln1"} <= names and cg.meta["fusions"] == sorted(fusion.FUSIONS)


def test_tp2_keeps_the_all_reduce_and_fuses_the_prologues():
    cg = programs(fp32("tiny"), 2, fuse=True)[0]
    kinds = _layer_kinds(cg, 1)
    assert kinds.count("norm_linear") == 2 and kinds.count("silu_linear") == 1 and "linear_residual" not in kinds
    assert kinds.count("allreduce_reduce") == 2 and "rms_norm" not in kinds and "silu_mul" not in kinds


def test_fusions_can_be_chosen_one_by_one():
    (cg,) = programs(fp32("tiny"), 1, fuse="silu")
    assert _layer_kinds(cg, 0) == ["rms_norm", "linear", "qkv_prep", "attention", "linear", "add", "rms_norm",
                                   "linear", "silu_linear", "add"]
    (cg,) = programs(fp32("tiny"), 1, fuse=["residual"])
    assert _layer_kinds(cg, 0).count("linear_residual") == 2 and "add" not in _layer_kinds(cg, 0)
    with pytest.raises(InputError, match=r"fuse: expected .* got \['gelu'\]"):
        fusion.fusion_set("norm,gelu")


def test_prologue_too_large_to_stage_is_not_fused():
    g = build_graph(get_preset("qwen3-8b"), tp=1, rank=0, batch=16, max_seq_len=64)
    kinds = {i.linear.name: i.kind for i in fusion.plan(g, True) if isinstance(i, fusion.FusedLinear)}
    # down_proj: 16 rows x 12288 bf16 = 384 KiB > STAGE_LIMIT: silu stays a task, the residual is still fused
    assert kinds["L0.down_proj"] == "linear_residual" and kinds["L0.qkv_proj"] == "norm_linear"


def test_staging_bytes_is_the_largest_fused_prologue():
    cg = programs(fp32("tiny"), 1, batch=2, fuse=True)[0]
    I, H = get_preset("tiny").intermediate_size, get_preset("tiny").hidden_size
    assert fusion.staging_bytes(cg, 1 << 20) == fusion.STAGE_OFFSET_BYTES + 2 * 2 * I
    assert fusion.staging_bytes(cg, fusion.STAGE_OFFSET_BYTES + 2 * 2 * H) == fusion.STAGE_OFFSET_BYTES + 2 * 2 * H
    assert fusion.staging_bytes(programs(fp32("tiny"), 1)[0], 1 << 20) == 0


@pytest.mark.parametrize("config,tp", [("tiny", 1), ("tiny", 2), ("tiny-llama", 1), ("tiny-llama", 2)])
def test_fused_random_schedules_match_torch_backend(config, tp):
    cfg = fp32(config)
    cgs, ws = programs(cfg, tp, fuse=True), weights(cfg, tp)
    greedy, forced = [[7]] + [[-1]] * (LONG - 1), [[7], [300]]
    refs = {"greedy": reference(cfg, tp, greedy), "forced": reference(cfg, tp, forced)}
    for seed in range(SCHEDULES):
        feed, (ref_logits, ref_tokens) = (greedy, refs["greedy"]) if seed % 2 == 0 else (forced, refs["forced"])
        steps = LONG if seed == 0 else SHORT
        res = Interpreter(cgs, ws, seed=seed, mode="aot" if seed % 4 == 3 else "jit").run(
            steps, torch.tensor(feed[:steps]), torch.tensor([0]))
        err = max_rel_err(res.captured["logits"], ref_logits[:steps])
        assert err <= 1e-5, f"{config} tp={tp} schedule {seed}: max rel. error {err:.2e}"
        assert torch.equal(res.tokens, ref_tokens[:steps]), f"{config} tp={tp} schedule {seed}: tokens differ"


@pytest.mark.parametrize("fuse", [True, "norm,silu,residual,silu_epi"], ids=["default", "silu_epi"])
@pytest.mark.parametrize("config,tp,batch", [("tiny", 1, 2), ("tiny-llama", 2, 1)])
def test_bf16_fused_equals_unfused_bit_for_bit(config, tp, batch, fuse):
    """Rounding points unchanged: in bf16 the fused and unfused programs give identical logits (also with silu_mul as
    the gate|up projection's epilogue, which rounds where the gate|up linear and silu_mul round)."""
    cfg = get_preset(config)
    ws = weights(cfg, tp, batch=batch)
    feed = torch.tensor([[7, 11][:batch]] + [[-1] * batch] * 5)
    out = [Interpreter(programs(cfg, tp, batch=batch, fuse=f), ws, seed=2).run(6, feed, torch.zeros(batch, dtype=torch.int32))
           for f in (False, fuse)]
    assert torch.equal(out[0].captured["logits"], out[1].captured["logits"])
    assert torch.equal(out[0].tokens, out[1].tokens)


@pytest.mark.parametrize("tp,layer", [(1, 1), (2, 0)])
def test_deleting_any_edge_of_a_fused_layer_is_caught(tp, layer):
    cfg = fp32("tiny")
    cgs, ws = programs(cfg, tp, fuse=True), weights(cfg, tp)
    kinds = _layer_kinds(cgs[0], layer)
    assert "norm_linear" in kinds and "silu_linear" in kinds
    feed = torch.tensor([[5], [-1]])
    missed, tried = uncaught_edge_deletions(cgs, ws, layer, feed)
    assert tried >= 20
    assert not missed, f"deleting these edges of a fused layer went unnoticed: {missed}"


EPI = "norm,silu,residual,silu_epi"


def test_silu_epilogue_folds_silu_mul_into_the_gate_up_tiles():
    """With 'silu_epi' the gate|up projection writes silu(gate) * up itself: the gate|up activation is not
    declared, no silu_mul task is left, and the down projection is a plain linear (with the residual at tp 1),
    not a silu_linear that recomputes the silu."""
    (cg,) = programs(fp32("tiny"), 1, fuse=EPI)
    assert _layer_kinds(cg, 0) == ["norm_linear", "qkv_prep", "attention", "linear_residual", "norm_linear_silu",
                                   "linear_residual"]
    names = {b["name"] for b in cg.meta["buffers"]}
    assert "L0.gate_up" not in names and "L0.act" in names
    kinds = _layer_kinds(programs(fp32("tiny"), 2, fuse=EPI)[0], 1)
    assert kinds.count("norm_linear_silu") == 1 and "silu_linear" not in kinds and "silu_mul" not in kinds
    # without the norm fused into the gate|up projection the epilogue is not planned: silu goes to the down tiles
    (cg,) = programs(fp32("tiny"), 1, fuse="silu,residual,silu_epi")
    assert "norm_linear_silu" not in _layer_kinds(cg, 0) and "silu_linear" in _layer_kinds(cg, 0)


def test_silu_epilogue_tiles_own_gate_and_up_rows_of_the_same_columns():
    """Each norm_linear_silu tile's weight rows are its columns' gate rows and, UP_ROWS rows later, their up rows;
    the tiles cover every intermediate column once."""
    from mpk_dist.taskgraph.abi import TASK_COLS
    from mpk_dist.taskgraph.tasks import BY_NAME

    cfg = fp32("tiny")
    (cg,) = programs(cfg, 1, fuse=EPI)
    kind, I, K = BY_NAME["norm_linear_silu"], cfg.intermediate_size, cfg.hidden_size
    tasks = cg.arrays["tasks"]
    rows = tasks[(tasks[:, TASK_COLS["OPCODE"]] == kind.opcode) & (tasks[:, TASK_COLS["LAYER"]] == 0)]
    cols = []
    for t in rows:
        p = cg.arrays["params"][t[TASK_COLS["PARAM_BEGIN"]]:t[TASK_COLS["PARAM_END"]]]
        n, up = int(p[kind.param_index("N_TILE")]) // 2, int(p[kind.param_index("UP_ROWS")])
        a = cg.arrays["args"][t[TASK_COLS["ARG_BEGIN"]] + kind.arg_index("W")]
        y = cg.arrays["args"][t[TASK_COLS["ARG_BEGIN"]] + kind.arg_index("Y")]
        c0 = int(a[1]) // K
        assert up == I and int(y[1]) == c0 and int(a[2]) == (I + n) * K
        cols.extend(range(c0, c0 + n))
    assert sorted(cols) == list(range(I)) and len(rows) > 1


def test_staging_bytes_counts_the_gate_up_sums():
    cg = programs(fp32("tiny"), 1, batch=2, fuse=EPI)[0]
    from mpk_dist.taskgraph.tasks import kind_params

    B, K, n = (int(v.max()) for v in kind_params(cg, "norm_linear_silu", "BATCH", "K", "N_TILE"))
    assert fusion.pair_offset(B, K) % fusion.PAIR_ALIGN == 0 and fusion.pair_offset(B, K) >= fusion.STAGE_OFFSET_BYTES + 2 * B * K
    assert fusion.staging_bytes(cg, 1 << 20) >= fusion.pair_offset(B, K) + 2 * B * n


def _check_random_schedules(config: str, tp: int, fuse: str, kind: str) -> None:
    """fp32: four schedules (jit and aot) of the ``fuse`` program, whose layer 0 has a ``kind`` op, give the torch
    backend's logits within 1e-5 and its tokens (the interpreter's race checker runs)."""
    cfg = fp32(config)
    cgs, ws = programs(cfg, tp, fuse=fuse), weights(cfg, tp)
    assert kind in _layer_kinds(cgs[0], 0)
    greedy = [[7]] + [[-1]] * (LONG - 1)
    ref_logits, ref_tokens = reference(cfg, tp, greedy)
    for seed in range(4):
        steps = LONG if seed == 0 else SHORT
        res = Interpreter(cgs, ws, seed=seed, mode="aot" if seed % 2 else "jit").run(
            steps, torch.tensor(greedy[:steps]), torch.tensor([0]))
        err = max_rel_err(res.captured["logits"], ref_logits[:steps])
        assert err <= 1e-5, f"{config} tp={tp} {fuse} schedule {seed}: max rel. error {err:.2e}"
        assert torch.equal(res.tokens, ref_tokens[:steps])


@pytest.mark.parametrize("config,tp", [("tiny", 1), ("tiny-llama", 2)])
def test_silu_epilogue_random_schedules_match_torch_backend(config, tp):
    _check_random_schedules(config, tp, EPI, "norm_linear_silu")


def test_deleting_any_edge_of_a_silu_epilogue_layer_is_caught():
    cfg = fp32("tiny")
    cgs, ws = programs(cfg, 1, fuse=EPI), weights(cfg, 1)
    assert "norm_linear_silu" in _layer_kinds(cgs[0], 1)
    missed, tried = uncaught_edge_deletions(cgs, ws, 1, torch.tensor([[5], [-1]]))
    assert tried >= 10
    assert not missed, f"deleting these edges of a fused layer went unnoticed: {missed}"


DOWN = "norm,silu,residual,silu_epi,silu_down"


def test_silu_down_folds_the_down_projection_into_the_gate_up_tiles():
    """Fusion 'silu_down' (tp 1): the down level disappears; the gate|up tiles read the down weight's columns of
    their block and add into x_out, which the o_proj tiles write as a copy of x_mid. At tp 2 nothing changes
    (no residual fusion there: the all-reduce adds the residual)."""
    cfg = fp32("tiny")
    cg = programs(cfg, 1, fuse=DOWN)[0]
    assert _layer_kinds(cg, 0)[-2:] == ["linear_residual", "norm_linear_silu"]
    assert _layer_kinds(programs(cfg, 1, fuse=EPI)[0], 0)[-1] == "linear_residual"
    assert _layer_kinds(programs(cfg, 2, fuse=DOWN)[0], 0) == _layer_kinds(programs(cfg, 2, fuse=EPI)[0], 0)
    names = [x["name"] for x in cg.meta["buffers"]]
    assert "L0.down_partial" not in names and "L0.x_out" in names


@pytest.mark.parametrize("config", ["tiny", "tiny-llama"])
def test_silu_down_random_schedules_match_torch_backend(config):
    """fp32: the split-K down partials summed in the residual stream give the torch backend's logits (the race
    checker runs: the adds are ordered after o_proj's copy and before every reader)."""
    _check_random_schedules(config, 1, DOWN, "norm_linear_silu")


def test_deleting_any_edge_of_a_silu_down_layer_is_caught():
    cfg = fp32("tiny")
    cgs, ws = programs(cfg, 1, fuse=DOWN), weights(cfg, 1)
    assert _layer_kinds(cgs[0], 1)[-1] == "norm_linear_silu"
    missed, tried = uncaught_edge_deletions(cgs, ws, 1, torch.tensor([[5], [-1]]))
    assert tried >= 10
    assert not missed, f"deleting these edges of a silu_down layer went unnoticed: {missed}"

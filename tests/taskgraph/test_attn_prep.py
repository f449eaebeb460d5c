"""The attn_prep fusion (qkv_prep -> attention as one attention_prep task-op): what the pass rewrites and
refuses, bit-identical logits against the unfused program in the interpreter (race checks on), one level
less per layer, tiles that wait only on their own qkv columns, every edge of a fused layer necessary."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mpk_dist.taskgraph import fusion
from mpk_dist.taskgraph.abi import TASK_COLS
from mpk_dist.taskgraph.interpreter import Interpreter
from mpk_dist.taskgraph.levels import _producers, level_summary
from mpk_dist.taskgraph.lowering_attn_prep import attn_prep_smem_bytes
from mpk_dist.taskgraph.tasks import BY_NAME
from mpk_dist.taskgraph.testing import (assert_schedules_match_reference, fp32, max_rel_err, preset_or_short,
                                        programs, reference, uncaught_edge_deletions, weights)

DEFAULT = sorted(fusion.FUSIONS)
WITH = DEFAULT + ["attn_prep"]


pytestmark = pytest.mark.usefixtures("one_thread")


def _kinds(cg, layer: int) -> list[str]:
    return [o["kind"] for o in cg.meta["ops"] if o["layer"] == layer]


def test_opt_in_only_and_names_accepted():
    assert "attn_prep" not in fusion.fusion_set(True) and "attn_prep" in fusion.fusion_set("norm,attn_prep")
    (cg,) = programs(fp32("tiny"), 1, fuse=True)
    assert "attention_prep" not in _kinds(cg, 0)
    (cg,) = programs(fp32("tiny"), 1, fuse=WITH)
    assert _kinds(cg, 0) == ["norm_linear", "attention_prep", "linear_residual", "norm_linear", "silu_linear"]
    assert cg.meta["fusions"] == sorted(WITH)
    assert "L0.q" in {b["name"] for b in cg.meta["buffers"]}  # q stays: the tile writes and reads it
    (cg,) = programs(fp32("tiny-llama"), 1, fuse="attn_prep")  # alone, with the unfused linears
    assert _kinds(cg, 0) == ["rms_norm", "linear", "attention_prep", "linear", "add", "rms_norm", "linear", "silu_mul",
                             "linear", "add"]


def test_tiles_and_arguments():
    cfg = fp32("tiny")  # 4 q heads, 2 kv heads of 32
    (cg,) = programs(cfg, 1, batch=3, fuse=["attn_prep"])
    kind = BY_NAME["attention_prep"]
    tasks = cg.arrays["tasks"]
    rows = tasks[(tasks[:, TASK_COLS["OPCODE"]] == kind.opcode) & (tasks[:, TASK_COLS["LAYER"]] == 1)]
    assert len(rows) == 2 * 3  # (kv head, sequence) pairs
    args, params = cg.arrays["args"], cg.arrays["params"]
    hq, hkv, D, G = 4, 2, 32, 2
    for t, (j, b) in zip(rows, [(j, b) for j in range(hkv) for b in range(3)]):
        a = args[t[TASK_COLS["ARG_BEGIN"]]: t[TASK_COLS["ARG_END"]]]
        p = dict(zip([s.name for s in kind.params], params[t[TASK_COLS["PARAM_BEGIN"]]: t[TASK_COLS["PARAM_END"]]]))
        assert a[kind.arg_index("QKV"), 1] == b * (hq + 2 * hkv) * D + j * G * D
        assert a[kind.arg_index("QKV"), 1] + p["K_OFFSET"] == b * (hq + 2 * hkv) * D + (hq + j) * D
        assert p["V_OFFSET"] == hkv * D and p["GROUP"] == G and p["HEAD_DIM"] == D
        assert a[kind.arg_index("POSITIONS"), 1:].tolist() == [b, 1]
        assert a[kind.arg_index("OUT"), 1:].tolist() == [b * hq * D + j * G * D, G * D]


def test_tile_waits_only_on_its_qkv_columns():
    """Tile (j, b) depends on the qkv_proj tiles covering q heads j*G.., k head j and v head j only."""
    cfg = fp32("tiny")
    (cg,) = programs(cfg, 1, sms=16, batch=2, fuse=["attn_prep"])
    tasks, args = cg.arrays["tasks"], cg.arrays["args"]
    ops = [o["name"] for o in cg.meta["ops"]]
    qkv_tasks = np.nonzero(tasks[:, TASK_COLS["OP_INDEX"]] == ops.index("L0.qkv_proj"))[0]
    lin = BY_NAME["linear"]
    cols = {int(t): (int(args[tasks[t, TASK_COLS["ARG_BEGIN"]] + lin.arg_index("Y"), 1]),
                     int(args[tasks[t, TASK_COLS["ARG_BEGIN"]] + lin.arg_index("W"), 2]) // cfg.hidden_size)
            for t in qkv_tasks}
    prep = np.nonzero(tasks[:, TASK_COLS["OP_INDEX"]] == ops.index("L0.attention"))[0]
    hq, hkv, D, G = 4, 2, 32, 2
    preds = _producers(cg)
    for t, (j, _) in zip(prep, [(j, b) for j in range(hkv) for b in range(2)]):
        need = [(j * G * D, G * D), ((hq + j) * D, D), ((hq + hkv + j) * D, D)]
        want = {q for q, (c0, n) in cols.items() if any(c0 < s + w and s < c0 + n for s, w in need)}
        got = {p for p in preds[int(t)] if p in cols}
        assert got == want and len(want) < len(cols), (j, sorted(got), sorted(want))


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("name", ["tiny", "tiny-llama", "qwen3-0.6b-2l"])
def test_one_level_less_per_layer(name, tp):
    cfg = preset_or_short(name)
    base, fused = (programs(cfg, tp, fuse=f)[0] for f in (DEFAULT, WITH))
    a, b = level_summary(base), level_summary(fused)
    assert b["per_layer"] == [n - 1 for n in a["per_layer"]]
    assert b["step"] == a["step"] - cfg.num_layers
    assert attn_prep_smem_bytes(fused, 512) == 16 * (cfg.num_heads // cfg.num_kv_heads) * (cfg.head_dim + 2) * 4
    assert attn_prep_smem_bytes(base, 512) == 0


CASES = [(n, tp, b) for n in ("tiny", "tiny-llama", "qwen3-0.6b-2l") for tp in (1, 2) for b in (1, 4)]


@pytest.mark.parametrize("name,tp,batch", CASES)
def test_bf16_logits_bit_identical_to_unfused(name, tp, batch):
    """bf16 (the GPU's dtype), teacher-forced then greedy, sequences at different positions, race checks
    on: the fused program's logits equal the unfused program's bit for bit (with the default fusions
    on both sides; for one case also both without them)."""
    cfg = preset_or_short(name)
    ws = weights(cfg, tp, batch=batch)
    feed = torch.tensor([[7, 11, 300, 5][:batch]] + [[13, -1, 2, -1][:batch]] + [[-1] * batch] * 2)
    start = torch.tensor([0, 9, 3, 30][:batch], dtype=torch.int32)
    pairs = [(DEFAULT, WITH)] + ([(False, ["attn_prep"])] if (tp, batch) == (2, 4) else [])
    for k, (off, on) in enumerate(pairs):
        out = [Interpreter(programs(cfg, tp, batch=batch, fuse=f), ws, seed=3 + k, mode=m).run(4, feed, start)
               for f, m in ((off, "jit"), (on, "aot" if batch == 4 else "jit"))]
        assert torch.equal(out[0].captured["logits"], out[1].captured["logits"]), (name, tp, batch, off)
        assert torch.equal(out[0].tokens, out[1].tokens)


@pytest.mark.parametrize("config,tp", [("tiny", 1), ("tiny", 2), ("tiny-llama", 2)])
def test_fp32_random_schedules_match_torch_backend(config, tp):
    cfg = fp32(config)
    cgs, ws = programs(cfg, tp, fuse=WITH), weights(cfg, tp)
    feed = [[7]] + [[-1]] * 7
    ref_logits, ref_tokens = reference(cfg, tp, feed)
    for seed in range(4):
        steps = 8 if seed == 0 else 2
        res = Interpreter(cgs, ws, seed=seed, mode="aot" if seed % 2 else "jit").run(
            steps, torch.tensor(feed[:steps]), torch.tensor([0]))
        assert max_rel_err(res.captured["logits"], ref_logits[:steps]) <= 1e-5
        assert torch.equal(res.tokens, ref_tokens[:steps])


def test_split_kv_programs_fold_the_prep_into_the_split_tiles():
    cfg = fp32("tiny")
    split = programs(cfg, 1, fuse=WITH, attn_splits=4)[0]
    plain = programs(cfg, 1, fuse=DEFAULT, attn_splits=4)[0]
    kinds, plain_kinds = [o["kind"] for o in split.meta["ops"]], [o["kind"] for o in plain.meta["ops"]]
    layers = cfg.num_layers
    assert kinds.count("attention_split_prep") == layers and kinds.count("attention_merge") == layers
    assert "qkv_prep" not in kinds and "attention_split" not in kinds and "attention_prep" not in kinds
    assert plain_kinds.count("qkv_prep") == layers and plain_kinds.count("attention_split") == layers
    assert len(kinds) == len(plain_kinds) - layers, "one op (a dependent level) less per layer"
    a, b = level_summary(plain), level_summary(split)
    assert b["per_layer"] == [n - 1 for n in a["per_layer"]]
    # 'auto' that resolves to one range is an unsplit program: the unsplit fusion
    (auto,) = programs(cfg, 1, sms=2, fuse=WITH, attn_splits="auto")
    assert "attention_prep" in {o["kind"] for o in auto.meta["ops"]}


SPLIT_CASES = [("tiny", 1, 1, 4), ("tiny", 2, 4, 3), ("tiny-llama", 2, 1, 2), ("qwen3-0.6b-2l", 1, 4, 4)]


@pytest.mark.parametrize("name,tp,batch,splits", SPLIT_CASES)
def test_fused_split_logits_bit_identical_to_unfused_split(name, tp, batch, splits):
    """bf16, teacher-forced then greedy, sequences at different positions (so different ranges append),
    race checks on: the fused split program's logits equal the unfused split program's bit for bit."""
    cfg = preset_or_short(name)
    ws = weights(cfg, tp, batch=batch)
    feed = torch.tensor([[7, 11, 300, 5][:batch]] + [[13, -1, 2, -1][:batch]] + [[-1] * batch] * 2)
    start = torch.tensor([0, 9, 3, 30][:batch], dtype=torch.int32)
    out = [Interpreter(programs(cfg, tp, batch=batch, fuse=f, attn_splits=splits), ws, seed=5, mode=m).run(4, feed, start)
           for f, m in ((DEFAULT, "jit"), (WITH, "aot" if batch == 4 else "jit"))]
    kinds = {o["kind"] for o in programs(cfg, tp, batch=batch, fuse=WITH, attn_splits=splits)[0].meta["ops"]}
    assert "attention_split_prep" in kinds
    assert torch.equal(out[0].captured["logits"], out[1].captured["logits"]), (name, tp, batch, splits)
    assert torch.equal(out[0].tokens, out[1].tokens)


def test_fused_split_fp32_random_schedules_match_torch_backend():
    cfg = fp32("tiny")
    assert_schedules_match_reference(cfg, 2, programs(cfg, 2, fuse=WITH, attn_splits=3), weights(cfg, 2))


def test_paged_graphs_have_nothing_to_fuse():
    from mpk_dist.models.llama import PagedSpec, build_paged_graph

    g = build_paged_graph(fp32("tiny"), PagedSpec(max_tokens=4, max_seqs=2, num_pages=8, page_size=8,
                                                  max_pages_per_seq=4), tp=1, rank=0)
    assert not [i for i in fusion.plan(g, ["attn_prep"]) if isinstance(i, fusion.FusedAttention)]


@pytest.mark.parametrize("tp,layer", [(1, 1), (2, 0)])
def test_deleting_any_edge_of_a_fused_layer_is_caught(tp, layer):
    cfg = fp32("tiny")
    cgs, ws = programs(cfg, tp, fuse=WITH), weights(cfg, tp)
    assert "attention_prep" in _kinds(cgs[0], layer)
    feed = torch.tensor([[5], [-1]])
    missed, tried = uncaught_edge_deletions(cgs, ws, layer, feed)
    assert tried >= 20
    assert not missed, f"deleting these edges of a fused layer went unnoticed: {missed}"

"""Lowering: tiles sized from the SM count, tile-granular dependencies, communication tasks."""

from __future__ import annotations

from collections import Counter

import pytest
from mpk_dist.taskgraph.testing import MAX_SEQ, fp32

from mpk_dist.models import build_graph
from mpk_dist.taskgraph.deps import build_events, reduce_events
from mpk_dist.taskgraph.lowering import col_tiles
from mpk_dist.taskgraph.lowering_comm import lower_graph


def _lowered(name: str, tp: int, sms: int = 8, rank: int = 0):
    g = build_graph(fp32(name), tp=tp, rank=rank, batch=1, max_seq_len=MAX_SEQ)
    prog = lower_graph(g, sms, MAX_SEQ)
    return prog, reduce_events(build_events(prog))


def _tasks(prog):
    """[(op name, tile)] in task order."""
    return [(op.name, i) for op in prog.ops for i in range(op.tiles)]


def _producers(prog, eg, task):
    """(op name, tile) of every task whose signal the given task waits for (offset 0)."""
    names = _tasks(prog)
    sig = {}
    for t, es in enumerate(eg.signals):
        for e in es:
            sig.setdefault(e, []).append(names[t])
    return sorted(p for e, off in eg.waits[names.index(task)] if off == 0 for p in sig[e])


@pytest.mark.parametrize("n,sms", [(64, 8), (4096, 132), (768, 132), (151936 // 8, 132), (100, 3)])
def test_col_tiles_cover_exactly_and_respect_sms(n, sms):
    tiles = col_tiles(n, sms)
    assert sum(c for _, c in tiles) == n
    assert all(c0 == sum(c for _, c in tiles[:i]) for i, (c0, _) in enumerate(tiles))
    assert len(tiles) <= max(sms, -(-n // 16))
    assert all(c % 16 == 0 for _, c in tiles[:-1])


def test_tile_granular_edges_oproj_to_allreduce_and_gateup_to_silu():
    prog, eg = _lowered("tiny", tp=2)
    assert _producers(prog, eg, ("L0.attn_reduce/push", 2)) == [("L0.o_proj", 2)]
    assert _producers(prog, eg, ("L0.attn_reduce/reduce", 2)) == [("L0.attn_reduce/push", 2)]
    n_silu = next(op.tiles for op in prog.ops if op.name == "L0.silu_mul")
    assert _producers(prog, eg, ("L0.silu_mul", 1)) == [("L0.gate_up_proj", 1), ("L0.gate_up_proj", 1 + n_silu)]
    # full barriers only where the math needs the whole tensor
    n_red = next(op.tiles for op in prog.ops if op.name == "L0.attn_reduce/reduce")
    assert _producers(prog, eg, ("L0.mlp_norm", 0)) == [("L0.attn_reduce/reduce", t) for t in range(n_red)]
    assert _producers(prog, eg, ("argmax_partial", 3)) == [("lm_head", 3)]


def test_comm_events_are_signalled_by_every_rank():
    prog, eg = _lowered("tiny", tp=4)
    names = _tasks(prog)
    push = names.index(("L1.mlp_reduce/push", 0))
    (e,) = eg.signals[push]
    assert eg.target[e] == -2 and eg.triggers[e] == 4  # one push per rank, every rank's counter
    gather = names.index(("all_gather", 0))
    (e,) = eg.signals[gather]
    assert eg.triggers[e] == 4


def test_residual_wait_is_implied_and_removed():
    prog, eg = _lowered("tiny", tp=2)
    # the reduce reads x0 as residual, but x0's producers are already ancestors via o_proj
    assert all(p[0].startswith("L0.attn_reduce/push") for p in _producers(prog, eg, ("L0.attn_reduce/reduce", 0)))


def test_kv_heads_below_tp_and_qkv_prep_tiles():
    cfg = fp32("tiny", num_kv_heads=1)
    g = build_graph(cfg, tp=4, rank=3, batch=1, max_seq_len=MAX_SEQ)
    prog = lower_graph(g, 8, MAX_SEQ)
    prep = next(op for op in prog.ops if op.name == "L0.qkv_prep")
    assert prep.tiles == 1 + 1  # one q head and the (replicated) kv head on this rank
    att = next(op for op in prog.ops if op.name == "L0.attention")
    assert att.tiles == 1


def test_step_loop_edge_waits_on_previous_step_select():
    prog, eg = _lowered("tiny", tp=1)
    names = _tasks(prog)
    waits = eg.waits[names.index(("step_begin", 0))]
    assert [off for _, off in waits] == [-1]
    sig = [t for t, es in enumerate(eg.signals) if waits[0][0] in es]
    assert [names[t] for t in sig] == [("argmax_select", 0)]


def test_tiles_follow_sm_count():
    small, _ = _lowered("tiny", tp=1, sms=4)
    big, _ = _lowered("tiny", tp=1, sms=64)
    count = lambda p: Counter(op.kind.name for op in p.ops for _ in range(op.tiles))  # noqa: E731
    assert count(big)["linear"] > count(small)["linear"]

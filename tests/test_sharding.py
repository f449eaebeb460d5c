"""Tensor-parallel shard plans and their refusals."""

from __future__ import annotations

import pytest

from mpk_dist.errors import ShardingError
from mpk_dist.models.presets import get_preset
from mpk_dist.sharding import plan_shards, valid_tp_degrees


def test_kv_head_replication_when_kv_heads_below_tp():
    cfg = get_preset("qwen3-8b")  # 32 q heads, 8 kv heads
    plans = [plan_shards(cfg, 16, r) for r in range(16)]
    assert all(p.kv_heads == 1 for p in plans)
    assert [p.kv_head_start for p in plans] == [r // 2 for r in range(16)]
    # each rank's query heads must use the KV head it holds (GQA group of 4 query heads)
    for p in plans:
        assert p.q_head_start // (cfg.num_heads // cfg.num_kv_heads) == p.kv_head_start


def test_slices_tile_every_dimension():
    cfg = get_preset("llama3-8b")
    plans = [plan_shards(cfg, 4, r) for r in range(4)]
    assert sum(p.vocab_size for p in plans) == cfg.vocab_size
    assert sum(p.inter_size for p in plans) == cfg.intermediate_size
    assert [p.vocab_start for p in plans] == [r * cfg.vocab_size // 4 for r in range(4)]


def test_non_dividing_tp_names_working_values():
    cfg = get_preset("qwen3-0.6b")
    with pytest.raises(ShardingError, match=r"tp values that work for this model: \[1, 2, 4, 8"):
        plan_shards(cfg, 3, 0)
    assert 3 not in valid_tp_degrees(cfg) and 8 in valid_tp_degrees(cfg)

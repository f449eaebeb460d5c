"""Megatron-style tensor-parallel sharding plan (as vLLM does it).

q/k/v and gate/up are split by columns of the output (on head / intermediate boundaries),
o_proj and down_proj by rows of the input (followed by an all-reduce), norms are replicated, and
the embedding and lm_head are split over the vocabulary. When a model has fewer KV heads than the
TP degree, each rank keeps one KV head, replicated tp / kv_heads times: rank r holds KV head
r // (tp / kv_heads).
"""

from __future__ import annotations

from dataclasses import dataclass

from mpk_dist.config import ModelConfig
from mpk_dist.errors import ShardingError


@dataclass(frozen=True)
class ShardPlan:
    """Which slice of each sharded dimension one rank owns."""

    tp: int
    rank: int
    q_head_start: int
    q_heads: int
    kv_head_start: int
    kv_heads: int
    inter_start: int
    inter_size: int
    vocab_start: int
    vocab_size: int


def _problems(cfg: ModelConfig, tp: int) -> list[str]:
    out = []
    if cfg.num_heads % tp:
        out.append(f"num_attention_heads={cfg.num_heads}")
    kv = cfg.num_kv_heads
    if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
        out.append(f"num_key_value_heads={kv} (needs kv_heads % tp == 0, or tp % kv_heads == 0 when tp > kv_heads)")
    if cfg.intermediate_size % tp:
        out.append(f"intermediate_size={cfg.intermediate_size}")
    if cfg.vocab_size % tp:
        out.append(f"vocab_size={cfg.vocab_size}")
    return out


def valid_tp_degrees(cfg: ModelConfig, limit: int = 64) -> list[int]:
    """TP degrees in 1..limit that divide every sharded dimension of ``cfg``."""
    return [tp for tp in range(1, limit + 1) if not _problems(cfg, tp)]


def plan_shards(cfg: ModelConfig, tp: int, rank: int) -> ShardPlan:
    """The slices rank ``rank`` of ``tp`` owns; raises ``ShardingError`` naming the tp values that work."""
    if tp < 1:
        raise ShardingError(f"--tp: expected a positive integer, got {tp}")
    if not 0 <= rank < tp:
        raise ShardingError(f"rank: expected 0 <= rank < tp={tp}, got {rank}")
    bad = _problems(cfg, tp)
    if bad:
        valid = [t for t in valid_tp_degrees(cfg) if t <= max(8, tp)]
        raise ShardingError(
            f"--tp {tp}: does not divide {', '.join(bad)}; tp values that work for this model: {valid}"
        )
    q_heads = cfg.num_heads // tp
    if cfg.num_kv_heads >= tp:
        kv_heads = cfg.num_kv_heads // tp
        kv_start = rank * kv_heads
    else:
        kv_heads = 1
        kv_start = rank // (tp // cfg.num_kv_heads)
    inter = cfg.intermediate_size // tp
    vocab = cfg.vocab_size // tp
    return ShardPlan(
        tp=tp,
        rank=rank,
        q_head_start=rank * q_heads,
        q_heads=q_heads,
        kv_head_start=kv_start,
        kv_heads=kv_heads,
        inter_start=rank * inter,
        inter_size=inter,
        vocab_start=rank * vocab,
        vocab_size=vocab,
    )

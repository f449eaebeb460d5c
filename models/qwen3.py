"""Qwen3 decoder: Llama's structure plus per-head RMSNorm of q and k (q_norm / k_norm) before rope.

head_dim is independent of hidden_size / num_heads in Qwen3 (e.g. 0.6B: hidden 1024, 16 heads of 128).
"""

from __future__ import annotations

from mpk_dist.config import ModelConfig
from mpk_dist.graph import Graph
from mpk_dist.models import llama


def build_graph(cfg: ModelConfig, tp: int = 1, rank: int = 0, batch: int = 1, max_seq_len: int = 512, name: str = "qwen3") -> Graph:
    """The decode-step op graph of rank ``rank`` of a ``tp``-way sharded Qwen3 model."""
    return llama.build_graph(cfg, tp=tp, rank=rank, batch=batch, max_seq_len=max_seq_len, name=name, qk_norm=True)

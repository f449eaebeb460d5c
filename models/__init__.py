"""Model families: each module builds the op graph of one tensor-parallel rank.

``build_graph(cfg, tp, rank, batch, max_seq_len)`` dispatches on ``cfg.family``; presets live in
``mpk_dist.models.presets``.
"""

from __future__ import annotations

import importlib

from mpk_dist.config import ModelConfig
from mpk_dist.graph import Graph


def build_graph(cfg: ModelConfig, tp: int = 1, rank: int = 0, batch: int = 1, max_seq_len: int = 512, name: str = "") -> Graph:
    """Build the decode-step op graph of rank ``rank`` of ``tp`` for the model family of ``cfg``."""
    module = importlib.import_module(f"mpk_dist.models.{cfg.family}")
    return module.build_graph(cfg, tp=tp, rank=rank, batch=batch, max_seq_len=max_seq_len, name=name or cfg.family)

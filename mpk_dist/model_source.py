"""Resolve ``--model`` (a checkpoint directory or a preset name) into config, weights and tokenizer.

Small presets are written once as a deterministic HF-layout checkpoint in the cache dir
(``MPK_CACHE_DIR`` or ~/.cache/mpk_dist) and then read like any checkpoint, so the loader is
exercised; presets with real shapes generate their weights on the target device instead
(writing gigabytes of random numbers to disk buys nothing).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from mpk_dist.config import ModelConfig, load_config
from mpk_dist.errors import ConfigError
from mpk_dist.models.presets import PRESETS, get_preset
from mpk_dist.tokenizer import load_tokenizer
from mpk_dist.weights import SYNTHETIC_VERSION, SafetensorsSource, SyntheticSource, check_source, expected_tensors

# Presets up to this many parameters are materialised as files (tiny ones, for the loader path).
MAX_MATERIALIZED_PARAMS = 50_000_000


@dataclass
class ModelSource:
    """What ``--model`` resolved to."""

    name: str
    config: ModelConfig
    weights: object  # SafetensorsSource | SyntheticSource
    tokenizer: object
    path: Path | None


def cache_dir() -> Path:
    """Root of mpk_dist's caches."""
    return Path(os.environ.get("MPK_CACHE_DIR", Path.home() / ".cache" / "mpk_dist"))


def _num_params(cfg: ModelConfig) -> int:
    total = 0
    for shape in expected_tensors(cfg).values():
        n = 1
        for s in shape:
            n *= s
        total += n
    return total


def write_checkpoint(cfg: ModelConfig, out_dir: Path, seed: int = 0) -> Path:
    """Write a preset's deterministic random weights as an HF directory (config.json + model.safetensors)."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    src = SyntheticSource(cfg, seed=seed)
    tensors = {name: src.full(name).contiguous() for name in sorted(src.names())}
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2))
    if out_dir.exists():
        shutil.rmtree(tmp)  # another process won the race; its files are identical
    else:
        tmp.rename(out_dir)
    return out_dir


def open_model(model: str, seed: int = 0, device: str | torch.device = "cpu") -> ModelSource:
    """Resolve a checkpoint directory or preset name; raises ``ConfigError``/``CheckpointError``."""
    path = Path(model).expanduser()
    if path.is_dir():
        cfg = load_config(path)
        source = SafetensorsSource(path)
        check_source(cfg, source)
        return ModelSource(model, cfg, source, load_tokenizer(path), path)
    if model not in PRESETS:
        if os.sep in model or path.exists():
            raise ConfigError(f"model: {model!r} is not a readable checkpoint directory")
        get_preset(model)  # raises the "unknown preset" error
    cfg = get_preset(model)
    if _num_params(cfg) <= MAX_MATERIALIZED_PARAMS:
        target = cache_dir() / "presets" / f"{model}-seed{seed}-v{SYNTHETIC_VERSION}"
        if not (target / "model.safetensors").is_file():
            write_checkpoint(cfg, target, seed=seed)
        return ModelSource(model, cfg, SafetensorsSource(target), load_tokenizer(None), target)
    return ModelSource(model, cfg, SyntheticSource(cfg, seed=seed, device=device), load_tokenizer(None), None)

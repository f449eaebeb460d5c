"""Shared fixtures: random-weight Hugging Face checkpoints written with transformers itself."""

from __future__ import annotations

import os

import pytest
import torch

# The nvcc build tests run in a second process beside the rest (tests/nvcc_offload.py); hooks found by name here.
from tests.nvcc_offload import pytest_collection_modifyitems, pytest_sessionfinish, pytest_terminal_summary  # noqa: F401

HF_SPECS = {
    # Qwen3: q/k norm, head_dim (32) != hidden/heads (16), GQA 4:2, tied embeddings.
    "qwen3-tied": ("Qwen3", dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                 tie_word_embeddings=True, max_position_embeddings=256)),
    # Llama-3.1 style rope scaling, GQA 4:1 (kv_heads < tp for tp 2, 4), untied.
    "llama31-untied": ("Llama", dict(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=False,
                                     max_position_embeddings=256, rope_theta=500000.0,
                                     rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
}


def make_hf_checkpoint(kind: str, out_dir, seed: int = 0, max_shard_size: str | None = None):
    """Build a random-weight HF model of ``kind`` (a key of HF_SPECS) in fp32 and save_pretrained it."""
    import transformers

    family, kwargs = HF_SPECS[kind]
    cfg = getattr(transformers, f"{family}Config")(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, f"{family}ForCausalLM")(cfg).float().eval()
    # HF's init (std 0.02) gives near-constant logits; larger weights make token choices meaningful.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, p.shape[1] ** -0.5)
    model.save_pretrained(out_dir, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    return model


@pytest.fixture(scope="session")
def hf_checkpoint_factory():
    """``make_hf_checkpoint`` as a fixture, for tests that need a variant (sharded files, another seed)."""
    return make_hf_checkpoint


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory):
    """kind -> (checkpoint dir, transformers model) for every HF_SPECS entry."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    out = {}
    for kind in HF_SPECS:
        d = tmp_path_factory.mktemp(kind)
        out[kind] = (d, make_hf_checkpoint(kind, d))
    return out


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    """Tiny models run 10-100x faster single-threaded on a shared 2-core machine (thread-pool churn)."""
    torch.set_num_threads(1)


@pytest.fixture(autouse=True, scope="session")
def _isolated_cache(tmp_path_factory):
    """Presets materialise into a per-session cache, never the user's. MPK_TEST_CACHE_DIR names a cache
    to reuse instead (scripts/gpu_check.sh: kernels, superoptimizer choices and preset checkpoints
    carry over between its pytest processes rather than being rebuilt by each)."""
    os.environ["MPK_CACHE_DIR"] = os.environ.get("MPK_TEST_CACHE_DIR") or str(tmp_path_factory.mktemp("mpk_cache"))

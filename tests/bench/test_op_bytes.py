"""The per-op split of a decode step's bytes (mpk_dist/bench/op_bytes.py) against the bench's floor bytes."""

from __future__ import annotations

import pytest

from mpk_dist.bench.op_bytes import kv_bytes_per_position, op_bytes
from mpk_dist.bench.runner import step_bytes
from mpk_dist.models.presets import get_preset


@pytest.mark.parametrize("preset", ["tiny", "tiny-llama", "qwen3-0.6b", "llama3-8b"])
@pytest.mark.parametrize("batch", [1, 8])
def test_ops_sum_to_the_steps_floor_bytes(preset, batch):
    """At tp 1 the layer ops times the layers, the once-a-step ops and the cache rows at a context add up to
    runner.step_bytes (what bench's floor divides by the bandwidth)."""
    cfg, ctx = get_preset(preset), 481
    ob = op_bytes(cfg, 1, batch)
    layer = sum(v for k, v in ob.items() if k not in ("embedding", "lm_head"))
    total = cfg.num_layers * (layer + kv_bytes_per_position(cfg, 1, batch) * ctx) + ob["lm_head"] + ob["embedding"]
    assert total == step_bytes(cfg, 1, batch, ctx)


def test_qwen3_0p6b_ops_read_their_matrices():
    """qwen3-0.6b (hidden 1024, 16 q and 8 kv heads of 128, intermediate 3072, tied embeddings): each op's bytes
    are its matrices' (bf16) with the norm it fuses; the q/k norms count with the attention; tp 2 halves them."""
    cfg = get_preset("qwen3-0.6b")
    ob = op_bytes(cfg, 1, 1)
    assert ob["qkv_proj"] == (16 + 8 + 8) * 128 * 1024 * 2 + 1024 * 2
    assert ob["o_proj"] == 1024 * 16 * 128 * 2
    assert ob["gate_up_proj"] == 2 * 3072 * 1024 * 2 + 1024 * 2 and ob["down_proj"] == 1024 * 3072 * 2
    assert ob["attention"] == 2 * 128 * 2
    assert ob["lm_head"] == cfg.vocab_size * 1024 * 2 + 1024 * 2 and ob["embedding"] == 1024 * 2
    assert kv_bytes_per_position(cfg, 1, 8) == 2 * 8 * 128 * 8 * 2
    half = op_bytes(cfg, 2, 1)
    assert half["qkv_proj"] == ob["qkv_proj"] // 2 and half["embedding"] == ob["embedding"]


def test_a_tensor_no_op_reads_is_an_error(monkeypatch):
    """A checkpoint tensor op_bytes cannot place (a new architecture) is a ValueError naming it, not a silent 0."""
    import mpk_dist.weights as weights

    cfg = get_preset("tiny")
    real = weights.expected_tensors
    monkeypatch.setattr(weights, "expected_tensors", lambda c: {**real(c), "model.layers.0.mlp.router.weight": (4, 4)})
    with pytest.raises(ValueError, match="mlp.router.weight"):
        op_bytes(cfg, 1, 1)
    with pytest.raises(ValueError, match="expected tp >= 1"):
        op_bytes(cfg, 0, 1)

"""Built-in model presets: real shapes, random weights (deterministic from a seed).

Presets exist to measure speed (real shapes) and to test (``tiny``). Their weights are generated,
not downloaded; see ``mpk_dist.weights.SyntheticSource``. Vocabularies are byte-level: ids 0..255
are bytes, larger ids decode to nothing.
"""

from __future__ import annotations

from mpk_dist.config import ModelConfig, RopeConfig
from mpk_dist.errors import ConfigError

_LLAMA31_ROPE = RopeConfig(theta=500000.0, rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                           high_freq_factor=4.0, original_max_position_embeddings=8192)


def _qwen3(vocab: int, hidden: int, inter: int, layers: int, heads: int, kv: int, head_dim: int, tied: bool) -> ModelConfig:
    return ModelConfig(family="qwen3", architecture="Qwen3ForCausalLM", vocab_size=vocab, hidden_size=hidden,
                       intermediate_size=inter, num_layers=layers, num_heads=heads, num_kv_heads=kv,
                       head_dim=head_dim, rms_norm_eps=1e-6, rope=RopeConfig(theta=1000000.0),
                       max_position_embeddings=40960, tie_word_embeddings=tied, dtype="bfloat16",
                       eos_token_ids=(151645,) if vocab > 151645 else ())


def _llama(vocab: int, hidden: int, inter: int, layers: int, heads: int, kv: int, rope: RopeConfig, tied: bool) -> ModelConfig:
    return ModelConfig(family="llama", architecture="LlamaForCausalLM", vocab_size=vocab, hidden_size=hidden,
                       intermediate_size=inter, num_layers=layers, num_heads=heads, num_kv_heads=kv,
                       head_dim=hidden // heads, rms_norm_eps=1e-5, rope=rope, max_position_embeddings=131072,
                       tie_word_embeddings=tied, dtype="bfloat16",
                       eos_token_ids=(128001, 128009) if vocab > 128009 else ())


PRESETS: dict[str, ModelConfig] = {
    # tiny: Qwen3 structure (q/k norm, head_dim != hidden/heads, GQA), small enough for CPU tests.
    "tiny": _qwen3(vocab=512, hidden=64, inter=128, layers=2, heads=4, kv=2, head_dim=32, tied=True),
    "tiny-llama": _llama(vocab=512, hidden=64, inter=160, layers=2, heads=4, kv=2,
                         rope=RopeConfig(theta=500000.0, rope_type="llama3", factor=8.0,
                                         original_max_position_embeddings=64), tied=False),
    "qwen3-0.6b": _qwen3(151936, 1024, 3072, 28, 16, 8, 128, tied=True),
    "qwen3-1.7b": _qwen3(151936, 2048, 6144, 28, 16, 8, 128, tied=True),
    "qwen3-8b": _qwen3(151936, 4096, 12288, 36, 32, 8, 128, tied=False),
    "llama3-8b": _llama(128256, 4096, 14336, 32, 32, 8, _LLAMA31_ROPE, tied=False),
    "llama3-70b": _llama(128256, 8192, 28672, 80, 64, 8, _LLAMA31_ROPE, tied=False),
}

DEFAULT_PRESET = "tiny"


def get_preset(name: str) -> ModelConfig:
    """The config of a built-in preset; unknown names raise ``ConfigError`` listing the presets."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"model: expected a preset ({', '.join(PRESETS)}) or a checkpoint directory, got {name!r}") from None

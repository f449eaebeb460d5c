"""Model configuration: parse and validate a Hugging Face config.json.

Accepts both the transformers 4.x form (``rope_theta``, ``rope_scaling``, ``torch_dtype``) and the
5.x form (``rope_parameters``, ``dtype``). Only what the runtime implements is accepted; anything
else raises ``ConfigError`` naming the field and what is supported.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mpk_dist.errors import ConfigError

# architecture name in config.json -> model family module under mpk_dist.models
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen3ForCausalLM": "qwen3",
}
SUPPORTED_ROPE_TYPES = ("default", "llama3")
SUPPORTED_DTYPES = ("bfloat16", "float16", "float32")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters (``rope_type`` 'default' or Llama-3.1's 'llama3')."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """Everything the op-graph builders need to know about a decoder-only model."""

    family: str  # "llama" or "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    dtype: str = "bfloat16"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = ""
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def has_qk_norm(self) -> bool:
        """Qwen3 normalises q and k per head before rope."""
        return self.family == "qwen3"

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json (transformers 5.x form) describing this model."""
        rope: dict[str, Any] = {"rope_type": self.rope.rope_type, "rope_theta": self.rope.theta}
        if self.rope.rope_type == "llama3":
            rope.update(
                factor=self.rope.factor,
                low_freq_factor=self.rope.low_freq_factor,
                high_freq_factor=self.rope.high_freq_factor,
                original_max_position_embeddings=self.rope.original_max_position_embeddings,
            )
        eos = list(self.eos_token_ids)
        return {
            "architectures": [self.architecture or _family_architecture(self.family)],
            "model_type": self.family,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": rope,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "dtype": self.dtype,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        }

    def summary(self) -> dict[str, Any]:
        """A JSON-able description (for logs and bench results)."""
        d = asdict(self)
        d.pop("extra", None)
        return d


def _family_architecture(family: str) -> str:
    for arch, fam in SUPPORTED_ARCHITECTURES.items():
        if fam == family:
            return arch
    raise ConfigError(f"model family: expected one of {sorted(set(SUPPORTED_ARCHITECTURES.values()))}, got {family!r}")


def _require(d: dict, key: str, where: str) -> Any:
    if key not in d or d[key] is None:
        raise ConfigError(f"{where}: missing required field {key!r}")
    return d[key]


def _parse_rope(d: dict, where: str) -> RopeConfig:
    # 5.x keeps everything in rope_parameters; 4.x has rope_theta at top level and rope_scaling beside it.
    params = d.get("rope_parameters")
    if params is None:
        params = dict(d.get("rope_scaling") or {})
        if "rope_theta" in d:
            params.setdefault("rope_theta", d["rope_theta"])
    params = dict(params)
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(
            f"{where}: rope type: expected one of {list(SUPPORTED_ROPE_TYPES)}, got {rope_type!r}; "
            "this runtime implements plain rope and Llama-3.1's 'llama3' scaling"
        )
    theta = float(params.get("rope_theta", 10000.0))
    if rope_type == "default":
        return RopeConfig(theta=theta)
    return RopeConfig(
        theta=theta,
        rope_type="llama3",
        factor=float(_require(params, "factor", f"{where} rope_parameters")),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )


def _parse_dtype(d: dict, where: str) -> str:
    dtype = d.get("dtype") or d.get("torch_dtype") or "bfloat16"
    dtype = str(dtype).removeprefix("torch.")
    if dtype not in SUPPORTED_DTYPES:
        raise ConfigError(f"{where}: dtype: expected one of {list(SUPPORTED_DTYPES)}, got {dtype!r}")
    return dtype


def _reject_unsupported(d: dict, where: str) -> None:
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{where}: hidden_act: expected 'silu', got {act!r}")
    for key in ("attention_bias", "mlp_bias"):
        if d.get(key):
            raise ConfigError(f"{where}: {key}: expected false (biases are not implemented), got true")
    if d.get("use_sliding_window"):
        raise ConfigError(f"{where}: use_sliding_window: expected false (sliding-window attention is not implemented)")


def config_from_dict(d: dict, where: str = "config.json") -> ModelConfig:
    """Validate an HF config dict and turn it into a ``ModelConfig``."""
    archs = d.get("architectures") or []
    arch = archs[0] if archs else None
    if arch is None:
        model_type = d.get("model_type")
        arch = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}.get(model_type or "")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(
            f"{where}: architecture: expected one of {sorted(SUPPORTED_ARCHITECTURES)}, got {arch!r}"
        )
    _reject_unsupported(d, where)
    hidden = int(_require(d, "hidden_size", where))
    heads = int(_require(d, "num_attention_heads", where))
    kv_heads = int(d.get("num_key_value_heads") or heads)
    head_dim = int(d.get("head_dim") or hidden // heads)
    if heads % kv_heads:
        raise ConfigError(f"{where}: num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})")
    eos = d.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    return ModelConfig(
        family=SUPPORTED_ARCHITECTURES[arch],
        architecture=arch,
        vocab_size=int(_require(d, "vocab_size", where)),
        hidden_size=hidden,
        intermediate_size=int(_require(d, "intermediate_size", where)),
        num_layers=int(_require(d, "num_hidden_layers", where)),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope=_parse_rope(d, where),
        max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        dtype=_parse_dtype(d, where),
        bos_token_id=d.get("bos_token_id"),
        eos_token_ids=eos_ids,
    )


def load_config(model_dir: str | Path) -> ModelConfig:
    """Read ``model_dir/config.json``; raise ``ConfigError`` with a clear message on any problem."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path}: no such file; expected a Hugging Face model directory with config.json")
    try:
        d = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: unreadable JSON ({exc})") from None
    return config_from_dict(d, where=str(path))

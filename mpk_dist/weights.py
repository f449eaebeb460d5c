"""Weight sources and per-rank loading.

A source answers "what tensors exist, with which shape and dtype" and "give me rows/cols [a, b) of
tensor X". ``SafetensorsSource`` reads a Hugging Face directory (model.safetensors or a sharded
index), memory-mapped, slicing on read so a rank never materialises the whole model.
``SyntheticSource`` generates deterministic random tensors for presets. ``load_rank_weights``
validates a source against the model's config and returns the tensors one rank's graph needs.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import torch

from mpk_dist.config import ModelConfig
from mpk_dist.errors import CheckpointError
from mpk_dist.graph import Graph, WeightSlice

TORCH_DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32, "i32": torch.int32}
CONFIG_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_ST_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
              "I8": torch.int8, "U8": torch.uint8, "I32": torch.int32, "I64": torch.int64, "BOOL": torch.bool}
# Buffers some exporters write that carry no weights.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name -> full (unsharded) shape of every tensor a checkpoint of ``cfg`` must hold."""
    H, D, I = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, H), "model.norm.weight": (H,)}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, H)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        out.update({
            p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
            p + "self_attn.q_proj.weight": (cfg.num_heads * D, H),
            p + "self_attn.k_proj.weight": (cfg.num_kv_heads * D, H),
            p + "self_attn.v_proj.weight": (cfg.num_kv_heads * D, H),
            p + "self_attn.o_proj.weight": (H, cfg.num_heads * D),
            p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H), p + "mlp.down_proj.weight": (H, I),
        })
        if cfg.has_qk_norm:
            out[p + "self_attn.q_norm.weight"] = (D,)
            out[p + "self_attn.k_norm.weight"] = (D,)
    return out


class SafetensorsSource:
    """A Hugging Face checkpoint directory: model.safetensors or model.safetensors.index.json."""

    def __init__(self, model_dir: str | Path):
        from safetensors import safe_open

        self.dir = Path(model_dir)
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError) as exc:
                raise CheckpointError(f"{index}: unreadable index ({exc})") from None
        elif (self.dir / "model.safetensors").is_file():
            weight_map = None
        else:
            raise CheckpointError(f"{self.dir}: expected model.safetensors or model.safetensors.index.json, found neither")
        files = sorted(set(weight_map.values())) if weight_map else ["model.safetensors"]
        self._handles = {}
        self._where: dict[str, str] = {}
        for f in files:
            path = self.dir / f
            if not path.is_file():
                raise CheckpointError(f"{path}: listed in the index but missing")
            try:
                h = safe_open(str(path), framework="pt")
            except Exception as exc:  # safetensors raises its own error types
                raise CheckpointError(f"{path}: not a readable safetensors file ({exc})") from None
            self._handles[f] = h
            for name in h.keys():
                self._where[name] = f
        self._slices = {}

    def names(self) -> set[str]:
        """All tensor names in the checkpoint."""
        return set(self._where)

    def _slice(self, name: str):
        if name not in self._slices:
            self._slices[name] = self._handles[self._where[name]].get_slice(name)
        return self._slices[name]

    def shape(self, name: str) -> tuple[int, ...]:
        """Full shape of a tensor."""
        return tuple(self._slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        """Element type of a tensor."""
        return _ST_DTYPES.get(self._slice(name).get_dtype(), torch.uint8)

    def read(self, part: WeightSlice) -> torch.Tensor:
        """Rows (dim 0) or columns (dim 1) [start, stop) of a tensor, or all of it (dim -1); CPU."""
        sl = self._slice(part.source)
        if part.dim == -1:
            return sl[:]
        if part.dim == 0:
            return sl[part.start:part.stop]
        return sl[:, part.start:part.stop]


# Bumped whenever SyntheticSource's numbers change, so preset checkpoints cached on disk by an
# older version are not read as if they were current.
SYNTHETIC_VERSION = 2


class SyntheticSource:
    """Deterministic random weights for a config: each tensor seeded from (seed, its name).

    Generated on ``device`` (fast on a GPU), so presets with real shapes need no files. Scales are
    chosen per tensor (see ``_std``) so activations stay O(1) and rounding does not blow up with depth.
    """

    def __init__(self, cfg: ModelConfig, seed: int = 0, device: str | torch.device = "cpu"):
        self.cfg, self.seed, self.device = cfg, seed, torch.device(device)
        self._shapes = expected_tensors(cfg)
        self._dtype = CONFIG_DTYPES[cfg.dtype]
        self._last: tuple[str, torch.Tensor] | None = None  # q|k|v or tied reads hit the same tensor twice

    def names(self) -> set[str]:
        """All tensor names of the model."""
        return set(self._shapes)

    def shape(self, name: str) -> tuple[int, ...]:
        """Full shape of a tensor."""
        return self._shapes[name]

    def dtype(self, name: str) -> torch.dtype:
        """Element type (the config's dtype)."""
        return self._dtype

    def full(self, name: str) -> torch.Tensor:
        """The whole tensor, generated deterministically."""
        shape = self._shapes[name]
        gen = torch.Generator(device=self.device).manual_seed((self.seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
        x = torch.randn(shape, generator=gen, device=self.device, dtype=torch.float32)
        return (x * self._std(name, shape) + (1.0 if len(shape) == 1 else 0.0)).to(self._dtype)

    def _std(self, name: str, shape: tuple[int, ...]) -> float:
        """Init scale per tensor, chosen so the random model behaves like a trained one numerically.

        Linears have std 1/sqrt(fan_in); the residual-branch outputs (o_proj, down_proj) are further
        scaled by 1/sqrt(2 * layers) as in GPT-2's init, so the residual stream dominates each
        layer's update as in trained models; embeddings have unit rows; norms are 1 + noise.
        """
        if len(shape) == 1:
            return 0.1
        if name == "model.embed_tokens.weight":
            return 1.0
        std = shape[1] ** -0.5
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            std /= (2 * self.cfg.num_layers) ** 0.5
        return std

    def read(self, part: WeightSlice) -> torch.Tensor:
        """Rows or columns [start, stop) of a generated tensor."""
        if self._last is None or self._last[0] != part.source:
            self._last = (part.source, self.full(part.source))
        x = self._last[1]
        if part.dim == 0:
            return x[part.start:part.stop]
        if part.dim == 1:
            return x[:, part.start:part.stop]
        return x


def check_source(cfg: ModelConfig, source) -> None:
    """Raise ``CheckpointError`` for missing, unexpected, mis-shaped or wrongly typed tensors."""
    want = expected_tensors(cfg)
    have = source.names()
    where = getattr(source, "dir", "checkpoint")
    missing = sorted(set(want) - have)
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise CheckpointError(f"{where}: missing weight(s) {missing[:3]}{more} for a {cfg.architecture} with {cfg.num_layers} layers")
    allowed_extra = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    extra = sorted(n for n in have - set(want) - allowed_extra if not n.endswith(_IGNORED_SUFFIXES))
    if extra:
        raise CheckpointError(f"{where}: unexpected tensor(s) {extra[:3]}; expected only the weights of a "
                              f"{cfg.architecture} with {cfg.num_layers} layers (wrong config.json?)")
    expect_dtype = CONFIG_DTYPES[cfg.dtype]
    for name, shape in want.items():
        got = source.shape(name)
        if tuple(got) != shape:
            raise CheckpointError(f"{where}: tensor {name}: expected shape {list(shape)}, got {list(got)}")
        dt = source.dtype(name)
        if dt != expect_dtype:
            raise CheckpointError(f"{where}: tensor {name}: expected dtype {cfg.dtype} (config.json), got {str(dt).removeprefix('torch.')}")


def load_rank_weights(graph: Graph, source, device: str | torch.device = "cpu", check: bool = True) -> dict[str, torch.Tensor]:
    """The weight tensors of one rank's graph, read slice by slice from ``source`` onto ``device``."""
    cfg: ModelConfig = graph.meta["config"]
    if check:
        check_source(cfg, source)
    out: dict[str, torch.Tensor] = {}
    for spec in graph.weights:
        parts = [source.read(p) for p in spec.weight.parts]
        t = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        if tuple(t.shape) != spec.shape:
            raise CheckpointError(f"weight {spec.name}: expected shape {list(spec.shape)} after slicing, got {list(t.shape)}")
        out[spec.name] = t.to(device=device, dtype=TORCH_DTYPES[spec.dtype]).contiguous()
    return out

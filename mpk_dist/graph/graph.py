"""Graph containers: tensor specs, weight references and the per-rank op list.

Shape conventions (glossary in CONTRIBUTING.md): B = sequences in the batch, H = hidden size,
Hq / Hkv = query / key-value heads on this rank, D = head dim, I = intermediate size on this rank,
V = vocabulary slice of this rank, S = max sequence length of the KV cache.

Activation tensors are recorded with one row per sequence (decode: shape [B, N]). Backends that
process several tokens per sequence (prefill) broadcast over an extra token axis: [B, T, N].
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

from mpk_dist.graph.ops import OP_KINDS

DTYPES = ("bf16", "f16", "f32", "i32")
TENSOR_KINDS = ("input", "weight", "activation", "state", "output")


@dataclass(frozen=True)
class WeightSlice:
    """Rows or columns [start, stop) of one checkpoint tensor (``dim`` -1 = the whole tensor)."""

    source: str
    dim: int
    start: int
    stop: int


@dataclass(frozen=True)
class WeightRef:
    """A rank's weight: checkpoint slices concatenated along dim 0 (e.g. q|k|v or gate|up)."""

    parts: tuple[WeightSlice, ...]

    @property
    def sources(self) -> tuple[str, ...]:
        """Names of the checkpoint tensors this weight reads."""
        return tuple(p.source for p in self.parts)


@dataclass
class TensorSpec:
    """A named tensor of the graph: its shape, dtype, role and (for weights) where it comes from."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    kind: str
    weight: WeightRef | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"tensor {self.name}: dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.kind not in TENSOR_KINDS:
            raise ValueError(f"tensor {self.name}: kind must be one of {TENSOR_KINDS}, got {self.kind!r}")
        self.shape = tuple(int(s) for s in self.shape)

    @property
    def numel(self) -> int:
        """Number of elements."""
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass
class Op:
    """One op of the graph. ``layer`` is the decoder layer index or None (embedding, head)."""

    kind: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attrs: dict[str, Any] = field(default_factory=dict)
    layer: int | None = None
    name: str = ""


@dataclass
class Graph:
    """The decode-step op graph of one tensor-parallel rank.

    ``inputs`` are fed each step (token ids, positions), ``state`` tensors persist across steps
    (the KV cache), ``outputs`` are read back (logits of the local vocab slice, next token).
    """

    model: str
    family: str
    rank: int
    world_size: int
    batch: int
    max_seq_len: int
    tensors: dict[str, TensorSpec] = field(default_factory=dict)
    ops: list[Op] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    def tensor(self, name: str, shape: Iterable[int], dtype: str, kind: str, weight: WeightRef | None = None) -> str:
        """Declare a tensor and return its name."""
        if name in self.tensors:
            raise ValueError(f"tensor {name!r} declared twice")
        self.tensors[name] = TensorSpec(name, tuple(shape), dtype, kind, weight)
        return name

    def op(self, kind: str, inputs: Iterable[str], outputs: Iterable[str], layer: int | None = None,
           op_name: str | None = None, **attrs: Any) -> Op:
        """Append an op after checking its kind and that every tensor it names exists.

        ``op_name`` (e.g. "o_proj") names the op within its layer; the default is its kind.
        """
        if kind not in OP_KINDS:
            raise ValueError(f"op kind: expected one of {sorted(OP_KINDS)}, got {kind!r}")
        inputs, outputs = tuple(inputs), tuple(outputs)
        for t in inputs + outputs:
            if t not in self.tensors:
                raise ValueError(f"op {kind} (layer {layer}): unknown tensor {t!r}")
        base = op_name or kind
        name = base if layer is None else f"L{layer}.{base}"
        n_same = sum(1 for o in self.ops if o.name.split("#")[0] == name)
        op = Op(kind, inputs, outputs, dict(attrs), layer, name if n_same == 0 else f"{name}#{n_same}")
        self.ops.append(op)
        return op

    def by_kind(self, kind: str) -> list[TensorSpec]:
        """All tensors of one kind (input, weight, activation, state, output), in declaration order."""
        return [t for t in self.tensors.values() if t.kind == kind]

    @property
    def weights(self) -> list[TensorSpec]:
        """Weight tensors in declaration order."""
        return self.by_kind("weight")

    def producers(self) -> dict[str, Op]:
        """Map tensor name -> the last op writing it."""
        out: dict[str, Op] = {}
        for op in self.ops:
            for t in op.outputs:
                out[t] = op
        return out

    def weight_bytes(self) -> int:
        """Bytes of this rank's weights (what a decode step must stream at batch 1)."""
        size = {"bf16": 2, "f16": 2, "f32": 4, "i32": 4}
        return sum(t.numel * size[t.dtype] for t in self.weights)

    def summary(self) -> str:
        """A short human-readable listing of the ops."""
        lines = [f"graph {self.model} rank {self.rank}/{self.world_size} batch {self.batch}: {len(self.ops)} ops"]
        for op in self.ops:
            lines.append(f"  {op.name:28s} {','.join(op.inputs)} -> {','.join(op.outputs)}")
        return "\n".join(lines)

"""The µGraph IR: kernel graph, block graphs, thread-level chains.

Kernel level (device memory): ``KernelOp`` s over named ``TensorInfo`` s. A pre-defined op
(matmul, add, mul, div, sum, chain) is one library kernel; a ``custom`` op holds a ``BlockGraph``.

Block level (one thread block, shared memory):
  * ``grid``: axes ``(symbol, count)``; axis a splits index symbol ``symbol`` into ``count`` parts.
  * ``BlockInput.imap[a]``: the tensor dim split by grid axis a, or None (replicated: every block
    reads the whole extent). ``BlockInput.fmap``: the dim split across the ``loop_count``
    iterations of the for-loop, or None (the same tile every iteration, loaded once).
  * ``body``: ops run in every iteration on iteration tiles; ``accs``: accumulators that carry a
    body tensor out of the loop (``sum`` over iterations; ``last`` and ``max`` exist for tests);
    ``post``: ops after the loop on accumulators and loop-invariant inputs.
  * ``BlockOutput.omap[a]``: the output dim grid axis a concatenates along, or ``STACK``: blocks of
    axis a write separate slices of a new leading dim (partial results a later op reduces).
Thread level: a ``chain`` op is a fused element-wise program kept in registers.

Every op carries ``origin``: the user-level target op it implements (for printed µGraphs and the
comments of generated code).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from mpk_dist.superopt import expr as E
from mpk_dist.superopt.target import chain_text

STACK = -1                  # omap value: grid axis writes a new leading dim
DTYPE_BYTES = 2             # bf16 in device and shared memory
SMEM_LIMIT = 227 * 1024     # bytes of shared memory one H100/H200 block may use


@dataclass(frozen=True)
class TensorInfo:
    """A tensor: shape, index symbols (None for size-1 dims) and canonical abstract expression."""

    shape: tuple
    syms: tuple
    expr: tuple

    def __hash__(self) -> int:
        # NOTE: cached; expressions are deep tuples and the search hashes infos millions of times
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash((self.shape, self.syms, self.expr))
            object.__setattr__(self, "_hash", h)
        return h


@dataclass(frozen=True)
class BlockOp:
    """``out = kind(inputs)`` on block tensors; attrs: dim (sum), prog (chain)."""

    kind: str
    inputs: tuple
    out: str
    info: TensorInfo
    attrs: tuple = ()
    origin: str = ""

    def attr(self, key, default=None):
        return dict(self.attrs).get(key, default)


@dataclass(frozen=True)
class BlockInput:
    """Kernel tensor ``name`` read as block tensor ``local`` with its grid and loop maps."""

    name: str
    local: str
    imap: tuple
    fmap: int | None
    tile: tuple


@dataclass(frozen=True)
class Accumulator:
    """``out`` carries body tensor ``src`` out of the loop; kind: sum | last | max."""

    src: str
    out: str
    kind: str
    info: TensorInfo


@dataclass(frozen=True)
class BlockOutput:
    """Block tensor ``src`` written to kernel tensor ``name`` with grid->dim map ``omap``."""

    src: str
    name: str
    omap: tuple


@dataclass(frozen=True)
class BlockGraph:
    """One custom kernel: a grid of identical thread blocks (see module docstring)."""

    grid: tuple                     # ((symbol, count), ...)
    loop: tuple | None              # (symbol, count) or None
    inputs: tuple
    body: tuple
    accs: tuple
    post: tuple
    outputs: tuple

    @property
    def grid_dims(self) -> tuple:
        return tuple(c for _, c in self.grid) or (1,)

    @property
    def num_blocks(self) -> int:
        n = 1
        for c in self.grid_dims:
            n *= c
        return n

    @property
    def loop_count(self) -> int:
        return self.loop[1] if self.loop else 1

    def ops(self) -> tuple:
        """Body then post ops (accumulators excluded)."""
        return self.body + self.post

    def iter_tile(self, b: "BlockInput") -> tuple:
        """The tile of input ``b`` one for-loop iteration works on."""
        if b.fmap is None:
            return b.tile
        return tuple(s // self.loop_count if d == b.fmap else s for d, s in enumerate(b.tile))

    def smem_bytes(self) -> int:
        """Shared memory one block needs: every input tile (per iteration), intermediate and
        accumulator; chain results stay in registers."""
        n = sum(_numel(self.iter_tile(i)) for i in self.inputs)
        n += sum(_numel(op.info.shape) for op in self.body + self.post if op.kind != "chain")
        n += sum(_numel(a.info.shape) for a in self.accs)
        return n * DTYPE_BYTES

    def text(self, indent: str = "    ", origins: bool = True) -> str:
        """Readable multi-line form (``origins``: each op's target op as a comment)."""
        grid = ", ".join(f"{s}/{c}" for s, c in self.grid) or "1"
        loop = f"{self.loop[0]}/{self.loop[1]}" if self.loop else "none"
        rows = [f"{indent}grid=({grid}) loop={loop} smem={self.smem_bytes() / 1024:.1f}KB"]
        for i in self.inputs:
            imap = ",".join("φ" if d is None else str(d) for d in i.imap) or "-"
            fmap = "φ" if i.fmap is None else str(i.fmap)
            rows.append(f"{indent}in  {i.local} <- {i.name} tile{i.tile} imap=[{imap}] fmap={fmap}")
        for op in self.body:
            rows.append(f"{indent}  for: {_op_text(op, origins)}")
        for a in self.accs:
            rows.append(f"{indent}acc {a.out} = {a.kind}({a.src}) {a.info.shape}")
        for op in self.post:
            rows.append(f"{indent}{_op_text(op, origins)}")
        for o in self.outputs:
            omap = ",".join("stack" if d == STACK else str(d) for d in o.omap) or "-"
            rows.append(f"{indent}out {o.src} -> {o.name} omap=[{omap}]")
        return "\n".join(rows)


def op_call_text(kind: str, attrs: tuple, args: tuple) -> str:
    """``kind[attrs](args)`` as a block op prints in ``BlockGraph.text`` (and so in
    ``UGraph.key``); the canonical op order of the block enumeration compares these strings."""
    return call_text(op_call_name(kind, attrs), args)


def call_text(name: str, args) -> str:
    """``name(args)``: the one place the op call's text is formatted (the canonical order compares it)."""
    return f"{name}({', '.join(args)})"


def op_call_name(kind: str, attrs: tuple) -> str:
    """The ``kind[attrs]`` part of ``op_call_text``."""
    name = _CALL_NAMES.get((kind, attrs))
    if name is None:
        a = dict(attrs)
        if kind == "chain":
            name = f"chain[{chain_text(a['prog'])}]"
        elif kind == "sum":
            name = f"sum[dim={a['dim']}{'' if a.get('keepdim', True) else ',drop'}]"
        else:
            name = kind
        # few distinct (kind, attrs) per search; the canonical order prints ~10^6 op calls
        _CALL_NAMES[(kind, attrs)] = name
    return name


_CALL_NAMES: dict = {}


def _op_text(op: BlockOp, origins: bool = True) -> str:
    src = f"  # {op.origin}" if op.origin and origins else ""
    return f"{op.out} = {op_call_text(op.kind, op.attrs, op.inputs)} {op.info.shape}{src}"


def _numel(shape: tuple) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


@dataclass(frozen=True)
class KernelOp:
    """A kernel-level op: pre-defined (``block`` None) or ``custom`` (``block`` set)."""

    kind: str
    inputs: tuple
    outputs: tuple
    attrs: tuple = ()
    block: BlockGraph | None = None
    origin: str = ""

    def attr(self, key, default=None):
        return dict(self.attrs).get(key, default)

    @property
    def is_custom(self) -> bool:
        return self.block is not None


@dataclass
class UGraph:
    """A µGraph: kernel ops over named tensors, computing ``output`` from ``inputs``."""

    inputs: dict                    # name -> TensorInfo
    kernel_ops: list
    tensors: dict                   # name -> TensorInfo (inputs and op outputs)
    output: str
    cost: dict = field(default_factory=dict)

    def evaluate(self, feeds: dict) -> list:
        """Float64 reference semantics of this exact µGraph: [output array]."""
        from mpk_dist.superopt.interp import run_float

        return run_float(self, feeds)

    def key(self) -> str:
        """A canonical text identifying the graph (costs excluded)."""
        return self.text(with_cost=False)

    def structure_key(self) -> str:
        """``key`` without the ops' origin comments: the graph's structure alone. Why: an op's
        origin is provenance for the reader, and until the fifteenth session ``Target.origin_of``
        answered a partial sum and the full one alike in the order a process asked, so two
        searches printed one graph with different comments (the unpruned attention_decode run of
        2026-12-01); it is a function of the expression now, and comparing structures keeps
        provenance out of the verdict either way."""
        return self.text(with_cost=False, origins=False)

    def text(self, with_cost: bool = True, origins: bool = True) -> str:
        """Readable multi-line form (``origins``: each op's target op as a comment)."""
        head = f"µGraph: {len(self.kernel_ops)} kernel op(s)"
        if with_cost and self.cost:
            c = self.cost
            head += (f", est {c['time_us']:.2f} us, {c['dram_bytes'] / 1e6:.3f} MB from device "
                     f"memory, {c['sync_points']} sync point(s)")
        rows = [head]
        for name, info in self.inputs.items():
            rows.append(f"  input {name} {info.shape}")
        for op in self.kernel_ops:
            outs = ", ".join(op.outputs)
            if op.is_custom:
                rows.append(f"  {outs} = custom({', '.join(op.inputs)})")
                rows.append(op.block.text("      ", origins))
            else:
                extra = ""
                if op.kind == "chain":
                    extra = f"[{chain_text(op.attr('prog'))}]"
                elif op.kind == "sum":
                    extra = f"[dim={op.attr('dim')}{'' if op.attr('keepdim', True) else ',drop'}]"
                src = f"  # {op.origin}" if op.origin and origins else ""
                rows.append(f"  {outs} = {op.kind}{extra}({', '.join(op.inputs)}) "
                            f"{self.tensors[op.outputs[0]].shape}{src}")
        rows.append(f"  output {self.output} {self.tensors[self.output].shape}")
        return "\n".join(rows)

    def __str__(self) -> str:
        return self.text()

    def expression(self) -> str:
        """The output's abstract expression as text."""
        return E.to_text(self.tensors[self.output].expr)

    def to_dict(self) -> dict:
        """Plain nested dicts/tuples of the whole graph (for code generation and JSON dumps)."""
        return asdict(self)

    def with_kernel_ops(self, ops: list) -> "UGraph":
        """A copy with other kernel ops (used to build mutants in tests)."""
        return replace(self, kernel_ops=list(ops), cost={})

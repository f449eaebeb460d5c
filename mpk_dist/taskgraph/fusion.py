"""Fusion pass: which ops of a rank's graph are folded into the linear tiles next to them.

Each fusion removes one task-op, and with it one dependency level of the decode step (the step is a
chain of levels, each costing an event round trip; docs/TASKGRAPH.md, 'Fused linears'):

* ``norm``: rms_norm -> linear becomes one ``norm_linear`` (every tile normalises its B input rows);
* ``silu``: silu_mul -> linear becomes one ``silu_linear`` (the tile computes silu(gate) * up);
* ``residual``: linear -> add (the tp-1 residual add) becomes ``linear_residual`` (or the residual
  epilogue of ``silu_linear``). At tp > 1 the all-reduce adds the residual already.

Opt-in (named explicitly, not part of ``fuse=True`` until verified on a GPU):

* ``attn_prep``: qkv_prep -> attention becomes one ``attention_prep`` task-op (tile = (kv head j,
  sequence b): the q/k norm, rope and KV append of that pair, then its attention), so the qkv_prep
  level disappears. In a split-KV program it lowers to ``attention_split_prep`` tiles (kv head j, range i:
  the q heads computed in the tile, k/v appended by the range holding the position) and the merge
  (``lowering_attn_prep``).
* ``attn_merge``: in a split-KV program the last split tile of each kv head to finish (a ticket word
  counts them) merges the head's partials into the attention output, so the merge level disappears
  (``lowering_attention``; tasks/attention_split.py). A lowering choice: nothing else in the plan changes.

* ``silu_epi``: rms_norm -> linear -> silu_mul (the gate|up projection) becomes one ``norm_linear_silu``:
  each tile owns a block of intermediate columns (their gate and their up weight rows) and writes
  silu(gate) * up itself, so the gate|up activation and the silu_mul level disappear and the down
  projection reads the activation as a plain input (``linear_residual`` at tp 1, a ``linear`` at tp > 1)
  instead of recomputing silu over the whole intermediate size in each of its tiles. Needs ``norm``;
  it takes the silu_mul before ``silu`` could fold it into the down projection.
* ``silu_down`` (with ``silu_epi`` and ``residual``, tp 1): the down projection folded into the gate|up tiles as a
  split-K partial: each ``norm_linear_silu`` tile multiplies its block of activation columns by the matching
  columns of the down weight and adds the fp32 result into the residual stream x_out atomically, which the
  o_proj tiles (``linear_residual``) initialise with x_mid as a second output (``COPY``). The down level and its
  dependency boundary disappear. NOT bit-identical to the unfused pair (the down product is summed in fp32 over
  the tiles in no fixed order instead of rounded once to bf16), so it is opt-in (the megakernel's
  MPK_FUSE_SILU_DOWN=1); measured slower on an H200 (docs/PERF.md v0.35).
* ``flags``: not a fusion of ops but a hand-over: the ``linear_residual`` tiles also write a flagged copy of the
  fp32 residual stream and its norm_linear readers poll it instead of waiting on an event
  (``mpk_dist.taskgraph.flag_words``; the mega-kernel's MPK_FLAG_WORDS=1). Needs ``residual``; the plan ignores it.
  ``flags16`` (with ``flags``; MPK_FLAG_WORDS=2): also the bf16 vectors the down and o_proj projections read.

The pass only plans; ``mpk_dist.taskgraph.lowering_fused`` and ``lowering_attn_prep`` lower the plan.
Numerics are unchanged: every fused kind rounds at exactly the points the unfused ops round. OFF by
default in ``compile_rank_programs``; ``fuse=True`` turns on the ``FUSIONS``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from mpk_dist.errors import InputError
from mpk_dist.graph import Graph, Op

FUSIONS = ("norm", "silu", "residual")
"""Names of the fusions ``fuse=True`` turns on, in the order they are documented."""

OPT_IN_FUSIONS = ("attn_prep", "attn_merge", "silu_epi", "flags", "flags16", "silu_down")
"""Fusions that must be named (``fuse='norm,silu,residual,attn_prep'`` or a list): not GPU-verified yet."""

VEC = 8
"""The fused CUDA bodies load 8 bf16 at a time: K must be a multiple of this (else not fused)."""

STAGE_OFFSET_BYTES = 256
"""Where staged prologue rows start in shared memory (``kStageOffset`` floats in csrc/tasks/fused_gemv.cuh)."""

STAGE_LIMIT = 200 * 1024
"""Largest shared-memory staging (bytes) a prologue fusion may plan for: an H200 block may opt in
to 227 KB. A norm/silu prologue whose B*K bf16 rows would need more is not fused (the unfused pair
is faster than the per-element fallback the kernel would take)."""


def fusion_set(fuse: bool | str | Iterable[str] | None) -> frozenset[str]:
    """Normalise the ``fuse`` option: True = the ``FUSIONS``, False/None = none, or names ('norm,silu',
    a list, or a set such as another call's result) from ``FUSIONS`` and ``OPT_IN_FUSIONS``."""
    if fuse is None or fuse is False:
        return frozenset()
    if fuse is True:
        return frozenset(FUSIONS)
    names = [n.strip() for n in fuse.split(",")] if isinstance(fuse, str) else list(fuse)
    bad = [n for n in names if n not in FUSIONS + OPT_IN_FUSIONS]
    if bad:
        raise InputError(f"fuse: expected True/False or names from {', '.join(FUSIONS + OPT_IN_FUSIONS)}, got {bad}; "
                         "e.g. fuse='norm,silu'")
    if "silu_down" in names and "flags" in names:
        raise InputError("fuse: 'silu_down' and 'flags' do not go together (the folded down projection adds into the "
                         "residual stream, whose flagged copy only linear_residual writes); drop one "
                         "(MPK_FUSE_SILU_DOWN / MPK_FLAG_WORDS)")
    return frozenset(names)


@dataclass
class FusedLinear:
    """A linear op and the ops folded into its tiles (prologue: ``norm`` or ``silu``; epilogue: ``residual``,
    or ``act``: the silu_mul that reads the gate|up output, and with it ``down``: the down projection that
    reads the activation, itself a fused linear_residual; ``copy``: a tensor the residual epilogue also writes)."""

    linear: Op
    norm: Op | None = None
    silu: Op | None = None
    residual: Op | None = None
    act: Op | None = None
    down: "FusedLinear | None" = None
    copy: str | None = None

    @property
    def kind(self) -> str:
        """The task kind that runs it."""
        if self.act is not None:
            return "norm_linear_silu"
        if self.silu is not None:
            return "silu_linear"
        return "norm_linear" if self.norm is not None else "linear_residual"

    @property
    def output(self) -> str:
        """The tensor the fused tiles write (the add's output when the residual is fused, silu_mul's with ``act``)."""
        return (self.act or self.residual or self.linear).outputs[0]

    def residual_input(self) -> str | None:
        """The residual operand of the fused add (its input that is not the linear's output)."""
        if self.residual is None:
            return None
        a, b = self.residual.inputs
        return b if a == self.linear.outputs[0] else a


@dataclass
class FusedAttention:
    """A qkv_prep op and the attention op that reads its outputs, run as one ``attention_prep`` task-op."""

    prep: Op
    attention: Op

    @property
    def kind(self) -> str:
        """The task kind that runs it."""
        return "attention_prep"


def _consumers(graph: Graph) -> dict[str, list[Op]]:
    out: dict[str, list[Op]] = {}
    for op in graph.ops:
        for t in op.inputs:
            out.setdefault(t, []).append(op)
    return out


def _sole_consumer(graph: Graph, cons: dict[str, list[Op]], tensor: str, op: Op) -> bool:
    """``op`` is the only reader of the activation ``tensor`` (so the tensor need not exist)."""
    return graph.tensors[tensor].kind == "activation" and [id(c) for c in cons.get(tensor, [])] == [id(op)]


def _plan_one(graph: Graph, lin: Op, producer: dict[str, Op], cons: dict[str, list[Op]],
              fusions: frozenset[str], taken: set[int]) -> FusedLinear | None:
    """The fused group of one linear (None: nothing folds into it). ``taken``: ids of silu_mul ops an
    earlier gate|up linear folded as its epilogue (not available as a prologue); this call adds its own."""
    x, out = lin.inputs[0], lin.outputs[0]
    K = graph.tensors[lin.inputs[1]].shape[1]
    if K % VEC:
        return None
    f = FusedLinear(lin)
    src = producer.get(x)
    from mpk_dist.taskgraph.lowering import ROW_BLOCK  # (lowering imports this module)

    # A tile stages its own row block's rows (at most ROW_BLOCK: linears over more rows are row-blocked).
    stage_ok = STAGE_OFFSET_BYTES + 2 * min(graph.batch, ROW_BLOCK) * K <= STAGE_LIMIT
    if src is not None and stage_ok and _sole_consumer(graph, cons, x, lin):
        if "norm" in fusions and src.kind == "rms_norm":
            f.norm = src
        elif "silu" in fusions and src.kind == "silu_mul" and id(src) not in taken:
            f.silu = src
    users = cons.get(out, [])
    if ("silu_epi" in fusions and f.norm is not None and len(users) == 1 and users[0].kind == "silu_mul"
            and _sole_consumer(graph, cons, out, users[0])):
        f.act = users[0]
        taken.add(id(f.act))
        return f
    if ("residual" in fusions and f.norm is None and len(users) == 1 and users[0].kind == "add"
            and _sole_consumer(graph, cons, out, users[0])):
        add = users[0]
        other = add.inputs[1] if add.inputs[0] == out else add.inputs[0]
        if graph.tensors[add.outputs[0]].dtype == "f32" and graph.tensors[other].dtype == "f32":
            f.residual = add
    return f if (f.norm or f.silu or f.residual) else None


def _plan_attention(graph: Graph, attn: Op, producer: dict[str, Op], cons: dict[str, list[Op]]) -> FusedAttention | None:
    """qkv_prep -> attention when the attention reads exactly the prep's q and caches and nothing else
    reads q (so the q rows may be written and read inside one tile)."""
    prep = producer.get(attn.inputs[0])
    if prep is None or prep.kind != "qkv_prep" or list(attn.inputs[:3]) != list(prep.outputs):
        return None
    if attn.inputs[3] != prep.inputs[1] or not _sole_consumer(graph, cons, attn.inputs[0], attn):
        return None
    return FusedAttention(prep, attn)


def plan(graph: Graph, fuse: bool | str | Iterable[str] | None) -> list[Op | FusedLinear | FusedAttention]:
    """The ops of ``graph`` in order, with each fused group replaced by one ``FusedLinear`` at the
    linear's place, or one ``FusedAttention`` at the attention's place (the ops they absorb are
    dropped). ``fuse`` as in ``fusion_set``."""
    fusions = fusion_set(fuse)
    if not fusions:
        return list(graph.ops)
    producer = {t: op for op in graph.ops for t in op.outputs}
    cons = _consumers(graph)
    fused: dict[int, FusedLinear | FusedAttention] = {}
    taken: set[int] = set()  # silu_mul ops folded as an epilogue (the gate|up linear comes before its down)
    for op in graph.ops:
        f = None
        if op.kind == "linear":
            f = _plan_one(graph, op, producer, cons, fusions, taken)
        elif op.kind == "attention" and "attn_prep" in fusions:
            f = _plan_attention(graph, op, producer, cons)
        if f is not None:
            fused[id(op)] = f
    absorbed = {id(o) for f in fused.values()
                for o in ((f.prep,) if isinstance(f, FusedAttention) else (f.norm, f.silu, f.residual, f.act)) if o is not None}
    if "silu_down" in fusions:
        absorbed |= _fold_down(list(fused.values()), cons)
    return [fused.get(id(op), op) for op in graph.ops if id(op) not in absorbed]


def _fold_down(groups: list, cons: dict[str, list[Op]]) -> set[int]:
    """Fusion 'silu_down': each down projection (a linear_residual group) whose activation comes from a
    norm_linear_silu group and whose residual from another linear_residual group (the o_proj) is folded into
    the former, the latter writing its output to the down's output too. Returns the ids of the folded linears."""
    by_output = {f.output: f for f in groups if isinstance(f, FusedLinear)}
    folded = set()
    for fd in groups:
        if not isinstance(fd, FusedLinear) or fd.kind != "linear_residual":
            continue
        fg, fo = by_output.get(fd.linear.inputs[0]), by_output.get(fd.residual_input())
        if fg is None or fg.act is None or fg.down is not None or fo is None or fo.kind != "linear_residual":
            continue
        if [id(c) for c in cons.get(fg.output, [])] != [id(fd.linear)] or fo.copy is not None:
            continue
        fg.down, fo.copy = fd, fd.output
        folded.add(id(fd.linear))
    return folded


def dropped_tensors(items: list[Op | FusedLinear | FusedAttention]) -> set[str]:
    """Activations no task reads or writes once the plan is lowered (their buffers are not declared;
    a ``FusedAttention`` keeps q: its tiles write and read it)."""
    out: set[str] = set()
    for f in items:
        if isinstance(f, FusedLinear):
            if f.norm is not None or f.silu is not None:
                out.add(f.linear.inputs[0])
            if f.residual is not None or f.act is not None:
                out.add(f.linear.outputs[0])
            if f.down is not None:
                out.add(f.down.linear.outputs[0])
    return out

STAGING_KINDS = ("norm_linear", "silu_linear", "norm_linear_silu")

PAIR_ALIGN = 16
"""norm_linear_silu keeps its tile's rounded gate|up sums (B x N_TILE bf16) in shared memory after the staged
rows, at the next multiple of this (``kPairAlign`` in csrc/tasks/norm_linear_silu.cuh)."""


def pair_offset(batch, k):
    """Byte offset of norm_linear_silu's gate|up sums in dynamic shared memory: after the staged rows."""
    return -(-(STAGE_OFFSET_BYTES + 2 * batch * k) // PAIR_ALIGN) * PAIR_ALIGN


def staging_bytes(cg, limit: int) -> int:
    """Dynamic shared memory the fused tiles of a compiled program want for staging their prologue
    (the reduction scratch plus B*K bf16; norm_linear_silu also its B*N_TILE gate|up sums after them), the
    largest such need that is <= ``limit`` (the device's per-block maximum minus what else the kernel
    keeps there); 0 without staging tiles. A tile that needs more than the launch provides computes its
    prologue per element instead (same result, slower), so the runtime should size its dynamic shared
    memory to at least this."""
    from mpk_dist.taskgraph.tasks import kind_params

    best = 0
    for name in STAGING_KINDS:
        p = kind_params(cg, name, "BATCH", "K", "N_TILE")
        if p is None:
            continue
        need = STAGE_OFFSET_BYTES + 2 * p[0] * p[1]
        if name == "norm_linear_silu":
            need = pair_offset(p[0], p[1]) + 2 * p[0] * p[2]
        fits = need[need <= limit]
        best = max(best, int(fits.max(initial=0)))
    return best

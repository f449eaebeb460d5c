"""Llama (incl. Llama-3.x) decoder: the op graph of one tensor-parallel rank.

The model itself knows the shard plan only through weight references and local sizes; the
communication ops (all_reduce after row-parallel linears, all_gather of argmax candidates) are the
only places ranks meet.
"""

from __future__ import annotations

from dataclasses import dataclass

from mpk_dist.config import ModelConfig
from mpk_dist.graph import Graph, WeightRef, WeightSlice
from mpk_dist.sharding import ShardPlan, plan_shards

_DT = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}


def _rows(source: str, start: int, stop: int) -> WeightSlice:
    return WeightSlice(source, 0, start, stop)


def _cols(source: str, start: int, stop: int) -> WeightSlice:
    return WeightSlice(source, 1, start, stop)


def _whole(source: str) -> WeightRef:
    return WeightRef((WeightSlice(source, -1, 0, 0),))


class _Builder:
    """Shared state while emitting one rank's graph."""

    def __init__(self, cfg: ModelConfig, plan: ShardPlan, graph: Graph, qk_norm: bool, paged: "PagedSpec | None" = None):
        self.cfg, self.plan, self.g, self.qk_norm = cfg, plan, graph, qk_norm
        self.dt = _DT[cfg.dtype]
        # NOTE: the residual stream is kept in fp32. In bf16 every residual add rounds the whole
        # stream, and two correct implementations whose sums differ in the last fp32 bit then
        # drift apart by ~1 bf16 ulp per element per layer (seen: ~8% of the logits' std on
        # qwen3-0.6b shapes). In fp32 the stream carries no such noise; norms still feed bf16
        # activations to the linears, so weight traffic is unchanged.
        self.res = "f32"
        self.B = graph.batch
        self.paged = paged
        self.gather_last = True

    def act(self, name: str, *shape: int, dtype: str | None = None) -> str:
        return self.g.tensor(name, (self.B, *shape), dtype or self.dt, "activation")

    def weight(self, name: str, shape: tuple[int, ...], ref: WeightRef) -> str:
        return self.g.tensor(name, shape, self.dt, "weight", ref)

    def reduce(self, partial: str, residual: str | None, out: str, layer: int | None, name: str) -> None:
        """Sum partials over ranks (+ residual once); at tp 1 this is a plain add."""
        if self.plan.tp == 1:
            if residual is None:
                raise AssertionError("tp 1 reduce without residual is the identity; callers avoid it")
            self.g.op("add", [partial, residual], [out], layer, op_name=name)
        else:
            ins = [partial] if residual is None else [partial, residual]
            self.g.op("all_reduce", ins, [out], layer, op_name=name)


def _embedding(b: _Builder) -> str:
    c, p, g = b.cfg, b.plan, b.g
    g.tensor("tokens", (b.B,), "i32", "input")
    g.tensor("positions", (b.B,), "i32", "input")
    if b.paged is not None:
        _paged_inputs(b)
    table = b.weight("embed", (p.vocab_size, c.hidden_size), WeightRef((_rows("model.embed_tokens.weight", p.vocab_start, p.vocab_start + p.vocab_size),)))
    if p.tp == 1:
        x = b.act("x0", c.hidden_size, dtype=b.res)
        g.op("embedding", ["tokens", table], [x], None, vocab_start=p.vocab_start)
        return x
    part = b.act("embed_partial", c.hidden_size, dtype=b.res)
    g.op("embedding", ["tokens", table], [part], None, vocab_start=p.vocab_start)
    x = b.act("x0", c.hidden_size, dtype=b.res)
    b.reduce(part, None, x, None, "embed_reduce")
    return x


def _attention_block(b: _Builder, i: int, x: str) -> str:
    c, p, g = b.cfg, b.plan, b.g
    D, hq, hkv = c.head_dim, p.q_heads, p.kv_heads
    pre = f"model.layers.{i}."
    ln = b.weight(f"L{i}.ln1", (c.hidden_size,), _whole(pre + "input_layernorm.weight"))
    h = b.act(f"L{i}.h_attn", c.hidden_size)
    g.op("rms_norm", [x, ln], [h], i, op_name="attn_norm", eps=c.rms_norm_eps)
    q0, k0 = p.q_head_start * D, p.kv_head_start * D
    wqkv = b.weight(f"L{i}.wqkv", ((hq + 2 * hkv) * D, c.hidden_size), WeightRef((
        _rows(pre + "self_attn.q_proj.weight", q0, q0 + hq * D),
        _rows(pre + "self_attn.k_proj.weight", k0, k0 + hkv * D),
        _rows(pre + "self_attn.v_proj.weight", k0, k0 + hkv * D),
    )))
    qkv = b.act(f"L{i}.qkv", (hq + 2 * hkv) * D)
    g.op("linear", [h, wqkv], [qkv], i, op_name="qkv_proj")
    o = _paged_attention(b, i, qkv, pre) if b.paged is not None else _static_attention(b, i, qkv, pre)
    wo = b.weight(f"L{i}.wo", (c.hidden_size, hq * D), WeightRef((_cols(pre + "self_attn.o_proj.weight", q0, q0 + hq * D),)))
    part = b.act(f"L{i}.o_partial", c.hidden_size)
    g.op("linear", [o, wo], [part], i, op_name="o_proj")
    out = b.act(f"L{i}.x_mid", c.hidden_size, dtype=b.res)
    b.reduce(part, x, out, i, "attn_reduce")
    return out


def _qkv_attrs(b: _Builder) -> dict:
    """Attributes of a qkv_prep / qkv_prep_paged op (heads, q/k norm, rope parameters)."""
    c, p, rope = b.cfg, b.plan, b.cfg.rope
    return dict(q_heads=p.q_heads, kv_heads=p.kv_heads, head_dim=c.head_dim, qk_norm=b.qk_norm, eps=c.rms_norm_eps,
                rope_theta=rope.theta, rope_type=rope.rope_type, rope_factor=rope.factor,
                rope_low_freq_factor=rope.low_freq_factor, rope_high_freq_factor=rope.high_freq_factor,
                rope_original_max_pos=rope.original_max_position_embeddings)


def _qk_norm_weights(b: _Builder, i: int, pre: str) -> list[str]:
    if not b.qk_norm:
        return []
    D = b.cfg.head_dim
    return [b.weight(f"L{i}.q_norm", (D,), _whole(pre + "self_attn.q_norm.weight")),
            b.weight(f"L{i}.k_norm", (D,), _whole(pre + "self_attn.k_norm.weight"))]


def _static_attention(b: _Builder, i: int, qkv: str, pre: str) -> str:
    """qkv_prep + attention over a static per-sequence cache [B, S, Hkv, D] (the default graph)."""
    g, D, hq, hkv = b.g, b.cfg.head_dim, b.plan.q_heads, b.plan.kv_heads
    kc = g.tensor(f"L{i}.k_cache", (b.B, g.max_seq_len, hkv, D), b.dt, "state")
    vc = g.tensor(f"L{i}.v_cache", (b.B, g.max_seq_len, hkv, D), b.dt, "state")
    q = b.act(f"L{i}.q", hq * D)
    ins = [qkv, "positions", *_qk_norm_weights(b, i, pre)]
    g.op("qkv_prep", [*ins, kc, vc], [q, kc, vc], i, **_qkv_attrs(b))
    o = b.act(f"L{i}.attn_out", hq * D)
    g.op("attention", [q, kc, vc, "positions"], [o], i, q_heads=hq, kv_heads=hkv, head_dim=D, scale=D ** -0.5)
    return o


def _paged_attention(b: _Builder, i: int, qkv: str, pre: str) -> str:
    """qkv_prep_paged + paged_attention over this layer's page pools [NP, P, Hkv, D]."""
    g, D, hq, hkv, ps = b.g, b.cfg.head_dim, b.plan.q_heads, b.plan.kv_heads, b.paged
    kp = g.tensor(f"L{i}.k_pages", (ps.num_pages, ps.page_size, hkv, D), b.dt, "state")
    vp = g.tensor(f"L{i}.v_pages", (ps.num_pages, ps.page_size, hkv, D), b.dt, "state")
    q = b.act(f"L{i}.q", hq * D)
    ins = [qkv, "positions", "seq_slots", "page_table", *_qk_norm_weights(b, i, pre)]
    g.op("qkv_prep_paged", [*ins, kp, vp], [q, kp, vp], i, page_size=ps.page_size, **_qkv_attrs(b))
    o = b.act(f"L{i}.attn_out", hq * D)
    g.op("paged_attention", [q, kp, vp, "positions", "seq_slots", "page_table"], [o], i, q_heads=hq, kv_heads=hkv,
         head_dim=D, scale=D ** -0.5, page_size=ps.page_size)
    return o


def _mlp_block(b: _Builder, i: int, x: str) -> str:
    c, p, g = b.cfg, b.plan, b.g
    pre = f"model.layers.{i}."
    ln = b.weight(f"L{i}.ln2", (c.hidden_size,), _whole(pre + "post_attention_layernorm.weight"))
    h = b.act(f"L{i}.h_mlp", c.hidden_size)
    g.op("rms_norm", [x, ln], [h], i, op_name="mlp_norm", eps=c.rms_norm_eps)
    s, n = p.inter_start, p.inter_size
    wgu = b.weight(f"L{i}.wgate_up", (2 * n, c.hidden_size), WeightRef((
        _rows(pre + "mlp.gate_proj.weight", s, s + n), _rows(pre + "mlp.up_proj.weight", s, s + n))))
    gu = b.act(f"L{i}.gate_up", 2 * n)
    g.op("linear", [h, wgu], [gu], i, op_name="gate_up_proj")
    a = b.act(f"L{i}.act", n)
    g.op("silu_mul", [gu], [a], i)
    wd = b.weight(f"L{i}.wdown", (c.hidden_size, n), WeightRef((_cols(pre + "mlp.down_proj.weight", s, s + n),)))
    part = b.act(f"L{i}.down_partial", c.hidden_size)
    g.op("linear", [a, wd], [part], i, op_name="down_proj")
    out = b.act(f"L{i}.x_out", c.hidden_size, dtype=b.res)
    b.reduce(part, x, out, i, "mlp_reduce")
    return out


def _head(b: _Builder, x: str) -> None:
    c, p, g = b.cfg, b.plan, b.g
    if b.paged is not None and b.gather_last:
        # Only each sequence's last token of the pass needs logits: pick those rows first, and the
        # head runs over max_seqs rows instead of max_tokens.
        b.B = b.paged.max_seqs
        last = b.act("x_last", c.hidden_size, dtype=b.res)  # fp32 like the stream it is cut from
        g.op("gather_rows", [x, "logit_rows"], [last], None)
        x = last
    ln = b.weight("final_norm", (c.hidden_size,), _whole("model.norm.weight"))
    h = b.act("h_final", c.hidden_size)
    g.op("rms_norm", [x, ln], [h], None, op_name="final_norm", eps=c.rms_norm_eps)
    src = "model.embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight"
    w = b.weight("lm_head", (p.vocab_size, c.hidden_size), WeightRef((_rows(src, p.vocab_start, p.vocab_start + p.vocab_size),)))
    logits = g.tensor("logits", (b.B, p.vocab_size), "f32", "output")
    g.op("linear", [h, w], [logits], None, op_name="lm_head")
    cand = b.act("argmax_cand", 2, dtype="f32")
    g.op("argmax_partial", [logits], [cand], None, vocab_start=p.vocab_start)
    cands = g.tensor("argmax_cands", (p.tp, b.B, 2), "f32", "activation")
    g.op("all_gather", [cand], [cands], None)
    g.tensor("next_token", (b.B,), "i32", "output")
    g.op("argmax_select", [cands], ["next_token"], None)


@dataclass(frozen=True)
class PagedSpec:
    """Sizes of a paged-KV graph (docs/SERVING.md).

    ``max_tokens``: tokens per pass (N; decode tokens and prompt chunks together); ``max_seqs``:
    sequences (page-table rows, MB); ``num_pages``: pages per layer pool (NP); ``page_size``:
    positions per page (P); ``max_pages_per_seq``: page-table columns (MP).
    """

    max_tokens: int
    max_seqs: int
    num_pages: int
    page_size: int
    max_pages_per_seq: int

    def __post_init__(self) -> None:
        for name in ("max_tokens", "max_seqs", "num_pages", "page_size", "max_pages_per_seq"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"paged graph {name}: expected >= 1, got {getattr(self, name)}")


def _paged_inputs(b: _Builder) -> None:
    """Per-pass inputs of a paged graph: token -> slot map, page table, rows that get logits."""
    ps, g = b.paged, b.g
    g.tensor("seq_slots", (ps.max_tokens,), "i32", "input")
    g.tensor("page_table", (ps.max_seqs, ps.max_pages_per_seq), "i32", "input")
    if b.gather_last:
        g.tensor("logit_rows", (ps.max_seqs,), "i32", "input")


def build_paged_graph(cfg: ModelConfig, spec: PagedSpec, tp: int = 1, rank: int = 0, name: str = "",
                      gather_last: bool = True) -> Graph:
    """One rank's op graph over a RAGGED batch with a paged KV cache (opt-in; see graph/ops.py).

    Token activations have ``spec.max_tokens`` rows, the head (final norm, lm_head, argmax) has
    ``spec.max_seqs`` rows (one per sequence: ``logit_rows`` picks its last token of the pass). The
    KV cache of layer i is ``L{i}.k_pages`` / ``L{i}.v_pages`` [NP, P, Hkv, D]. Weights are the same
    tensors as ``build_graph``'s. Qwen3 (q/k norm) and Llama families.
    """
    if cfg.family not in ("llama", "qwen3"):
        raise ValueError(f"paged graph: expected family llama or qwen3, got {cfg.family!r}")
    plan = plan_shards(cfg, tp, rank)
    g = Graph(model=name or cfg.family, family=cfg.family, rank=rank, world_size=tp, batch=spec.max_tokens,
              max_seq_len=spec.page_size * spec.max_pages_per_seq)
    g.meta.update(config=cfg, plan=plan, paged=spec)
    b = _Builder(cfg, plan, g, cfg.family == "qwen3", paged=spec)
    b.gather_last = gather_last
    x = _embedding(b)
    for i in range(cfg.num_layers):
        x = _attention_block(b, i, x)
        x = _mlp_block(b, i, x)
    _head(b, x)
    return g


def build_graph(cfg: ModelConfig, tp: int = 1, rank: int = 0, batch: int = 1, max_seq_len: int = 512,
                name: str = "llama", qk_norm: bool = False) -> Graph:
    """The decode-step op graph of rank ``rank`` of a ``tp``-way sharded Llama-family model."""
    plan = plan_shards(cfg, tp, rank)
    g = Graph(model=name, family=cfg.family, rank=rank, world_size=tp, batch=batch, max_seq_len=max_seq_len)
    g.meta.update(config=cfg, plan=plan)
    b = _Builder(cfg, plan, g, qk_norm)
    x = _embedding(b)
    for i in range(cfg.num_layers):
        x = _attention_block(b, i, x)
        x = _mlp_block(b, i, x)
    _head(b, x)
    return g

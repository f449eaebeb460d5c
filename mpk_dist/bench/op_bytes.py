"""Bytes each op of a decode step must read, per tensor-parallel rank: the per-op split of ``runner.step_bytes``.

``mpk-dist trace-summary --levels STEP --bandwidth GBS`` sets each op's time in a trace against these bytes at the
read bandwidth (its floor), so a trace says which levels hold a step above the memory-bandwidth floor. The trace
carries them (``megakernel_backend._write_trace``: ``otherData["op_bytes"]``).

Op names are the task graph's, without the layer prefix: ``qkv_proj``, ``attention``, ``o_proj``,
``gate_up_proj``, ``down_proj`` (every layer); ``embedding`` and ``lm_head`` (once a step). A norm's weights count
with the linear they feed (the fused programs read them there), the q/k norms' with ``attention`` (read by the
prep of the attention tiles or of qkv_prep). ``attention``'s cache rows depend on the context:
``kv_bytes_per_position`` gives them per position and layer.
"""

from __future__ import annotations

import re

# tensor name (inside model.layers.<i>.) -> the op that reads it
_LAYER_OPS = (
    (re.compile(r"^self_attn\.(q|k|v)_proj\."), "qkv_proj"),
    (re.compile(r"^input_layernorm\."), "qkv_proj"),
    (re.compile(r"^self_attn\.(q|k)_norm\."), "attention"),
    (re.compile(r"^self_attn\.o_proj\."), "o_proj"),
    (re.compile(r"^mlp\.(gate|up)_proj\."), "gate_up_proj"),
    (re.compile(r"^post_attention_layernorm\."), "gate_up_proj"),
    (re.compile(r"^mlp\.down_proj\."), "down_proj"),
)
_LAYER_PREFIX = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def element_bytes(cfg) -> int:
    """Bytes of one weight or cache element of the model's dtype (float32: 4, bf16 / fp16: 2)."""
    return 4 if cfg.dtype == "float32" else 2


def op_bytes(cfg, tp: int, batch: int) -> dict[str, int]:
    """Weight bytes one rank reads per op: a layer op's bytes for ONE layer (every layer has the same), and
    ``embedding`` (the batch's looked-up rows) and ``lm_head`` (with the final norm; the whole table when tied)
    once a step. Weights are split evenly over the ``tp`` ranks (the sharded matrices; norms are small). Raises
    ValueError for a tensor no op reads (a new architecture's name)."""
    from mpk_dist.weights import expected_tensors

    if tp < 1 or batch < 1:
        raise ValueError(f"op_bytes: expected tp >= 1 and batch >= 1, got tp={tp}, batch={batch}")
    elt = element_bytes(cfg)
    out: dict[str, int] = {}
    for name, shape in expected_tensors(cfg).items():
        n = 1
        for s in shape:
            n *= s
        m = _LAYER_PREFIX.match(name)
        if m:
            if int(m.group(1)) != 0:
                continue  # every layer reads the same: count layer 0's
            op = next((o for pat, o in _LAYER_OPS if pat.match(m.group(2))), None)
            if op is None:
                raise ValueError(f"op_bytes: no op reads tensor {name!r}; expected one of the Llama/Qwen layer tensors")
            out[op] = out.get(op, 0) + n * elt
        elif name == "model.embed_tokens.weight":
            out["embedding"] = out.get("embedding", 0) + batch * cfg.hidden_size * elt
            if cfg.tie_word_embeddings:
                out["lm_head"] = out.get("lm_head", 0) + n * elt
        elif name in ("lm_head.weight", "model.norm.weight"):
            out["lm_head"] = out.get("lm_head", 0) + n * elt
        else:
            raise ValueError(f"op_bytes: no op reads tensor {name!r}")
    return {k: (v if k == "embedding" else v // tp) for k, v in out.items()}


def kv_bytes_per_position(cfg, tp: int, batch: int) -> int:
    """Cache bytes one rank's attention reads per layer and context position (k and v of its kv heads; heads
    replicated where tp exceeds them, as ``runner.step_bytes`` counts)."""
    kv_heads_rank = max(cfg.num_kv_heads, tp) // tp
    return 2 * kv_heads_rank * cfg.head_dim * batch * element_bytes(cfg)

"""Op kinds of the per-rank graph and their exact semantics.

All shapes are per rank. Row-wise ops act on the last axis and broadcast over leading axes, so the
same graph serves decode ([B, N]) and prefill ([B, T, N]).

| kind | inputs -> outputs | semantics |
|---|---|---|
| embedding | tokens[B] i32, table[V, H] -> x[B, H] | x = table[tok - vocab_start] if the id is in this rank's slice, else 0 |
| all_reduce | partial[B, N] (, residual[B, N]) -> y[B, N] | y = sum over ranks of partial, + residual (added once) |
| rms_norm | x[B, N], w[N] -> y[B, N] | y = w * round(x / sqrt(mean(x^2) + eps)), statistics in fp32 |
| linear | x[B, K], w[N, K] -> y[B, N] | y = x @ w.T, fp32 accumulation, rounded once to y's dtype (fp32 logits are not rounded) |
| qkv_prep | qkv[B, (Hq+2Hkv)D], pos[B] (, q_norm[D], k_norm[D]), k_cache, v_cache -> q[B, Hq D], k_cache, v_cache | split q|k|v; optional per-head rms_norm of q and k; rope on q and k; write k, v at pos into the caches |
| attention | q[B, Hq D], k_cache[B, S, Hkv, D], v_cache, pos[B] -> o[B, Hq D] | causal attention of each query over cache positions 0..pos, GQA (query head h reads kv head h // (Hq/Hkv)) |
| silu_mul | gu[B, 2I] -> a[B, I] | a = silu(gu[:, :I]) * gu[:, I:] |
| add | a, b -> y | y = a + b |
| argmax_partial | logits[B, V] -> cand[B, 2] f32 | (max value, vocab_start + first index of the max) of this rank's slice |
| all_gather | x[...] -> y[world, ...] | y[r] = x of rank r |
| argmax_select | cands[world, B, 2] -> token[B] i32 | the candidate with the largest value; ties go to the lowest index |

Token indices in ``cand`` are stored as float32, exact below 2**24 (far above any vocabulary).

Precision: every op computes in fp32 from its inputs and rounds its output once to the output
tensor's dtype. The residual stream (embedding output, all_reduce/add outputs) is fp32 even in
bf16 models; the norms hand bf16 activations to the linears.

Paged KV cache (opt-in: ``models.llama.build_paged_graph``, see docs/SERVING.md). The batch is RAGGED:
N tokens of up to MB sequences in one pass (decode tokens and prompt chunks mixed); token i belongs
to the sequence in page-table row ``slot[i]`` (-1 = padding token) and sits at position ``pos[i]``.
The KV cache of a layer is a pool of pages [NP, P, Hkv, D]; ``page_table[s, j]`` is the page holding
positions j*P .. j*P+P-1 of the sequence in slot s.

| kind | inputs -> outputs | semantics |
|---|---|---|
| qkv_prep_paged | qkv[N, (Hq+2Hkv)D], pos[N], slot[N], page_table[MB, MP] (, q_norm, k_norm), k_pages[NP, P, Hkv, D], v_pages -> q[N, Hq D], k_pages, v_pages | as qkv_prep; k, v of token i go to page page_table[slot[i], pos[i] // P], row pos[i] % P; padding tokens write nothing |
| paged_attention | q[N, Hq D], k_pages, v_pages, pos[N], slot[N], page_table -> o[N, Hq D] | token i attends over positions 0..pos[i] of sequence slot[i] (GQA as attention); every token's k, v of the pass is written before any is read, so a prompt chunk is causal within itself; padding tokens give o = 0 |
| gather_rows | x[N, C], rows[R] i32 -> y[R, C] | y[r] = x[rows[r]]; rows[r] < 0 gives a zero row (picks each sequence's last token before the head) |
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OpKind:
    """Static facts about an op kind used by passes (communication or not, state it writes)."""

    name: str
    is_comm: bool = False
    writes_state: bool = False


OP_KINDS: dict[str, OpKind] = {
    k.name: k
    for k in (
        OpKind("embedding"),
        OpKind("all_reduce", is_comm=True),
        OpKind("rms_norm"),
        OpKind("linear"),
        OpKind("qkv_prep", writes_state=True),
        OpKind("attention"),
        OpKind("silu_mul"),
        OpKind("add"),
        OpKind("argmax_partial"),
        OpKind("all_gather", is_comm=True),
        OpKind("argmax_select"),
        # paged KV cache (opt-in graphs only)
        OpKind("qkv_prep_paged", writes_state=True),
        OpKind("paged_attention"),
        OpKind("gather_rows"),
    )
}

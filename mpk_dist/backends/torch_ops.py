"""Reference semantics of every op kind in torch (see ``mpk_dist.graph.ops`` for the table).

These functions are the ground truth for the other backends: the task-graph interpreter checks its
tiles against them and the mega-kernel is compared with them. Precision follows Hugging Face's
Llama/Qwen3 code: norms and softmax in fp32, matmuls in the model dtype with fp32 accumulation,
rope tables in fp32. Activations carry an optional token axis: decode [B, N], prefill [B, T, N].
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F


def embedding(tokens: torch.Tensor, table: torch.Tensor, vocab_start: int) -> torch.Tensor:
    """Rows of this rank's vocab slice; ids outside the slice give zero rows (summed by all_reduce)."""
    local = tokens.long() - vocab_start
    inside = (local >= 0) & (local < table.shape[0])
    rows = table[local.clamp(0, table.shape[0] - 1)]
    return rows * inside.unsqueeze(-1).to(rows.dtype)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """y = w * round(x / sqrt(mean(x^2) + eps)) over the last axis: statistics in fp32, the
    normalised row rounded to the weight's dtype before the multiply (HF's RMSNorm order)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(w.dtype)


# device type -> whether torch.mm(..., out_dtype=torch.float32) works there (set by probe_fp32_out).
_MM_FP32_OUT: dict[str, bool] = {}


def probe_fp32_out(device: torch.device) -> bool:
    """Find out once per device type whether bf16 x bf16 -> fp32 matmuls (no rounding) are native."""
    kind = torch.device(device).type
    if kind not in _MM_FP32_OUT:
        a = torch.ones(2, 8, dtype=torch.bfloat16, device=device)
        try:
            _MM_FP32_OUT[kind] = torch.mm(a, a.t(), out_dtype=torch.float32).dtype == torch.float32
        except (RuntimeError, NotImplementedError, TypeError):
            _MM_FP32_OUT[kind] = False
    return _MM_FP32_OUT[kind]


def linear(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """y = x @ w.T with fp32 accumulation, rounded once to the weight dtype; an fp32 ``out_dtype``
    (the logits) keeps the fp32 result unrounded."""
    x = x.to(w.dtype)
    if out_dtype == torch.float32 and w.dtype != torch.float32:
        if _MM_FP32_OUT.get(x.device.type):
            flat = torch.mm(x.reshape(-1, x.shape[-1]), w.t(), out_dtype=torch.float32)
            return flat.reshape(*x.shape[:-1], w.shape[0])
        return torch.matmul(x.float(), w.float().t())
    y = torch.matmul(x, w.t())
    return y if out_dtype is None else y.to(out_dtype)


def rope_inv_freq(head_dim: int, theta: float, rope_type: str = "default", factor: float = 1.0,
                  low_freq_factor: float = 1.0, high_freq_factor: float = 4.0,
                  original_max_pos: int = 8192) -> torch.Tensor:
    """Inverse frequencies [D/2] in fp32, with Llama-3.1's 'llama3' long-context scaling."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope_type == "default":
        return inv
    # llama3: keep high frequencies, divide low ones by factor, interpolate in between.
    low_wavelen = original_max_pos / low_freq_factor
    high_wavelen = original_max_pos / high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (original_max_pos / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


_ROPE_KEYS = ("head_dim", "rope_theta", "rope_type", "rope_factor", "rope_low_freq_factor",
              "rope_high_freq_factor", "rope_original_max_pos")
# (rope attrs, device) -> inverse frequencies already on that device. NOTE: a host-to-device copy
# inside a CUDA-graph capture is an error, so the table is made once, outside any capture (the
# eager warm-up step fills this cache).
_INV_FREQ_CACHE: dict[tuple, torch.Tensor] = {}


def rope_attrs_inv_freq(attrs: dict, device: torch.device | str = "cpu") -> torch.Tensor:
    """``rope_inv_freq`` from the attrs of a qkv_prep op, on ``device`` (cached)."""
    key = (*(attrs[k] for k in _ROPE_KEYS), str(device))
    if key not in _INV_FREQ_CACHE:
        _INV_FREQ_CACHE[key] = rope_inv_freq(*(attrs[k] for k in _ROPE_KEYS)).to(device)
    return _INV_FREQ_CACHE[key]


def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate-half rope (HF convention) of x [..., heads, D] at positions [...]."""
    freqs = positions.float().unsqueeze(-1) * inv_freq  # [..., D/2]; inv_freq is on x's device
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos().to(x.dtype).unsqueeze(-2), emb.sin().to(x.dtype).unsqueeze(-2)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def qkv_prep(qkv: torch.Tensor, positions: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
             k_cache: torch.Tensor, v_cache: torch.Tensor, attrs: dict) -> torch.Tensor:
    """Split q|k|v, per-head norm (Qwen3), rope, write k and v into the caches; returns q [.., Hq*D]."""
    q, k, v = split_norm_rope(qkv, positions, q_norm, k_norm, attrs)
    write_kv(k_cache, v_cache, k, v, positions)
    return q.reshape(*qkv.shape[:-1], attrs["q_heads"] * attrs["head_dim"])


def split_norm_rope(qkv: torch.Tensor, positions: torch.Tensor, q_norm: torch.Tensor | None,
                    k_norm: torch.Tensor | None, attrs: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [.., Hq, D], k [.., Hkv, D] (per-head norm if ``qk_norm``, then rope) and v [.., Hkv, D]."""
    hq, hkv, d = attrs["q_heads"], attrs["kv_heads"], attrs["head_dim"]
    lead = qkv.shape[:-1]
    q = qkv[..., : hq * d].reshape(*lead, hq, d)
    k = qkv[..., hq * d: (hq + hkv) * d].reshape(*lead, hkv, d)
    v = qkv[..., (hq + hkv) * d:].reshape(*lead, hkv, d)
    if attrs.get("qk_norm"):
        q = rms_norm(q, q_norm, attrs["eps"])
        k = rms_norm(k, k_norm, attrs["eps"])
    inv = rope_attrs_inv_freq(attrs, qkv.device)
    return apply_rope(q, positions, inv), apply_rope(k, positions, inv), v


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
    """k_cache[b, pos[b, t]] = k[b, t] (same for v); positions [B] or [B, T]."""
    if positions.dim() == 1:
        positions, k, v = positions[:, None], k[:, None], v[:, None]
    b_idx = torch.arange(k_cache.shape[0], device=k_cache.device)[:, None].expand_as(positions)
    k_cache[b_idx, positions.long()] = k.to(k_cache.dtype)
    v_cache[b_idx, positions.long()] = v.to(v_cache.dtype)


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor, attrs: dict) -> torch.Tensor:
    """Causal GQA attention of queries at ``positions`` over cache entries 0..pos (inclusive)."""
    hq, hkv, d = attrs["q_heads"], attrs["kv_heads"], attrs["head_dim"]
    decode = positions.dim() == 1
    if decode:
        q, positions = q[:, None], positions[:, None]
    B, T = positions.shape
    # NOTE: the whole cache is read and masked (no host sync on the length), so the step can be
    # captured in a CUDA graph or compiled without graph breaks.
    S = k_cache.shape[1]
    qh = q.reshape(B, T, hq, d).transpose(1, 2).float()  # [B, Hq, T, D]
    k = k_cache[:, :S].transpose(1, 2).float().repeat_interleave(hq // hkv, dim=1)  # [B, Hq, S, D]
    v = v_cache[:, :S].transpose(1, 2).float().repeat_interleave(hq // hkv, dim=1)
    scores = torch.matmul(qh, k.transpose(-1, -2)) * attrs["scale"]  # [B, Hq, T, S]
    mask = torch.arange(S, device=q.device)[None, None, :] > positions[:, :, None]  # [B, T, S]
    scores = scores.masked_fill(mask[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, v).transpose(1, 2).reshape(B, T, hq * d).to(q.dtype)
    return out[:, 0] if decode else out


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, gate = first half of the last axis."""
    n = gu.shape[-1] // 2
    return F.silu(gu[..., :n]) * gu[..., n:]


def argmax_partial(logits: torch.Tensor, vocab_start: int) -> torch.Tensor:
    """(max, vocab_start + first argmax) of this rank's slice, as float32 pairs [..., 2]."""
    val, idx = logits.float().max(dim=-1)
    return torch.stack([val, (idx + vocab_start).float()], dim=-1)


def argmax_select(cands: torch.Tensor) -> torch.Tensor:
    """Pick the best (value, index) pair over ranks [world, ..., 2]; ties go to the lowest index."""
    vals, idx = cands[..., 0], cands[..., 1]
    best = vals.max(dim=0, keepdim=True).values
    # Among ranks holding the max value, take the smallest vocabulary index.
    masked = torch.where(vals == best, idx, torch.full_like(idx, float("inf")))
    return masked.min(dim=0).values.to(torch.int32)


# -- paged KV cache (opt-in graphs: models.llama.build_paged_graph; docs/SERVING.md) ------------------

def qkv_prep_paged(qkv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, page_table: torch.Tensor,
                   q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, k_pages: torch.Tensor,
                   v_pages: torch.Tensor, attrs: dict, live: torch.Tensor | None = None) -> torch.Tensor:
    """qkv_prep over a ragged batch [N, ..]; k, v go into the page pools; returns q [N, Hq*D].

    ``live``: rows with slot >= 0 if known (``PagedLayout.live``), to skip a device-to-host sync.
    """
    q, k, v = split_norm_rope(qkv, positions, q_norm, k_norm, attrs)
    write_kv_paged(k_pages, v_pages, k, v, positions, slots, page_table, live)
    return q.reshape(qkv.shape[0], attrs["q_heads"] * attrs["head_dim"])


def write_kv_paged(k_pages: torch.Tensor, v_pages: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   positions: torch.Tensor, slots: torch.Tensor, page_table: torch.Tensor,
                   live: torch.Tensor | None = None) -> None:
    """k_pages[page_table[slot[i], pos[i] // P], pos[i] % P] = k[i] (same for v); slot < 0 skipped."""
    P = k_pages.shape[1]
    keep = (slots >= 0).nonzero().squeeze(1) if live is None else live
    s, p = slots[keep].long(), positions[keep].long()
    page = page_table[s, p // P].long()
    k_pages[page, p % P] = k[keep].to(k_pages.dtype)
    v_pages[page, p % P] = v[keep].to(v_pages.dtype)


def _attend_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, scale: float) -> torch.Tensor:
    """One query per row, each over its own keys: q [n, Hq, D], k, v [n, L, Hkv, D]; fp32 [n, Hq, D]."""
    group = q.shape[1] // k.shape[2]
    kf = k.float().transpose(1, 2).repeat_interleave(group, dim=1)  # [n, Hq, L, D]
    vf = v.float().transpose(1, 2).repeat_interleave(group, dim=1)
    scores = torch.matmul(q.float().unsqueeze(2), kf.transpose(-1, -2)).squeeze(2) * scale  # [n, Hq, L]
    mask = torch.arange(k.shape[1], device=q.device)[None, :] > pos[:, None]  # [n, L]
    probs = torch.softmax(scores.masked_fill(mask[:, None], float("-inf")), dim=-1)
    return torch.matmul(probs.unsqueeze(2), vf).squeeze(2)  # [n, Hq, D]


def _attend_shared(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, scale: float) -> torch.Tensor:
    """Many queries of ONE sequence over its keys: q [n, Hq, D], k, v [L, Hkv, D]; fp32 [n, Hq, D].

    NOTE: heads lead ([Hq, n, L] scores) so the keys are never broadcast per query (a 4096-token
    prompt would otherwise materialise [n, Hq, L, D]: 256 GiB, seen on the H200).
    """
    group = q.shape[1] // k.shape[1]
    kf = k.float().transpose(0, 1).repeat_interleave(group, dim=0)  # [Hq, L, D]
    vf = v.float().transpose(0, 1).repeat_interleave(group, dim=0)
    scores = torch.matmul(q.float().transpose(0, 1), kf.transpose(-1, -2)) * scale  # [Hq, n, L]
    mask = torch.arange(k.shape[0], device=q.device)[None, :] > pos[:, None]  # [n, L]
    probs = torch.softmax(scores.masked_fill(mask[None], float("-inf")), dim=-1)
    return torch.matmul(probs, vf).transpose(0, 1)  # [n, Hq, D]


@dataclass
class PagedLayout:
    """Where each sequence's tokens sit in a ragged pass, computed once per pass on the host, so
    paged_attention needs no device-to-host sync per layer.

    ``single``: rows (on the device) of sequences with one token in the pass (decode) and
    ``single_pages`` the pages covering the longest of them; ``chunks``: (rows on the device, slot,
    pages) of each sequence with several tokens (a prompt chunk); ``live``: every non-padding row.
    """

    single: torch.Tensor
    single_pages: int
    chunks: list[tuple[torch.Tensor, int, int]]
    live: torch.Tensor  # rows with slot >= 0


def paged_layout(positions, slots, page_size: int, device) -> PagedLayout:
    """The ``PagedLayout`` of a pass from host copies (numpy or CPU tensors) of positions and slots."""
    pos, sl = np.asarray(positions).astype(np.int64), np.asarray(slots).astype(np.int64)
    live = np.nonzero(sl >= 0)[0]
    per_slot = np.bincount(sl[live]) if len(live) else np.zeros(0, np.int64)
    one = live[per_slot[sl[live]] == 1] if len(live) else live
    npg = int(pos[one].max()) // page_size + 1 if len(one) else 0
    chunks = []
    for s in np.nonzero(per_slot > 1)[0].tolist():
        rows = np.nonzero(sl == s)[0]
        chunks.append((torch.from_numpy(rows).to(device), s, int(pos[rows].max()) // page_size + 1))
    return PagedLayout(torch.from_numpy(one).to(device), npg, chunks, torch.from_numpy(live).to(device))


def paged_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, positions: torch.Tensor,
                    slots: torch.Tensor, page_table: torch.Tensor, attrs: dict,
                    layout: PagedLayout | None = None) -> torch.Tensor:
    """Token i attends over positions 0..pos[i] of sequence slot[i]'s pages; padding (slot < 0) -> 0.

    Sequences with one token in the pass (decode) are batched together; each multi-token sequence
    (a prompt chunk) is one matmul over its own keys. ``layout`` (``paged_layout``, once per pass)
    avoids reading lengths back from the device in every layer; without it, it is computed here.
    """
    hq, d, P = attrs["q_heads"], attrs["head_dim"], k_pages.shape[1]
    if layout is None:
        layout = paged_layout(positions.cpu(), slots.cpu(), P, q.device)
    N = q.shape[0]
    qh = q.reshape(N, hq, d)
    out = torch.zeros(N, hq, d, dtype=torch.float32, device=q.device)
    one, npg = layout.single, layout.single_pages
    if one.numel():
        # -1 (unallocated) columns of shorter sequences read page 0: masked, never used
        pages = page_table[slots[one].long(), :npg].long().clamp(min=0)  # [n, npg]
        k = k_pages[pages].reshape(one.numel(), npg * P, *k_pages.shape[2:])  # [n, L, Hkv, D]
        v = v_pages[pages].reshape(one.numel(), npg * P, *v_pages.shape[2:])
        out[one] = _attend_rows(qh[one], k, v, positions[one].long(), attrs["scale"])
    for rows, s, npg in layout.chunks:
        pages = page_table[s, :npg].long()
        k = k_pages[pages].reshape(npg * P, *k_pages.shape[2:])  # [L, Hkv, D]
        v = v_pages[pages].reshape(npg * P, *v_pages.shape[2:])
        out[rows] = _attend_shared(qh[rows], k, v, positions[rows].long(), attrs["scale"])
    return out.reshape(N, hq * d).to(q.dtype)


def gather_rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """y[r] = x[rows[r]]; rows[r] < 0 gives a zero row."""
    keep = (rows >= 0).unsqueeze(-1).to(x.dtype)
    return x[rows.long().clamp(min=0)] * keep

"""One attention_prep tile on the CPU (mpk_dist/taskgraph/tasks/attention_prep.py): the same bits as the
unfused qkv_prep tiles + attention tile, the declared footprint exact (what it writes is declared and
written; poisoning everything it does not declare reading changes nothing), traffic = the footprint."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mpk_dist.backends import torch_ops as T
from mpk_dist.errors import InputError
from mpk_dist.taskgraph.tasks import BY_NAME
from mpk_dist.taskgraph.tasks.base import TileContext

HQ, HKV, D, S, B = 8, 2, 32, 16, 3
G, QS = HQ // HKV, (HQ + 2 * HKV) * D
KIND = BY_NAME["attention_prep"]


def _buffers(norm: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    bf = lambda n: torch.randn(n, generator=g).to(torch.bfloat16)  # noqa: E731
    return {"qkv": bf(B * QS), "pos": torch.tensor([5, 0, S - 1], dtype=torch.int32),
            "qn": bf(D) if norm else None, "kn": bf(D) if norm else None,
            "inv": T.rope_inv_freq(D, 10000.0).float(),
            "q": bf(B * HQ * D), "kc": bf(B * S * HKV * D), "vc": bf(B * S * HKV * D), "o": bf(B * HQ * D)}


def _ctx(kind, bufs: dict, args: dict, params: dict) -> TileContext:
    """A tile of ``kind``: ``args`` maps argument names to (buffer name or None, offset, count)."""
    names = [args[a.name] for a in kind.args]
    tensors = [None if n is None or bufs[n[0]] is None else bufs[n[0]] for n in names]
    return TileContext(kind, tensors, [0 if n is None else n[1] for n in names], [0 if n is None else n[2] for n in names],
                       kind.pack_params(params), 0, 0, 1, lambda k: [tensors[k]])


def _fused(bufs: dict, j: int, b: int) -> TileContext:
    k_off = (HQ + j) * D - j * G * D
    qa, kva = (b * HQ * D + j * G * D, G * D), (b * S * HKV * D + j * D, (S - 1) * HKV * D + D)
    return _ctx(KIND, bufs, {"QKV": ("qkv", b * QS + j * G * D, k_off + HKV * D + D), "POSITIONS": ("pos", b, 1),
                             "Q_NORM_W": ("qn", 0, D), "K_NORM_W": ("kn", 0, D), "INV_FREQ": ("inv", 0, D // 2),
                             "Q": ("q", *qa), "K_CACHE": ("kc", *kva), "V_CACHE": ("vc", *kva), "OUT": ("o", *qa)},
                {"HEAD_DIM": D, "GROUP": G, "K_OFFSET": k_off, "V_OFFSET": HKV * D, "KV_POS_STRIDE": HKV * D,
                 "MAX_SEQ": S, "EPS": 1e-6, "SCALE": D ** -0.5})


def _unfused(bufs: dict, j: int) -> None:
    """qkv_prep's q tiles of group j and kv tile j over all B rows, then attention tiles (j, 0..B-1)."""
    prep, att = BY_NAME["qkv_prep"], BY_NAME["attention"]
    common = {"BATCH": B, "HEAD_DIM": D, "QKV_STRIDE": QS, "EPS": 1e-6}
    for h in range(j * G, (j + 1) * G):
        prep.run_tile(_ctx(prep, bufs, {"QKV": ("qkv", h * D, 0), "POSITIONS": ("pos", 0, B), "NORM_W": ("qn", 0, D),
                                        "INV_FREQ": ("inv", 0, D // 2), "DST": ("q", h * D, 0), "DST_V": None},
                           {**common, "V_OFFSET": 0, "DST_BATCH_STRIDE": HQ * D, "DST_POS_STRIDE": 0, "MAX_SEQ": 1,
                            "IS_KV": 0}))
    prep.run_tile(_ctx(prep, bufs, {"QKV": ("qkv", (HQ + j) * D, 0), "POSITIONS": ("pos", 0, B), "NORM_W": ("kn", 0, D),
                                    "INV_FREQ": ("inv", 0, D // 2), "DST": ("kc", j * D, 0), "DST_V": ("vc", j * D, 0)},
                       {**common, "V_OFFSET": HKV * D, "DST_BATCH_STRIDE": S * HKV * D, "DST_POS_STRIDE": HKV * D,
                        "MAX_SEQ": S, "IS_KV": 1}))
    for b in range(B):
        qa = (b * HQ * D + j * G * D, G * D)
        att.run_tile(_ctx(att, bufs, {"Q": ("q", *qa), "K_CACHE": ("kc", b * S * HKV * D + j * D, 0),
                                      "V_CACHE": ("vc", b * S * HKV * D + j * D, 0), "POSITIONS": ("pos", b, 1),
                                      "OUT": ("o", *qa)},
                          {"BATCH": 1, "HEAD_DIM": D, "GROUP": G, "Q_STRIDE": HQ * D, "KV_POS_STRIDE": HKV * D,
                           "KV_BATCH_STRIDE": S * HKV * D, "MAX_SEQ": S, "SCALE": D ** -0.5}))


@pytest.mark.parametrize("norm", [True, False])
def test_same_bits_as_qkv_prep_then_attention(norm):
    fused, plain = _buffers(norm), _buffers(norm)
    for j in range(HKV):
        for b in range(B):
            KIND.run_tile(_fused(fused, j, b))
        _unfused(plain, j)
    for name in ("q", "kc", "vc", "o"):
        assert torch.equal(fused[name], plain[name]), name


def _declared(ctx: TileContext, mode: str) -> dict[int, set[int]]:
    out: dict[int, set[int]] = {}
    for a in KIND.accesses(ctx):
        if a.mode == mode:
            out.setdefault(a.arg, set()).update(np.asarray(a.index).tolist())
    return out


ARG_BUF = {0: "qkv", 1: "pos", 2: "qn", 3: "kn", 4: "inv", 5: "q", 6: "kc", 7: "vc", 8: "o"}


@pytest.mark.parametrize("j,b", [(0, 0), (1, 2), (1, 1)])
def test_writes_are_exactly_the_declared_ones(j, b):
    """Output buffers are NaN except what the tile declares reading and not writing (earlier cache
    positions): afterwards the non-NaN elements are those plus exactly the declared writes."""
    bufs = _buffers(True)
    ctx = _fused(bufs, j, b)
    reads, writes = _declared(ctx, "r"), _declared(ctx, "w")
    kept = {}
    for arg in (5, 6, 7, 8):
        t = bufs[ARG_BUF[arg]]
        keep = sorted(reads.get(arg, set()) - writes[arg])
        kept[arg] = (keep, t[keep].clone())
        t.fill_(float("nan"))
        t[keep] = kept[arg][1]
    KIND.run_tile(ctx)
    for arg, name in ARG_BUF.items():
        if arg not in kept:
            assert arg not in writes
            continue
        keep, before = kept[arg]
        assert torch.equal(bufs[name][keep], before), name
        written = set(torch.nonzero(~torch.isnan(bufs[name].float())).reshape(-1).tolist()) - set(keep)
        assert written == writes[arg] and len(written) > 0, name


@pytest.mark.parametrize("j,b", [(0, 2), (1, 0)])
def test_undeclared_elements_are_not_read(j, b):
    clean, poisoned = _buffers(True), _buffers(True)
    reads = _declared(_fused(clean, j, b), "r")
    writes = _declared(_fused(clean, j, b), "w")
    for arg, name in ARG_BUF.items():
        t = poisoned[name]
        keep = torch.zeros(t.numel(), dtype=torch.bool)
        keep[sorted(reads.get(arg, set()) | writes.get(arg, set()))] = True
        if t.dtype == torch.int32:
            t[~keep] = -7
        else:
            t[~keep] = float("nan")
    KIND.run_tile(_fused(clean, j, b))
    KIND.run_tile(_fused(poisoned, j, b))
    for arg in writes:
        idx = sorted(writes[arg])
        assert torch.equal(clean[ARG_BUF[arg]][idx], poisoned[ARG_BUF[arg]][idx]), ARG_BUF[arg]


def test_traffic_is_the_footprint_at_a_full_cache():
    bufs = _buffers(True)
    bufs["pos"][2] = S - 1
    ctx = _fused(bufs, 1, 2)
    nbytes = {0: 2, 1: 4, 2: 2, 3: 2, 4: 4, 5: 2, 6: 2, 7: 2, 8: 2}
    rd = sum(len(v) * nbytes[a] for a, v in _declared(ctx, "r").items())
    wr = sum(len(v) * nbytes[a] for a, v in _declared(ctx, "w").items())
    counts = [0] * len(KIND.args)
    params = KIND.pack_params({"HEAD_DIM": D, "GROUP": G, "K_OFFSET": 0, "V_OFFSET": HKV * D, "KV_POS_STRIDE": HKV * D,
                               "MAX_SEQ": S, "EPS": 1e-6, "SCALE": 0.1})
    assert KIND.traffic(counts, [nbytes[a] for a in range(9)], params, 1) == (rd, wr)


def test_position_outside_the_cache_is_an_input_error():
    bufs = _buffers(True)
    bufs["pos"][0] = S
    with pytest.raises(InputError, match=r"position: expected 0 <= pos < 16"):
        KIND.accesses(_fused(bufs, 0, 0))
    with pytest.raises(InputError, match=r"position: expected"):
        KIND.run_tile(_fused(bufs, 0, 0))

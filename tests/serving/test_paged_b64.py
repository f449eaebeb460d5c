"""Serving passes wider than 16 tokens (row blocks, docs/TASKGRAPH.md "Row blocks"): a continuous-
batching run on the compiled task graph (interpreter, races raise) with 64 tokens a pass and 32
sequences gives every request the tokens (and teacher-forced logits) it gets alone; the mega-kernel
backend's compiled spec keeps every linear tile at the kernel's 16 rows inside its buffers, and its
host side pads a 40-token pass budget to 48 and returns each request's tokens (GPU parts faked)."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from mpk_dist.backends.base import GenerateRequest
from mpk_dist.backends.torch_backend import TorchBackend
from mpk_dist.errors import InputError
from mpk_dist.model_source import open_model
from mpk_dist.models.llama import PagedSpec
from mpk_dist.models.presets import get_preset
from mpk_dist.runtime import tables
from mpk_dist.runtime.group import vocab_start
from mpk_dist.serving import megakernel_paged as MP
from mpk_dist.serving.server import Server, VirtualClock
from mpk_dist.taskgraph.abi import TASK_COLS
from mpk_dist.taskgraph.paged_compiler import compile_paged_programs
from mpk_dist.taskgraph.tasks import BY_NAME, BY_OPCODE
from mpk_dist.weights import SyntheticSource
from tests.serving.conftest import run_fake_page_alloc


def _workload(n: int, seed: int, long_prompt: int = 60) -> list[tuple[list[int], int, float]]:
    """n requests: prompts of 1..12 tokens (one of ``long_prompt``: a prefill wider than 16 in one
    pass), 4..8 outputs (so decodes of many sequences pile up in one pass), arrivals in three waves."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        plen = long_prompt if i == 3 else rng.randint(1, 12)
        out.append(([rng.randrange(512) for _ in range(plen)], rng.randint(4, 8), 0.01 * (i % 3)))
    return out


@pytest.mark.parametrize("tp, schedule", [(1, "jit"), (2, "aot")])
def test_64_tokens_a_pass_equal_each_request_alone(tp, schedule):
    cfg = dataclasses.replace(get_preset("tiny"), dtype="float32")
    src = SyntheticSource(cfg, seed=11)
    work = _workload(36, seed=tp)
    srv = Server((cfg, src), backend="interpreter", tp=tp, max_batch=32, page_size=8, max_seq_len=72,
                 max_tokens_per_step=64, clock=VirtualClock(0.01),
                 backend_opts={"schedule": schedule, "seed": tp, "check_races": True})
    force = {5: [7, 7, 100, 3, 5, 1, 2, 3], 17: [450, 2, 2, 2, 2, 9, 9, 9]}
    for i, (p, n, t) in enumerate(work):
        srv.submit(p, n, t, force_tokens=force.get(i, [])[:n] or None, want_logits=i in force)
    outs = srv.run(check_pages=True)
    ref = TorchBackend(cfg, src, tp=tp, max_seq_len=80)
    for i, ((p, n, _), o) in enumerate(zip(work, outs)):
        alone = ref.generate(GenerateRequest([p], max_new_tokens=n, want_logits=i in force,
                                             force_tokens=force.get(i, [])[:n] or None))
        assert o.tokens == alone.tokens[0], f"request {i}"
        if i in force:
            want = alone.logits[:, 0]
            assert float(((o.logits - want).abs().amax(-1) / want.abs().amax(-1)).max()) <= 1e-5, f"request {i}"
    assert max(p["tokens"] for p in srv.passes) > 48 and max(p["seqs"] for p in srv.passes) > 16, \
        "passes must be wider than one row block"
    assert any(p["prefill_tokens"] >= 60 for p in srv.passes), "the 60-token prompt in one pass"
    assert srv.pool.num_free == srv.pool.num_pages


def test_refuses_passes_wider_than_256():
    with pytest.raises(InputError, match=r"expected at most 256 tokens and sequences per pass, got 512 tokens"):
        MP.check_spec(PagedSpec(max_tokens=512, max_seqs=64, num_pages=8, page_size=4, max_pages_per_seq=2))
    MP.check_spec(PagedSpec(max_tokens=64, max_seqs=32, num_pages=8, page_size=4, max_pages_per_seq=2))


@pytest.mark.parametrize("n, mb, want", [(8, 3, (8, 8)), (16, 16, (16, 16)), (40, 20, (48, 32)), (64, 8, (64, 16)),
                                         (64, 32, (64, 32))])
def test_kernel_spec_pads_tokens_and_head_rows(n, mb, want):
    spec = PagedSpec(max_tokens=n, max_seqs=mb, num_pages=8, page_size=4, max_pages_per_seq=2)
    ks = MP.kernel_spec(spec)
    assert (ks.max_tokens, ks.max_seqs) == want and ks.num_pages == spec.num_pages


def _linear_rows_inside(cg) -> list[str]:
    """Every linear-kind task: the MPK_BATCH (= kernel_batch) rows its CUDA body touches of X / GU,
    Y and RESIDUAL lie inside the argument's COUNT (what the H200's illegal address broke)."""
    kb, bad = tables.kernel_batch(cg), []
    tasks, args = cg.arrays["tasks"], cg.arrays["args"]
    for t in range(tasks.shape[0]):
        kind = BY_OPCODE[int(tasks[t, TASK_COLS["OPCODE"]])]
        if kind.name not in tables.LINEAR_KINDS:
            continue
        p = tables.task_params(cg, t)
        a = {spec.name: args[tasks[t, TASK_COLS["ARG_BEGIN"]] + i] for i, spec in enumerate(kind.args)}
        need = {"Y": (kb - 1) * p["Y_STRIDE"] + p["N_TILE"], "RESIDUAL": (kb - 1) * p["Y_STRIDE"] + p["N_TILE"]}
        if kind.name == "silu_linear":
            need["GU"] = (kb - 1) * p["GU_STRIDE"] + p["UP_OFFSET"] + p["K"]
        else:
            need["X"] = (kb - 1) * p["X_STRIDE"] + p["K"]
        for name, n in need.items():
            if name in a and a[name][0] >= 0 and a[name][2] < n:
                bad.append(f"{cg.task_label(t)} {name}: {kb} rows need {n} elements, COUNT {a[name][2]}")
    return bad


@pytest.mark.parametrize("tp", [1, 2])
def test_kernel_programs_keep_linear_tiles_at_16_rows_inside_their_buffers(tp):
    cfg = open_model("tiny").config
    spec = PagedSpec(max_tokens=64, max_seqs=8, num_pages=40, page_size=4, max_pages_per_seq=8)
    for cg in compile_paged_programs(cfg, MP.kernel_spec(spec), tp, sms=8):
        MP.check_paged_tasks(cg)
        tables.check_supported(cg)
        assert tables.kernel_batch(cg) == 16 and cg.meta["batch"] == 64
        assert not _linear_rows_inside(cg)
        ops = cg.arrays["tasks"][:, TASK_COLS["OPCODE"]]
        att = np.nonzero(ops == BY_NAME["paged_attention"].opcode)[0]
        assert {tables.task_params(cg, int(t))["BATCH"] for t in att} == {16}, "paged attention per 16-token block"
    (raw,) = compile_paged_programs(cfg, spec, 1, sms=8)  # head over MB = 8 rows: 8-row lm_head tiles
    assert _linear_rows_inside(raw), "the emulation must see the 8-row head as out of bounds"
    with pytest.raises(InputError, match=r"lm_head \(linear\).*expected BATCH 16 .* got 8"):
        MP.check_paged_tasks(raw)


# ---- the megakernel backend's host side with a 40-token budget (GPU parts faked) ---------------------
def _device_pass(sess) -> None:
    """The fake device: gathered logits row b = one-hot of (token + position) % V of token row
    logit_rows[b] (what test_megakernel_paged.py's fake does), after checking the padded inputs; the
    pass's pages from page_alloc's CPU reference, as the kernel takes them."""
    if getattr(sess, "ran", 0) == len(sess.kernel.launches):
        return
    sess.ran = len(sess.kernel.launches)
    sp = sess.cg.meta["special"]
    run_fake_page_alloc(sess, sess.bufs[sp["start_pos"]])  # the kernel's page_alloc at step 0
    slots = sess.buffer("seq_slots")
    assert slots.shape[0] == 48 and bool((slots[sess.live_tokens:] == -1).all()), "padded to 48 tokens, slot -1"
    rows = sess.buffer("logit_rows").long()
    live = (rows >= 0).nonzero()[:, 0]
    tok = sess.bufs[sp["forced_tokens"]][0].long()[rows[live]]
    pos = sess.bufs[sp["start_pos"]].long()[rows[live]]
    logits = sess.bufs[sp["logits"]]
    vocab = logits.shape[1] * int(sess.cg.meta["world_size"])
    want = (tok + pos) % vocab - vocab_start(sess.cg)
    logits.zero_()
    hit = (want >= 0) & (want < logits.shape[1])
    logits[live[hit], want[hit]] = 1.0


@pytest.fixture()
def fake_device(install_fake_device):
    install_fake_device(_device_pass)


def test_megakernel_backend_pads_the_pass_and_returns_each_request(fake_device, monkeypatch):
    m = open_model("tiny")
    srv = Server(m, backend="megakernel", tp=1, max_batch=20, page_size=4, max_seq_len=48, max_tokens_per_step=40,
                 device="cpu", clock=VirtualClock(0.01))
    be = srv.backend
    assert (be.kernel_spec.max_tokens, be.kernel_spec.max_seqs) == (48, 32)
    sess = be.group.sessions[0]
    assert tables.kernel_batch(sess.cg) == 16
    step = be.step

    def noted(batch):
        sess.live_tokens = batch.num_tokens  # what the fake device checks the padding against
        return step(batch)

    monkeypatch.setattr(be, "step", noted)
    work = _workload(24, seed=7, long_prompt=30)
    for p, n, t in work:
        srv.submit(p, n, t)
    outs = srv.run(check_pages=True)
    V = srv.cfg.vocab_size
    for (p, n, _), o in zip(work, outs):
        last, at, want = p[:30][-1], len(p[:30]) - 1, []
        for _ in range(n):
            last = (last + at) % V
            want.append(last)
            at += 1
        assert o.tokens == want, f"request {o.id}"
    assert max(p["tokens"] for p in srv.passes) > 16 and max(p["seqs"] for p in srv.passes) > 16

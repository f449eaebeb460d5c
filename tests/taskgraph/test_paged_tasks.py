"""Paged task kinds (qkv_prep_paged, paged_attention) and the paged compiler, on the interpreter.

One ragged pass (a prompt chunk, a decode token, padding) runs as one launch and must match the
torch reference of the same paged graph (its host pool and the program's page_alloc hand out the same
page ids); every wait of a paged task is necessary (dropping it is caught as a race); bad page tables
raise clear errors.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from mpk_dist.errors import DeviceTimeout, InputError
from mpk_dist.models.llama import PagedSpec, build_paged_graph
from mpk_dist.models.presets import get_preset
from mpk_dist.serving.pages import PagePool
from mpk_dist.serving.request import Request
from mpk_dist.serving.scheduler import Scheduler
from mpk_dist.serving.torch_paged import TorchPagedBackend
from mpk_dist.taskgraph.abi import TASK_COLS
from mpk_dist.taskgraph.interpreter import Interpreter
from mpk_dist.taskgraph.paged_compiler import compile_paged_programs, page_state
from mpk_dist.taskgraph.race import RaceError
from mpk_dist.taskgraph.tasks import BY_NAME
from mpk_dist.taskgraph.testing import drop_wait
from mpk_dist.weights import SyntheticSource, load_rank_weights

@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """Tiny matmuls: one thread is fastest (the pool's spin-waits cost 10-100x on a loaded 2-core box)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


SPEC = PagedSpec(max_tokens=12, max_seqs=3, num_pages=16, page_size=4, max_pages_per_seq=6)


def _cfg(name="tiny"):
    return dataclasses.replace(get_preset(name), dtype="float32")


def _weights(cfg, tp):
    src = SyntheticSource(cfg, seed=2)
    return [load_rank_weights(build_paged_graph(cfg, SPEC, tp=tp, rank=r), src) for r in range(tp)]


def _passes():
    """Two passes: prompts of 7 and 3 tokens; then one decode token each plus a new 4-token prompt."""
    pool = PagePool(SPEC.num_pages, SPEC.page_size, SPEC.max_seqs, SPEC.max_pages_per_seq)
    sched = Scheduler(pool, SPEC.max_tokens)
    sched.submit(Request(0, (5, 17, 99, 3, 200, 8, 42), 4))
    sched.submit(Request(1, (1, 2, 3), 4))
    b0 = sched.plan(0.0)
    sched.commit(b0, torch.eye(512)[[7, 9]], 1.0)
    sched.submit(Request(2, (300, 301, 302, 303), 2, arrival_time=1.0))
    return pool, [b0, sched.plan(1.0)]


def _interp(cgs, w, **kw):
    """An interpreter with zeroed state and the page allocator's initial state on every rank."""
    it = Interpreter(cgs, w, **kw)
    it.reset_state()
    for r, cg in enumerate(cgs):
        for name, a in page_state(cg).items():
            it.buffer(r, name).copy_(torch.from_numpy(a))
    return it


def _launch(it, batch, tp, gathered=True):
    """One pass; the logits of the ``logit_rows`` rows [R, V] (gathered in the graph, or picked here)."""
    x = batch.tensors(pad_tokens=SPEC.max_tokens, pad_rows=SPEC.max_seqs)
    for r in range(tp):
        it.buffer(r, "seq_slots").copy_(x["seq_slots"])
        it.buffer(r, "release_slots").copy_(x["release_slots"])
        if gathered:
            it.buffer(r, "logit_rows").copy_(x["logit_rows"])
    logits = it.run(1, x["tokens"].reshape(1, -1), x["positions"]).captured["logits"][0]
    R = len(batch.logit_rows)
    if gathered:
        assert logits.shape[0] == SPEC.max_seqs and not bool(logits[R:].any()), "padding rows: zero logits"
        return logits[:R]
    return logits[torch.from_numpy(batch.logit_rows).long()]


@pytest.mark.parametrize("name, tp", [("tiny", 1), ("tiny", 2), ("tiny-llama", 2)])
def test_ragged_passes_match_the_torch_paged_reference(name, tp):
    cfg = _cfg(name)
    w = _weights(cfg, tp)
    cgs = compile_paged_programs(cfg, SPEC, tp, sms=8)
    ops = {int(o) for o in cgs[0].arrays["tasks"][:, TASK_COLS["OPCODE"]]}
    assert {BY_NAME["qkv_prep_paged"].opcode, BY_NAME["paged_attention"].opcode} <= ops
    assert BY_NAME["attention"].opcode not in ops and BY_NAME["qkv_prep"].opcode not in ops
    ref = TorchPagedBackend(cfg, None, SPEC, tp=tp, weights=w)
    for schedule in ("jit", "aot"):
        it = _interp(cgs, w, seed=3, mode=schedule)
        ref.reset()
        for batch in _passes()[1]:
            ours = _launch(it, batch, tp)
            want = ref.step(batch)
            err = float(((ours - want).abs().amax(-1) / want.abs().amax(-1)).max())
            assert err <= 1e-5, f"{schedule}: logits differ by {err:.2e}"
        # the program's page_alloc handed out the host pool's page ids (slot order on both sides)
        pool, _ = _passes()
        assert torch.equal(it.buffer(0, "page_table"), torch.from_numpy(pool.page_table))
        # padding tokens wrote nothing: only pages in the page table hold keys
        used = set(pool.page_table[pool.page_table >= 0].tolist())
        kp = it.buffer(0, "L0.k_pages")
        nonzero = {p for p in range(SPEC.num_pages) if bool((kp[p] != 0).any())}
        assert nonzero == used


def test_every_wait_of_the_paged_tasks_is_necessary():
    cfg, tp = _cfg(), 1
    w = _weights(cfg, tp)
    (cg,) = compile_paged_programs(cfg, SPEC, tp, sms=8)
    t = cg.arrays["tasks"]
    paged = {BY_NAME["qkv_prep_paged"].opcode, BY_NAME["paged_attention"].opcode}
    rows = [k for row in t if row[TASK_COLS["LAYER"]] == 0 and int(row[TASK_COLS["OPCODE"]]) in paged
            for k in range(row[TASK_COLS["WAIT_BEGIN"]], row[TASK_COLS["WAIT_END"]])]
    assert len(rows) >= 4
    batch = _passes()[1][0]
    for k in rows:
        it = _interp([drop_wait(cg, k)], w, seed=k)
        # a tile that runs before page_alloc finds no page for its position (-1) and says so
        with pytest.raises((RaceError, DeviceTimeout, InputError)) as exc:
            _launch(it, batch, tp)
        assert exc.type is not InputError or "page table row" in str(exc.value)


def test_bad_page_table_is_a_clear_error():
    """A corrupt device page table (ids past the pool, rows marked full so page_alloc takes nothing)
    is refused by the paged tasks that read it."""
    cfg, tp = _cfg(), 1
    w = _weights(cfg, tp)
    it = _interp(compile_paged_programs(cfg, SPEC, tp, sms=8), w, check_races=False)
    batch = _passes()[1][0]
    it.buffer(0, "page_table").fill_(SPEC.num_pages)  # ids past the pool
    it.buffer(0, "pages_used").fill_(SPEC.max_pages_per_seq)
    with pytest.raises(InputError, match="page table row"):
        _launch(it, batch, tp)


def _ops(cg) -> set[int]:
    return {int(o) for o in cg.arrays["tasks"][:, TASK_COLS["OPCODE"]]}


def test_gathered_head_runs_over_sequences_and_matches_the_ungathered_head():
    """gather_rows: the head buffers have MB rows, and the logits equal the N-row head's picked rows."""
    cfg, tp = _cfg(), 2
    w = _weights(cfg, tp)
    gathered = compile_paged_programs(cfg, SPEC, tp, sms=8)
    full = compile_paged_programs(cfg, SPEC, tp, sms=8, gather_last=False)
    assert BY_NAME["gather_rows"].opcode in _ops(gathered[0]) and BY_NAME["gather_rows"].opcode not in _ops(full[0])
    shapes = {b["name"]: tuple(b["shape"]) for b in gathered[0].meta["buffers"]}
    V = cfg.vocab_size // tp
    assert shapes["x_last"][0] == shapes["h_final"][0] == SPEC.max_seqs
    assert shapes["logits"] == (SPEC.max_seqs, V) and shapes["argmax_cand"] == (SPEC.max_seqs, 2)
    assert shapes["token_out"] == (1, SPEC.max_seqs) and shapes["tokens"] == (SPEC.max_tokens,)
    assert {b["name"]: tuple(b["shape"]) for b in full[0].meta["buffers"]}["logits"] == (SPEC.max_tokens, V)
    a, b = _interp(gathered, w, seed=5), _interp(full, w, seed=6)
    for batch in _passes()[1]:
        x, y = _launch(a, batch, tp), _launch(b, batch, tp, gathered=False)
        assert x.shape == (len(batch.logit_rows), cfg.vocab_size)
        # fp32 matmuls over 3 vs 12 rows sum in different orders: last-bit differences only
        err = float(((x - y).abs().amax(-1) / y.abs().amax(-1)).max())
        assert err <= 1e-5, f"gathered vs N-row head logits differ by {err:.2e}"


def test_bad_logit_row_is_a_clear_error():
    cfg, tp = _cfg(), 1
    it = _interp(compile_paged_programs(cfg, SPEC, tp, sms=8), _weights(cfg, tp), check_races=False)
    batch = _passes()[1][0]
    batch.logit_rows = np.array([SPEC.max_tokens], np.int32)  # past the pass's token rows
    with pytest.raises(InputError, match="gather_rows: expected row ids"):
        _launch(it, batch, tp)


def test_every_wait_of_gather_rows_is_necessary():
    """Dropping any wait of a gather_rows tile (on the last layer's residual, or its readers' side) is caught."""
    cfg, tp = _cfg(), 1
    w = _weights(cfg, tp)
    (cg,) = compile_paged_programs(cfg, SPEC, tp, sms=8)
    t = cg.arrays["tasks"]
    rows = [k for row in t if int(row[TASK_COLS["OPCODE"]]) == BY_NAME["gather_rows"].opcode
            for k in range(row[TASK_COLS["WAIT_BEGIN"]], row[TASK_COLS["WAIT_END"]])]
    assert rows, "gather_rows tiles wait on the residual stream"
    batch = _passes()[1][1]
    for k in rows:
        it = _interp([drop_wait(cg, k)], w, seed=k)
        with pytest.raises((RaceError, DeviceTimeout)):
            _launch(it, batch, tp)


def test_gather_rows_tile_picks_rows_zeroes_padding_and_rounds_to_the_output_dtype():
    """One tile of the CPU reference: columns 2..5 of rows [3, -1, 0] of an fp32 [4, 8] stream into
    a bf16 [3, 8] buffer; the declared accesses are exactly the rows read and the block written."""
    from mpk_dist.taskgraph.tasks.base import TileContext

    kind = BY_NAME["gather_rows"]
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0)).reshape(-1)
    rows = torch.tensor([3, -1, 0], dtype=torch.int32)
    out = torch.full((3 * 8,), 9.0, dtype=torch.bfloat16)
    params = kind.pack_params({"BATCH": 3, "COLS": 4, "X_STRIDE": 8, "OUT_STRIDE": 8, "X_ROWS": 4})
    t = TileContext(kind, [x, rows, out], [2, 0, 2], [3 * 8 + 4, 3, 2 * 8 + 4], params, 0, 0, 1, lambda i: [])
    kind.run_tile(t)
    o = out.reshape(3, 8)
    assert torch.equal(o[0, 2:6], x.reshape(4, 8)[3, 2:6].to(torch.bfloat16))
    assert torch.equal(o[2, 2:6], x.reshape(4, 8)[0, 2:6].to(torch.bfloat16))
    assert not bool(o[1, 2:6].any()) and bool((o[:, :2] == 9).all()) and bool((o[:, 6:] == 9).all())
    acc = {a.arg: set(a.index.tolist()) for a in kind.accesses(t)}
    assert acc[0] == {3 * 8 + c for c in range(2, 6)} | set(range(2, 6))
    assert acc[2] == {b * 8 + c for b in range(3) for c in range(2, 6)}

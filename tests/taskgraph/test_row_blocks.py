"""Row blocks (docs/TASKGRAPH.md, "Row blocks"): linear-kind ops over B > 16 rows become tiles of
16 rows x a column block, each an ordinary tile with BATCH = 16 and its pointers at its row block,
with exact footprints. Checked here: the tiles partition the output exactly and read only their rows;
batch 32 and 64 programs of tiny / tiny-llama (tp 1 and 2, fused and unfused) match the torch
backend per sequence on the interpreter with race detection on; in bf16 a sequence's logits in a
batch-32 program equal its logits in a batch-16 program bit for bit (same per-row arithmetic);
deleting a wait of a row-blocked layer is caught; the kernel-side limits (kernel_batch, padding,
refusals) say what they need."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mpk_dist.errors import InputError
from mpk_dist.models import build_graph
from mpk_dist.models.presets import get_preset
from mpk_dist.runtime import tables
from mpk_dist.taskgraph.abi import TASK_COLS
from mpk_dist.taskgraph.interpreter import Interpreter
from mpk_dist.taskgraph.lowering import LINEAR_ALIGN, ROW_BLOCK, col_tiles, row_blocks
from mpk_dist.taskgraph.lowering_comm import lower_graph
from mpk_dist.taskgraph.testing import (MAX_SEQ, drop_wait, fp32, max_rel_err, programs, reference, rows_of_layer,
                                        weights)
from mpk_dist.taskgraph.testing import mutation_caught
from mpk_dist.taskgraph.tasks import BY_NAME, BY_OPCODE

LINEAR_KINDS = tables.LINEAR_KINDS


@pytest.fixture(autouse=True)
def _one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: the intra-op pool only adds spin-waits on 2 cores
    yield
    torch.set_num_threads(before)


def _feed(cfg, B: int, steps: int, seed: int) -> list[list[int]]:
    """Random first tokens per sequence, then greedy (-1) rows."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, cfg.vocab_size, (B,), generator=g).tolist()] + [[-1] * B] * (steps - 1)


def test_row_blocks_split_rows():
    assert row_blocks(1) == [(0, 1)] and row_blocks(16) == [(0, 16)]
    assert row_blocks(64) == [(0, 16), (16, 16), (32, 16), (48, 16)]
    assert row_blocks(40) == [(0, 16), (16, 16), (32, 8)]


@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize("tp", [1, 2])
def test_linear_tiles_partition_the_output_and_read_their_rows(tp, fuse):
    """Every linear-kind op of a batch-64 program: tiles of 16 rows whose written rectangles cover the
    [B, N] output exactly once, whose reads are their own rows (all K columns), whose arguments
    start at their row block; the all-reduce tiles follow the producing linear's tiles one to one."""
    B, sms = 64, 8
    g = build_graph(fp32("tiny"), tp=tp, rank=0, batch=B, max_seq_len=MAX_SEQ)
    prog = lower_graph(g, sms, 2, fuse=fuse)
    seen = set()
    for op in prog.ops:
        if op.kind.name not in LINEAR_KINDS and op.kind.name not in ("allreduce_push", "allreduce_reduce"):
            continue
        seen.add(op.kind.name)
        out = op.writes[0]
        rows, cols = prog.buffers[out.buf].view
        assert rows == (tp * B if op.kind.name == "allreduce_push" else B), op.name
        cover = np.zeros((rows, cols), np.int32)
        for fp in op.writes:  # push: one footprint per slot of the [W * B, N] receive buffer
            assert fp.buf == out.buf
            for r0, r1, c0, c1 in fp.rects:
                cover[r0:r1, c0:c1] += 1
        assert (cover == 1).all(), f"{op.name}: the tiles must write every output element exactly once"
        assert len(op.writes) == (tp if op.kind.name == "allreduce_push" else 1)
        assert {r1 - r0 for r0, r1, _, _ in out.rects} == {ROW_BLOCK}
        batch = [p[op.kind.param_index("BATCH")] for p in op.params]
        assert set(batch) == {ROW_BLOCK}, op.name
        if op.kind.name in LINEAR_KINDS:
            x = op.reads[0]
            np.testing.assert_array_equal(x.rects[:, :2], out.rects[:, :2], err_msg=f"{op.name}: reads its rows only")
            assert (x.rects[:, 2] == 0).all() and (x.rects[:, 3] == prog.buffers[x.buf].view[1]).all()
            n_tile = np.array([p[op.kind.param_index("N_TILE")] for p in op.params])
            assert (n_tile >= LINEAR_ALIGN).all(), f"{op.name}: tiles keep >= {LINEAR_ALIGN} weight rows"
            k = op.params[0][op.kind.param_index("K")]
            xoff = np.array([a[op.kind.arg_index("GU" if op.kind.name == "silu_linear" else "X")][1] for a in op.args])
            np.testing.assert_array_equal(xoff, out.rects[:, 0] * (2 * k if op.kind.name == "silu_linear" else k))
    assert "allreduce_push" in seen or tp == 1
    assert ("norm_linear" in seen) == fuse and (fuse or "linear" in seen)


def test_column_tiles_share_the_sms_between_row_blocks():
    """About one wave of tiles: sms / blocks column tiles per row block (each >= 8 weight rows), the
    tiles of one weight block next to each other; B <= 16 keeps sms column tiles of one block."""
    cfg = fp32("tiny")
    (cg16,), (cg64,) = programs(cfg, 1, sms=16, batch=16), programs(cfg, 1, sms=16, batch=64)
    for cg, blocks in ((cg16, 1), (cg64, 4)):
        tasks = cg.arrays["tasks"]
        lm = [t for t in range(tasks.shape[0]) if cg.meta["ops"][tasks[t, TASK_COLS["OP_INDEX"]]]["name"] == "lm_head"]
        p = [tables.task_params(cg, t) for t in lm]
        vocab = cfg.vocab_size
        assert sum(x["N_TILE"] for x in p) == blocks * vocab and {x["BATCH"] for x in p} == {min(cg.meta["batch"], 16)}
        assert len(p) == blocks * len(col_tiles(vocab, 16 // blocks, LINEAR_ALIGN)) and len(p) <= 16 + blocks
        offs = [int(cg.arrays["args"][tasks[t, TASK_COLS["ARG_BEGIN"]] + BY_NAME["linear"].arg_index("W"), 1])
                for t in lm]
        assert offs[:blocks] == [0] * blocks, "the row blocks of the first weight block come first"


CASES = [("tiny", 1, 32, False), ("tiny", 1, 64, True), ("tiny", 2, 32, True), ("tiny", 2, 64, False),
         ("tiny-llama", 1, 64, False), ("tiny-llama", 2, 32, True), ("tiny-llama", 2, 64, True)]


@pytest.mark.parametrize("config,tp,batch,fuse", CASES)
def test_batch_above_16_matches_torch_per_sequence(config, tp, batch, fuse):
    """fp32: logits of every sequence within 1e-5 of TorchBackend at the same batch, the same greedy
    tokens, on a jit and an aot schedule with race detection raising."""
    cfg = fp32(config)
    cgs, ws = programs(cfg, tp, batch=batch, fuse=fuse), weights(cfg, tp)
    assert {tables.task_params(cgs[0], t)["BATCH"] for t in range(cgs[0].arrays["tasks"].shape[0])
            if BY_OPCODE[int(cgs[0].arrays["tasks"][t, TASK_COLS["OPCODE"]])].name in LINEAR_KINDS} == {ROW_BLOCK}
    feed = _feed(cfg, batch, 3, seed=batch + tp)
    ref_logits, ref_tokens = reference(cfg, tp, feed)
    for seed, mode in ((0, "jit"), (1, "aot")):
        res = Interpreter(cgs, ws, seed=seed, mode=mode, on_race="raise").run(
            3, torch.tensor(feed), torch.zeros(batch, dtype=torch.int32))
        err = max_rel_err(res.captured["logits"], ref_logits)
        assert err <= 1e-5, f"{config} tp={tp} b={batch} {mode}: max rel. error {err:.2e}"
        assert torch.equal(res.tokens, ref_tokens), f"{config} tp={tp} b={batch} {mode}: tokens differ"


@pytest.mark.parametrize("config,tp,fuse", [("tiny", 1, True), ("tiny-llama", 2, False)])
def test_bf16_sequences_equal_their_batch_16_run_bit_for_bit(config, tp, fuse):
    """bf16: the batch-32 program's logits of sequences 0..15 and 16..31 equal two batch-16 runs of
    those sequences bit for bit (each row block is a batch-16 tile: the same per-row arithmetic)."""
    cfg = get_preset(config)
    ws = weights(cfg, tp)
    feed = torch.tensor(_feed(cfg, 32, 3, seed=5))
    big = Interpreter(programs(cfg, tp, batch=32, fuse=fuse), ws, seed=3).run(3, feed, torch.zeros(32, dtype=torch.int32))
    small = programs(cfg, tp, batch=16, fuse=fuse)
    for r0 in (0, 16):
        part = Interpreter(small, ws, seed=4).run(3, feed[:, r0:r0 + 16], torch.zeros(16, dtype=torch.int32))
        assert torch.equal(big.captured["logits"][:, r0:r0 + 16], part.captured["logits"]), f"rows {r0}..{r0 + 15}"
        assert torch.equal(big.tokens[:, r0:r0 + 16], part.tokens)


@pytest.mark.parametrize("tp,fuse", [(1, True), (2, False)])
def test_deleting_a_wait_of_a_row_blocked_layer_is_caught(tp, fuse):
    """Every wait of the row-blocked tasks of layer 0 (linear kinds and all-reduce tiles, batch 32)
    is necessary: without it the interpreter reports a race or a deadlock (or the logits change)."""
    cfg = fp32("tiny")
    cgs, ws = programs(cfg, tp, sms=4, batch=32, fuse=fuse), weights(cfg, tp)
    feed = torch.tensor(_feed(cfg, 32, 2, seed=9))
    baseline = Interpreter(cgs, ws, seed=0).run(2, feed, torch.zeros(32, dtype=torch.int32)).captured["logits"]
    tasks = cgs[0].arrays["tasks"]
    blocked = {BY_NAME[k].opcode for k in (*LINEAR_KINDS, "allreduce_push", "allreduce_reduce")}
    rows = [k for t in np.nonzero((tasks[:, TASK_COLS["LAYER"]] == 0) & np.isin(tasks[:, TASK_COLS["OPCODE"]],
                                                                                 list(blocked)))[0]
            for k in range(int(tasks[t, TASK_COLS["WAIT_BEGIN"]]), int(tasks[t, TASK_COLS["WAIT_END"]]))]
    assert set(rows) <= set(rows_of_layer(cgs[0], 0, "WAIT_BEGIN", "WAIT_END")) and len(rows) >= 8
    missed = [k for k in rows if not mutation_caught([drop_wait(cg, k) for cg in cgs], ws, baseline, feed)]
    assert not missed, f"deleting these waits went unnoticed: {missed}"


# ---- kernel-side limits -------------------------------------------------------------------------
def test_kernel_batch_and_padding():
    cfg = fp32("tiny")
    assert [tables.padded_batch(b) for b in (1, 7, 16, 17, 32, 40, 256)] == [1, 7, 16, 32, 32, 48, 256]
    for bad in (0, 257):
        with pytest.raises(InputError, match=r"batch: expected 1\.\.256 sequences, got"):
            tables.padded_batch(bad)
    (cg,) = programs(get_preset("tiny"), 1, batch=64, fuse=True)
    assert tables.kernel_batch(cg) == 16 and tables.MAX_BATCH == 256
    tables.check_supported(cg)
    (cg8,) = programs(get_preset("tiny"), 1, batch=8)
    assert tables.kernel_batch(cg8) == 8
    tables.check_supported(cg8)
    assert cfg.dtype == "float32"


def test_batches_the_kernel_cannot_run_are_refused_clearly():
    """Above 16 rows the batch must be a multiple of 16 (a last block of 8 rows would run 16 rows in
    the kernel); a linear tile whose BATCH differs from MPK_BATCH is named."""
    (cg,) = programs(get_preset("tiny"), 1, batch=40)
    with pytest.raises(InputError, match=r"batch: expected 1\.\.16 or a multiple of 16 up to 256 .* got 40; "
                                         r"pad the batch to 48"):
        tables.check_supported(cg)
    with pytest.raises(InputError, match=r"\(linear\).*expected BATCH 16 \(the kernel's compile-time rows, "
                                         r"MPK_BATCH\), got 8"):
        tables.check_linear_batch(cg)


def test_fusions_stay_at_large_batch():
    """Prologue staging is sized per 16-row block, so batch 64 keeps every fusion batch 16 has."""
    from mpk_dist.models.presets import get_preset
    from mpk_dist.taskgraph.compiler import compile_rank_programs

    kinds = [{o["kind"] for o in compile_rank_programs(get_preset("qwen3-0.6b"), tp=1, batch=b, sms=132,
                                                      max_seq_len=64, fuse=True)[0].meta["ops"]} for b in (16, 64)]
    assert kinds[0] == kinds[1] and "silu_mul" not in kinds[1] and "rms_norm" not in kinds[1]

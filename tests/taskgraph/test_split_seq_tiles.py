"""Split-KV attention above SPLIT_TILE_MAX_SEQS sequences (mpk_dist.taskgraph.lowering_attention.split_tiles):
each split tile takes one sequence, so a batch-6 program with an explicit split count has kv heads x 6 x
ranges split tiles of BATCH 1 ('auto' does not split there); the merge of (kv head, sequence) waits on that pair's
ranges only; the program computes what the torch backend does (fp32, random schedules, unfused, merged in
the last tile, with the q/k prep folded in); the merge in the last tile and the folded prep give the bits
of the plain split program, with one ticket word per (kv head, sequence) back at 0 after every step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mpk_dist.taskgraph import fusion
from mpk_dist.runtime.tables import task_params
from mpk_dist.taskgraph.abi import SIGNAL_COLS, TASK_COLS, WAIT_COLS
from mpk_dist.taskgraph.interpreter import Interpreter
from mpk_dist.taskgraph.lowering_attention import AUTO_SPLIT_MAX_BATCH, SPLIT_TILE_MAX_SEQS, resolve_splits
from mpk_dist.taskgraph.testing import fp32, max_rel_err, preset_or_short, programs, reference, weights

pytestmark = pytest.mark.usefixtures("one_thread")

B = SPLIT_TILE_MAX_SEQS + 2  # 6 sequences: one split tile per (kv head, sequence, range)
SPLITS = 3  # MAX_SEQ 64 -> ranges of 22 positions
DEFAULT = sorted(fusion.FUSIONS)
MERGE = DEFAULT + ["attn_merge"]
PREP = MERGE + ["attn_prep"]
FEED = [[7, 11, 300, 5, 42, 9], [13, -1, 2, -1, 8, -1], [-1] * B, [-1] * B]
STARTS = [0, 9, 3, 30, 21, 44]  # positions in every range, two sequences crossing into the next one


def _op_tasks(cg, name: str) -> np.ndarray:
    idx = [i for i, o in enumerate(cg.meta["ops"]) if o["name"] == name]
    return np.nonzero(cg.arrays["tasks"][:, TASK_COLS["OP_INDEX"]] == idx[0])[0]


def test_auto_leaves_them_unsplit_and_an_explicit_count_splits():
    assert B > AUTO_SPLIT_MAX_BATCH  # 'auto' splits fewer sequences than a split tile may hold
    assert resolve_splits("auto", 132, 8, 576, batch=B) == 1
    assert resolve_splits(SPLITS, 132, 8, 576, batch=B) == SPLITS
    kinds = [o["kind"] for o in programs(fp32("tiny"), 1, batch=B, attn_splits="auto")[0].meta["ops"]]
    assert "attention_split" not in kinds and "attention" in kinds


@pytest.mark.parametrize("fuse,kind", [(DEFAULT, "attention_split"), (PREP, "attention_split_prep")])
def test_one_sequence_per_split_tile_and_merges_wait_on_their_pair(fuse, kind):
    cfg = fp32("tiny")
    cg = programs(cfg, 1, batch=B, fuse=fuse, attn_splits=SPLITS)[0]
    hkv = cfg.num_kv_heads
    split = _op_tasks(cg, "L0.attention/split")
    assert len(split) == hkv * B * SPLITS
    assert all(cg.meta["ops"][int(cg.arrays["tasks"][t, TASK_COLS["OP_INDEX"]])]["kind"] == kind for t in split)
    assert {task_params(cg, int(t))["BATCH"] for t in split} == {1}
    tickets = [b for b in cg.meta["buffers"] if b["kind"] == "ticket"]
    if "attn_merge" in fuse:
        assert tickets and all(int(np.prod(b["shape"])) == hkv * B for b in tickets)
        return
    assert not tickets
    t, waits, sig = cg.arrays["tasks"], cg.arrays["waits"], cg.arrays["signals"]
    producers_of: dict[int, set[int]] = {}
    for i, row in enumerate(t):
        for k in range(row[TASK_COLS["SIGNAL_BEGIN"]], row[TASK_COLS["SIGNAL_END"]]):
            producers_of.setdefault(int(sig[k, SIGNAL_COLS["EVENT"]]), set()).add(i)
    merge = _op_tasks(cg, "L0.attention/merge")
    assert len(merge) == hkv * B
    for n, m in enumerate(merge):  # tile (h, b): exactly that pair's SPLITS range tiles
        ev = waits[t[m, TASK_COLS["WAIT_BEGIN"]]:t[m, TASK_COLS["WAIT_END"]], WAIT_COLS["EVENT"]]
        got = set().union(*(producers_of[int(e)] for e in ev)) & {int(s) for s in split}
        assert got == {int(s) for s in split[n * SPLITS:(n + 1) * SPLITS]}, f"merge tile {n}"


@pytest.mark.parametrize("fuse", [DEFAULT, MERGE, PREP])
def test_fp32_matches_the_torch_backend(fuse):
    cfg = fp32("tiny")
    ref_logits, ref_tokens = reference(cfg, 2, FEED, start=torch.tensor(STARTS))
    cgs, ws = programs(cfg, 2, batch=B, fuse=fuse, attn_splits=SPLITS), weights(cfg, 2, batch=B)
    for seed, mode in ((0, "jit"), (1, "aot")):
        res = Interpreter(cgs, ws, seed=seed, mode=mode).run(len(FEED), torch.tensor(FEED), torch.tensor(STARTS))
        err = max_rel_err(res.captured["logits"], ref_logits)
        assert err <= 1e-5, f"{fuse} schedule {seed}: max rel. error {err:.2e}"
        assert torch.equal(res.tokens, ref_tokens)


@pytest.mark.parametrize("name", ["tiny", "tiny-llama"])
def test_bf16_merge_in_the_last_tile_and_folded_prep_keep_the_bits(name):
    cfg = preset_or_short(name)
    ws = weights(cfg, 1, batch=B)
    runs = []
    for fuse, mode, seed in ((DEFAULT, "jit", 5), (MERGE, "aot", 6), (PREP, "jit", 7)):
        it = Interpreter(programs(cfg, 1, batch=B, fuse=fuse, attn_splits=SPLITS), ws, seed=seed, mode=mode)
        runs.append(it.run(len(FEED), torch.tensor(FEED), torch.tensor(STARTS, dtype=torch.int32)))
        words = [it.bufs[0][b] for b, info in enumerate(it.meta["buffers"]) if info["kind"] == "ticket"]
        assert bool(words) == ("attn_merge" in fuse)
        assert all(int(w.abs().sum()) == 0 for w in words), "a ticket word did not return to 0 at a step's end"
    for r in runs[1:]:
        assert torch.equal(runs[0].captured["logits"], r.captured["logits"])
        assert torch.equal(runs[0].tokens, r.tokens)

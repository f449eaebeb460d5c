"""Split-KV ranges that follow the position (tasks.attention_split.split_range): every tile walks at most
ceil((pos + 1) / SPLITS) positions whatever the cache length, exactly one range appends the position, and the
programs still match the torch backend when positions sit far below max_seq_len (empty ranges included)."""

from __future__ import annotations

import pytest
import torch

from mpk_dist.taskgraph import fusion
from mpk_dist.taskgraph.interpreter import Interpreter
from mpk_dist.taskgraph.tasks.attention_split import range_rows, split_range
from mpk_dist.taskgraph.testing import MAX_SEQ, fp32, max_rel_err, programs, reference, weights

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("splits", [1, 2, 3, 5, 16])
def test_ranges_cut_positions_0_to_p_into_equal_pieces(splits):
    for p in range(0, 300):
        ranges = [split_range(i, splits, p) for i in range(splits)]
        walked = [list(range(s0, e)) for s0, e in ranges]
        assert sum(walked, []) == list(range(p + 1)), (splits, p, ranges)  # in order, each position once
        per = -(-(p + 1) // splits)
        assert max(len(w) for w in walked) == per, (splits, p)
        owners = [i for i, (s0, e) in enumerate(ranges) if s0 <= p < e]
        last_nonempty = max(i for i, w in enumerate(walked) if w)
        assert owners == [last_nonempty], (splits, p, owners)
        # what the stage must hold: the longest range a cache of p + 1 positions can give
        assert per <= range_rows(splits, p + 1)


def test_ranges_do_not_grow_with_the_cache_length():
    """The static cut (ranges of ceil(S / SPLITS)) walked 256 positions per tile at position 600 of a
    4096-position cache; the cut at the position walks 38."""
    assert max(e - s0 for s0, e in (split_range(i, 16, 600) for i in range(16))) == 38
    assert range_rows(16, 4096) == 256


PREP = sorted(fusion.FUSIONS) + ["attn_merge", "attn_prep"]


@pytest.mark.parametrize("fuse,start", [(False, 1), (PREP, 1), (PREP, 6), (False, 37)])
def test_fp32_matches_torch_with_positions_below_the_split_count(fuse, start):
    """tiny (kv heads of one rank, 8 ranges over a 64-position cache) from position `start`: at 1 most ranges
    are empty for the first steps; the appended row moves from range to range as the position grows."""
    cfg = fp32("tiny")
    feed = [[7], [-1], [-1], [-1], [-1], [-1]]
    start_t = torch.tensor([start])
    ref_logits, ref_tokens = reference(cfg, 1, feed, start=start_t)
    cgs, ws = programs(cfg, 1, sms=32, fuse=fuse, attn_splits=8), weights(cfg, 1)
    assert cgs[0].meta.get("attn_splits") == 8 and MAX_SEQ // 8 > 2
    for seed, mode in ((0, "jit"), (1, "aot")):
        res = Interpreter(cgs, ws, seed=seed, mode=mode).run(len(feed), torch.tensor(feed), start_t)
        err = max_rel_err(res.captured["logits"], ref_logits)
        assert err <= 1e-5, f"{fuse} {mode} from {start}: max rel. error {err:.2e}"
        assert torch.equal(res.tokens, ref_tokens)

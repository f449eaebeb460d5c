"""The nucleus head: validated programs at tp 1 and 2, the stage order, exactly six more dependent
levels than the plain head, and plain programs without any of it."""

from __future__ import annotations

import pytest

from mpk_dist.errors import InputError
from mpk_dist.taskgraph import sampling_rng as R
from mpk_dist.taskgraph.compiler import compile_rank_programs
from mpk_dist.taskgraph.levels import task_levels
from mpk_dist.taskgraph.testing import MAX_SEQ, fp32, programs

HEAD = [("argmax_partial/max", "argmax_partial"), ("argmax_partial/max/reduce", "argmax_reduce"),
        ("argmax_partial/max/gather", "allgather_push"), ("argmax_partial/hist", "argmax_nucleus_hist"),
        ("argmax_partial/hist/gather", "allgather_push"), ("argmax_partial/cut", "argmax_nucleus_cut"),
        ("argmax_partial", "argmax_partial"), ("argmax_partial/reduce", "argmax_reduce"),
        ("all_gather", "allgather_push"), ("argmax_select", "argmax_select")]


@pytest.mark.parametrize("tp", [1, 2])
def test_nucleus_program_validates_with_the_stages_in_order(tp):
    cfg = fp32("tiny-llama")
    plain = programs(cfg, tp)[0]
    nuc = compile_rank_programs(cfg, tp, sms=8, max_seq_len=MAX_SEQ, nucleus=True)[0]  # validated
    assert [(o["name"], o["kind"]) for o in nuc.meta["ops"][-len(HEAD):]] == HEAD
    assert nuc.meta["nucleus"] is True and "nucleus" not in plain.meta
    assert int(task_levels(nuc).max()) == int(task_levels(plain).max()) + 6


def test_plain_programs_carry_only_the_sampling_buffer():
    cg = programs(fp32("tiny"), 2)[0]
    names = [b["name"] for b in cg.meta["buffers"]]
    assert "sampling" in names and cg.meta["special"]["sampling"] == names.index("sampling")
    assert not any(n.endswith((".hist", ".hist_all", ".cut", ".maxes")) for n in names)
    assert not any(o["kind"].startswith("argmax_nucleus") for o in cg.meta["ops"])


def test_nucleus_refuses_vocabularies_beyond_the_fixed_point_range():
    cfg = fp32("tiny-llama", vocab_size=R.MAX_NUCLEUS_VOCAB * 2)
    with pytest.raises(InputError, match="top-p sampling: expected a vocabulary of at most"):
        compile_rank_programs(cfg, 1, sms=8, max_seq_len=MAX_SEQ, nucleus=True)

"""The attn_merge fusion (split-KV attention merged by the last split tile of each kv head, counted on a
ticket word): the merge op disappears (one level less per layer), logits equal the split program with
merge tiles bit for bit in the interpreter with race checks on (unfused and attn_prep split programs,
tp 1/2, batch 1/4, jit and aot orders), the ticket words end every step at zero, and every edge of a
merged layer is necessary."""

from __future__ import annotations

import pytest
import torch

from mpk_dist.models.presets import get_preset
from mpk_dist.taskgraph import fusion
from mpk_dist.taskgraph.interpreter import Interpreter, _Launch
from mpk_dist.taskgraph.levels import level_summary
from mpk_dist.taskgraph.testing import (assert_schedules_match_reference, fp32, preset_or_short, programs,
                                        uncaught_edge_deletions, weights)

DEFAULT = sorted(fusion.FUSIONS)
MERGE = DEFAULT + ["attn_merge"]


pytestmark = pytest.mark.usefixtures("one_thread")


def test_no_merge_op_and_one_level_less():
    cfg = get_preset("tiny")
    for extra in ([], ["attn_prep"]):
        merged = programs(cfg, 1, fuse=MERGE + extra, attn_splits=4)[0]
        plain = programs(cfg, 1, fuse=DEFAULT + extra, attn_splits=4)[0]
        kinds = [o["kind"] for o in merged.meta["ops"]]
        assert "attention_merge" not in kinds
        assert [o["kind"] for o in plain.meta["ops"]].count("attention_merge") == cfg.num_layers
        assert sum(b["kind"] == "ticket" for b in merged.meta["buffers"]) == cfg.num_layers
        assert level_summary(merged)["step"] == level_summary(plain)["step"] - cfg.num_layers
    # unsplit programs have no merge to move: the option changes nothing there
    a, b = programs(cfg, 1, fuse=MERGE, attn_splits=1)[0], programs(cfg, 1, fuse=DEFAULT, attn_splits=1)[0]
    assert [o["kind"] for o in a.meta["ops"]] == [o["kind"] for o in b.meta["ops"]]


CASES = [("tiny", 1, 1, 4, []), ("tiny", 2, 4, 3, []), ("tiny-llama", 2, 1, 2, ["attn_prep"]),
         ("tiny", 1, 4, 3, ["attn_prep"]), ("qwen3-0.6b-2l", 1, 4, 4, [])]


@pytest.mark.parametrize("name,tp,batch,splits,extra", CASES)
def test_logits_bit_identical_to_merge_tiles(name, tp, batch, splits, extra):
    """bf16, teacher-forced then greedy, sequences at different positions, race checks on (the ticket's
    acquire is what orders the last tile's reads of the other ranges' partials)."""
    cfg = preset_or_short(name)
    ws = weights(cfg, tp, batch=batch)
    feed = torch.tensor([[7, 11, 300, 5][:batch]] + [[13, -1, 2, -1][:batch]] + [[-1] * batch] * 2)
    start = torch.tensor([0, 9, 3, 30][:batch], dtype=torch.int32)
    runs = []
    for f, m, seed in ((DEFAULT + extra, "jit", 5), (MERGE + extra, "jit", 6), (MERGE + extra, "aot", 7)):
        it = Interpreter(programs(cfg, tp, batch=batch, fuse=f, attn_splits=splits), ws, seed=seed, mode=m)
        runs.append(it.run(4, feed, start))
        tickets = [it.bufs[r][b] for r in range(tp) for b, info in enumerate(it.meta["buffers"])
                   if info["kind"] == "ticket"]
        assert bool(tickets) == ("attn_merge" in f)
        assert all(int(t.abs().sum()) == 0 for t in tickets), "a ticket word did not return to 0 at a step's end"
    for r in runs[1:]:
        assert torch.equal(runs[0].captured["logits"], r.captured["logits"]), (name, tp, batch, splits, extra)
        assert torch.equal(runs[0].tokens, r.tokens)


def test_fp32_random_schedules_match_torch_backend():
    cfg = fp32("tiny")
    assert_schedules_match_reference(cfg, 2, programs(cfg, 2, fuse=MERGE + ["attn_prep"], attn_splits=3), weights(cfg, 2))


def test_a_merge_without_the_ticket_acquire_is_a_race(monkeypatch):
    """The race detector sees through a ticket that released nothing: the last tile's reads of the other
    ranges' partials are then unordered."""
    cfg = fp32("tiny")
    cgs, ws = programs(cfg, 1, fuse=MERGE, attn_splits=3), weights(cfg, 1)
    real = _Launch._take_ticket

    def forgetful(self, r, s, xid, kind, ctx, args, tk, mine):
        key = (r, args[kind.arg_index(tk[0])][0], ctx.off(tk[0]))
        count, _ = self.tickets.get(key, (0, 0))
        self.tickets[key] = (count, 0)  # drop what earlier adders released
        return real(self, r, s, xid, kind, ctx, args, tk, mine)

    monkeypatch.setattr(_Launch, "_take_ticket", forgetful)
    with pytest.raises(Exception, match="race"):
        Interpreter(cgs, ws, seed=1, mode="jit").run(3, torch.tensor([[7], [-1], [-1]]), torch.tensor([0]))


@pytest.mark.parametrize("tp,layer", [(1, 1), (2, 0)])
def test_deleting_any_edge_of_a_merged_layer_is_caught(tp, layer):
    cfg = fp32("tiny")
    cgs, ws = programs(cfg, tp, fuse=MERGE, attn_splits=3), weights(cfg, tp)
    feed = torch.tensor([[5], [-1]])
    missed, tried = uncaught_edge_deletions(cgs, ws, layer, feed)
    assert tried >= 20
    assert not missed, f"deleting these edges of a merged layer went unnoticed: {missed}"

"""The interpreter runs the serialized task graph like the kernel would and agrees with the torch
backend: tiny Qwen3 and Llama, kv_heads < tp, tp 1/2/4, 20 random schedules each."""

from __future__ import annotations

import pytest
import torch

from mpk_dist.errors import DeviceTimeout, InputError
from mpk_dist.taskgraph.interpreter import Interpreter
from mpk_dist.taskgraph.race import RaceError
from mpk_dist.taskgraph.testing import drop_wait, fp32, max_rel_err, programs, reference, weights

CONFIGS = {
    "tiny": lambda: fp32("tiny"),              # Qwen3: q/k norm, head_dim 32 != 64/4, GQA 4:2
    "tiny-llama": lambda: fp32("tiny-llama"),  # Llama-3.1 rope scaling, untied head
    "tiny-kv1": lambda: fp32("tiny", num_kv_heads=1),  # kv_heads < tp at tp 2 and 4
}
CASES = [(c, tp) for c in CONFIGS for tp in (1, 2, 4) if not (c == "tiny-kv1" and tp == 1)]
SCHEDULES = 20
LONG = 16   # steps of the first schedule (greedy: the tokens the graph produces itself)
SHORT = 2   # steps of the other schedules (keeps the suite fast); alternately greedy / teacher-forced


@pytest.mark.parametrize("config,tp", CASES)
def test_random_schedules_match_torch_backend(config, tp):
    cfg = CONFIGS[config]()
    cgs, ws = programs(cfg, tp), weights(cfg, tp)
    greedy = [[7]] + [[-1]] * (LONG - 1)
    forced = [[7], [300]]
    ref_greedy = reference(cfg, tp, greedy)
    ref_forced = reference(cfg, tp, forced)
    for seed in range(SCHEDULES):
        feed, (ref_logits, ref_tokens) = (greedy, ref_greedy) if seed % 2 == 0 else (forced, ref_forced)
        steps = LONG if seed == 0 else SHORT
        it = Interpreter(cgs, ws, seed=seed, mode="aot" if seed % 5 == 4 else "jit")
        res = it.run(steps, torch.tensor(feed[:steps]), torch.tensor([0]))
        err = max_rel_err(res.captured["logits"], ref_logits[:steps])
        assert err <= 1e-5, f"{config} tp={tp} schedule {seed}: max rel. error {err:.2e}"
        assert torch.equal(res.tokens, ref_tokens[:steps]), f"{config} tp={tp} schedule {seed}: tokens differ"


def test_batch_of_two_and_several_launches_share_the_kv_cache():
    cfg = fp32("tiny")
    it = Interpreter(programs(cfg, 2, batch=2), weights(cfg, 2, batch=2), seed=3)
    ref_logits, ref_tokens = reference(cfg, 2, [[5, 9], [-1, -1], [-1, -1], [-1, -1]])
    first = it.run(2, torch.tensor([[5, 9], [-1, -1]]), torch.tensor([0, 0]))
    second = it.run(2, torch.tensor([first.tokens[-1].tolist(), [-1, -1]]), torch.tensor([2, 2]))
    logits = torch.cat([first.captured["logits"], second.captured["logits"]])
    assert max_rel_err(logits, ref_logits) <= 1e-5
    assert torch.equal(torch.cat([first.tokens, second.tokens]), ref_tokens)


def test_removed_edge_is_reported_as_a_race_naming_both_tasks():
    cfg = fp32("tiny")
    cgs = programs(cfg, 2)
    t = cgs[0].arrays["tasks"]
    # the wait row of the first silu_mul tile (waits on its gate and up tiles of gate_up_proj)
    task = next(i for i in range(len(t)) if "L0.silu_mul" in cgs[0].task_label(i))
    k = int(t[task, 4])
    mutated = [drop_wait(cg, k) for cg in cgs]
    with pytest.raises(RaceError) as info:
        Interpreter(mutated, weights(cfg, 2), seed=0).run(1, torch.tensor([[3]]), torch.tensor([0]))
    msg = str(info.value)
    assert "L0.silu_mul (silu_mul), layer 0, tile 0" in msg and "L0.gate_up_proj (linear)" in msg
    # silu read before gate_up wrote (write-after-read) or after it without an event (read-after-write)
    assert info.value.race.kind in ("read-after-write", "write-after-read")


def test_missing_signal_deadlocks_with_a_named_wait():
    cfg = fp32("tiny")
    cgs = programs(cfg, 1)
    embed = next(i for i in range(cgs[0].num_tasks) if "op embedding" in cgs[0].task_label(i))
    e = int(cgs[0].arrays["waits"][cgs[0].arrays["tasks"][embed, 4], 0])  # the event embedding waits on
    for cg in cgs:
        cg.arrays["events"][e, 0] += 1  # one trigger more than anyone signals
    with pytest.raises(DeviceTimeout, match=r"deadlock: rank 0 step 0 .* waits on event"):
        Interpreter(cgs, weights(cfg, 1)).run(1, torch.tensor([[3]]), torch.tensor([0]))


def test_bad_inputs_are_refused():
    cfg = fp32("tiny")
    it = Interpreter(programs(cfg, 1), weights(cfg, 1))
    with pytest.raises(InputError, match="row 0"):
        it.run(1, torch.tensor([[-1]]), torch.tensor([0]))
    with pytest.raises(InputError, match="steps"):
        it.run(10_000, torch.full((10_000, 1), 3), torch.tensor([0]))
    with pytest.raises(InputError, match="weight"):
        Interpreter(programs(cfg, 1), [{}])

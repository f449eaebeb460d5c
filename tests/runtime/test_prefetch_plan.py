"""The per-task L2 prefetch plan (mpk_dist/runtime/prefetch_plan.py): which linear tiles prefetch
their whole weight block before waiting, and the L2 budget split."""

from __future__ import annotations

import numpy as np
import pytest

from mpk_dist.models.presets import get_preset
from mpk_dist.runtime.prefetch_plan import L2_SHARE, describe, prefetch_plan
from mpk_dist.taskgraph.abi import TASK_COLS
from mpk_dist.taskgraph.compiler import compile_rank_programs
from mpk_dist.taskgraph.tasks import BY_OPCODE

SMS = 132
MODEL = "qwen3-0.6b"  # linears span the workers (the tiny preset's are all narrow)
BATCH = 2  # the plan's mechanics: from batch 2 an unsplit attention op is narrow (batch 1: see the last tests)


def _by_name(cg, plan):
    """{(op name, kind): sorted set of planned values of its tasks}."""
    out: dict = {}
    for t, v in enumerate(plan.tolist()):
        op = cg.meta["ops"][int(cg.arrays["tasks"][t, TASK_COLS["OP_INDEX"]])]
        out.setdefault((op["name"], BY_OPCODE[int(cg.arrays["tasks"][t, TASK_COLS["OPCODE"]])].name), set()).add(v)
    return out


@pytest.mark.parametrize("fuse,tp", [(True, 1), (False, 1), (True, 2)])
def test_only_linears_after_a_narrow_op_prefetch_whole_tiles(fuse, tp):
    """Fused: only o_proj (after attention's 8 tasks). Unfused: also qkv_proj, gate_up_proj and lm_head,
    which wait on a one-task rms_norm; never down_proj (after the full-width gate_up / silu_mul)."""
    cg = compile_rank_programs(get_preset(MODEL), tp=tp, batch=BATCH, sms=SMS, max_seq_len=64, fuse=fuse)[0]
    plan = prefetch_plan(cg, SMS, 50 << 20)
    marked = {k: v for k, v in _by_name(cg, plan).items() if v != {-1}}
    layers = get_preset(MODEL).num_layers
    want = {"o_proj"} if fuse else {"o_proj", "qkv_proj", "gate_up_proj", "lm_head"}
    assert {name.split(".")[-1] for name, _ in marked} == want, sorted(marked)
    assert len(marked) == layers * len(want - {"lm_head"}) + ("lm_head" in want)
    for (name, kind), vals in marked.items():
        assert kind in ("linear", "linear_residual", "norm_linear") and max(vals) > 0, (name, kind)
    # planned bytes = the tile's whole weight block (o/qkv/gate_up: far below the budget; lm_head, 311 MB,
    # gets an equal share of it)
    ops = cg.arrays["tasks"][:, TASK_COLS["OP_INDEX"]]
    head = [i for i, o in enumerate(cg.meta["ops"]) if o["name"].endswith("lm_head")]
    for t in np.nonzero((plan > 0) & ~np.isin(ops, head))[0]:
        row = cg.arrays["tasks"][t]
        p = cg.arrays["params"][row[TASK_COLS["PARAM_BEGIN"]]:row[TASK_COLS["PARAM_END"]]]
        named = {s.name: int(x) for s, x in zip(BY_OPCODE[int(row[TASK_COLS["OPCODE"]])].params, p)}
        assert plan[t] == named["N_TILE"] * named["K"] * 2
    assert "whole-tile L2 prefetch" in describe(cg, plan)


def test_a_tile_whose_worker_runs_the_producer_first_prefetches_nothing():
    """o_proj tiles on the workers that ran attention (their input is ready when they get there) get 0;
    exactly those: every other marked tile keeps its whole block."""
    cg = compile_rank_programs(get_preset(MODEL), tp=1, batch=BATCH, sms=SMS, max_seq_len=64, fuse=True)[0]
    plan = prefetch_plan(cg, SMS, 50 << 20)
    tasks = cg.arrays["tasks"]
    kinds = [BY_OPCODE[int(o)].name for o in tasks[:, TASK_COLS["OPCODE"]]]
    offs, lst = cg.arrays["worker_offsets"], cg.arrays["worker_tasks"]
    zero = set(np.nonzero(plan == 0)[0].tolist())
    assert zero, "some attention worker also runs an o_proj tile of its layer"
    for t in np.nonzero(plan >= 0)[0].tolist():
        w = int(tasks[t, TASK_COLS["WORKER"]])
        mine = lst[int(offs[w]):int(offs[w + 1])].tolist()
        layer = int(tasks[t, TASK_COLS["LAYER"]])
        before = mine[: mine.index(t)]
        ran_attention = any(kinds[u] == "attention" and int(tasks[u, TASK_COLS["LAYER"]]) == layer for u in before)
        assert (t in zero) == ran_attention, cg.task_label(t)


def test_budget_is_shared_when_the_blocks_exceed_it():
    cg = compile_rank_programs(get_preset(MODEL), tp=1, batch=BATCH, sms=SMS, max_seq_len=64, fuse=True)[0]
    full = prefetch_plan(cg, SMS, 50 << 20)
    tiny_l2 = 1 << 20
    small = prefetch_plan(cg, SMS, tiny_l2)
    assert ((small >= 0) == (full >= 0)).all() and ((small == 0) == (full == 0)).all()
    ops = cg.arrays["tasks"][:, TASK_COLS["OP_INDEX"]]
    for op in set(ops[full > 0].tolist()):
        tiles = np.nonzero((ops == op) & (full > 0))[0]
        assert small[tiles].sum() <= int(L2_SHARE * tiny_l2)
        assert (small[tiles] < full[tiles]).all()


def test_no_narrow_wait_means_no_plan():
    """With as few workers as attention tasks nothing counts as narrow: every entry is -1."""
    cg = compile_rank_programs(get_preset("tiny"), tp=1, batch=1, sms=4, max_seq_len=64, fuse=True)[0]
    assert (prefetch_plan(cg, 4, 50 << 20) == -1).all()


@pytest.mark.parametrize("model", ["qwen3-0.6b", "qwen3-1.7b"])
def test_split_attention_at_context_512_is_not_narrow(model):
    """At context 512 split-KV attention has 64 tiles (at least NARROW_FRACTION of 132 workers): the o_proj
    tiles after it get no whole-tile plan. Measured, not an accident: planning them was slower on an H200
    (docs/PERF.md v0.14), so a rule change that marks them again must be measured first. (The 8B presets' 'auto'
    is unsplit there: see the next test.)"""
    from mpk_dist.runtime.megakernel_backend import fusions_for_batch, fusions_from_env

    cg = compile_rank_programs(get_preset(model), tp=1, batch=1, sms=SMS, max_seq_len=512,
                               fuse=fusions_for_batch(fusions_from_env(True), 1), attn_splits="auto")[0]
    per_layer = sum(1 for o in cg.arrays["tasks"][:, TASK_COLS["OPCODE"]]
                    if BY_OPCODE[int(o)].name == "attention_split_prep") // get_preset(model).num_layers
    assert per_layer >= 0.25 * SMS, per_layer
    assert (prefetch_plan(cg, SMS, 50 << 20) == -1).all()


@pytest.mark.parametrize("model,attn_splits", [("qwen3-8b", "auto"), ("llama3-8b", "auto"), ("qwen3-0.6b", 1)])
def test_nothing_is_planned_behind_batch_1_attention(model, attn_splits):
    """Batch 1: the 8B presets' 'auto' leaves attention unsplit at context 512 (8 tiles, a narrow op), and so does
    --attn-splits 1 for qwen3-0.6b, yet no tile behind it gets a whole-tile plan (NO_PLAN_BEHIND_ATTENTION_MAX_BATCH):
    the o_proj plan was 0.5-0.6% slower there (docs/PERF.md v0.30). At batch 2 the same op is planned."""
    from mpk_dist.runtime.megakernel_backend import fusions_for_batch, fusions_from_env
    from mpk_dist.runtime.prefetch_plan import NO_PLAN_BEHIND_ATTENTION_MAX_BATCH

    assert NO_PLAN_BEHIND_ATTENTION_MAX_BATCH == 1
    plans = {}
    for batch in (1, 2):
        cg = compile_rank_programs(get_preset(model), tp=1, batch=batch, sms=SMS, max_seq_len=512,
                                   fuse=fusions_for_batch(fusions_from_env(True), batch), attn_splits=attn_splits)[0]
        kinds = {BY_OPCODE[int(o)].name for o in cg.arrays["tasks"][:, TASK_COLS["OPCODE"]]}
        assert "attention_prep" in kinds, sorted(kinds)  # unsplit at both batches
        plans[batch] = {k[0].split(".")[-1] for k, v in _by_name(cg, prefetch_plan(cg, SMS, 50 << 20)).items()
                        if v != {-1}}
    assert plans[1] == set() and "o_proj" in plans[2], plans


def test_the_rule_is_the_signaller_count_not_the_op():
    """The tiny preset at 32 workers: its down_proj has 4 tiles, so the next layer's qkv_proj waits on a
    narrow op and is planned too (at qwen3-0.6b's 128 down tiles it is not), at batch 1 as well, where the o_proj
    tiles behind attention are not (NO_PLAN_BEHIND_ATTENTION_MAX_BATCH)."""
    names = {}
    for batch in (1, BATCH):
        cg = compile_rank_programs(get_preset("tiny"), tp=1, batch=batch, sms=32, max_seq_len=64, fuse=True)[0]
        names[batch] = {n.split(".")[-1] for n, _ in (k for k, v in _by_name(cg, prefetch_plan(cg, 32, 50 << 20)).items()
                                                      if v != {-1})}
    assert "qkv_proj" in names[1] and "o_proj" not in names[1], names
    assert {"o_proj", "qkv_proj"} <= names[BATCH], names


def test_switch_from_env_and_what_the_kernel_reads():
    """MPK_PREFETCH_PLAN=0 asks the session for no plan (the task records then hold -1 and the kernel keeps
    its MPK_PREFETCH_KB cap); the kernel's prefetch hook reads the plan from the task's record."""
    from mpk_dist.errors import InputError
    from mpk_dist.runtime.build import CSRC
    from mpk_dist.runtime.megakernel_backend import tuning_from_env

    assert "prefetch_plan" not in tuning_from_env(512, {}) and tuning_from_env(512, {"MPK_PREFETCH_PLAN": "1"}) == \
        tuning_from_env(512, {})
    assert tuning_from_env(512, {"MPK_PREFETCH_PLAN": "0"})["prefetch_plan"] is False
    with pytest.raises(InputError, match="MPK_PREFETCH_PLAN: expected one of 0, 1"):
        tuning_from_env(512, {"MPK_PREFETCH_PLAN": "off"})
    loop = (CSRC / "runtime" / "worker.cuh").read_text()
    loop = loop[loop.index("__device__ void worker_loop_aot("):]
    assert "prefetch_task(p, rec, rec[REC_PREFETCH], tid, nt)" in loop
    assert "prefetch_task(p, recs[slot ^ 1], rec[REC_PREFETCH_NEXT], tid, nt)" in loop


@pytest.mark.parametrize("attn_splits", [1, "auto"])
def test_hoist_ahead_moves_narrow_tiles_to_a_non_linear_predecessor(attn_splits):
    """Every o_proj tile whose aot predecessor is an attention-side task has its bytes issued during that
    task's wait (ahead = the bytes prefetch_plan gives it, or would give without the producer-first rule;
    its own plan 0); a tile after a linear keeps its plan; nothing else changes."""
    from mpk_dist.runtime.prefetch_plan import hoist_ahead
    from mpk_dist.runtime.task_records import REC_PREFETCH, REC_PREFETCH_NEXT, build_records

    cg = compile_rank_programs(get_preset(MODEL), tp=1, batch=BATCH, sms=SMS, max_seq_len=256, fuse=True,
                               attn_splits=attn_splits)[0]
    base = prefetch_plan(cg, SMS, 50 << 20)
    plan, ahead = hoist_ahead(cg, SMS, 50 << 20)
    tasks = cg.arrays["tasks"]
    kinds = [BY_OPCODE[int(o)].name for o in tasks[:, TASK_COLS["OPCODE"]]]
    offs, lst = cg.arrays["worker_offsets"], cg.arrays["worker_tasks"]
    hoisted = 0
    for w in range(len(offs) - 1):
        order = lst[int(offs[w]):int(offs[w + 1])].tolist()
        for prev, t in zip(order, order[1:]):
            if base[t] >= 0 and kinds[prev] not in ("linear", "norm_linear", "linear_residual", "silu_linear"):
                whole = int(max(base[base > 0]))  # every o_proj tile of this model has the same block
                assert (plan[t], ahead[prev]) == (0, whole), (cg.task_label(prev), cg.task_label(t))
                hoisted += 1
            else:
                assert plan[t] == base[t] and ahead[prev] == 0, cg.task_label(t)
    assert hoisted >= cg.meta["ops"].__len__() // 10 and (ahead > 0).sum() == hoisted
    assert "issued during the previous task's wait" in describe(cg, plan, ahead)
    # the records carry both, in worker order
    rec, task_rec = build_records(cg, np.zeros(cg.arrays["args"].shape[0], np.uint64), plan, ahead, bulk_prefetch=True)
    assert (rec[task_rec, REC_PREFETCH] == plan).all() and (rec[task_rec, REC_PREFETCH_NEXT] == ahead).all()


def test_bulk_and_ahead_switches_reach_the_records():
    """MPK_BULK_PREFETCH / MPK_PREFETCH_AHEAD are session switches (same kernel binary): the records' flag bit
    and REC_PREFETCH_NEXT follow them; bad values are refused."""
    from mpk_dist.errors import InputError
    from mpk_dist.runtime.megakernel_backend import tuning_from_env
    from mpk_dist.runtime.task_records import FLAG_BULK_PREFETCH, REC_FLAGS

    assert tuning_from_env(512, {"MPK_BULK_PREFETCH": "0", "MPK_PREFETCH_AHEAD": "0"}).get("bulk_prefetch", False) is False
    on = tuning_from_env(512, {"MPK_BULK_PREFETCH": "1", "MPK_PREFETCH_AHEAD": "1"})
    assert on["bulk_prefetch"] is True and on["prefetch_ahead"] is True
    with pytest.raises(InputError, match="MPK_PREFETCH_AHEAD: expected one of 0, 1"):
        tuning_from_env(512, {"MPK_PREFETCH_AHEAD": "yes"})
    from mpk_dist.runtime.task_records import build_records
    cg = compile_rank_programs(get_preset("tiny"), tp=1, batch=1, sms=8, max_seq_len=64, fuse=True)[0]
    addr = np.zeros(cg.arrays["args"].shape[0], np.uint64)
    assert ((build_records(cg, addr, bulk_prefetch=True)[0][:, REC_FLAGS] & FLAG_BULK_PREFETCH) != 0).all()
    assert ((build_records(cg, addr)[0][:, REC_FLAGS] & FLAG_BULK_PREFETCH) == 0).all()


def test_level_cap_fills_every_other_linear_tile():
    """MPK_PREFETCH_LEVEL_KB (table-only): the linear tiles the plan leaves at the kernel's cap get that many
    bytes in their records instead; the narrow-waiting tiles keep their plan; non-linear tasks keep -1."""
    from mpk_dist.errors import InputError
    from mpk_dist.runtime.megakernel_backend import tuning_from_env

    assert tuning_from_env(512, {"MPK_PREFETCH_LEVEL_KB": "128"})["prefetch_level_kb"] == 128
    assert "prefetch_level_kb" not in tuning_from_env(512, {})
    with pytest.raises(InputError, match="MPK_PREFETCH_LEVEL_KB: expected a cap in KB >= 0"):
        tuning_from_env(512, {"MPK_PREFETCH_LEVEL_KB": "-5"})
    cg = compile_rank_programs(get_preset(MODEL), tp=1, batch=1, sms=SMS, max_seq_len=64, fuse=True)[0]
    base = prefetch_plan(cg, SMS, 50 << 20)
    level = prefetch_plan(cg, SMS, 50 << 20, level_bytes=128 << 10)
    linear = np.array([BY_OPCODE[int(o)].name in ("linear", "norm_linear", "linear_residual", "silu_linear")
                       for o in cg.arrays["tasks"][:, TASK_COLS["OPCODE"]]])
    assert (level[linear & (base == -1)] == 128 << 10).all() and (linear & (base == -1)).sum() > 100
    assert (level[~linear] == -1).all() and (level[base >= 0] == base[base >= 0]).all()


def test_tune_sweep_has_the_level_cap_token(tune_sweep):
    """scripts/tune_sweep.py: 'e<KB>' sets MPK_PREFETCH_LEVEL_KB (a table-only sweep on one binary)."""
    assert tune_sweep.parse_variant("e128,h1") == ({"MPK_PREFETCH_LEVEL_KB": "128", "MPK_PREFETCH_AHEAD": "1"}, {})


@pytest.fixture(scope="module")
def qwen3_8b_b1():
    """qwen3-8b's batch-1 program at context 512 ('auto': attention unsplit, 8 tiles: a narrow op)."""
    from mpk_dist.runtime.megakernel_backend import fusions_for_batch, fusions_from_env

    return compile_rank_programs(get_preset("qwen3-8b"), tp=1, batch=1, sms=SMS, max_seq_len=512,
                                 fuse=fusions_for_batch(fusions_from_env(True), 1), attn_splits="auto")[0]


def _next_in_worker(cg) -> dict[int, int]:
    offs, lst = cg.arrays["worker_offsets"], cg.arrays["worker_tasks"]
    out = {}
    for w in range(len(offs) - 1):
        order = lst[int(offs[w]):int(offs[w + 1])].tolist()
        out.update(zip(order, order[1:]))
    return out


def test_plan_behind_attention_switch_plans_o_proj_at_batch_1(qwen3_8b_b1):
    """MPK_PLAN_BEHIND_ATTENTION=1 (record-level): the o_proj tiles behind the 8 unsplit batch-1 attention tiles get
    their whole blocks, as at batch 2; without it nothing is planned there (NO_PLAN_BEHIND_ATTENTION_MAX_BATCH)."""
    from mpk_dist.errors import InputError
    from mpk_dist.runtime.megakernel_backend import tuning_from_env
    from mpk_dist.runtime.prefetch_plan import plan_tables

    cg = qwen3_8b_b1
    assert tuning_from_env(512, {"MPK_PLAN_BEHIND_ATTENTION": "1"})["plan_behind_attention"] is True
    assert "plan_behind_attention" not in tuning_from_env(512, {"MPK_PLAN_BEHIND_ATTENTION": "0"})
    with pytest.raises(InputError, match="MPK_PLAN_BEHIND_ATTENTION: expected one of 0, 1"):
        tuning_from_env(512, {"MPK_PLAN_BEHIND_ATTENTION": "yes"})
    off, _ = plan_tables(cg, SMS, 50 << 20)
    on, ahead = plan_tables(cg, SMS, 50 << 20, behind_attention=True)
    assert ahead is None and (off == -1).all()
    marked = {k[0].split(".")[-1] for k, v in _by_name(cg, on).items() if v != {-1}}
    assert marked == {"o_proj"}, marked
    assert int(on.max()) == 4096 * 4096 * 2 // 128  # one o_proj tile's whole 256 KB block


@pytest.mark.parametrize("behind", [False, True])
def test_prefetch_next_gives_the_narrow_waiters_the_head_of_their_next_linear(qwen3_8b_b1, behind):
    """MPK_PREFETCH_NEXT_KB (record-level, aot): every linear tile waiting on the narrow batch-1 attention (o_proj)
    prefetches up to N KB of its worker's next task when that is a linear tile (a gate|up tile), within the L2 share
    its op's own plan leaves; no other task gets bytes ahead; the records carry them."""
    from mpk_dist.errors import InputError
    from mpk_dist.runtime.megakernel_backend import tuning_from_env
    from mpk_dist.runtime.prefetch_plan import L2_SHARE, plan_tables
    from mpk_dist.runtime.task_records import REC_PREFETCH_NEXT, build_records

    assert tuning_from_env(512, {"MPK_PREFETCH_NEXT_KB": "256"})["prefetch_next_kb"] == 256
    assert "prefetch_next_kb" not in tuning_from_env(512, {"MPK_PREFETCH_NEXT_KB": "0"})
    with pytest.raises(InputError, match="MPK_PREFETCH_NEXT_KB: expected a size in KB >= 0"):
        tuning_from_env(512, {"MPK_PREFETCH_NEXT_KB": "-1"})
    cg, l2 = qwen3_8b_b1, 50 << 20
    plan, ahead = plan_tables(cg, SMS, l2, behind_attention=behind, next_bytes=256 << 10)
    tasks = cg.arrays["tasks"]
    kind = lambda t: BY_OPCODE[int(tasks[t, TASK_COLS["OPCODE"]])].name  # noqa: E731
    name = lambda t: cg.meta["ops"][int(tasks[t, TASK_COLS["OP_INDEX"]])]["name"].split(".")[-1]  # noqa: E731
    nxt = _next_in_worker(cg)
    o_proj = [t for t in range(tasks.shape[0]) if name(t) == "o_proj"]
    share = (int(L2_SHARE * l2) - sum(max(0, int(plan[t])) for t in o_proj[:128])) // 128  # one layer's 128 tiles
    want = min(256 << 10, share)
    got = {name(t): set() for t in np.nonzero(ahead)[0]}
    for t in np.nonzero(ahead)[0]:
        got[name(t)].add(int(ahead[t]))
        assert kind(nxt[int(t)]) == "norm_linear_silu", (cg.task_label(int(t)), cg.task_label(nxt[int(t)]))
    assert set(got) == {"o_proj"} and got["o_proj"] == {want}, got
    assert (want == 256 << 10) != behind  # the whole-tile plan leaves the next tiles only a sliver of the share
    followed = sum(1 for t in o_proj if t in nxt and kind(nxt[t]) == "norm_linear_silu")
    assert (ahead > 0).sum() == followed and followed >= 0.9 * len(o_proj)
    rec, task_rec = build_records(cg, np.zeros(cg.arrays["args"].shape[0], np.uint64), plan, ahead)
    assert (rec[task_rec, REC_PREFETCH_NEXT] == ahead).all()
    assert (plan_tables(cg, SMS, l2, next_bytes=0)[1] is None)


def test_tune_sweep_sets_any_switch_by_name(tune_sweep):
    """scripts/tune_sweep.py: a part MPK_<NAME>=<value> sets that switch (every letter is taken)."""
    assert tune_sweep.parse_variant("MPK_PLAN_BEHIND_ATTENTION=1,MPK_PREFETCH_NEXT_KB=256,u16") == (
        {"MPK_PLAN_BEHIND_ATTENTION": "1", "MPK_PREFETCH_NEXT_KB": "256", "MPK_LINEAR_UNROLL": "16"}, {})
    with pytest.raises(SystemExit, match="MPK_<NAME>=<value>"):
        tune_sweep.parse_variant("MPK_PREFETCH_NEXT_KB")


@pytest.mark.parametrize("kb", [0, 32, 1024])
def test_behind_attention_bytes_replace_the_cap_of_the_tiles_behind_batch_1_attention(qwen3_8b_b1, kb):
    """MPK_PREFETCH_BEHIND_ATTENTION_KB (record-level): the o_proj tiles behind the 8 unsplit batch-1 attention tiles
    get that many bytes (at most their 256 KB block; 0 where their worker ran the attention first) instead of the
    kernel's cap (-1); every other task keeps its plan; batch 2 (planned behind attention already) is unchanged;
    the switch reaches the session's keywords and refuses a bad value or MPK_PLAN_BEHIND_ATTENTION=1 beside it."""
    from mpk_dist.errors import InputError
    from mpk_dist.runtime.megakernel_backend import tuning_from_env
    from mpk_dist.runtime.prefetch_plan import plan_tables

    cg, l2 = qwen3_8b_b1, 50 << 20
    base, _ = plan_tables(cg, SMS, l2)
    plan, ahead = plan_tables(cg, SMS, l2, behind_attention_bytes=kb << 10)
    assert ahead is None
    changed = np.flatnonzero(plan != base)
    names = {k[0].split(".")[-1] for k, v in _by_name(cg, plan).items() if v != {-1}}
    assert names == {"o_proj"}, names  # no longer the cap (-1) there, even at 0
    tasks = cg.arrays["tasks"]
    o_proj = [t for t in range(tasks.shape[0]) if
              cg.meta["ops"][int(tasks[t, TASK_COLS["OP_INDEX"]])]["name"].endswith("o_proj")]
    assert set(changed.tolist()) <= set(o_proj) and (base[o_proj] == -1).all()
    want = min(kb << 10, 4096 * 4096 * 2 // 128)
    assert set(plan[o_proj].tolist()) <= {0, want} and (plan[o_proj] == want).sum() > 100 * cg.meta["num_layers"]
    b2 = _program_b2_qwen3_8b()
    assert np.array_equal(plan_tables(b2, SMS, l2, behind_attention_bytes=0)[0], plan_tables(b2, SMS, l2)[0])
    assert tuning_from_env(512, {"MPK_PREFETCH_BEHIND_ATTENTION_KB": "0"})["prefetch_behind_attention_kb"] == 0
    assert "prefetch_behind_attention_kb" not in tuning_from_env(512, {})
    with pytest.raises(InputError, match="MPK_PREFETCH_BEHIND_ATTENTION_KB: expected a size in KB >= 0"):
        tuning_from_env(512, {"MPK_PREFETCH_BEHIND_ATTENTION_KB": "-1"})
    with pytest.raises(InputError, match="expected MPK_PLAN_BEHIND_ATTENTION unset or 0"):
        tuning_from_env(512, {"MPK_PREFETCH_BEHIND_ATTENTION_KB": "0", "MPK_PLAN_BEHIND_ATTENTION": "1"})
    with pytest.raises(ValueError, match="expected at most one"):
        plan_tables(cg, SMS, l2, behind_attention=True, behind_attention_bytes=0)


def _program_b2_qwen3_8b():
    from mpk_dist.runtime.megakernel_backend import fusions_for_batch, fusions_from_env

    return compile_rank_programs(get_preset("qwen3-8b"), tp=1, batch=2, sms=SMS, max_seq_len=512,
                                 fuse=fusions_for_batch(fusions_from_env(True), 2), attn_splits="auto")[0]

"""Flagged words (mpk_dist.taskgraph.flag_words, fusion name 'flags'): which buffers get a flagged copy, which tiles
write and read it, which waits the polling tiles drop from their records, the shared memory they need, and that the
interpreter (which ignores the copies) computes the same logits. The kernel side is built in
tests/runtime/test_flag_words_build.py and checked bit for bit on the GPU (tests/runtime/test_code_variants_gpu.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mpk_dist.models.presets import get_preset
from mpk_dist.taskgraph import flag_words
from mpk_dist.taskgraph.abi import ARG_COLS, NULL_BUFFER, TASK_COLS, WAIT_COLS
from mpk_dist.taskgraph.compiler import compile_rank_programs
from mpk_dist.taskgraph.interpreter import Interpreter
from mpk_dist.taskgraph.tasks import BY_NAME
from mpk_dist.taskgraph.testing import weights

B1_FUSE = "norm,silu,residual,silu_epi,attn_prep,attn_merge"  # the megakernel's batch-1 program


def _compile(name="qwen3-0.6b", fuse=B1_FUSE + ",flags", batch=1, splits="auto"):
    return compile_rank_programs(get_preset(name), tp=1, batch=batch, sms=132, max_seq_len=576, fuse=fuse,
                                 attn_splits=splits)[0]


def _arg(cg, t: int, kind: str, name: str) -> tuple[int, int]:
    """(buffer, offset) of task t's argument ``name``."""
    row = cg.arrays["args"][cg.arrays["tasks"][t, TASK_COLS["ARG_BEGIN"]] + BY_NAME[kind].arg_index(name)]
    return int(row[ARG_COLS["BUFFER"]]), int(row[ARG_COLS["OFFSET"]])


def _tasks(cg):
    """(task, op name without its layer, layer, kind) of every task."""
    ops = cg.meta["ops"]
    for t, oi in enumerate(cg.arrays["tasks"][:, TASK_COLS["OP_INDEX"]].tolist()):
        op = ops[oi]
        yield t, op["name"].split(".")[-1], op["layer"], op["kind"]


@pytest.fixture(scope="module")
def flagged():
    return _compile()


def test_the_residual_stream_gets_flagged_copies_and_every_reader_its_twin(flagged):
    cg, bufs = flagged, flagged.meta["buffers"]
    layers = get_preset("qwen3-0.6b").num_layers
    assert cg.meta["flag_words"] == [f"L{i}.{n}" for i in range(layers) for n in ("x_mid", "x_out")]
    by_name = {b["name"]: i for i, b in enumerate(bufs)}
    for name in cg.meta["flag_words"]:
        copy = bufs[by_name[name + flag_words.SUFFIX]]
        assert copy["shape"] == bufs[by_name[name]]["shape"] + [2]
        assert copy["dtype"] == "i32" and copy["kind"] == "state"
    twins = {"o_proj": ("Y", "Y_FLAGS"), "down_proj": ("Y", "Y_FLAGS"), "qkv_proj": ("X", "X_FLAGS"),
             "gate_up_proj": ("X", "X_FLAGS"), "lm_head": ("X", "X_FLAGS")}
    seen = set()
    for t, op, layer, kind in _tasks(cg):
        pairs = [twins[op]] if op in twins else []
        if kind == "linear_residual":
            pairs.append(("RESIDUAL", "RESIDUAL_FLAGS"))
        for plain, twin in pairs:
            (pb, po), (fb, fo) = _arg(cg, t, kind, plain), _arg(cg, t, kind, twin)
            if op == "qkv_proj" and layer == 0 or plain == "RESIDUAL" and layer == 0 and op == "o_proj":
                assert fb == NULL_BUFFER, f"{op} of layer 0 reads x0 (the embedding's): no copy"
                continue
            assert bufs[fb]["name"] == bufs[pb]["name"] + flag_words.SUFFIX and fo == 2 * po, (op, layer, plain)
            seen.add(op)
    assert seen == set(twins)


def test_polling_tiles_drop_exactly_their_producers_waits(flagged):
    cg = flagged
    skip = np.zeros(cg.arrays["waits"].shape[0], bool)
    skip[cg.meta["skip_waits"]] = True
    ops = cg.meta["ops"]
    signallers = {}
    owner = np.repeat(np.arange(cg.num_tasks), np.diff(cg.arrays["tasks"][:, [TASK_COLS["SIGNAL_BEGIN"],
                                                                                TASK_COLS["SIGNAL_END"]]]).ravel())
    for e, t in zip(cg.arrays["signals"][:, 0].tolist(), owner.tolist()):
        signallers.setdefault(e, set()).add(ops[cg.arrays["tasks"][t, TASK_COLS["OP_INDEX"]]]["name"])
    dropped = {}
    for t, op, layer, kind in _tasks(cg):
        k0, k1 = cg.arrays["tasks"][t, TASK_COLS["WAIT_BEGIN"]], cg.arrays["tasks"][t, TASK_COLS["WAIT_END"]]
        for k in range(k0, k1):
            if not skip[k]:
                continue
            e = int(cg.arrays["waits"][k, WAIT_COLS["EVENT"]])
            assert kind in flag_words.POLLED and cg.arrays["waits"][k, WAIT_COLS["STEP_OFFSET"]] == 0
            # the producer of what the task polls: down (qkv, lm_head) or o_proj (gate_up) of its layer or the last
            want = f"L{layer - 1}.down_proj" if op == "qkv_proj" else f"L{layer}.o_proj" if op == "gate_up_proj" \
                else f"L{get_preset('qwen3-0.6b').num_layers - 1}.down_proj"
            assert signallers[e] == {want}, (op, layer, signallers[e])
            dropped[op] = dropped.get(op, 0) + 1
    tiles = {op: sum(1 for _, o, layer, _ in _tasks(cg) if o == op and (op != "qkv_proj" or layer > 0))
             for op in ("qkv_proj", "gate_up_proj", "lm_head")}
    assert dropped == tiles, (dropped, tiles)  # one wait each (the producer's event), every polling tile


def test_records_hold_the_kept_waits_only(flagged):
    from mpk_dist.runtime.task_records import REC_NWAITS, REC_WAITS, REC_WAIT_COLS, build_records

    cg = flagged
    addr = np.arange(cg.arrays["args"].shape[0], dtype=np.uint64) * 16 + 4096
    rec, task_rec = build_records(cg, addr)
    plain = cg.copy()
    plain.meta.pop("skip_waits")
    rec0, _ = build_records(plain, addr)
    skip = set(cg.meta["skip_waits"])
    changed = 0
    for t, op, layer, kind in _tasks(cg):
        r, r0 = rec[task_rec[t]], rec0[task_rec[t]]
        k0, k1 = cg.arrays["tasks"][t, TASK_COLS["WAIT_BEGIN"]], cg.arrays["tasks"][t, TASK_COLS["WAIT_END"]]
        kept = [int(cg.arrays["waits"][k, WAIT_COLS["EVENT"]]) for k in range(k0, k1) if k not in skip]
        assert r[REC_NWAITS] == len(kept) and [r[REC_WAITS + j * REC_WAIT_COLS] for j in range(len(kept))] == kept
        changed += not np.array_equal(r, r0)
        if k1 - k0 == len(kept):
            assert np.array_equal(r, r0), (op, layer)
    assert changed == len(skip)


def test_no_copy_where_a_reader_could_not_take_it():
    """Without the silu epilogue the down projection is a silu_linear, which reads x_mid as its residual and writes
    x_out itself: neither buffer may be flagged (x_mid's reader would read the plain value unordered; x_out's writer
    is not a linear_residual), so the program has no copies and drops no wait."""
    cg = _compile(fuse="norm,silu,residual,attn_prep,attn_merge,flags")
    assert "flag_words" not in cg.meta and "skip_waits" not in cg.meta
    assert not any(b["name"].endswith(flag_words.SUFFIX) for b in cg.meta["buffers"])


def test_without_flags_the_program_is_unchanged():
    a, b = _compile(fuse=B1_FUSE), _compile(fuse=B1_FUSE + ",flags")
    assert "flag_words" not in a.meta
    assert all(np.array_equal(a.arrays[k], b.arrays[k]) for k in ("tasks", "events", "waits", "signals"))


def test_shared_memory_holds_the_body_and_the_gathered_rows(flagged):
    from mpk_dist.runtime import tables
    from mpk_dist.taskgraph.tasks import kind_params

    need = flag_words.smem_bytes(flagged)
    B, K, n = kind_params(flagged, "norm_linear_silu", "BATCH", "K", "N_TILE")
    body = 256 + 2 * int(B.max()) * int(K.max()) + 2 * int(B.max()) * int(n.max())
    assert need >= body + 4 * int(B.max()) * int(K.max())
    assert flag_words.smem_bytes(_compile(fuse=B1_FUSE)) == 0
    for threads in (256, 512):
        assert tables.smem_bytes(flagged, threads) >= need


def test_the_kernel_shape_follows_the_program(flagged):
    from mpk_dist.runtime.codegen import render_source
    from mpk_dist.runtime.session import kernel_shape

    on, off = kernel_shape(flagged, 256, "aot"), kernel_shape(_compile(fuse=B1_FUSE), 256, "aot")
    assert on.flag_words and not off.flag_words and on.name().endswith("_fw") and not off.name().endswith("_fw")
    assert "#define MPK_FLAG_WORDS 1" in render_source(on) and "MPK_FLAG_WORDS" not in render_source(off)


def test_the_switch_adds_the_fusion(monkeypatch):
    from mpk_dist.errors import InputError
    from mpk_dist.runtime.megakernel_backend import fusions_from_env

    assert "flags" not in fusions_from_env(True)
    monkeypatch.setenv("MPK_FLAG_WORDS", "1")
    assert "flags" in fusions_from_env(True)
    monkeypatch.setenv("MPK_FUSE_RESIDUAL", "0")  # flags needs the residual fusion's linear_residual tiles
    assert "flags" not in fusions_from_env(True)
    monkeypatch.delenv("MPK_FUSE_RESIDUAL")
    monkeypatch.setenv("MPK_FLAG_WORDS", "2")
    assert {"flags", "flags16"} <= fusions_from_env(True)
    for bad in ("yes", "3"):
        monkeypatch.setenv("MPK_FLAG_WORDS", bad)
        with pytest.raises(InputError, match="MPK_FLAG_WORDS"):
            fusions_from_env(True)


@pytest.fixture(scope="module")
def flagged16():
    return _compile(fuse=B1_FUSE + ",flags,flags16")


def test_flags16_adds_the_bf16_vectors_of_down_and_o_proj(flagged16):
    """'flags16': the attention output (written by the split tiles' head merge) and the gate|up product
    (norm_linear_silu) get copies too, a column pair a word; down and o_proj poll their x and residual, except layer 0's o_proj, whose
    residual is the embedding's x0 (no copy): it keeps its wait and reads x after it."""
    cg, bufs = flagged16, flagged16.meta["buffers"]
    layers = get_preset("qwen3-0.6b").num_layers
    assert sorted(cg.meta["flag_words"]) == sorted(f"L{i}.{n}" for i in range(layers)
                                                   for n in ("attn_out", "x_mid", "act", "x_out"))
    by_name = {b["name"]: i for i, b in enumerate(bufs)}
    for name in ("L3.attn_out", "L3.act"):
        plain, copy = bufs[by_name[name]], bufs[by_name[name + flag_words.SUFFIX]]
        assert plain["dtype"] == "bf16" and copy["shape"] == plain["shape"][:-1] + [plain["shape"][-1] // 2, 2]
    polled = {}
    for t, op, layer, kind in _tasks(cg):
        if kind != "linear_residual":
            continue
        (xb, xo), (fb, fo) = _arg(cg, t, kind, "X"), _arg(cg, t, kind, "X_FLAGS")
        if op == "o_proj" and layer == 0:
            assert fb == NULL_BUFFER
            continue
        assert bufs[fb]["name"] == bufs[xb]["name"] + flag_words.SUFFIX and fo == xo  # two bf16 a word: same offset
        assert _arg(cg, t, kind, "RESIDUAL_FLAGS")[0] != NULL_BUFFER
        polled[op] = polled.get(op, 0) + 1
    producers = {"split": "MERGED_FLAGS", "gate_up_proj": "Y_FLAGS"}
    for t, op, layer, kind in _tasks(cg):
        key = op.split("/")[-1]
        if key in producers:
            assert bufs[_arg(cg, t, kind, producers[key])[0]]["name"].endswith(flag_words.SUFFIX), (op, layer)
    tiles = {op: sum(1 for _, o, _, k in _tasks(cg) if o == op) for op in ("o_proj", "down_proj")}
    assert polled == {"o_proj": tiles["o_proj"] * (layers - 1) // layers, "down_proj": tiles["down_proj"]}


def test_flags16_polling_projections_drop_their_producers_waits(flagged16):
    cg = flagged16
    skip = np.zeros(cg.arrays["waits"].shape[0], bool)
    skip[cg.meta["skip_waits"]] = True
    for t, op, layer, kind in _tasks(cg):
        if op not in ("o_proj", "down_proj"):
            continue
        k0, k1 = cg.arrays["tasks"][t, TASK_COLS["WAIT_BEGIN"]], cg.arrays["tasks"][t, TASK_COLS["WAIT_END"]]
        polls = _arg(cg, t, kind, "X_FLAGS")[0] != NULL_BUFFER
        assert skip[k0:k1].all() == polls and (skip[k0:k1].any() or not polls), (op, layer)
    assert flag_words.smem_bytes(cg) >= flag_words.smem_bytes(_compile())


@pytest.mark.parametrize("batch", [1, 2])
def test_the_interpreter_computes_the_same_logits(batch):
    """The copies are a kernel-side channel: the interpreter ignores them, so the flagged program (same events) gives
    the unflagged one's logits bit for bit over a random valid schedule."""
    cfg = get_preset("tiny")
    ws = weights(cfg, 1, batch=batch)
    feed = torch.tensor([[7, 11][:batch]] + [[-1] * batch] * 4)
    out = []
    for fuse in (B1_FUSE, B1_FUSE + ",flags", B1_FUSE + ",flags,flags16"):
        cgs = compile_rank_programs(cfg, tp=1, batch=batch, sms=4, max_seq_len=16, fuse=fuse, attn_splits=2)
        assert ("flag_words" in cgs[0].meta) == ("flags" in fuse)
        out.append(Interpreter(cgs, ws, seed=3).run(5, feed, torch.zeros(batch, dtype=torch.int32)))
    assert torch.equal(out[0].captured["logits"], out[1].captured["logits"])
    assert torch.equal(out[0].captured["logits"], out[2].captured["logits"])


def test_a_word_that_stayed_behind_is_named_with_its_writers(flagged):
    """The watchdog's record of a flagged-word timeout (code 9: event_id = the element, seen / expected = the tags)
    becomes a message naming the polling task, the copy, the element, both steps and the ops that write the copy."""
    from mpk_dist.runtime.diagnosis import error_message
    from mpk_dist.runtime.params import ErrorRecord

    t = next(t for t, op, layer, _ in _tasks(flagged) if op == "gate_up_proj" and layer == 3)

    class Sess:
        cg = flagged

        @staticmethod
        def error_record():
            return ErrorRecord(code=9, valid=1, task_id=t, event_id=17, step=5, sm_id=9, worker=9, rank=0, seen=5,
                               expected=6, elapsed_ns=2 * 10**9, peer=-1)

    msg = error_message(Sess())
    assert "flagged word wait" in msg and f"(task {t})" in msg and "element 17 of buffer 'L3.x_mid.flags'" in msg, msg
    assert "held the tag of step 4's, expected step 5's" in msg and "written by L3.o_proj" in msg, msg

"""CPU test of the host side of a launch: buffers, forced-token rows and RuntimeParams, with the
GPU parts (kernel build/load, stream) replaced by fakes that record what they receive (the
``fake_gpu`` fixture of conftest.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mpk_dist.model_source import open_model
from mpk_dist.models import build_graph
from mpk_dist.runtime import session as S
from mpk_dist.runtime.params import RuntimeParams
from mpk_dist.taskgraph.compiler import compile_rank_programs
from mpk_dist.weights import load_rank_weights


@pytest.fixture()
def sess(fake_gpu):
    m = open_model("tiny")
    cg = compile_rank_programs(m.config, tp=1, batch=2, sms=4, max_seq_len=16)[0]
    w = load_rank_weights(build_graph(m.config, tp=1, rank=0, batch=1, max_seq_len=16), m.weights, "cpu")
    return S.Session(cg, w, torch.device("cpu"), schedule="jit", trace=True)


def test_buffers_forced_rows_and_params(sess):
    cg = sess.cg
    for b, t in zip(cg.meta["buffers"], sess.bufs):
        assert tuple(t.shape) == tuple(b["shape"]), b["name"]
    assert sess.buffer("L0.wqkv").data_ptr() != 0
    sess.fill_forced([[5, 6, 7], [8, 9, 10]], [11, 12], n_steps=6)
    forced = sess.buffer("forced_tokens")
    assert forced[:5].tolist() == [[5, 8], [6, 9], [7, 10], [11, 11], [12, 12]]
    assert int(forced[5:].max()) == -1, "rows past the forced ones must read -1 (use the sampled token)"
    sess.launch(0, 6, 3, 4, (7,), True, True)
    grid, ptr, coop = sess.kernel.launches[-1]
    assert grid == cg.meta["workers"] == 4 and ptr == sess.params_dev.data_ptr() and coop
    p = RuntimeParams.from_buffer_copy(sess.params_dev.numpy().tobytes())
    assert p.tasks == sess.tabs["tasks"].data_ptr() and p.event_tab == sess.tabs["events"].data_ptr()
    assert p.logits == sess.buffer("logits").data_ptr() and p.token_out == sess.buffer("token_out").data_ptr()
    assert (p.num_tasks, p.batch, p.vocab, p.step_end, p.prompt_len, p.num_stop) == (cg.arrays["tasks"].shape[0], 2, 512, 6, 3, 1)
    assert p.final_task == S.tables.final_task(cg) and p.inject_hang_task == -1 and p.trace_cap > 0
    assert sess.logits_dump.shape == (4, 2, 512)
    base = np.frombuffer(sess.buf_base.numpy().tobytes(), np.uint64)
    assert [int(x) for x in base] == [t.data_ptr() for t in sess.bufs]
    assert p.records == sess.records.data_ptr() and p.task_rec == sess.task_rec.data_ptr()
    from mpk_dist.runtime import task_records as R
    from mpk_dist.taskgraph.abi import TASK_COLS

    args, tasks = cg.arrays["args"], cg.arrays["tasks"]
    recs, task_rec = sess.records.numpy(), sess.task_rec.numpy()
    for t in range(tasks.shape[0]):  # every argument row of every task: its buffer base + offset * elem size
        a0, a1 = int(tasks[t, TASK_COLS["ARG_BEGIN"]]), int(tasks[t, TASK_COLS["ARG_END"]])
        addr = recs[task_rec[t], R.REC_ARGS: R.REC_ARGS + 2 * (a1 - a0)].copy().view(np.uint64)
        for i, k in enumerate(range(a0, a1)):
            b, off = int(args[k, 0]), int(args[k, 1])
            want = 0 if b < 0 else sess.bufs[b].data_ptr() + off * sess.bufs[b].element_size()
            assert int(addr[i]) == want, (t, k)
    assert (args[:, 0] < 0).any(), "the tiny graph has optional NULL arguments (q tiles' DST_V)"
    sess.wait()  # fake device: every step done at once; no error record
    assert sess.progress() == 6 and sess.error_message() is None


def test_watchdog_record_becomes_a_named_error(sess):
    from mpk_dist.errors import DeviceTimeout
    from mpk_dist.runtime.params import ErrorRecord

    rec = ErrorRecord(code=1, valid=1, task_id=5, event_id=3, step=0, sm_id=17, worker=4, rank=0, seen=1, expected=3,
                      elapsed_ns=500_000_000)
    sess.pinned["error"].copy_(torch.frombuffer(bytearray(bytes(rec)), dtype=torch.uint8))
    with pytest.raises(DeviceTimeout) as info:
        sess.raise_on_error()
    msg = str(info.value)
    assert sess.cg.task_label(5) in msg and "event 3" in msg and "step 0" in msg and "SM 17" in msg
    # all counters are 0: step_begin had its inputs (the previous step's wait is met at step 0) but never signalled
    assert "root cause: op step_begin" in msg


def test_pass_wait_record_names_the_host(sess):
    """kErrPassWait (csrc/runtime/pass_begin.cuh): the message says the host posted no pass, not a task stall."""
    from mpk_dist.errors import DeviceTimeout
    from mpk_dist.runtime.params import ErrorRecord

    rec = ErrorRecord(code=5, valid=1, task_id=0, event_id=-1, step=7, sm_id=3, worker=0, rank=0, seen=7, expected=8,
                      elapsed_ns=10_500_000_000)
    sess.pinned["error"].copy_(torch.frombuffer(bytearray(bytes(rec)), dtype=torch.uint8))
    with pytest.raises(DeviceTimeout, match=r"of pass 7 on rank 0 waited 10.50 s for the host to post it \(posted 7\)"):
        sess.raise_on_error()


@pytest.mark.parametrize("code, seen, expected, want", [
    (6, 1, 3, r"\(page pool empty\): .* at step 4 on rank 0: page_alloc: expected 3 free pages for slot 2, got 1"),
    (7, 0xFFFFFFFF, 0xFFFFFFFF, r"\(page released twice\): .*released slot 2 to own its pages, got it holds no pages"),
    (8, 9, 8, r"\(page table full\): .*at most 8 pages \(the page-table row\) for slot 2, got a position needing 9"),
])
def test_page_alloc_record_names_the_fault(sess, code, seen, expected, want):
    """page_alloc's faults (csrc/tasks/page_alloc.cuh: the slot in event_id) read as the CPU reference's
    errors (tasks/page_alloc.py fault_message), not as a stalled wait."""
    from mpk_dist.errors import DeviceTimeout
    from mpk_dist.runtime.params import ErrorRecord

    rec = ErrorRecord(code=code, valid=1, task_id=1, event_id=2, step=4, sm_id=3, worker=0, rank=0, seen=seen,
                      expected=expected, elapsed_ns=0)
    sess.pinned["error"].copy_(torch.frombuffer(bytearray(bytes(rec)), dtype=torch.uint8))
    with pytest.raises(DeviceTimeout, match=want):
        sess.raise_on_error()


def test_backend_generate_host_path(fake_gpu, tmp_path):
    """The backend's whole host path (session, forced rows, launch, wait, result, trace file) with a
    fake kernel that 'finishes' at once: 1 token streamed per step as if the device wrote it."""
    from mpk_dist.backends.base import GenerateRequest

    MB = fake_gpu
    m = open_model("tiny")
    b = MB.MegakernelBackend(m.config, m.weights, device="cpu", max_seq_len=32, trace=str(tmp_path / "t.json"), sms=4)
    res = b.generate(GenerateRequest([[1, 2, 3]], 5, force_tokens=[7, 7], want_logits=True))
    assert res.tokens == [[2, 3, 4, 5, 6]] and res.logits.shape == (5, 1, 512)
    assert res.prefill_ms == pytest.approx(3.0) and res.per_token_ms == pytest.approx([1.0] * 4)
    assert b.session(1).buffer("forced_tokens")[:5, 0].tolist() == [1, 2, 3, 7, 7]
    assert (tmp_path / "t.json").is_file() and res.extra["steps"] == 7
    assert "exposed_comm_share" not in res.extra, "tp 1 has no communication to profile"
    b.reset(1)
    logits = b.prefill(torch.tensor([[1, 2]]), torch.tensor([[0, 1]]))
    assert logits.shape == (1, 512) and b._step == 2
    with pytest.raises(Exception, match="expected 2"):
        b.decode(torch.tensor([5]), torch.tensor([7]))


def test_every_env_knob_reaches_the_kernel_shape(fake_gpu, monkeypatch):
    """Each knob tuning_from_env reads (set away from its default) arrives in the KernelShape the
    backend's Session builds: a knob the Session does not take fails here, not on the GPU."""
    shapes = []
    monkeypatch.setattr(S, "build_kernel", lambda shape, **k: shapes.append(shape) or (
        "src", __import__("types").SimpleNamespace(cubin=b"", cached=True, compiler="fake", path="x")))
    env = {"MPK_LINEAR_UNROLL": "16", "MPK_WORKER_THREADS": "256", "MPK_PREFETCH_KB": "32", "MPK_ATTN_PREFETCH": "0",
           "MPK_LINEAR_MMA": "1", "MPK_LINEAR_TMA": "1", "MPK_LINEAR_PIPE": "1", "MPK_PREFETCH_PLAN": "0",
           "MPK_BULK_PREFETCH": "1", "MPK_PREFETCH_AHEAD": "1", "MPK_ATTN_STAGE_KV": "1",
           "MPK_LOAD_AHEAD": "0", "MPK_WEIGHT_EVICT_FIRST": "1"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(S.tables, "kv_stage_fits", lambda *a, **k: True)  # tiny at 16 positions has no split tiles
    m = open_model("tiny")
    sess = fake_gpu.MegakernelBackend(m.config, m.weights, device="cpu", max_seq_len=16).session(1)
    assert sess.bulk_prefetch and sess.prefetch_ahead and not sess.use_prefetch_plan  # record-level switches
    assert sess.stage_kv
    shape = shapes[-1]
    assert (shape.linear_unroll, shape.worker_threads, shape.prefetch_kb) == (16, 256, 32)
    assert shape.linear_mma and shape.linear_tma and shape.linear_pipe and not shape.attn_prefetch
    assert not shape.load_ahead and shape.weight_evict_first


def test_scoped_env_restores_every_variable(monkeypatch):
    """megakernel_backend.scoped_env: the variables hold inside the block; afterwards a variable that was set
    has its old value and one that was absent is absent again (also when the block raises)."""
    import os

    from mpk_dist.runtime.megakernel_backend import scoped_env

    monkeypatch.setenv("MPK_TEST_SET", "old")
    monkeypatch.delenv("MPK_TEST_ABSENT", raising=False)
    monkeypatch.delenv("MPK_TEST_KEY", raising=False)
    with pytest.raises(RuntimeError):
        with scoped_env({"MPK_TEST_SET": "new", "MPK_TEST_ABSENT": "1"}, keys=["MPK_TEST_KEY"]):
            assert os.environ["MPK_TEST_SET"] == "new" and os.environ["MPK_TEST_ABSENT"] == "1"
            os.environ["MPK_TEST_KEY"] = "changed inside"
            raise RuntimeError("leave the block")
    assert os.environ["MPK_TEST_SET"] == "old"
    assert "MPK_TEST_ABSENT" not in os.environ and "MPK_TEST_KEY" not in os.environ


def test_layer_aligned_workers_switch_reaches_the_worker_lists(fake_gpu, monkeypatch):
    """MPK_LAYER_ALIGNED_WORKERS=1: the backend's aot Session runs the program with serialize.layer_aligned_workers'
    placement (every layer's op on the same workers), in its tables and in the task records' order; unset, the
    compiled placement."""
    from mpk_dist.taskgraph.abi import TASK_COLS
    from mpk_dist.taskgraph.serialize import layer_aligned_workers

    m = open_model("tiny")
    monkeypatch.delenv("MPK_LAYER_ALIGNED_WORKERS", raising=False)
    plain = fake_gpu.MegakernelBackend(m.config, m.weights, device="cpu", max_seq_len=16, sms=5).session(1)
    monkeypatch.setenv("MPK_LAYER_ALIGNED_WORKERS", "1")
    aligned = fake_gpu.MegakernelBackend(m.config, m.weights, device="cpu", max_seq_len=16, sms=5).session(1)
    want = layer_aligned_workers(plain.cg)
    col = TASK_COLS["WORKER"]
    assert not np.array_equal(plain.cg.arrays["tasks"][:, col], want.arrays["tasks"][:, col])  # it moves something
    for name in ("tasks", "worker_offsets", "worker_tasks"):
        np.testing.assert_array_equal(aligned.cg.arrays[name], want.arrays[name])
        np.testing.assert_array_equal(aligned.tabs[name].cpu().numpy(), want.arrays[name])
    np.testing.assert_array_equal(aligned.records.cpu().numpy()[:, 0], want.arrays["worker_tasks"])  # REC_TASK


def test_prefetch_behind_attention_switch_reaches_the_records(fake_gpu, monkeypatch):
    """MPK_PREFETCH_BEHIND_ATTENTION_KB=0: the backend's Session puts 0 (no L2 prefetch) into REC_PREFETCH of the
    batch-1 linear tiles that wait on a narrow attention op (tiny's unsplit tiles on 64 workers: its o_proj), which
    otherwise hold -1 (the kernel's cap); every other record word is as without the switch."""
    from mpk_dist.runtime.task_records import REC_ARGS, REC_MAX_ARGS, REC_PREFETCH, REC_TASK
    from mpk_dist.taskgraph.abi import TASK_COLS
    from mpk_dist.taskgraph.tasks import BY_OPCODE

    m = open_model("tiny")
    # enough workers that tiny's few unsplit attention tiles are a narrow op (fewer than a quarter of them)
    monkeypatch.setattr(fake_gpu.MegakernelBackend, "_num_sms", lambda self: 64)
    monkeypatch.setattr(S.LoadedKernel, "num_sms", 64)  # the fake kernel's co-residency check
    monkeypatch.delenv("MPK_PREFETCH_BEHIND_ATTENTION_KB", raising=False)
    plain = fake_gpu.MegakernelBackend(m.config, m.weights, device="cpu", max_seq_len=16, attn_splits=1).session(1)
    monkeypatch.setenv("MPK_PREFETCH_BEHIND_ATTENTION_KB", "0")
    zero = fake_gpu.MegakernelBackend(m.config, m.weights, device="cpu", max_seq_len=16, attn_splits=1).session(1)
    assert zero.prefetch_behind_attention_kb == 0 and plain.prefetch_behind_attention_kb is None
    a, b = plain.records.cpu().numpy(), zero.records.cpu().numpy()
    changed = np.flatnonzero(a[:, REC_PREFETCH] != b[:, REC_PREFETCH])
    # every other word equal but the argument addresses (each session allocates its own buffers)
    other = [c for c in range(a.shape[1]) if c != REC_PREFETCH and not REC_ARGS <= c < REC_ARGS + 2 * REC_MAX_ARGS]
    assert np.array_equal(a[:, other], b[:, other])
    assert "attention_prep" in {o["kind"] for o in zero.cg.meta["ops"]}  # the unsplit tiles
    assert changed.size > 0 and (a[changed, REC_PREFETCH] == -1).all() and (b[changed, REC_PREFETCH] == 0).all()
    tasks, ops = zero.cg.arrays["tasks"], zero.cg.meta["ops"]
    changed_tasks = b[changed, REC_TASK]
    assert {ops[int(tasks[t, TASK_COLS["OP_INDEX"]])]["name"].split(".")[-1] for t in changed_tasks} == {"o_proj"}
    assert {BY_OPCODE[int(tasks[t, TASK_COLS["OPCODE"]])].name for t in changed_tasks} <= {"linear", "linear_residual"}


def test_batch_8_takes_the_tuned_level_prefetch_cap(fake_gpu, monkeypatch):
    """Unset MPK_PREFETCH_LEVEL_KB: a one-GPU batch-8 Session (tensor-core linears) gives its full-width linear tiles
    prefetch_plan.TUNED_LEVEL_KB's 96 KB in REC_PREFETCH instead of -1 (the kernel's cap); batch 4 keeps -1; the
    variable set to 64 wins over the table."""
    from mpk_dist.runtime.prefetch_plan import TUNED_LEVEL_KB
    from mpk_dist.runtime.task_records import REC_PREFETCH, REC_TASK
    from mpk_dist.taskgraph.abi import TASK_COLS
    from mpk_dist.taskgraph.tasks import BY_OPCODE

    m = open_model("tiny")
    monkeypatch.delenv("MPK_PREFETCH_LEVEL_KB", raising=False)

    def linear_words(s):
        rec = s.records.cpu().numpy()
        kinds = [BY_OPCODE[int(s.cg.arrays["tasks"][t, TASK_COLS["OPCODE"]])].name for t in rec[:, REC_TASK]]
        return np.array([w for w, k in zip(rec[:, REC_PREFETCH], kinds) if k.startswith("linear")])

    b8 = fake_gpu.MegakernelBackend(m.config, m.weights, device="cpu", max_seq_len=16, sms=5).session(8)
    assert TUNED_LEVEL_KB[8] == 96 and b8.prefetch_level_kb == 96
    words = linear_words(b8)
    assert words.size > 0 and (words == 96 * 1024).any() and not (words == -1).any()
    b4 = fake_gpu.MegakernelBackend(m.config, m.weights, device="cpu", max_seq_len=16, sms=5).session(4)
    assert b4.prefetch_level_kb is None and (linear_words(b4) == -1).any()
    monkeypatch.setenv("MPK_PREFETCH_LEVEL_KB", "64")
    b8_64 = fake_gpu.MegakernelBackend(m.config, m.weights, device="cpu", max_seq_len=16, sms=5).session(8)
    assert b8_64.prefetch_level_kb == 64 and not (linear_words(b8_64) == 96 * 1024).any()

"""CPU test of the host side of a launch: buffers, forced-token rows and RuntimeParams, with the
GPU parts (kernel build/load, stream) replaced by fakes that record what they receive."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from mpk_dist.model_source import open_model
from mpk_dist.models import build_graph
from mpk_dist.runtime import session as S
from mpk_dist.runtime.params import RuntimeParams
from mpk_dist.taskgraph.compiler import compile_rank_programs
from mpk_dist.weights import load_rank_weights


class FakeKernel:
    def __init__(self, cubin, device_index, block_threads, smem):
        self.block_threads, self.smem, self.launches = block_threads, smem, []

    def launch(self, grid, params_ptr, stream):
        self.launches.append((grid, params_ptr))


class FakeStream:
    cuda_stream = 0

    def query(self):
        return True

    def synchronize(self):
        pass


@pytest.fixture()
def sess(monkeypatch):
    monkeypatch.setattr(S, "build_kernel", lambda *a, **k: ("src", types.SimpleNamespace(cubin=b"", cached=True)))
    monkeypatch.setattr(S, "LoadedKernel", FakeKernel)
    monkeypatch.setattr(S, "host_device_pointer", lambda p: p)
    monkeypatch.setattr(S.Session, "_stream", lambda self: FakeStream())
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
    grid, ptr = sess.kernel.launches[-1]
    assert grid == cg.meta["workers"] == 4 and ptr == sess.params_dev.data_ptr()
    p = RuntimeParams.from_buffer_copy(sess.params_dev.numpy().tobytes())
    assert p.tasks == sess.tabs["tasks"].data_ptr() and p.event_tab == sess.tabs["events"].data_ptr()
    assert p.logits == sess.buffer("logits").data_ptr() and p.token_out == sess.buffer("token_out").data_ptr()
    assert (p.num_tasks, p.batch, p.vocab, p.step_end, p.prompt_len, p.num_stop) == (cg.arrays["tasks"].shape[0], 2, 512, 6, 3, 1)
    assert p.final_task == S.tables.final_task(cg) and p.inject_hang_task == -1 and p.trace_cap > 0
    assert sess.logits_dump.shape == (4, 2, 512)
    base = np.frombuffer(sess.buf_base.numpy().tobytes(), np.uint64)
    assert [int(x) for x in base] == [t.data_ptr() for t in sess.bufs]
    assert p.arg_addr == sess.arg_addr.data_ptr()
    args, addr = cg.arrays["args"], sess.arg_addr.numpy().view(np.uint64)
    for k in range(args.shape[0]):  # every argument row resolves to its buffer base + offset * elem size
        b, off = int(args[k, 0]), int(args[k, 1])
        want = 0 if b < 0 else sess.bufs[b].data_ptr() + off * sess.bufs[b].element_size()
        assert int(addr[k]) == want, k
    assert (args[:, 0] < 0).any(), "the tiny graph has optional NULL arguments (q tiles' DST_V)"
    sess.wait()  # fake stream: finished at once; no error record
    assert sess.progress() == 0


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


def test_backend_generate_host_path(monkeypatch, tmp_path):
    """The backend's whole host path (session, forced rows, launch, wait, result, trace file) with a
    fake kernel that 'finishes' at once: 1 token streamed per step as if the device wrote it."""
    from mpk_dist.backends.base import GenerateRequest
    from mpk_dist.runtime import megakernel_backend as MB

    monkeypatch.setattr(S, "build_kernel", lambda *a, **k: ("src", types.SimpleNamespace(cubin=b"", cached=True,
                                                                                          compiler="fake", path="x")))
    monkeypatch.setattr(S, "LoadedKernel", FakeKernel)
    monkeypatch.setattr(S, "host_device_pointer", lambda p: p)
    monkeypatch.setattr(S.Session, "_stream", lambda self: FakeStream())

    def fake_wait(self, on_step=None):  # what the device would leave behind for steps s0..s1-1
        s0, s1 = self._steps
        self.pinned["token_out"][s0:s1] = torch.arange(s0, s1, dtype=torch.int32)[:, None]
        self.pinned["step_end_ns"][s0:s1 + 1] = torch.arange(s0, s1 + 1) * 1_000_000
        self.pinned["progress"][0] = s1
        if self.logits_dump is not None:
            self.logits_dump.fill_(1.0)

    monkeypatch.setattr(S.Session, "wait", fake_wait)
    monkeypatch.setattr(MB.MegakernelBackend, "__init__", _cpu_init(MB.MegakernelBackend.__init__))
    m = open_model("tiny")
    b = MB.MegakernelBackend(m.config, m.weights, device="cpu", max_seq_len=32, trace=str(tmp_path / "t.json"), sms=4)
    res = b.generate(GenerateRequest([[1, 2, 3]], 5, force_tokens=[7, 7], want_logits=True))
    assert res.tokens == [[2, 3, 4, 5, 6]] and res.logits.shape == (5, 1, 512)
    assert res.prefill_ms == pytest.approx(3.0) and res.per_token_ms == pytest.approx([1.0] * 4)
    assert b.session(1).buffer("forced_tokens")[:5, 0].tolist() == [1, 2, 3, 7, 7]
    assert (tmp_path / "t.json").is_file() and res.extra["steps"] == 7
    b.reset(1)
    logits = b.prefill(torch.tensor([[1, 2]]), torch.tensor([[0, 1]]))
    assert logits.shape == (1, 512) and b._step == 2
    with pytest.raises(Exception, match="expected 2"):
        b.decode(torch.tensor([5]), torch.tensor([7]))


def _cpu_init(orig):
    """Let the backend construct on a CPU-only machine (the GPU checks are the only difference)."""
    def init(self, cfg, source, tp=1, device="cpu", **kw):
        monkey = torch.device
        try:
            orig(self, cfg, source, tp=tp, device="cuda:0", **kw)
        except Exception:
            pass
        from mpk_dist.models import build_graph as bg
        from mpk_dist.weights import load_rank_weights as lw

        self.device = monkey("cpu")
        self.weights = lw(bg(cfg, tp=1, rank=0, batch=1, max_seq_len=kw.get("max_seq_len", 32)), source, "cpu")
        self.sessions, self.last_session, self.batch, self._step = {}, None, 0, 0
    return init

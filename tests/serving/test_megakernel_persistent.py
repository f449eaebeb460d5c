"""CPU tests of persistent passes on the megakernel serving backend (host side; the kernel faked):
passes are staged and posted into one resident launch, the fake "kernel" applies the copy table
exactly as csrc/runtime/pass_begin.cuh does (forced_tokens row s, start_pos = positions - s), every
request's tokens come back right, a launch ends after P passes or when the server idles, the
kernel's parameters carry the channel, and bad options are refused clearly. The GPU run of the same
path is tests/serving/test_megakernel_paged_gpu.py::test_persistent_passes_equal_one_launch_per_pass."""

from __future__ import annotations

import pytest
import torch

from mpk_dist.errors import InputError
from mpk_dist.model_source import open_model
from mpk_dist.models.llama import PagedSpec
from mpk_dist.runtime.params import DOORBELL_POSTED, DOORBELL_STOP, RuntimeParams
from mpk_dist.serving import megakernel_paged as MP
from mpk_dist.serving.server import Server, VirtualClock
from tests.serving.conftest import fake_greedy, run_fake_page_alloc, write_fake_logits

SPEC = PagedSpec(max_tokens=8, max_seqs=3, num_pages=12, page_size=4, max_pages_per_seq=4)
WORK = [([5, 17, 99, 3, 200, 8, 42], 5, 0.0), ([1, 2, 3], 6, 0.0), ([9] * 11, 3, 0.015), ([300, 301], 4, 0.03),
        ([7, 7], 3, 5.0)]  # the last one arrives after an idle gap: the server pauses the launch


def _run_posted_passes(sess) -> None:
    """The fake kernel: every pass posted and not yet run goes through pass_begin's copy table, then
    step_begin (tokens = forced row s, positions = start_pos + s), page_alloc, then the head; progress s + 1."""
    ch, prog = sess.passes, sess.pinned["progress"]
    sp = sess.cg.meta["special"]
    while int(prog[0]) < int(ch.doorbell[DOORBELL_POSTED]) and not int(ch.doorbell[DOORBELL_STOP]):
        s = int(prog[0])
        for off, b, words, per_step in ch.copies.cpu().tolist():
            sess.bufs[b].view(-1)[per_step * s: per_step * s + words] = ch.stage[off: off + words]
        tokens = sess.bufs[sp["forced_tokens"]][s]
        run_fake_page_alloc(sess, sess.bufs[sp["start_pos"]] + s)
        write_fake_logits(sess, tokens, sess.bufs[sp["start_pos"]] + s)
        prog[0] = s + 1


def _launch_ended(sess) -> bool:
    p = RuntimeParams.from_buffer_copy(sess.params_dev.numpy().tobytes())
    return bool(int(sess.passes.doorbell[DOORBELL_STOP])) or int(sess.pinned["progress"][0]) >= p.step_end


@pytest.fixture()
def persistent_fake(install_fake_device, monkeypatch):
    from mpk_dist.runtime import session as S
    from mpk_dist.runtime import pass_io

    install_fake_device(lambda sess: None)
    progress = S.Session.progress
    monkeypatch.setattr(S.Session, "progress", lambda self: _run_posted_passes(self) or progress(self))
    monkeypatch.setattr(S.Session, "finished", lambda self: _launch_ended(self))
    monkeypatch.setattr(pass_io.platform, "machine", lambda: "x86_64")


def _server(tp: int, passes: int) -> Server:
    return Server(open_model("tiny"), backend="megakernel", tp=tp, max_batch=SPEC.max_seqs, page_size=SPEC.page_size,
                  max_seq_len=SPEC.page_size * SPEC.max_pages_per_seq, max_tokens_per_step=SPEC.max_tokens,
                  device="cpu", clock=VirtualClock(0.01), backend_opts={"persistent_passes": passes})


@pytest.mark.parametrize("tp, passes", [(1, 64), (2, 4)])
def test_passes_posted_into_one_launch(persistent_fake, tp, passes):
    srv = _server(tp, passes)
    be = srv.backend
    for p, n, t in WORK:
        srv.submit(p, n, t)
    outs = srv.run(check_pages=True)
    for (p, n, _), o in zip(WORK, outs):
        assert o.tokens == fake_greedy(p, n, srv.cfg.vocab_size), f"request {o.id}"
    n = len(srv.passes)
    # one launch until the idle gap, one after it; with P = 4 also one per 4 passes
    assert 2 <= be.launches < n and not be.running
    if passes == 4:
        assert be.launches >= -(-n // passes)
    assert be.group.own_streams, "a resident kernel must not sit on the default stream"
    for s in be.group.sessions:
        p = RuntimeParams.from_buffer_copy(s.params_dev.numpy().tobytes())
        assert (p.step_begin, p.step_end, p.num_pass_copies) == (0, passes, 5)
        assert p.pass_doorbell and p.pass_stage and p.pass_copies and p.pass_wait_ns == int(10e9)
        assert s.cg.meta["max_steps"] == passes


def test_bad_persistent_options_are_refused(persistent_fake, monkeypatch):
    m = open_model("tiny")
    with pytest.raises(InputError, match="persistent_passes: expected >= 0 with schedule aot"):
        MP.MegakernelPagedBackend(m.config, m.weights, SPEC, device="cpu",
                                  schedule="jit", persistent_passes=4)
    from mpk_dist.runtime import pass_io

    monkeypatch.setattr(pass_io.platform, "machine", lambda: "aarch64")
    with pytest.raises(InputError, match="expected an x86-64 host"):
        _server(1, 4)


def test_pass_channel_stages_then_rings():
    """PassChannel.post: the stage holds the pass in the copy table's layout, then the doorbell says s + 1."""
    from types import SimpleNamespace

    from mpk_dist.runtime.pass_io import PassChannel

    bufs = [torch.zeros(2, 4, dtype=torch.int32), torch.zeros(4, dtype=torch.int32)]
    cg = SimpleNamespace(meta={"buffers": [{"name": "forced_tokens"}, {"name": "start_pos"}]})
    sess = SimpleNamespace(cg=cg, bufs=bufs, device=torch.device("cpu"), _addr=lambda t: t.data_ptr())
    ch = PassChannel(sess, [("forced_tokens", 4), ("start_pos", 0)], wait_s=1.0)
    assert ch.copies.tolist() == [[0, 0, 4, 4], [4, 1, 4, 0]]
    ch.post(0, {"forced_tokens": [1, 2, 3, 4], "start_pos": [5, 6, 7, 8]})
    assert ch.stage.tolist() == [1, 2, 3, 4, 5, 6, 7, 8] and ch.posted == 1
    with pytest.raises(InputError, match="expected 4 words of start_pos, got 3"):
        ch.post(1, {"forced_tokens": [1, 2, 3, 4], "start_pos": [5, 6, 7]})
    with pytest.raises(InputError, match="pass_wait_s: expected a positive"):
        PassChannel(sess, [("start_pos", 0)], wait_s=0)


class _RacingSession:
    """A rank whose launch finishes pass n - 1 and ends between the host's progress read and its finished read."""

    def __init__(self, n: int, reach: bool):
        self.n, self.reach, self.reads, self.done = n, reach, 0, False

    def progress(self) -> int:
        self.reads += 1
        return self.n if (self.done and self.reach) else self.n - 1

    def finished(self) -> bool:
        self.done = True  # the kernel ran its last pass and exited while the host looked away
        return True


@pytest.mark.parametrize("reach", [True, False])
def test_wait_progress_reads_again_when_the_launch_just_ended(reach):
    """The launch ending right after its last pass is no error (progress is read again once it has ended); a
    launch that ended short of the pass still raises, naming the pass and the progress."""
    from types import SimpleNamespace

    from mpk_dist.errors import DeviceTimeout

    ended = []
    fake = SimpleNamespace(group=SimpleNamespace(sessions=[_RacingSession(5, reach)]), pass_wait_s=1.0,
                           timeout_s=1.0, _end_launch=lambda: ended.append(True))
    if reach:
        MP.MegakernelPagedBackend._wait_progress(fake, 5)
        assert not ended
    else:
        with pytest.raises(DeviceTimeout, match=r"ended before pass 4 finished \(progress \[4\]\)"):
            MP.MegakernelPagedBackend._wait_progress(fake, 5)
        assert ended

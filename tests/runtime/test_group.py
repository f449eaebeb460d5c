"""CPU tests of a TP group's host side (mpk_dist.runtime.group) with the GPU parts faked: SM shares,
per-rank sessions and regions, peer tables as the kernel reads them, back-to-back launches, logits
merged from the vocabulary slices, the test hook, errors that name the peer rank."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mpk_dist.backends.base import GenerateRequest
from mpk_dist.errors import DeviceTimeout, InputError
from mpk_dist.model_source import open_model
from mpk_dist.runtime.comm_layout import comm_layout
from mpk_dist.runtime.group import merge_vocab
from mpk_dist.runtime.params import ErrorRecord, RuntimeParams


def params_of(sess) -> RuntimeParams:
    return RuntimeParams.from_buffer_copy(sess.params_dev.numpy().tobytes())


@pytest.fixture()
def tp2(fake_gpu):
    MB = fake_gpu
    m = open_model("tiny")
    return MB.MegakernelBackend(m.config, m.weights, tp=2, device="cpu", max_seq_len=32, inject_hang_task=3,
                                inject_hang_rank=1, fuse=False)  # the tests name unfused tasks


def test_local_tp2_launches_every_rank_on_its_share(tp2):
    res = tp2.generate(GenerateRequest([[1, 2, 3]], 4, want_logits=True))
    g = tp2.group(1)
    assert [s.rank for s in g.sessions] == [0, 1] and tp2.workers == 4, "8 SMs / 2 ranks"
    for s in g.sessions:
        grid, ptr, coop = s.kernel.launches[-1]
        assert grid == s.workers == 4 and not coop, "a group on one GPU launches plainly (own co-residency check)"
        p = params_of(s)
        assert (p.world, p.rank, p.num_workers) == (2, s.rank, 4)
        assert p.trace_from == 3 and p.trace_cap > 0, "tp > 1 traces the decode steps for the comm profile"
        assert p.inject_hang_task == (3 if s.rank == 1 else -1), "the hang hook hits rank 1 only"
        assert p.peer_quota == s.peer_quota.data_ptr() and p.events == s.events.data_ptr()
    # logits: rank r's dump holds r + 1; the merge puts rank 0's slice (ids 0..255) first
    assert res.logits.shape == (4, 1, 512)
    assert torch.all(res.logits[..., :256] == 1) and torch.all(res.logits[..., 256:] == 2)
    assert res.tokens == [[2, 3, 4, 5]] and res.extra["tp"] == 2 and res.extra["transport"] == "local"
    assert res.extra["exposed_comm_share"] == 0.0, "no trace records (fake kernel): nothing exposed"


def test_peer_tables_point_at_every_rank_region(tp2):
    g = tp2.group(1)
    lay = comm_layout(g.lead.cg)
    regions = [s.region.local.data_ptr() for s in g.sessions]
    nb = len(g.lead.bufs)
    for s in g.sessions:
        base = s.peer_base.numpy().view(np.uint64).reshape(2, nb)
        assert s.region.peer_ptrs == regions
        assert [int(x) for x in base[s.rank]] == [s._addr(t) for t in s.bufs], "own row = own buffers"
        other = 1 - s.rank
        for b in range(nb):
            want = regions[other] + lay.buffer_offsets[b] if b in lay.buffer_offsets else 0
            assert int(base[other, b]) == want, (s.rank, b)
        assert [int(x) for x in s.peer_events.numpy().view(np.uint64)] == regions, "counters open each region"
        assert s.events.data_ptr() == s.region.local.data_ptr() and s.events.numel() == 2 * lay.num_events
        for b, off in lay.buffer_offsets.items():  # comm buffers are views into the region, where peers write
            assert s.bufs[b].data_ptr() == s.region.local.data_ptr() + off


def test_comm_layout_is_aligned_disjoint_and_rank_independent():
    from mpk_dist.models.presets import get_preset
    from mpk_dist.runtime.comm_layout import ALIGN, peer_quota
    from mpk_dist.taskgraph.abi import EVENT_COLS, SIG_SELF
    from mpk_dist.taskgraph.compiler import compile_rank_programs

    cgs = compile_rank_programs(get_preset("tiny"), tp=4, batch=2, sms=8, max_seq_len=16)
    lays = [comm_layout(cg) for cg in cgs]
    assert len({lay.signature for lay in lays}) == 1, "every rank must agree on the region layout"
    lay, cg = lays[0], cgs[0]
    assert lay.counters_offset == 0 and lay.tallies_offset == 4 * lay.num_events
    spans = sorted((off, off + lay.buffer_bytes[b]) for b, off in lay.buffer_offsets.items())
    assert spans[0][0] >= 8 * lay.num_events and all(a % ALIGN == 0 for a, _ in spans)
    assert all(spans[i][1] <= spans[i + 1][0] for i in range(len(spans) - 1)) and spans[-1][1] <= lay.nbytes
    comm = {i for i, b in enumerate(cg.meta["buffers"]) if b["kind"] == "comm"}
    assert set(lay.buffer_offsets) == comm and len(comm) == 1 + 2 * 2 + 1, "embed + 2 per layer + argmax gather"
    quota, sig = peer_quota(cg), cg.arrays["signals"]
    own = np.bincount(sig[sig[:, 1] == SIG_SELF, 0], minlength=len(quota))
    assert np.array_equal(own + 4 * quota, cg.arrays["events"][:, EVENT_COLS["TRIGGERS"]]), \
        "triggers = own signallers + WORLD x all-rank signallers"
    assert quota.sum() > 0


def test_group_refuses_ranks_with_different_structure(fake_gpu):
    from mpk_dist.models.presets import get_preset
    from mpk_dist.runtime.group import RankGroup
    from mpk_dist.runtime.transport import LocalTransport
    from mpk_dist.taskgraph.compiler import compile_rank_programs

    a = compile_rank_programs(get_preset("tiny"), tp=2, batch=1, sms=4, max_seq_len=16)
    b = compile_rank_programs(get_preset("tiny"), tp=2, batch=1, sms=3, max_seq_len=16)
    with pytest.raises(InputError, match="rank 1 different from rank 0"):
        RankGroup([a[0], b[1]], [{}, {}], LocalTransport(2, torch.device("cpu")), torch.device("cpu"), {})


def test_errors_name_the_peer_rank_first(tp2):
    g = tp2.group(1)
    g.launch(0, 4, 3, 2, (), True, False)
    s0, s1 = g.sessions
    sys_ev = int(np.nonzero(s0.cg.arrays["events"][:, 1] == 1)[0][0])
    red = next(t for t in range(s0.cg.num_tasks) if "allreduce_reduce" in s0.cg.task_label(t))
    rec0 = ErrorRecord(code=1, valid=1, task_id=red, event_id=sys_ev, step=1, sm_id=3, worker=0, rank=0, seen=5,
                       expected=8, elapsed_ns=10**9, peer=1, peer_sent=3, peer_expected=4)
    rec1 = ErrorRecord(code=1, valid=1, task_id=5, event_id=2, step=1, sm_id=70, worker=1, rank=1, seen=0, expected=2,
                       elapsed_ns=10**9, peer=-1)
    for s, rec in ((s0, rec0), (s1, rec1)):
        s.pinned["error"].copy_(torch.frombuffer(bytearray(bytes(rec)), dtype=torch.uint8))
    with pytest.raises(DeviceTimeout) as info:
        g.raise_on_error()
    msg = str(info.value)
    assert msg.startswith("rank 0: "), "the rank that names a peer comes first"
    assert "waiting on peer rank 1: it sent 3 of the 4 signals of event" in msg
    assert f"'{s0.cg.meta['events'][sys_ev]}'" in msg and "rank 1: mega-kernel watchdog" in msg


def test_a_rank_short_of_its_own_push_gets_its_root_cause(tp2):
    """The kernel names this rank as the short one (its own push never went out): the message then walks
    this rank's counters to the producer that never signalled, instead of pointing at itself."""
    from mpk_dist.runtime.diagnosis import error_message

    g = tp2.group(1)
    g.launch(0, 4, 3, 2, (), True, False)
    s1 = g.sessions[1]
    sys_ev = int(np.nonzero(s1.cg.arrays["events"][:, 1] == 1)[0][0])
    red = next(t for t in range(s1.cg.num_tasks) if "allreduce_reduce" in s1.cg.task_label(t))
    rec = ErrorRecord(code=1, valid=1, task_id=red, event_id=sys_ev, step=0, sm_id=3, worker=0, rank=1, seen=1,
                      expected=2, elapsed_ns=10**9, peer=1, peer_sent=0, peer_expected=1)
    s1.pinned["error"].copy_(torch.frombuffer(bytearray(bytes(rec)), dtype=torch.uint8))
    msg = error_message(s1)
    assert "waiting on this rank itself: it sent 0 of the 1 signals of event" in msg, msg
    assert "root cause: " in msg, msg


def test_trace_keeps_the_last_steps_that_fit(fake_gpu, monkeypatch, tmp_path):
    """--trace with a prompt whose steps would fill the trace buffer: the launch traces the last steps
    that fit (the decode steps), not the first ones; when everything fits, it traces from step 0."""
    from mpk_dist.runtime import session as S
    from mpk_dist.runtime.tables import max_tasks_per_worker

    m = open_model("tiny")
    b = fake_gpu.MegakernelBackend(m.config, m.weights, device="cpu", max_seq_len=32, trace=str(tmp_path / "t.json"))
    b.generate(GenerateRequest([[1, 2, 3]], 4))
    assert params_of(b.session(1)).trace_from == 0, "everything fits: every step traced"
    b2 = fake_gpu.MegakernelBackend(m.config, m.weights, device="cpu", max_seq_len=32,
                                    trace=str(tmp_path / "t2.json"))
    per_step = max_tasks_per_worker(b2.session(1).cg)
    b2.groups.clear()
    monkeypatch.setattr(S, "TRACE_BYTES_CAP", 5 * per_step * S.TRACE_DTYPE.itemsize * b2.workers)
    prompt = list(range(1, 20))
    b2.generate(GenerateRequest([prompt], 4))
    s = b2.session(1)
    assert s.trace_cap == 5 * per_step
    assert params_of(s).trace_from == len(prompt) - 1 + 4 - 5, "the last 5 of the launch's steps"
    # Without the byte cap: the last TRACE_STEPS steps of a launch longer than that.
    b3 = fake_gpu.MegakernelBackend(m.config, m.weights, device="cpu", max_seq_len=64,
                                    trace=str(tmp_path / "t3.json"))
    monkeypatch.setattr(S, "TRACE_BYTES_CAP", 1 << 40)
    prompt = list(range(1, fake_gpu.TRACE_STEPS + 10))
    b3.generate(GenerateRequest([prompt], 4))
    s = b3.session(1)
    assert s.trace_cap == fake_gpu.TRACE_STEPS * max_tasks_per_worker(s.cg)
    assert params_of(s).trace_from == len(prompt) - 1 + 4 - fake_gpu.TRACE_STEPS


def test_merge_vocab_orders_and_checks_slices():
    a, b = torch.zeros(2, 3), torch.ones(2, 5)
    assert torch.equal(merge_vocab([b, a], [3, 0], 8), torch.cat([a, b], -1))
    with pytest.raises(InputError, match="tile the vocabulary"):
        merge_vocab([a, b], [0, 4], 9)
    with pytest.raises(InputError, match="expected 9 ids"):
        merge_vocab([a, b], [0, 3], 9)


def test_a_local_timeout_downstream_of_a_missing_push_still_names_the_peer(tp2):
    """Rank 0 timed out on a LOCAL event (the norm after the all-reduce), so its record names no
    peer; the host reads both ranks' tallies and finds rank 1 behind on L0's all-reduce pushes."""
    from mpk_dist.runtime.comm_layout import peer_quota
    from mpk_dist.runtime.diagnosis import first_signaller

    g = tp2.group(1)
    g.launch(0, 4, 3, 2, (), True, False)
    s0, s1 = g.sessions
    cg, E = s0.cg, s0.cg.num_events
    quota = torch.from_numpy(peer_quota(cg))
    names = cg.meta["events"]
    late = torch.tensor([names[e].startswith("L0.attn_reduce/push") for e in range(E)])
    s0.events[E:] = quota  # step 0: rank 0 sent all its pushes
    s1.events[E:] = torch.where(late, torch.zeros_like(quota), quota)  # rank 1 never pushed L0's attention
    norm = next(t for t in range(cg.num_tasks) if "L0.mlp_norm" in cg.task_label(t))
    local_ev = int(cg.arrays["waits"][cg.arrays["tasks"][norm, 4], 0])
    assert cg.arrays["events"][local_ev, 1] == 0, "the norm waits on a local event"
    rec = ErrorRecord(code=1, valid=1, task_id=norm, event_id=local_ev, step=0, sm_id=1, worker=0, rank=0, seen=0,
                      expected=1, elapsed_ns=10**9, peer=-1)
    s0.pinned["error"].copy_(torch.frombuffer(bytearray(bytes(rec)), dtype=torch.uint8))
    with pytest.raises(DeviceTimeout) as info:
        g.raise_on_error()
    msg = str(info.value)
    first_late = min((e for e in range(E) if late[e]), key=lambda e: first_signaller(cg)[e])
    assert f"waiting on peer rank 1: it sent 0 of the {int(quota[first_late])} signals of event {first_late}" in msg, msg
    s1.events[E:] = quota  # rank 1 caught up: no peer is behind, the own-counter root cause is reported
    with pytest.raises(DeviceTimeout, match="root cause|no producer"):
        g.raise_on_error()


def test_a_rank_that_fails_to_start_does_not_leave_its_peers_running(tp2):
    """Rank 1's launch fails after rank 0 started: the group waits (bounded) for rank 0's kernel to
    end before the error reaches the caller."""
    from mpk_dist.errors import BackendUnavailable

    g = tp2.group(1)
    polled = []
    s0, s1 = g.sessions
    s0.finished = lambda: polled.append(1) or len(polled) > 2  # 'runs' for two polls, then ends

    def refuse(*a, **k):
        raise BackendUnavailable("cuLaunchKernel: expected CUDA_SUCCESS, got CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES")

    s1.kernel.launch = refuse
    with pytest.raises(BackendUnavailable, match="OUT_OF_RESOURCES"):
        g.launch(0, 4, 3, 2, (), True, False)
    assert len(s0.kernel.launches) == 1 and len(polled) == 3

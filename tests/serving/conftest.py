"""Serving tests run tiny models: one torch thread is fastest, and on a loaded 2-core machine the
intra-op thread pool's spin-waits made the same tests 10-100x slower (measured). Also the fake GPU the
mega-kernel serving tests share (``install_fake_device``): each test file brings its own device pass."""

from __future__ import annotations

import types

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class FakeKernel:
    """LoadedKernel stand-in: records each launch's grid."""

    blocks_per_sm, num_sms = 1, 8

    def __init__(self, cubin, device_index, block_threads, smem, min_carveout=False):
        self.launches = []

    def launch(self, grid, params_ptr, stream, cooperative=True):
        self.launches.append(grid)


@pytest.fixture()
def install_fake_device(monkeypatch):
    """A function that fakes the GPU parts of the mega-kernel serving backend: no build, FakeKernel
    launches, host pointers as device pointers, a stream that is always done, and ``device_pass(session)``
    run when the host polls a session for completion (what the fake kernel "computes")."""

    def install(device_pass) -> None:
        from mpk_dist.runtime import session as S
        from mpk_dist.serving import megakernel_paged as MP

        built = types.SimpleNamespace(cubin=b"", cached=True, compiler="fake", path="x")
        monkeypatch.setattr(S, "build_kernel", lambda *a, **k: ("src", built))
        monkeypatch.setattr(S, "LoadedKernel", FakeKernel)
        monkeypatch.setattr(S, "host_device_pointer", lambda p: p)
        stream = types.SimpleNamespace(cuda_stream=0, query=lambda: True, synchronize=lambda: None)
        monkeypatch.setattr(S.Session, "_stream", lambda self: stream)
        monkeypatch.setattr(S.Session, "finished", lambda self: device_pass(self) or True)
        monkeypatch.setattr(MP, "check_device", lambda device: torch.device(device))
        monkeypatch.setattr(MP.MegakernelPagedBackend, "_num_sms", lambda self: 8)

    return install


def write_fake_logits(sess, tokens: torch.Tensor, positions: torch.Tensor) -> None:
    """The fake device's head: row b of the gathered logits [MB, V/tp] (token row logit_rows[b]; -1 =
    zeros) is a one-hot of (token + position) % V in this rank's vocabulary slice."""
    from mpk_dist.runtime.group import vocab_start

    sp = sess.cg.meta["special"]
    rows = sess.buffer("logit_rows").long()
    live = (rows >= 0).nonzero()[:, 0]
    tok, pos = tokens.long()[rows[live]], positions.long()[rows[live]]
    logits = sess.bufs[sp["logits"]]
    assert logits.shape[0] == rows.shape[0], "the head runs over the MB gathered rows"
    vocab = logits.shape[1] * int(sess.cg.meta["world_size"])  # equal slices (tiny: 512 ids)
    want = (tok + pos) % vocab - vocab_start(sess.cg)  # column of the hot id in this rank's slice
    logits.zero_()
    hit = (want >= 0) & (want < logits.shape[1])
    logits[live[hit], want[hit]] = 1.0


def fake_greedy(prompt: list[int], n: int, vocab: int) -> list[int]:
    """The fake device's greedy tokens: next = (last input + its position) % V."""
    out, last, at = [], prompt[-1], len(prompt) - 1
    for _ in range(n):
        last = (last + at) % vocab
        out.append(last)
        at += 1
    return out


def run_fake_page_alloc(sess, positions: torch.Tensor) -> None:
    """What the kernel's page_alloc task does at the start of a pass (its CPU reference, run on the
    session's buffers): free the released slots' pages, take pages for the pass's positions. The
    fake device has no step_begin, so ``positions`` stands in for the ``positions`` buffer."""
    from mpk_dist.taskgraph.abi import TASK_COLS
    from mpk_dist.taskgraph.tasks import BY_NAME
    from mpk_dist.taskgraph.tasks.base import TileContext

    cg, kind = sess.cg, BY_NAME["page_alloc"]
    tasks = cg.arrays["tasks"]
    (t,) = [int(i) for i in (tasks[:, TASK_COLS["OPCODE"]] == kind.opcode).nonzero()[0]]
    args = cg.arrays["args"][tasks[t, TASK_COLS["ARG_BEGIN"]]:tasks[t, TASK_COLS["ARG_END"]]]
    params = cg.arrays["params"][tasks[t, TASK_COLS["PARAM_BEGIN"]]:tasks[t, TASK_COLS["PARAM_END"]]].tolist()
    bufs = [sess.bufs[b].view(-1) for b, _, _ in args]
    bufs[kind.arg_index("POSITIONS")] = positions.to(torch.int32).reshape(-1)
    ctx = TileContext(kind, bufs, [int(a[1]) for a in args], [int(a[2]) for a in args], params, 0, sess.rank,
                      int(cg.meta["world_size"]), lambda i: [bufs[i]])
    kind.run_tile(ctx)

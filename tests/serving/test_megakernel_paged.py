"""CPU tests of the megakernel serving backend (mpk_dist/serving/megakernel_paged.py): clear refusals
without a GPU and for pass sizes the bodies cannot run; the host side of a pass with the GPU parts
faked (kernel build/load, stream): every rank gets the pass's inputs, counters are zeroed before
each launch and the page pools are not, the gathered logits rows (``logit_rows``) come back in order
after merging the ranks' vocabulary slices; and a whole continuous-batching run whose "device" computes a known rule from the inputs
it finds in the buffers. The GPU check of the same backend is test_megakernel_paged_gpu.py."""

from __future__ import annotations

import types

import pytest
import torch

from mpk_dist.cli import main
from mpk_dist.errors import BackendUnavailable, InputError
from mpk_dist.model_source import open_model
from mpk_dist.models.llama import PagedSpec
from mpk_dist.runtime.group import vocab_start
from mpk_dist.runtime.params import RuntimeParams
from mpk_dist.serving import megakernel_paged as MP
from mpk_dist.serving.server import Server, VirtualClock
from mpk_dist.taskgraph.abi import TASK_COLS
from mpk_dist.taskgraph.tasks import BY_NAME

SPEC = PagedSpec(max_tokens=8, max_seqs=3, num_pages=12, page_size=4, max_pages_per_seq=4)


def test_refuses_clearly_without_a_gpu(capsys):
    with pytest.raises(BackendUnavailable, match="expected a CUDA device, got cpu"):
        Server("tiny", backend="megakernel", device="cpu")
    if not torch.cuda.is_available():
        with pytest.raises(BackendUnavailable, match="expected a CUDA GPU, got none visible"):
            Server("tiny", backend="megakernel")
        assert main(["serve-bench", "--synthetic", "2", "--backend", "megakernel,torch"]) == 2
        assert "expected a CUDA GPU" in capsys.readouterr().err
    assert main(["serve-bench", "--synthetic", "2", "--backend", "torch,bogus", "--device", "cpu"]) == 2
    assert "--backend: expected comma-separated names" in capsys.readouterr().err


def test_refuses_passes_wider_than_a_linear_tile():
    with pytest.raises(InputError, match="--max-tokens-per-step 16"):
        MP.check_spec(PagedSpec(max_tokens=32, max_seqs=4, num_pages=8, page_size=4, max_pages_per_seq=2))
    MP.check_spec(PagedSpec(max_tokens=16, max_seqs=16, num_pages=8, page_size=4, max_pages_per_seq=2))


# ---- the GPU parts faked ----------------------------------------------------------------------------
class _Kernel:
    blocks_per_sm, num_sms = 1, 8

    def __init__(self, cubin, device_index, block_threads, smem):
        self.launches = []

    def launch(self, grid, params_ptr, stream, cooperative=True):
        self.launches.append(grid)


class _Stream:
    cuda_stream = 0

    def query(self):
        return True

    def synchronize(self):
        pass


def _device_pass(sess) -> None:
    """What this fake device does for one launch: check the counters were zeroed, then write the
    gathered logits [MB, V/tp] of this rank's slice: row b (token row logit_rows[b]; -1 = zeros) is a
    one-hot of (token + position) % V of that token, and count some events."""
    if getattr(sess, "ran_launches", 0) == len(sess.kernel.launches):
        return  # already ran for this launch (finished() is polled)
    sess.ran_launches = len(sess.kernel.launches)
    sess.counters_at_launch = int(sess.events.abs().sum())
    sp = sess.cg.meta["special"]
    rows = sess.buffer("logit_rows").long()
    live = (rows >= 0).nonzero()[:, 0]
    tok = sess.bufs[sp["forced_tokens"]][0].long()[rows[live]]
    pos = sess.bufs[sp["start_pos"]].long()[rows[live]]
    logits = sess.bufs[sp["logits"]]
    assert logits.shape[0] == rows.shape[0], "the head runs over the MB gathered rows"
    vocab = logits.shape[1] * int(sess.cg.meta["world_size"])  # equal slices (tiny: 512 ids)
    want = (tok + pos) % vocab - vocab_start(sess.cg)  # column of the hot id in this rank's slice
    logits.zero_()
    hit = (want >= 0) & (want < logits.shape[1])
    logits[live[hit], want[hit]] = 1.0
    sess.events.fill_(7)  # the kernel counts: the next launch must start from zero again
    sess.buffer("L0.k_pages").view(-1)[0] += 1  # the pools persist across launches


@pytest.fixture()
def fake_device(monkeypatch):
    from mpk_dist.runtime import session as S

    monkeypatch.setattr(S, "build_kernel", lambda *a, **k: ("src", types.SimpleNamespace(cubin=b"", cached=True,
                                                                                          compiler="fake", path="x")))
    monkeypatch.setattr(S, "LoadedKernel", _Kernel)
    monkeypatch.setattr(S, "host_device_pointer", lambda p: p)
    monkeypatch.setattr(S.Session, "_stream", lambda self: _Stream())
    monkeypatch.setattr(S.Session, "finished", lambda self: _device_pass(self) or True)
    monkeypatch.setattr(MP, "check_device", lambda device: torch.device(device))
    monkeypatch.setattr(MP.MegakernelPagedBackend, "_num_sms", lambda self: 8)


def _server(tp: int) -> Server:
    m = open_model("tiny")
    return Server(m, backend="megakernel", tp=tp, max_batch=SPEC.max_seqs, page_size=SPEC.page_size,
                  max_seq_len=SPEC.page_size * SPEC.max_pages_per_seq, max_tokens_per_step=SPEC.max_tokens,
                  device="cpu", clock=VirtualClock(0.01))


def _expected(prompt: list[int], n: int, vocab: int) -> list[int]:
    """The fake device's greedy tokens: next = (last input + its position) % V."""
    out, last, at = [], prompt[-1], len(prompt) - 1
    for _ in range(n):
        last = (last + at) % vocab
        out.append(last)
        at += 1
    return out


@pytest.mark.parametrize("tp", [1, 2])
def test_passes_reach_every_rank_and_rows_come_back_in_order(fake_device, tp):
    srv = _server(tp)
    be = srv.backend
    assert [s.workers for s in be.group.sessions] == [8 // tp] * tp
    work = [([5, 17, 99, 3, 200, 8, 42], 5, 0.0), ([1, 2, 3], 6, 0.0), ([9] * 11, 3, 0.015), ([300, 301], 4, 0.03)]
    for p, n, t in work:
        srv.submit(p, n, t)
    outs = srv.run(check_pages=True)
    vocab = srv.cfg.vocab_size
    for (p, n, _), o in zip(work, outs):
        assert o.tokens == _expected(p, n, vocab), f"request {o.id}"
    assert be.launches == len(srv.passes) and max(p["seqs"] for p in srv.passes) == 3
    assert any(0 < p["prefill_tokens"] < p["tokens"] for p in srv.passes), "prompt chunks next to decodes"
    for s in be.group.sessions:
        assert s.counters_at_launch == 0, "event counters zeroed before every one-step launch"
        assert float(s.buffer("L0.k_pages").view(-1)[0]) == be.launches, "page pools never zeroed between passes"
        p = RuntimeParams.from_buffer_copy(s.params_dev.numpy().tobytes())
        assert (p.step_begin, p.step_end, p.world, p.rank) == (0, 1, tp, s.rank)
        assert len(s.kernel.launches) == be.launches


def test_bad_page_table_is_refused_before_launch(fake_device):
    srv = _server(1)
    srv.submit([1, 2, 3, 4, 5], 2)
    batch = srv.scheduler.plan(0.0)
    batch.page_table[batch.slots[0], 1] = SPEC.num_pages  # position 4's page out of range
    with pytest.raises(InputError, match=r"page table row \d+: expected page ids in \[0, 12\)"):
        srv.backend.step(batch)
    assert srv.backend.launches == 0


@pytest.mark.skipif(__import__("shutil").which("nvcc") is None, reason="nvcc not on PATH (CI installs CUDA 13.0)")
def test_kernel_with_the_paged_bodies_compiles_for_sm90a(tmp_path, monkeypatch):
    """The mega-kernel the backend builds for a tp-2 paged program (task bodies of opcodes 14, 15 and
    gather_rows and their dispatch cases included) compiles with nvcc for sm_90a."""
    from mpk_dist.runtime.codegen import KernelShape
    from mpk_dist.runtime.kernel import build_kernel
    from mpk_dist.taskgraph.paged_compiler import compile_paged_programs

    monkeypatch.setenv("MPK_CACHE_DIR", str(tmp_path))
    cg = compile_paged_programs(open_model("tiny").config, SPEC, 2, sms=4)[1]
    src, res = build_kernel(KernelShape(batch=SPEC.max_tokens, worker_threads=512, superopt=False), rank=1, world=2,
                            compiler="nvcc", program=cg)
    assert "#define MPK_BATCH 8" in src and res.cubin[:4] == b"\x7fELF" and not res.cached
    names = {p.name for p in res.headers}
    assert {"qkv_prep_paged.cuh", "paged_attention.cuh", "gather_rows.cuh", "dispatch.cuh"} <= names, \
        "paged bodies in the cache key"
    assert BY_NAME["gather_rows"].opcode in set(cg.arrays["tasks"][:, TASK_COLS["OPCODE"]].tolist())

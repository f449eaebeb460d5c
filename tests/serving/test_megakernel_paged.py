"""CPU tests of the megakernel serving backend (mpk_dist/serving/megakernel_paged.py): clear refusals
without a GPU and for pass sizes the bodies cannot run; the host side of a pass with the GPU parts
faked (kernel build/load, stream): every rank gets the pass's inputs, counters are zeroed before
each launch and the page pools are not, the gathered logits rows (``logit_rows``) come back in order
after merging the ranks' vocabulary slices; and a whole continuous-batching run whose "device" computes a known rule from the inputs
it finds in the buffers. The GPU check of the same backend is test_megakernel_paged_gpu.py."""

from __future__ import annotations


import numpy as np
import pytest
import torch

from mpk_dist.cli import main
from mpk_dist.errors import BackendUnavailable, InputError
from mpk_dist.model_source import open_model
from mpk_dist.models.llama import PagedSpec
from mpk_dist.runtime.params import RuntimeParams
from mpk_dist.serving import megakernel_paged as MP
from mpk_dist.serving.server import Server, VirtualClock
from mpk_dist.taskgraph.abi import TASK_COLS
from mpk_dist.taskgraph.tasks import BY_NAME, BY_OPCODE
from tests.serving.conftest import fake_greedy, run_fake_page_alloc, write_fake_logits

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


# ---- the GPU parts faked ----------------------------------------------------------------------------
def _device_pass(sess) -> None:
    """What this fake device does for one launch: check the counters were zeroed, then write the
    gathered logits [MB, V/tp] of this rank's slice: row b (token row logit_rows[b]; -1 = zeros) is a
    one-hot of (token + position) % V of that token, and count some events."""
    if getattr(sess, "ran_launches", 0) == len(sess.kernel.launches):
        return  # already ran for this launch (finished() is polled)
    sess.ran_launches = len(sess.kernel.launches)
    sess.counters_at_launch = int(sess.events.abs().sum())
    sp = sess.cg.meta["special"]
    run_fake_page_alloc(sess, sess.bufs[sp["start_pos"]])  # the pass's pages, as the kernel's page_alloc
    write_fake_logits(sess, sess.bufs[sp["forced_tokens"]][0], sess.bufs[sp["start_pos"]])
    sess.events.fill_(7)  # the kernel counts: the next launch must start from zero again
    sess.buffer("L0.k_pages").view(-1)[0] += 1  # the pools persist across launches


@pytest.fixture()
def fake_device(install_fake_device):
    install_fake_device(_device_pass)


def _server(tp: int) -> Server:
    m = open_model("tiny")
    return Server(m, backend="megakernel", tp=tp, max_batch=SPEC.max_seqs, page_size=SPEC.page_size,
                  max_seq_len=SPEC.page_size * SPEC.max_pages_per_seq, max_tokens_per_step=SPEC.max_tokens,
                  device="cpu", clock=VirtualClock(0.01))


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
        assert o.tokens == fake_greedy(p, n, vocab), f"request {o.id}"
    assert be.launches == len(srv.passes) and max(p["seqs"] for p in srv.passes) == 3
    assert any(0 < p["prefill_tokens"] < p["tokens"] for p in srv.passes), "prompt chunks next to decodes"
    for s in be.group.sessions:
        assert s.counters_at_launch == 0, "event counters zeroed before every one-step launch"
        assert float(s.buffer("L0.k_pages").view(-1)[0]) == be.launches, "page pools never zeroed between passes"
        p = RuntimeParams.from_buffer_copy(s.params_dev.numpy().tobytes())
        assert (p.step_begin, p.step_end, p.world, p.rank) == (0, 1, tp, s.rank)
        assert len(s.kernel.launches) == be.launches


def test_bad_slot_inputs_are_refused_before_launch(fake_device):
    """The host checks what page_alloc will read: positions within the slot's page-table row (16
    positions here), slots below max_batch, release flags 0 or 1."""
    srv = _server(1)
    srv.submit([1, 2, 3, 4, 5], 2)
    batch = srv.scheduler.plan(0.0)
    assert type(srv.pool).__name__ == "PageCounts" and batch.page_table is None, "page ids live on the device"
    batch.positions[-1] = SPEC.page_size * SPEC.max_pages_per_seq  # past the row
    with pytest.raises(InputError, match=r"pass slot 0: expected positions 0..15 \(max_seq_len\), got up to 16"):
        srv.backend.step(batch)
    batch.positions[-1] = 4
    batch.slots[0] = SPEC.max_seqs
    with pytest.raises(InputError, match=r"expected sequence slots < 3"):
        srv.backend.step(batch)
    batch.slots[0] = 0
    batch.release = np.array([2, 0, 0], np.int32)
    with pytest.raises(InputError, match=r"release_slots: expected at most 3 flags of 0 or 1"):
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
    cg = compile_paged_programs(open_model("tiny").config, MP.kernel_spec(SPEC), 2, sms=4)[1]  # as the backend
    MP.check_paged_tasks(cg)
    src, res = build_kernel(KernelShape(batch=SPEC.max_tokens, worker_threads=512, superopt=False), rank=1, world=2,
                            compiler="nvcc", program=cg)
    assert "#define MPK_BATCH 8" in src and res.cubin[:4] == b"\x7fELF" and not res.cached
    names = {p.name for p in res.headers}
    bodies = {"qkv_prep_paged.cuh", "paged_attention.cuh", "gather_rows.cuh", "page_alloc.cuh", "dispatch.cuh"}
    assert bodies <= names, "paged bodies in the cache key"
    ops = set(cg.arrays["tasks"][:, TASK_COLS["OPCODE"]].tolist())
    assert {BY_NAME["gather_rows"].opcode, BY_NAME["page_alloc"].opcode} <= ops


# ---- the CUDA bodies' addresses on the compiled tables (CPU emulation) -------------------------------
# Each function below repeats the index arithmetic of one CUDA body (the file named in its docstring)
# for one task: the element offsets, relative to each pointer argument, that the body touches with
# the pass's host-written inputs. The bodies' contract (tasks/base.py) is 0 <= offset < COUNT, and
# every element touched is one the Python kind's ``accesses`` declare (what the race checker sees).
def _rows_cols(rows, stride: int, cols) -> np.ndarray:
    return (np.asarray(rows, np.int64)[:, None] * stride + np.asarray(cols, np.int64)[None, :]).reshape(-1)


def _linear(p, x, mpk_batch: int) -> dict:
    """csrc/tasks/linear.cuh linear_tile<MPK_BATCH>: MPK_BATCH rows, whatever BATCH says."""
    rows, k = range(mpk_batch), np.arange(p["K"])
    return {"X": _rows_cols(rows, p["X_STRIDE"], k), "W": _rows_cols(range(p["N_TILE"]), p["K"], k),
            "Y": _rows_cols(rows, p["Y_STRIDE"], np.arange(p["N_TILE"]))}


def _page(p, table, s: int, j: int) -> int:
    """PagedKv::page (qkv_prep_paged.cuh): -1 for a bad slot, column or id, the table read only in range."""
    i = s * p["MAX_PAGES"] + j
    if s < 0 or not 0 <= j < p["MAX_PAGES"] or i >= len(table):
        return -1
    return int(table[i]) if 0 <= table[i] < p["NUM_PAGES"] else -1


def _tokens_ok(p, x, prefix: bool) -> bool:
    """paged_tokens_ok (qkv_prep_paged.cuh)."""
    for s, pos in zip(x["SLOTS"], x["POSITIONS"]):
        if s >= 0 and (pos < 0 or any(_page(p, x["PAGE_TABLE"], s, j) < 0
                                      for j in range(0 if prefix else pos // p["PAGE_SIZE"], pos // p["PAGE_SIZE"] + 1))):
            return False
    return True


def _kv_row(p, x, s: int, pos: int) -> int:
    """PagedKv::row of position pos of slot s."""
    return _page(p, x["PAGE_TABLE"], s, pos // p["PAGE_SIZE"]) * p["PAGE_STRIDE"] + pos % p["PAGE_SIZE"] * p["POS_STRIDE"]


def _qkv_prep_paged(p, x, mpk_batch: int) -> dict:
    """csrc/tasks/qkv_prep_paged.cuh (the per-token math of qkv_prep.cuh)."""
    B, D = p["BATCH"], p["HEAD_DIM"]
    d, out = np.arange(D), {"POSITIONS": np.arange(B), "SLOTS": np.arange(B), "INV_FREQ": np.arange(D // 2)}
    if "NORM_W" not in x["NULL"]:  # the per-head norm only when the model has one (norm_w != nullptr)
        out["NORM_W"] = d
    if not p["IS_KV"]:
        return {**out, "QKV": _rows_cols(range(B), p["QKV_STRIDE"], d), "DST": _rows_cols(range(B), p["Q_STRIDE"], d)}
    if not _tokens_ok(p, x, prefix=False):
        return out  # the body reports a bad task before any write
    live = [b for b in range(B) if x["SLOTS"][b] >= 0]
    rows = [_kv_row(p, x, x["SLOTS"][b], x["POSITIONS"][b]) for b in live]
    dst = _rows_cols(rows, 1, d)
    src = _rows_cols(live, p["QKV_STRIDE"], d)
    return {**out, "QKV": np.concatenate([src, src + p["V_OFFSET"]]), "DST": dst, "DST_V": dst}


def _paged_attention(p, x, mpk_batch: int) -> dict:
    """csrc/tasks/paged_attention.cuh."""
    B, D, G, qs = p["BATCH"], p["HEAD_DIM"], p["GROUP"], p["Q_STRIDE"]
    out = {"POSITIONS": np.arange(B), "SLOTS": np.arange(B)}
    if not _tokens_ok(p, x, prefix=True):
        return out
    live = [b for b in range(B) if x["SLOTS"][b] >= 0]
    kv = [_kv_row(p, x, x["SLOTS"][b], t) for b in live for t in range(x["POSITIONS"][b] + 1)]
    kv = _rows_cols(kv, 1, np.arange(D))
    return {**out, "Q": _rows_cols(live, qs, np.arange(G * D)), "OUT": _rows_cols(range(B), qs, np.arange(G * D)),
            "K_PAGES": kv, "V_PAGES": kv}


def _gather_rows(p, x, mpk_batch: int) -> dict:
    """csrc/tasks/gather_rows.cuh (nothing but the row ids when a row id is >= X_ROWS)."""
    B, c = p["BATCH"], np.arange(p["COLS"])
    rows = x["ROWS"]
    if (rows >= p["X_ROWS"]).any():
        return {"ROWS": np.arange(B)}
    return {"ROWS": np.arange(B), "X": _rows_cols(rows[rows >= 0], p["X_STRIDE"], c),
            "OUT": _rows_cols(range(B), p["OUT_STRIDE"], c)}


_BODIES = {"linear": _linear, "qkv_prep_paged": _qkv_prep_paged, "paged_attention": _paged_attention,
           "gather_rows": _gather_rows}
_INPUTS = ("POSITIONS", "SLOTS", "PAGE_TABLE", "ROWS")  # int32 arguments whose values steer the addresses


def _out_of_bounds(sess) -> list[str]:
    """Every (task, argument) whose emulated addresses leave [0, COUNT) of the argument, with the
    inputs the host wrote for the last pass (positions = start_pos: step_begin's copy at step 0)."""
    from mpk_dist.runtime.tables import task_params

    cg, bad = sess.cg, []
    host = {"positions": sess.bufs[cg.meta["special"]["start_pos"]]}
    tasks = cg.arrays["tasks"]
    for t in range(tasks.shape[0]):
        kind = BY_OPCODE[int(tasks[t, TASK_COLS["OPCODE"]])]
        if kind.name not in _BODIES:
            continue
        args = cg.arrays["args"][tasks[t, TASK_COLS["ARG_BEGIN"]]:tasks[t, TASK_COLS["ARG_END"]]]
        x = {"NULL": {spec.name for spec, (buf, _, _) in zip(kind.args, args) if buf < 0}}
        for spec, (buf, off, cnt) in zip(kind.args, args):
            if spec.name in _INPUTS:
                name = cg.meta["buffers"][buf]["name"]
                x[spec.name] = host.get(name, sess.bufs[buf]).reshape(-1)[off:off + cnt].numpy().astype(np.int64)
        addrs = _BODIES[kind.name](task_params(cg, t), x, int(cg.meta["batch"]))
        declared = _declared(sess, kind, t, args, host)
        for i, (spec, (buf, off, cnt)) in enumerate(zip(kind.args, args)):
            a = addrs.get(spec.name, np.zeros(0, np.int64))
            where = f"{cg.task_label(t)} {spec.name}"
            if len(a) and (buf < 0 or a.min() < 0 or a.max() >= cnt):
                bad.append(f"{where}: touches [{a.min()}, {a.max()}], expected within "
                           f"[0, {cnt}) of {cg.meta['buffers'][buf]['name'] if buf >= 0 else 'NULL'}")
            elif i in declared and not np.isin(a + off, declared[i]).all():
                bad.append(f"{where}: touches elements the kind's accesses() do not declare (the race checker's view)")
    return bad


def _declared(sess, kind, t: int, args, host) -> dict[int, np.ndarray]:
    """Argument index -> elements the kind's ``accesses`` declare for this tile (CPU reference footprint)."""
    from mpk_dist.taskgraph.tasks.base import TileContext

    cg = sess.cg
    bufs = [None if b < 0 else host.get(cg.meta["buffers"][b]["name"], sess.bufs[b]).reshape(-1) for b, _, _ in args]
    p = cg.arrays["params"][cg.arrays["tasks"][t, TASK_COLS["PARAM_BEGIN"]]:cg.arrays["tasks"][t, TASK_COLS["PARAM_END"]]]
    ctx = TileContext(kind, bufs, [int(a[1]) for a in args], [int(a[2]) for a in args], p.tolist(), 0, sess.rank,
                      int(cg.meta["world_size"]), lambda i: [bufs[i]])
    out: dict[int, list] = {}
    for acc in kind.accesses(ctx):
        out.setdefault(acc.arg, []).append(np.asarray(acc.index, np.int64).reshape(-1))
    return {i: np.concatenate(v) for i, v in out.items()}


def _diff_test_server(backend: str, tp: int = 1):
    """The GPU diff test's server (tiny, max_batch 4, page 4, 32 positions, 16 tokens a pass) on the
    CPU, with its three requests submitted (two at 0 s, one at 0.02 s); (server, model)."""
    from mpk_dist.runtime.testing import rand_ids

    m = open_model("tiny")
    srv = Server(m, backend=backend, tp=tp, max_batch=4, page_size=4, max_seq_len=32, max_tokens_per_step=16,
                 device="cpu", clock=VirtualClock(0.01))
    for i, plen in enumerate((3, 6, 9)):
        srv.submit(rand_ids(plen, m.config.vocab_size, 300 + i), 4, 0.0 if i < 2 else 0.02)
    return srv, m


@pytest.mark.parametrize("tp", [1, 2])
def test_cuda_bodies_stay_inside_their_buffers_on_the_compiled_pass(fake_device, tp):
    """The two passes of the GPU diff test (two prompts and padding; then two decodes next to a
    prompt chunk), as the backend compiles and writes them: every address the linear (at the
    kernel's MPK_BATCH rows), qkv_prep_paged, paged_attention and gather_rows bodies compute is
    inside its argument and among the elements the kind's ``accesses`` declare. The gathered head over MB = 4 < N rows made the lm_head tiles read and
    write 16 rows of the [4, *] h_final and logits (the illegal memory access seen on the H200)."""
    srv, _ = _diff_test_server("megakernel", tp)
    kinds = {BY_OPCODE[int(o)].name for o in srv.backend.group.sessions[0].cg.arrays["tasks"][:, TASK_COLS["OPCODE"]]}
    assert {"qkv_prep_paged", "paged_attention", "gather_rows", "linear"} <= kinds
    for t, pages in ((0.0, 3), (0.02, 6)):
        batch = srv.scheduler.plan(t)
        srv.scheduler.commit(batch, srv.backend.step(batch), t + 0.01)
        assert 0 < batch.num_tokens < 16, "padding in the pass"
        for s in srv.backend.group.sessions:
            assert int(s.buffer("page_table").ge(0).sum()) == pages, "the pass's page table reached the kernel"
            bad = _out_of_bounds(s)
            assert not bad, f"pass at {t} s, rank {s.rank}: " + "; ".join(bad[:3])


def test_head_padded_to_the_kernel_batch_gives_the_same_logits():
    """kernel_spec's head over N rows (logit_rows and page table padded with -1) on the interpreter:
    the same logits as the MB-row head, bit for bit, and zero padding rows."""
    from mpk_dist.serving.interpreter_paged import InterpreterPagedBackend

    srv, m = _diff_test_server("interpreter")
    ks = MP.kernel_spec(srv.spec)
    assert (ks.max_seqs, ks.max_tokens, ks.num_pages) == (16, 16, srv.spec.num_pages)
    padded = InterpreterPagedBackend(m.config, m.weights, ks, sms=8)
    for t in (0.0, 0.02):
        batch = srv.scheduler.plan(t)
        want = srv.backend.step(batch)
        got = padded.step(batch)
        assert torch.equal(got, want), f"pass at {t} s: padded head logits differ"
        rows = padded.interp.buffer(0, "logits").reshape(ks.max_seqs, -1)
        assert not bool(rows[len(batch.logit_rows):].any()), "padding head rows are zero"
        srv.scheduler.commit(batch, want, t + 0.01)


def test_programs_whose_linears_disagree_with_the_kernel_batch_are_refused():
    """A paged program compiled for MB < N head rows (what the backend compiled before kernel_spec)
    has lm_head tiles of BATCH MB in a kernel of MPK_BATCH N: refused, naming the tile."""
    from mpk_dist.taskgraph.paged_compiler import compile_paged_programs

    cfg = open_model("tiny").config
    with pytest.raises(InputError, match=r"op lm_head \(linear\).*expected BATCH 8 .* got 3"):
        MP.check_paged_tasks(compile_paged_programs(cfg, SPEC, 1, sms=4)[0])
    MP.check_paged_tasks(compile_paged_programs(cfg, MP.kernel_spec(SPEC), 1, sms=4)[0])

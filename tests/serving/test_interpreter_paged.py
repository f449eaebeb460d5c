"""Continuous batching on the compiled task graph (interpreter, race-checked): every request's output
equals the request alone (greedy tokens, teacher-forced logits within 1e-5), tp 1 and 2."""

from __future__ import annotations

import dataclasses

import pytest

from mpk_dist.backends.base import GenerateRequest
from mpk_dist.backends.torch_backend import TorchBackend
from mpk_dist.models.presets import get_preset
from mpk_dist.serving.server import Server, VirtualClock
from mpk_dist.weights import SyntheticSource

WORKLOAD = [([5, 17, 99, 3, 200, 8, 42], 5, 0.0), ([1, 2, 3], 6, 0.0), ([9] * 14, 3, 0.015), ([300, 301], 4, 0.03)]
FORCE = [None, [7, 7, 100, 3, 5, 9], None, [450, 2, 2, 2]]


@pytest.mark.parametrize("tp, schedule", [(1, "jit"), (2, "aot")])
def test_interpreter_serving_equals_each_request_alone(tp, schedule):
    cfg = dataclasses.replace(get_preset("tiny"), dtype="float32")
    src = SyntheticSource(cfg, seed=5)
    srv = Server((cfg, src), backend="interpreter", tp=tp, max_batch=3, page_size=4, max_seq_len=24,
                 max_tokens_per_step=12, clock=VirtualClock(0.01), backend_opts={"schedule": schedule, "seed": tp})
    for (p, n, t), f in zip(WORKLOAD, FORCE):
        srv.submit(p, n, t, force_tokens=f, want_logits=True)
    outs = srv.run(check_pages=True)
    ref = TorchBackend(cfg, src, tp=tp, max_seq_len=64)
    for (p, n, _), f, o in zip(WORKLOAD, FORCE, outs):
        alone = ref.generate(GenerateRequest([p], max_new_tokens=n, want_logits=True, force_tokens=f))
        assert o.tokens == alone.tokens[0]
        want = alone.logits[:, 0]
        assert float(((o.logits - want).abs().amax(-1) / want.abs().amax(-1)).max()) <= 1e-5
    assert max(p["seqs"] for p in srv.passes) == 3 and srv.backend.launches == len(srv.passes)
    assert any(0 < p["prefill_tokens"] < p["tokens"] for p in srv.passes)
    assert srv.pool.num_free == srv.pool.num_pages


def test_gathered_head_gives_the_same_logits_as_the_n_row_head_and_torch():
    """gather_rows (head over MB sequences, the default) vs the head over all N tokens vs the torch
    paged backend, on one mixed workload (prompt chunks next to decodes, teacher forcing)."""
    cfg = dataclasses.replace(get_preset("tiny-llama"), dtype="float32")
    src = SyntheticSource(cfg, seed=8)
    runs = {}
    for key, backend, opts in (("gather", "interpreter", {"seed": 1}),
                               ("rows", "interpreter", {"seed": 2, "gather_last": False}), ("torch", "torch", {})):
        srv = Server((cfg, src), backend=backend, tp=2, max_batch=3, page_size=4, max_seq_len=24,
                     max_tokens_per_step=12, clock=VirtualClock(0.01), backend_opts=opts)
        for (p, n, t), f in zip(WORKLOAD, FORCE):
            srv.submit(p, n, t, force_tokens=f, want_logits=True)
        runs[key] = (srv.run(check_pages=True), srv)
    assert runs["gather"][1].backend.gather_last and not runs["rows"][1].backend.gather_last
    assert any(0 < p["prefill_tokens"] < p["tokens"] for p in runs["gather"][1].passes)
    for a, b, c in zip(*(runs[k][0] for k in ("gather", "rows", "torch"))):
        assert a.tokens == b.tokens == c.tokens
        for other in (b, c):
            err = float(((a.logits - other.logits).abs().amax(-1) / other.logits.abs().amax(-1)).max())
            assert err <= 1e-5, f"request {a.id}: gathered-head logits differ by {err:.2e}"


def test_device_page_ids_equal_the_host_pool_of_the_torch_backend():
    """The same workload on the torch backend (host PagePool: page ids on the host) and on the
    interpreter (page_alloc in the program, PageCounts on the host): after every pass the program's
    page table is the host pool's, on both ranks, and the pages really turn over (releases, reuse)."""
    import numpy as np

    cfg = dataclasses.replace(get_preset("tiny"), dtype="float32")
    src = SyntheticSource(cfg, seed=5)
    tables = {}
    for backend in ("torch", "interpreter"):
        srv = Server((cfg, src), backend=backend, tp=2, max_batch=3, page_size=4, max_seq_len=24,
                     max_tokens_per_step=12, num_pages=12, clock=VirtualClock(0.01),
                     backend_opts={"schedule": "aot"} if backend == "interpreter" else {})
        step, seen = srv.backend.step, []

        def snap(batch, step=step, srv=srv, seen=seen):
            out = step(batch)
            if srv.backend.name == "torch":
                seen.append(srv.pool.page_table.copy())
            else:
                ranks = srv.backend.device_pages()
                assert np.array_equal(ranks[0]["page_table"], ranks[1]["page_table"]), "ranks agree"
                seen.append(ranks[0]["page_table"].copy())
            return out

        srv.backend.step = snap
        for p, n, t in WORKLOAD + [([11, 12, 13, 14, 15], 4, 0.06)]:
            srv.submit(p, n, t)
        srv.run(check_pages=True)
        tables[backend] = seen
    assert len(tables["torch"]) == len(tables["interpreter"]) > 5
    for i, (a, b) in enumerate(zip(tables["torch"], tables["interpreter"])):
        assert np.array_equal(a, b), f"pass {i}: device page table {b.tolist()} != host pool's {a.tolist()}"
    owners: dict[int, set[int]] = {}  # page -> slots it served during the run
    for t in tables["torch"]:
        for slot, page in zip(*np.nonzero(t >= 0)):
            owners.setdefault(int(t[slot, page]), set()).add(int(slot))
    assert any(len(v) > 1 for v in owners.values()), "a page freed by one request was taken by another slot's"

"""GPU tests of serving on the mega-kernel (mpk_dist/serving/megakernel_paged.py, one launch per
pass; issue 10's first GPU milestone). Run on a machine with an NVIDIA GPU:

    python -m pytest -q -s -m gpu tests/serving/test_megakernel_paged_gpu.py

First a diff test of one ragged pass against the CPU interpreter (names the first op whose output
differs). Acceptance: a mixed continuous-batching workload (prompts of 2..30 tokens, some chunked; requests
arriving and finishing at different passes; greedy and teacher-forced requests in the same passes)
on tiny-llama and qwen3-0.6b at tp 1 and tp 2 (local transport): every greedy request's 32 (or
fewer) tokens identical to the request run alone on the torch backend (static cache, eager), and
every request's logits within compare_logits' ERR_TOL / AGREE_MIN of the alone run's; then one
``serve-bench --backend megakernel,torch`` run on the same workload that prints TTFT / TPOT.
"""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = pytest.mark.gpu

from mpk_dist.backends.base import GenerateRequest  # noqa: E402
from mpk_dist.runtime.testing import AGREE_MIN, ERR_TOL, compare_logits, model, rand_ids, ref  # noqa: E402
from mpk_dist.serving.server import Server, VirtualClock  # noqa: E402

# The reference's "fp32 accumulation" (as the mega-kernel tests): no reduced-precision split-K.
torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False

# (prompt length, outputs, arrival s, teacher-forced); 10 ms virtual passes, max_batch 4, 16 tokens a
# pass: E leaves early, C's 21-token prompt is chunked next to decodes, F joins when a slot frees.
WORKLOAD = [(5, 32, 0.0, False), (13, 32, 0.0, False), (9, 8, 0.02, False), (21, 24, 0.05, True),
            (2, 32, 0.1, True), (30, 16, 0.3, False)]


def _serve(name: str, tp: int, opts: dict | None = None):
    """The workload through the megakernel server; (requests, outputs, server)."""
    m = model(name)
    vocab = m.config.vocab_size
    srv = Server(m, backend="megakernel", tp=tp, max_batch=4, page_size=8, max_seq_len=64, max_tokens_per_step=16,
                 device="cuda", clock=VirtualClock(0.01), backend_opts=opts)
    reqs = []
    for i, (plen, n, t, forced) in enumerate(WORKLOAD):
        prompt = rand_ids(plen, vocab, 100 + i)
        force = rand_ids(n, vocab, 200 + i) if forced else None
        srv.submit(prompt, n, t, force_tokens=force, want_logits=True)
        reqs.append((prompt, n, force))
    return reqs, srv.run(check_pages=True), srv


@pytest.mark.parametrize("tp", [1, 2])
def test_one_pass_buffers_match_the_interpreter(tp):
    """Diff test on one ragged pass (two decodes, a prompt chunk, padding): every rank's op outputs
    (the gathered head rows x_last .. logits included) and page pools after the kernel equal the CPU
    interpreter's on the same compiled task stream; names the first op that differs."""
    from mpk_dist.models.llama import build_paged_graph
    from mpk_dist.serving.interpreter_paged import InterpreterPagedBackend

    m = model("tiny")
    srv = Server(m, backend="megakernel", tp=tp, max_batch=4, page_size=4, max_seq_len=32, max_tokens_per_step=16,
                 device="cuda", clock=VirtualClock(0.01))
    # the program the kernel runs: head and page table padded to N rows (megakernel_paged.kernel_spec)
    spec = srv.backend.kernel_spec
    cpu = InterpreterPagedBackend(m.config, m.weights, spec, tp=tp, sms=8)
    for i, plen in enumerate((3, 6, 9)):
        srv.submit(rand_ids(plen, m.config.vocab_size, 300 + i), 4, 0.0 if i < 2 else 0.02)
    batches = [srv.scheduler.plan(0.0)]
    srv.scheduler.commit(batches[0], srv.backend.step(batches[0]), 0.01)
    cpu.step(batches[0])
    batches.append(srv.scheduler.plan(0.02))  # decodes of the first two next to the third's prompt
    got, want = srv.backend.step(batches[1]), cpu.step(batches[1])
    assert 0 < batches[1].num_prefill_tokens < batches[1].num_tokens < 16, "expected decodes, a chunk and padding"
    bad = []
    for r, s in enumerate(srv.backend.group.sessions):
        for op in build_paged_graph(m.config, spec, tp=tp, rank=r).ops:  # gathered head, as compiled
            for out in op.outputs:
                if not any(x["name"] == out for x in s.cg.meta["buffers"]):
                    continue
                a, b = s.buffer(out).float().cpu(), cpu.interp.buffer(r, out).float().reshape(s.buffer(out).shape)
                tol = 2e-2 * float(b.abs().max()) + 1e-3
                if float((a - b).abs().max()) > tol:
                    bad.append(f"rank {r} {op.name}->{out}: max err {float((a - b).abs().max()):.4g} (tol {tol:.3g})")
    err, agree = compare_logits(got.cpu().unsqueeze(0), want.unsqueeze(0))
    print(f"\n[paged megakernel] one pass vs interpreter, tiny tp{tp}: {len(bad)} differing buffers, logits "
          f"max_err/std {err:.4f}: {'OK' if not bad else 'FAILED'}")
    assert not bad, "first differing ops: " + "; ".join(bad[:4])


@pytest.mark.parametrize("name,tp,passes", [("tiny-llama", 1, 0), ("tiny-llama", 2, 0), ("qwen3-0.6b", 1, 0),
                                             ("qwen3-0.6b", 2, 0), ("tiny-llama", 1, 256), ("tiny-llama", 2, 7),
                                             ("qwen3-0.6b", 2, 256)])
def test_each_request_equals_it_alone_on_torch(name, tp, passes):
    """With the device page allocator (page_alloc; the server's check_pages compares every rank's
    device free stack, page table and counts with the host's counts after each pass), a launch per
    pass (passes 0) or persistent passes (P passes per launch)."""
    reqs, outs, srv = _serve(name, tp, {"persistent_passes": passes} if passes else None)
    assert max(p["seqs"] for p in srv.passes) == 4, "expected passes with 4 sequences at once"
    assert any(0 < p["prefill_tokens"] < p["tokens"] for p in srv.passes), "expected prompt chunks next to decodes"
    assert srv.pool.num_free == srv.pool.num_pages, "every page back on the free list"
    worst_err, worst_agree, bad = 0.0, 1.0, []
    for (prompt, n, force), o in zip(reqs, outs):
        alone = ref(name, 1).generate(GenerateRequest([prompt], n, force_tokens=force, want_logits=True))
        if force is None and o.tokens != alone.tokens[0]:
            first = next(i for i, (a, b) in enumerate(zip(o.tokens, alone.tokens[0])) if a != b)
            bad.append(f"request {o.id} (prompt {len(prompt)}): tokens differ first at output {first}: "
                       f"{o.tokens[first]} vs {alone.tokens[0][first]}")
            continue  # the logits of diverged paths are not comparable
        err, agree = compare_logits(o.logits.unsqueeze(1), alone.logits)
        worst_err, worst_agree = max(worst_err, err), min(worst_agree, agree)
    ok = not bad and worst_err <= ERR_TOL and worst_agree >= AGREE_MIN
    assert type(srv.pool).__name__ == "PageCounts", "page ids on the GPU, counts on the host"
    print(f"\n[paged megakernel] {name} tp{tp} P{passes}: {len(outs)} requests, {len(srv.passes)} passes, "
          f"greedy tokens equal: {not bad}, max_err/std {worst_err:.4f}, argmax agree {worst_agree:.4f}: "
          f"{'OK' if ok else 'FAILED'}")
    assert not bad, "; ".join(bad)
    assert worst_err <= ERR_TOL, f"max |err| / std = {worst_err:.4f} > {ERR_TOL}"
    assert worst_agree >= AGREE_MIN, f"argmax agreement {worst_agree:.4f} < {AGREE_MIN}"


def test_serve_bench_megakernel_and_torch_in_one_run(tmp_path, capsys):
    from mpk_dist.cli import main

    out = tmp_path / "serve.json"
    code = main(["serve-bench", "--model", "qwen3-0.6b", "--backend", "megakernel,torch", "--synthetic", "8",
                 "--prompt-len", "24", "--output-len", "16", "--max-batch", "8", "--max-tokens-per-step", "16",
                 "--page-size", "16", "--warmup", "1", "--ignore-eos", "--check", "--device", "cuda",
                 "--output-json", str(out)])
    text = capsys.readouterr().out
    recs = json.loads(out.read_text())
    with capsys.disabled():
        print("\n" + text[text.index("============ Backends"):])
    assert code == 0, "serve-bench --check found a request whose tokens differ from it alone"
    assert [r["backend"] for r in recs] == ["megakernel", "torch"]
    for r in recs:
        assert r["completed"] == 8 and r["total_output_tokens"] == 8 * 16 and all(r["correct"])
        assert r["mean_ttft_ms"] > 0 and r["mean_tpot_ms"] > 0


@pytest.mark.parametrize("name,tp,passes", [("tiny-llama", 1, 256), ("qwen3-0.6b", 1, 256), ("qwen3-0.6b", 2, 7)])
def test_persistent_passes_equal_one_launch_per_pass(name, tp, passes):
    """Persistent passes (docs/SERVING.md): the same workload with every pass posted into a resident
    launch gives bitwise the logits and tokens of one launch per pass; with P = 256 the whole run
    (until the workload's idle gap) is one launch, with P = 7 a new launch every 7 passes."""
    _, base, base_srv = _serve(name, tp)
    _, got, srv = _serve(name, tp, {"persistent_passes": passes})
    n = len(srv.passes)
    same = all(a.tokens == b.tokens and torch.equal(a.logits, b.logits) for a, b in zip(got, base))
    print(f"\npersistent passes {name} tp{tp} P{passes}: {n} passes in {srv.backend.launches} launches "
          f"(launch per pass: {base_srv.backend.launches}), tokens and logits equal: {same}")
    assert n == len(base_srv.passes) and base_srv.backend.launches == n
    assert srv.backend.launches < n and not srv.backend.running
    if passes < n:
        assert srv.backend.launches >= -(-n // passes)
    assert same, "persistent passes changed a request's tokens or logits"


# ---- the device page allocator (task kind page_alloc, csrc/tasks/page_alloc.cuh) ---------------------------
def _host_page_tables(max_batch: int, page_size: int, max_seq_len: int, max_tokens: int, work) -> list:
    """The page table after each pass of the workload ``work`` [(prompt, n, arrival, force)] with every
    request teacher-forced (so the passes do not depend on the logits), replayed on the host: the
    scheduler with a PagePool (page ids on the host), the server's loop with a 10 ms virtual clock."""
    import numpy as np

    from mpk_dist.serving.pages import PagePool
    from mpk_dist.serving.request import Request
    from mpk_dist.serving.scheduler import Scheduler

    pages = -(-max_seq_len // page_size)
    sched = Scheduler(PagePool(max_batch * pages, page_size, max_batch, pages), max(max_tokens, max_batch))
    for i, (p, n, t, force) in enumerate(work):
        sched.submit(Request(i, tuple(p), n, t, force_tokens=tuple(force)))
    clock, out = VirtualClock(0.01), []
    while not sched.idle:
        batch = sched.plan(clock.now())
        if batch.num_tokens == 0:  # nothing runs: wait for the next arrival (none: all done)
            if sched.next_arrival() is not None:
                clock.wait_until(sched.next_arrival())
            continue
        clock.after_pass()
        sched.commit(batch, torch.zeros(len(batch.logit_rows), 8), clock.now())
        out.append(np.array(sched.pool.page_table))
    return out


@pytest.mark.parametrize("tp,passes", [(1, 0), (2, 0), (1, 256), (2, 5)])
def test_device_page_tables_equal_the_host_pool(tp, passes):
    """After every pass, every rank's device page table (page_alloc on the GPU) is the one a host
    PagePool computes for the same passes (the CPU rule, tasks/page_alloc.py), a launch per pass and
    persistent passes; pages are freed and reused during the run."""
    import numpy as np

    m = model("tiny")
    vocab = m.config.vocab_size
    work = [(rand_ids(plen, vocab, 400 + i), n, t, rand_ids(n, vocab, 500 + i))
            for i, (plen, n, t, _) in enumerate(WORKLOAD)]
    opts = {"persistent_passes": passes} if passes else None
    srv = Server(m, backend="megakernel", tp=tp, max_batch=4, page_size=8, max_seq_len=64, max_tokens_per_step=16,
                 device="cuda", clock=VirtualClock(0.01), backend_opts=opts)
    step, seen = srv.backend.step, []

    def snap(batch):
        out = step(batch)
        ranks = srv.backend.device_pages()
        assert all(np.array_equal(r["page_table"], ranks[0]["page_table"]) for r in ranks), "ranks agree"
        seen.append(ranks[0]["page_table"][: srv.pool.max_seqs].copy())
        return out

    srv.backend.step = snap
    for p, n, t, force in work:
        srv.submit(p, n, t, force_tokens=force)
    srv.run(check_pages=True)
    want = _host_page_tables(4, 8, 64, 16, work)
    bad = [i for i, (a, b) in enumerate(zip(want, seen)) if not np.array_equal(a, b)]
    print(f"\n[device pages] tiny tp{tp} P{passes}: {len(seen)} passes, page tables equal to the host pool's: "
          f"{'OK' if not bad and len(want) == len(seen) else 'FAILED'}")
    assert len(want) == len(seen) and not bad, f"first differing pass {bad[:1]}: {seen[bad[0]].tolist()} vs " \
                                              f"{want[bad[0]].tolist()}" if bad else "pass counts differ"


@pytest.mark.parametrize("passes", [0, 4])
def test_empty_free_stack_is_a_named_error(passes):
    """A device stack emptied behind the host's back (num_free 0 on every rank): the first pass that
    needs a page stops the kernel with page_alloc's record, named on the host ("page pool empty")."""
    from mpk_dist.errors import MpkError

    m = model("tiny")
    opts = {"persistent_passes": passes} if passes else None
    srv = Server(m, backend="megakernel", tp=2, max_batch=2, page_size=8, max_seq_len=32, max_tokens_per_step=16,
                 device="cuda", clock=VirtualClock(0.01), backend_opts=opts)
    for s in srv.backend.group.sessions:
        s.buffer("num_free").zero_()
    torch.cuda.synchronize()
    srv.submit(rand_ids(5, m.config.vocab_size, 7), 2, 0.0)
    with pytest.raises(MpkError, match=r"page pool empty.*expected 1 free pages for slot 0, got 0"):
        srv.run()

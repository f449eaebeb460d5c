"""The Python serving API: submit requests with arrival times, run them with continuous batching.

    server = Server("tiny", backend="torch", tp=2, max_batch=8, page_size=16)
    server.submit([1, 2, 3], max_new_tokens=8, arrival_time=0.0)
    outputs = server.run()          # list[RequestOutput], by request id

The loop: plan a pass (retire, admit, lay out tokens), run it on the backend, commit its tokens
at the clock time the pass ended. When nothing runs and the next request has not arrived yet, the
clock waits for it. ``WallClock`` is real time (serve-bench); ``VirtualClock`` advances a fixed
amount per pass, so tests get the same arrival/finish interleaving on every machine.
"""

from __future__ import annotations

import time

import torch

from mpk_dist.errors import BackendUnavailable, DeviceTimeout, InputError
from mpk_dist.models.llama import PagedSpec
from mpk_dist.serving.pages import PageCounts, PagePool
from mpk_dist.serving.request import Request, RequestOutput
from mpk_dist.serving.scheduler import Scheduler

SERVING_BACKENDS = ("torch", "interpreter", "megakernel")
"""Backends with a paged, ragged step (megakernel: one launch per pass, CUDA only)."""


class WallClock:
    """Seconds since ``start()``; ``wait_until`` sleeps."""

    def start(self) -> None:
        """Set time 0 to now."""
        self.t0 = time.perf_counter()

    def now(self) -> float:
        """Seconds since start."""
        return time.perf_counter() - self.t0

    def after_pass(self) -> None:
        """Nothing to do: real time moved on by itself."""

    def wait_until(self, t: float) -> None:
        """Sleep until time ``t``."""
        time.sleep(max(0.0, t - self.now()))


class VirtualClock:
    """Deterministic time: each pass takes ``pass_s`` seconds; waiting jumps to the arrival."""

    def __init__(self, pass_s: float = 0.01):
        self.pass_s, self.t = float(pass_s), 0.0

    def start(self) -> None:
        """Set time 0."""
        self.t = 0.0

    def now(self) -> float:
        """Current virtual time."""
        return self.t

    def after_pass(self) -> None:
        """A pass took ``pass_s``."""
        self.t += self.pass_s

    def wait_until(self, t: float) -> None:
        """Jump forward to ``t``."""
        self.t = max(self.t, t)


def _resolve_model(model, seed: int, device: str):
    """(config, weight source) from a preset name / checkpoint dir, a ModelSource, or a (cfg, source) pair."""
    if isinstance(model, tuple):
        return model
    if isinstance(model, str):
        from mpk_dist.model_source import open_model

        model = open_model(model, seed=seed, device=device)
    return model.config, model.weights


def _make_backend(name: str, cfg, source, spec: PagedSpec, tp: int, device: str, weights, opts: dict):
    """The paged step backend ``name`` (imported lazily)."""
    if name == "interpreter":
        from mpk_dist.serving.interpreter_paged import InterpreterPagedBackend

        return InterpreterPagedBackend(cfg, source, spec, tp=tp, device=device, weights=weights, **opts)
    if name == "megakernel":
        from mpk_dist.serving.megakernel_paged import MegakernelPagedBackend

        return MegakernelPagedBackend(cfg, source, spec, tp=tp, device=device, weights=weights, **opts)
    from mpk_dist.serving.torch_paged import TorchPagedBackend

    return TorchPagedBackend(cfg, source, spec, tp=tp, device=device, weights=weights, **opts)


class Server:
    """Continuous-batching server over a paged-KV step backend (all TP ranks in this process).

    ``max_batch``: sequences served at once (page-table rows, <= 64 is the kernel's target);
    ``page_size``: positions per page; ``max_seq_len``: prompt + output per request; ``num_pages``:
    pages per layer pool (default: enough for max_batch full-length sequences);
    ``max_tokens_per_step``: tokens per pass (prompt chunks + decode tokens; default 512).
    ``backend``: 'torch' (op by op), 'interpreter' (the compiled task graph on the CPU; the pass is
    padded to max_tokens_per_step, so keep it small) or 'megakernel' (the compiled task graph on the
    GPU, one launch per pass; max_tokens_per_step and max_batch <= 256, padded to multiples of 16); ``backend_opts`` go to the backend
    (interpreter: sms, seed, schedule, check_races; megakernel: schedule, sms, timeout_s,
    worker_threads, compiler).
    """

    def __init__(self, model, backend: str = "torch", tp: int = 1, max_batch: int = 64, page_size: int = 16,
                 max_seq_len: int = 512, num_pages: int | None = None, max_tokens_per_step: int = 512,
                 device: str | None = None, seed: int = 0, clock=None, weights=None, backend_opts: dict | None = None):
        if backend not in SERVING_BACKENDS:
            raise BackendUnavailable(f"serving backend: expected one of {', '.join(SERVING_BACKENDS)}, got {backend!r}")
        if max_batch < 1 or page_size < 1 or max_seq_len < 1:
            raise InputError(f"server sizes: expected max_batch, page_size, max_seq_len >= 1, got "
                             f"{max_batch}, {page_size}, {max_seq_len}")
        device = device or ("cuda" if backend == "megakernel" or (torch.cuda.is_available() and backend == "torch")
                            else "cpu")
        if backend == "megakernel":  # before any weight reaches the device: a clear error on a CPU-only machine
            from mpk_dist.serving.megakernel_paged import check_device

            check_device(device)
        cfg, source = _resolve_model(model, seed, device)
        pages_per_seq = -(-max_seq_len // page_size)
        num_pages = num_pages or max_batch * pages_per_seq
        self.spec = PagedSpec(max_tokens=max(max_tokens_per_step, max_batch), max_seqs=max_batch,
                              num_pages=num_pages, page_size=page_size, max_pages_per_seq=pages_per_seq)
        self.backend = _make_backend(backend, cfg, source, self.spec, tp, device, weights, backend_opts or {})
        self.cfg, self.tp = cfg, tp
        # The device backends allocate pages on the GPU (task kind page_alloc): the host keeps the counts only.
        pool_kind = PageCounts if getattr(self.backend, "pages_on_device", False) else PagePool
        self.pool = pool_kind(num_pages, page_size, max_batch, pages_per_seq)
        self.scheduler = Scheduler(self.pool, self.spec.max_tokens)
        self.clock = clock or WallClock()
        self._next_id = 0
        self.passes: list[dict] = []

    def submit(self, prompt_ids, max_new_tokens: int, arrival_time: float = 0.0, stop_ids=(),
               force_tokens=None, want_logits: bool = False) -> int:
        """Queue a request; returns its id. ``arrival_time`` is seconds after ``run()`` starts."""
        ids = [int(t) for t in prompt_ids]
        bad = [t for t in ids + list(force_tokens or []) if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise InputError(f"token id: expected 0 <= id < {self.cfg.vocab_size}, got {bad[0]}")
        rid = self._next_id
        self._next_id += 1
        self.scheduler.submit(Request(rid, tuple(ids), int(max_new_tokens), float(arrival_time), tuple(stop_ids),
                                      None if force_tokens is None else tuple(int(t) for t in force_tokens),
                                      want_logits))
        return rid

    def _pause_backend(self) -> None:
        pause = getattr(self.backend, "pause", None)  # persistent passes (megakernel): end the launch
        if pause is not None:
            pause()

    def _check_pages(self) -> None:
        """The pool's invariants, and (device allocator) the device's page state against the host counts."""
        self.pool.check()
        check = getattr(self.backend, "check_pages", None)
        if check is not None:
            check(self.pool)

    def run(self, timeout_s: float = 3600.0, check_pages: bool = False) -> list[RequestOutput]:
        """Serve every submitted request to completion; outputs by id. ``check_pages``: verify the
        page pool's invariants after every pass (tests)."""
        self.clock.start()
        wall0 = time.perf_counter()
        sched = self.scheduler
        while not sched.idle:
            if time.perf_counter() - wall0 > timeout_s:
                raise DeviceTimeout(f"server: expected all requests done within {timeout_s} s, got "
                                    f"{len(sched.running)} running and {len(sched.queue)} queued")
            batch = sched.plan(self.clock.now())
            if batch.num_tokens == 0:
                if sched.running:
                    raise AssertionError("scheduler: running requests but an empty pass")
                nxt = sched.next_arrival()
                self._pause_backend()  # a resident persistent launch ends before the server idles
                if nxt is not None:
                    self.clock.wait_until(min(nxt, self.clock.now() + timeout_s))
                continue
            logits = self.backend.step(batch)
            self.backend.synchronize()
            self.clock.after_pass()
            sched.commit(batch, logits, self.clock.now())
            self.passes.append({"tokens": batch.num_tokens, "prefill_tokens": batch.num_prefill_tokens,
                                "seqs": len(batch.scheduled), "end_s": self.clock.now()})
            if check_pages:
                self._check_pages()
        self._pause_backend()
        out = sched.drain()
        sched.finished = []
        if check_pages:
            self.pool.check()
        return out

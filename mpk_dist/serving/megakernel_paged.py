"""The paged, ragged pass on the GPU: the compiled paged program run by the mega-kernel, one launch
per pass (the first GPU milestone of docs/SERVING.md, "Inside the persistent kernel" item 5).

Same contract as ``InterpreterPagedBackend``: the host pads the pass to the compiled N tokens
(slot -1), writes ``seq_slots`` and ``release_slots`` into every rank's input buffers, the tokens as
row 0 of ``forced_tokens`` and the positions as ``start_pos``; ``step_begin`` copies them to
``tokens`` / ``positions``. The page pools are state buffers: zeroed once, they persist across
launches. So does the page allocator (docs/SERVING.md "The device free list"): the free stack, page
table and page counts live in state buffers initialised once here, the program's page_alloc task
frees the released slots' pages and takes the pass's new pages on the GPU, and the server's pool
keeps counts only (``pages_on_device``). Each launch runs step 0 of a one-step program (``max_steps``
1), so the event counters (never reset inside a launch) are zeroed before every launch; the pools are
not. ``logit_rows``
(padded to MB with -1) is written too: a ``gather_rows`` task picks those token rows, so the head
runs over the MB sequences and row b of the merged [MB, V] logits belongs to ``logit_rows[b]``.

The program is compiled for ``kernel_spec(spec)``: N padded to a multiple of 16 above 16 tokens, and
the head (and the page table) padded from MB rows to what the kernel's linear tiles hold, because a
generated kernel fixes the row count of every linear tile (MPK_BATCH = min(N, 16); linears over more
rows run in row blocks of 16, docs/TASKGRAPH.md "Row blocks"); the padding rows of ``logit_rows`` and
of the page table are -1 (zero head rows, no pages), padding tokens have slot -1.

``persistent_passes`` P > 0 (aot schedule, x86-64 host): one launch of a P-step program serves up to P
passes (docs/SERVING.md "Persistent passes"): pass s is step s; the host stages its inputs in mapped
memory and rings a doorbell (mpk_dist.runtime.pass_io), step_begin copies them in
(csrc/runtime/pass_begin.cuh), and the host reads the logits once the step epilogue published
progress s + 1, all while the kernel stays resident. ``pause()`` ends the launch (the server calls it
before it idles); the next pass starts a new one, as does the pass after P.

TP: every rank in this process on one GPU (``--transport local``), one kernel per rank on its own
stream and SM share (mpk_dist.runtime.group). Limits: N (tokens per pass) and MB <= 256
(tables.MAX_BATCH). Batched prefill runs on GEMV row blocks (each weight block read once per 16 tokens)
until tensor-core prefill tiles exist.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from mpk_dist.config import ModelConfig
from mpk_dist.errors import BackendUnavailable, InputError
from mpk_dist.models.llama import PagedSpec, build_paged_graph
from mpk_dist.serving.scheduler import StepBatch

MAX_PAGED_GROUP = 8
"""Query heads per kv head the paged attention body holds in registers (csrc/tasks/paged_attention.cuh)."""
MAX_PAGED_HEAD_DIM = 256
"""Head dim of the paged attention body (8 elements per lane)."""


def check_device(device) -> torch.device:
    """The CUDA device to serve on; BackendUnavailable (one line, what to do) on a CPU-only machine."""
    dev = torch.device(device)
    if dev.type != "cuda":
        raise BackendUnavailable(f"serving backend megakernel: expected a CUDA device, got {dev}; "
                                 "use --backend torch or interpreter on the CPU")
    if not torch.cuda.is_available():
        raise BackendUnavailable("serving backend megakernel: expected a CUDA GPU, got none visible "
                                 "(torch.cuda.is_available() is False); use --backend torch or interpreter here")
    return dev


def check_spec(spec: PagedSpec) -> None:
    """Refuse pass sizes the programs cannot hold (tables.MAX_BATCH tokens and sequences)."""
    from mpk_dist.runtime.tables import MAX_BATCH

    if max(spec.max_tokens, spec.max_seqs) > MAX_BATCH:
        raise InputError(f"megakernel serving: expected at most {MAX_BATCH} tokens and sequences per pass, got "
                         f"{spec.max_tokens} tokens and {spec.max_seqs} sequences; pass "
                         f"--max-tokens-per-step <= {MAX_BATCH} and --max-batch <= {MAX_BATCH}")


def kernel_spec(spec: PagedSpec) -> PagedSpec:
    """The spec the mega-kernel's paged program is compiled for: N tokens padded to
    ``tables.padded_batch`` (a multiple of 16 above 16) and head rows (and page-table rows) MB padded
    to N when N <= 16, else to a multiple of 16, so every linear tile has the kernel's row count.

    NOTE: a gathered head over MB rows whose linear tiles have BATCH != MPK_BATCH makes the linear
    body read and write MPK_BATCH rows of ``h_final`` / ``logits`` past the ends of those [MB, *]
    buffers (the illegal memory access of the first pass on the GPU, MB < N <= 16). Padding the
    head keeps every linear at the kernel's batch; the extra rows are -1 in ``logit_rows`` (zero
    rows) and in the page table (unused slots).
    """
    from mpk_dist.runtime.tables import ROW_BLOCK, padded_batch

    n = padded_batch(spec.max_tokens)
    return dataclasses.replace(spec, max_tokens=n,
                               max_seqs=n if n <= ROW_BLOCK else max(ROW_BLOCK, padded_batch(spec.max_seqs)))


def check_kernel_batch(cg) -> None:
    """Raise InputError naming the first linear-kind task the kernel would run with another row count
    than its BATCH parameter (``tables.check_linear_batch``: BATCH != MPK_BATCH = kernel_batch(cg))."""
    from mpk_dist.runtime.tables import check_linear_batch

    check_linear_batch(cg)


def check_paged_tasks(cg) -> None:
    """Raise InputError naming the first task whose shape or row count the CUDA bodies do not support."""
    from mpk_dist.runtime.tables import task_params
    from mpk_dist.taskgraph.abi import TASK_COLS
    from mpk_dist.taskgraph.tasks import BY_NAME

    check_kernel_batch(cg)
    ops = cg.arrays["tasks"][:, TASK_COLS["OPCODE"]]
    for t in np.nonzero(ops == BY_NAME["paged_attention"].opcode)[0]:
        p = task_params(cg, int(t))
        if p["GROUP"] > MAX_PAGED_GROUP or p["HEAD_DIM"] > MAX_PAGED_HEAD_DIM:
            raise InputError(f"{cg.task_label(int(t))}: expected GROUP <= {MAX_PAGED_GROUP} and head_dim <= "
                             f"{MAX_PAGED_HEAD_DIM}, got GROUP={p['GROUP']}, head_dim={p['HEAD_DIM']}")
    for t in np.nonzero(ops == BY_NAME["qkv_prep_paged"].opcode)[0]:
        p = task_params(cg, int(t))
        if p["HEAD_DIM"] % 2 or p["HEAD_DIM"] > 512:
            raise InputError(f"{cg.task_label(int(t))}: expected an even head_dim <= 512, got {p['HEAD_DIM']}")


def check_slots(batch: StepBatch, spec: PagedSpec) -> None:
    """Every token's slot is a sequence slot and its position fits the slot's page-table row; release
    flags are 0 or 1. The kernel's page_alloc refuses a position past the row too (kErrPageTableFull);
    checking here names the slot before a launch."""
    if batch.release is not None and (len(batch.release) > spec.max_seqs or not np.isin(batch.release, (0, 1)).all()):
        raise InputError(f"pass release_slots: expected at most {spec.max_seqs} flags of 0 or 1, got "
                         f"{batch.release.tolist()}")
    for s in np.unique(batch.slots[batch.slots >= 0]):
        if s >= spec.max_seqs:
            raise InputError(f"pass: expected sequence slots < {spec.max_seqs} (max_batch), got {int(s)}")
        last = int(batch.positions[batch.slots == s].max())
        if last >= spec.page_size * spec.max_pages_per_seq or int(batch.positions[batch.slots == s].min()) < 0:
            raise InputError(f"pass slot {int(s)}: expected positions 0..{spec.page_size * spec.max_pages_per_seq - 1} "
                             f"(max_seq_len), got up to {last}")


class MegakernelPagedBackend:
    """Paged-KV step backend on the mega-kernel: ``step(batch) -> logits [R, V]`` (float32, on the GPU).

    Options: ``schedule`` aot|jit (jit at tp 1 only), ``sms`` (SMs the group may use), ``timeout_s``
    (watchdog), ``worker_threads``, ``compiler`` (nvcc|nvrtc); ``weights``: per-rank weight dicts
    on the device to share (default: loaded from ``source``).
    """

    name = "megakernel"
    pages_on_device = True  # page ids live on the GPU (page_alloc); the server counts pages

    def __init__(self, cfg: ModelConfig, source, spec: PagedSpec, tp: int = 1, device="cuda", weights=None,
                 schedule: str = "aot", sms: int | None = None, timeout_s: float = 5.0,
                 worker_threads: int | None = None, compiler: str | None = None, persistent_passes: int = 0,
                 pass_wait_s: float = 10.0):
        from mpk_dist.runtime.transport import LocalTransport, check_options

        check_options(tp, "local", schedule)
        check_spec(spec)
        if timeout_s <= 0:
            raise InputError(f"timeout_s: expected a positive number of seconds, got {timeout_s}")
        if persistent_passes < 0 or (persistent_passes and schedule != "aot"):
            raise InputError(f"persistent_passes: expected >= 0 with schedule aot (the jit queues time out while "
                             f"the host is idle), got {persistent_passes} with {schedule}")
        if persistent_passes:
            from mpk_dist.runtime.pass_io import check_host_order

            check_host_order()
        self.persistent_passes, self.pass_wait_s, self.timeout_s = persistent_passes, pass_wait_s, timeout_s
        self.running = False  # a persistent launch is resident
        self.posted = 0  # passes posted into it
        self.device = self._check_device(device)
        self.cfg, self.spec, self.tp, self.schedule = cfg, spec, tp, schedule
        self.kernel_spec = kernel_spec(spec)  # what the program is compiled for (head rows = N)
        self.vocab_size = cfg.vocab_size
        self.transport = LocalTransport(tp, self.device)
        from mpk_dist.runtime.partition import workers_per_rank

        self.workers = workers_per_rank(self._num_sms(), self.transport.ranks_per_gpu, sms)
        if weights is None:
            from mpk_dist.weights import load_rank_weights

            weights = [load_rank_weights(build_paged_graph(cfg, spec, tp=tp, rank=r), source, self.device)
                       for r in range(tp)]
        self.group = self._build_group(weights, schedule, timeout_s, worker_threads, compiler)
        self.group.reset()  # pools and counters zeroed once; the pools then persist across launches
        self._init_pages()
        self._fill_sampling()
        self.launches = 0

    def _check_device(self, device) -> torch.device:
        return check_device(device)

    def _num_sms(self) -> int:
        return torch.cuda.get_device_properties(self.device).multi_processor_count

    def _build_group(self, weights, schedule, timeout_s, worker_threads, compiler):
        """Compile the paged programs of every rank and build their sessions (kernel built here, not
        at the first pass, so it is outside every TTFT)."""
        from mpk_dist.runtime.group import RankGroup
        from mpk_dist.runtime.megakernel_backend import DEFAULT_WORKER_THREADS, tuning_from_env
        from mpk_dist.taskgraph.paged_compiler import compile_paged_programs

        cgs = compile_paged_programs(self.cfg, self.kernel_spec, self.tp, sms=self.workers,
                                     max_steps=max(1, self.persistent_passes))
        for cg in cgs:
            check_paged_tasks(cg)
        tuning = tuning_from_env(worker_threads or DEFAULT_WORKER_THREADS)
        # superopt off: the paged programs have no fused linears, so there is nothing to generate.
        kw = dict(schedule=schedule, timeout_s=timeout_s, trace=0, compiler=compiler,
                  model=self.cfg.architecture or self.cfg.family, superopt=False, **tuning)
        group = RankGroup(cgs, weights, self.transport, self.device, kw, own_streams=self.persistent_passes > 0)
        if self.persistent_passes:
            from mpk_dist.taskgraph.paged_compiler import PERSISTENT_INPUTS

            n = self.kernel_spec.max_tokens
            for s in group.sessions:  # forced_tokens takes row s of pass s; the rest are whole buffers
                s.enable_passes([(name, n if name == "forced_tokens" else 0) for name in PERSISTENT_INPUTS],
                                self.pass_wait_s)
        return group

    def _init_pages(self) -> None:
        """The page allocator's state at server start on every rank (all pages free; persists after)."""
        from mpk_dist.taskgraph.paged_compiler import page_state

        for s in self.group.sessions:
            with s._on_stream():
                for name, a in page_state(s.cg).items():
                    s.buffer(name).copy_(torch.from_numpy(a))

    def device_pages(self) -> list[dict]:
        """Every rank's page-allocator state (``tasks.page_alloc.STATE_BUFFERS``) as numpy arrays: device
        copies only (on the side stream while a persistent launch is resident, as the logits)."""
        from mpk_dist.taskgraph.tasks.page_alloc import STATE_BUFFERS

        with self._off_kernel_stream():
            return [{n: s.buffer(n).cpu().numpy() for n in STATE_BUFFERS} for s in self.group.sessions]

    def check_pages(self, pool) -> None:
        """The device allocator's state after the last pass agrees on every rank and with ``pool``'s counts."""
        from mpk_dist.serving.pages import check_device_pages

        check_device_pages(self.device_pages(), pool)

    def _fill_sampling(self) -> None:
        """Greedy sampling words (the head's argmax runs in the kernel; the logits are what we return)."""
        from mpk_dist.taskgraph.sampling_rng import sampling_words

        words = torch.from_numpy(sampling_words(0.0, 1.0, 0))
        for s in self.group.sessions:
            with s._on_stream():
                s.bufs[s.cg.meta["special"]["sampling"]].copy_(words)

    def _write_inputs(self, x: dict) -> None:
        """The pass's inputs into every rank's buffers, and the counters zeroed for step 0 (on each
        rank's stream; RankGroup.launch orders the device before any kernel starts)."""
        from mpk_dist.taskgraph.paged_compiler import PASS_INPUTS

        forced = x["tokens"].reshape(1, -1)
        for s in self.group.sessions:
            sp = s.cg.meta["special"]
            with s._on_stream():
                # counters and tallies (one view), launched flags, done flags: a fresh step 0
                for t in (s.events, s.launched, s.done):
                    t.zero_()
                for name in PASS_INPUTS:  # seq_slots, release_slots, logit_rows
                    s.buffer(name).copy_(x[name])
                s.bufs[sp["forced_tokens"]].copy_(forced)
                s.bufs[sp["start_pos"]].copy_(x["positions"])

    def step(self, batch: StepBatch) -> torch.Tensor:
        """Run one pass as one launch per rank; logits [len(logit_rows), V] of the rows that emit."""
        N = self.spec.max_tokens
        if batch.num_tokens > N or len(batch.logit_rows) > self.spec.max_seqs:
            raise InputError(f"pass: expected at most {N} tokens and {self.spec.max_seqs} sequences, got "
                             f"{batch.num_tokens} and {len(batch.logit_rows)}")
        if batch.num_tokens and (int(batch.tokens.min()) < 0 or int(batch.tokens.max()) >= self.vocab_size):
            raise InputError(f"token id: expected 0 <= id < {self.vocab_size}, got "
                             f"{int(batch.tokens.min())}..{int(batch.tokens.max())}")
        check_slots(batch, self.spec)
        # NOTE: host tensors: each rank's copy then runs on that rank's stream (a device tensor made
        # on the current stream would race with a copy on another stream).
        x = batch.tensors("cpu", pad_tokens=self.kernel_spec.max_tokens, pad_rows=self.kernel_spec.max_seqs)
        if self.persistent_passes:
            return self._persistent_step(x, len(batch.logit_rows))
        self._write_inputs(x)
        g = self.group
        # One step, no stop ids; prompt_len / max_new out of reach: the epilogue only ends the launch.
        g.launch(0, 1, 1 << 30, 1 << 30, (), False, False)
        g.wait()
        self.launches += 1
        logits = g.logits(lambda s: s.bufs[s.cg.meta["special"]["logits"]], self.vocab_size)  # [MB', V] (kernel_spec)
        return logits[: len(batch.logit_rows)].float()  # row b = token row logit_rows[b] (gather_rows)

    # -- persistent passes ------------------------------------------------------------------------
    def _start_persistent(self) -> None:
        """Zero the counters and launch the P-step program (it then waits for pass 0)."""
        for s in self.group.sessions:
            with s._on_stream():
                for t in (s.events, s.launched, s.done):
                    t.zero_()
        # prompt_len / max_new out of reach: only the last step (or a stop) ends the launch
        self.group.launch(0, self.persistent_passes, 1 << 30, 1 << 30, (), False, False)
        self.launches += 1
        self.running, self.posted = True, 0
        if self._side is None and self.device.type == "cuda":
            self._side = torch.cuda.Stream(self.device)

    _side = None  # the stream host-side reads use while the kernel is resident

    def _off_kernel_stream(self):
        """A context on the side stream (never the kernel's: it is busy until the launch ends)."""
        import contextlib

        return torch.cuda.stream(self._side) if self._side is not None else contextlib.nullcontext()

    def _persistent_step(self, x: dict, rows: int) -> torch.Tensor:
        """Post the pass into the resident launch (a new launch when none is, or after P passes), wait
        for its final task, copy its logits to the host on a side stream (host logits back)."""
        if self.running and self.posted == self.persistent_passes:
            self._end_launch()  # it ends by itself after its last step
        if not self.running:
            self._start_persistent()
        s = self.posted
        from mpk_dist.taskgraph.paged_compiler import persistent_pass_inputs

        staged = {k: v.numpy() for k, v in persistent_pass_inputs(x, s).items()}
        for sess in self.group.sessions:
            sess.passes.post(s, staged)
        self.posted += 1
        self._wait_progress(s + 1)
        # Copies only while the launch is resident, and host logits back: any device kernel launched
        # now (torch.cat, argmax) may first need CUDA's lazy module loading, which waits for the
        # resident kernel, which waits for the next pass (GPU run 2026-11-30: every persistent test
        # stalled at pass 1 until pass_wait_s). The scheduler takes the argmax on the host.
        with self._off_kernel_stream():
            logits = self.group.logits(lambda q: q.bufs[q.cg.meta["special"]["logits"]][:rows], self.vocab_size,
                                       host=True)
        return logits.float()

    def _wait_progress(self, n: int) -> None:
        """Until every rank's epilogue published n finished steps (bounded; a failed kernel raises)."""
        import time

        from mpk_dist.errors import DeviceTimeout

        deadline = time.perf_counter() + self.pass_wait_s + 3 * self.timeout_s
        while not all(s.progress() >= n for s in self.group.sessions):
            if any(s.finished() for s in self.group.sessions):
                # A launch that ends after its last pass publishes that pass's progress first: read it again,
                # since it may have finished between the two reads (GPU run 2026-11-30: "ended before pass 4
                # finished (progress [5, 5])" at P = 5).
                if all(s.progress() >= n for s in self.group.sessions):
                    return
                self._end_launch()  # ended early: a watchdog record says why
                raise DeviceTimeout(f"persistent passes: the launch ended before pass {n - 1} finished "
                                    f"(progress {[s.progress() for s in self.group.sessions]})")
            if time.perf_counter() > deadline:
                raise DeviceTimeout(f"persistent passes: expected pass {n - 1} to finish within "
                                    f"{self.pass_wait_s + 3 * self.timeout_s:.0f} s, got progress "
                                    f"{[s.progress() for s in self.group.sessions]}; the watchdog did not fire")
            time.sleep(0.00002)

    def pause(self) -> None:
        """End a resident launch (stop at its next step_begin); the next pass launches again."""
        if not self.running:
            return
        for s in self.group.sessions:
            s.passes.stop()
        self._end_launch()

    def _end_launch(self) -> None:
        """Wait (bounded from now, not from the launch) for the resident kernels to end."""
        for s in self.group.sessions:
            s.restart_deadline()
        self.running = False
        self.group.wait()

    def synchronize(self) -> None:
        """Wait for queued device work (``step`` already waited for its kernels); with a resident
        persistent launch there is nothing to wait for (a device-wide sync would wait for the launch)."""
        if self.device.type == "cuda" and not self.running:
            torch.cuda.synchronize(self.device)

"""One compiled program on one GPU: its buffers (torch tensors), runtime state, kernel and launches.

A ``Session`` is built per (rank, batch): it allocates every buffer of the ABI buffer table
(weights shared with the backend), loads the kernel and fills RuntimeParams. Event counters, the
signal tallies and the ``comm`` buffers live in the rank's symmetric region (mpk_dist.runtime.
comm_layout), which peers reach through the peer tables; at tp 1 the region is a plain allocation
and the tables point at this rank only. ``launch`` = ``prepare`` (host-side state, on the session's
stream) + ``start`` (the kernel launch); a TP group prepares every rank, orders the device, then
starts them back to back (mpk_dist.runtime.group). ``wait`` streams progress from mapped pinned
memory until the kernel ends (bounded), then raises on a watchdog record.
"""

from __future__ import annotations

import contextlib
import time

import numpy as np
import torch

from mpk_dist.errors import DeviceTimeout, InputError
from mpk_dist.runtime import tables
from mpk_dist.runtime.codegen import KernelShape, tables_hash
from mpk_dist.runtime.comm_layout import comm_layout, peer_quota, peer_tables
from mpk_dist.runtime.kernel import build_kernel
from mpk_dist.runtime.loader import LoadedKernel, host_device_pointer
from mpk_dist.runtime.params import TRACE_DTYPE, ErrorRecord, RuntimeParams, to_bytes
from mpk_dist.runtime.task_records import build_records
from mpk_dist.taskgraph.abi import ABI_VERSION

_TORCH = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32, "i32": torch.int32}
QUEUE_SLOT_WORDS = 4


DEFAULT_L2_BYTES = 50 << 20
"""L2 size assumed when the device does not report one (an H100/H200 has 50 MB)."""


def _pow2(n: int) -> int:
    return 1 << max(4, (int(n) - 1).bit_length())


PAIRED_WORKER_THREADS = 256
"""Worker threads a block with two blocks per SM (MPK_BLOCKS_PER_SM=2): the default there, and the most allowed."""


def kernel_shape(cg, worker_threads: int | None, schedule: str, **knobs) -> KernelShape:
    """The KernelShape a Session of program ``cg`` builds (``knobs``: the other KernelShape fields; a
    ``worker_threads`` of None takes ``tables.default_worker_threads``, a ``linear_unroll`` of None
    ``tables.default_linear_unroll``, a ``compact_code`` of None ``tables.default_compact_code``, an
    ``attn_merge_phases`` above 1 the kernel with the phased merge; with two blocks per
    SM the threads are PAIRED_WORKER_THREADS, at most); the kernel
    prebuild (mpk_dist.runtime.prebuild) asks the same function,
    so its cubins are the ones found."""
    blocks = knobs.get("blocks_per_sm", 1)
    if worker_threads is None:
        # Two blocks share the SM's 64K registers: 256 threads keep 128 a thread (512 would leave 64 and spill).
        worker_threads = tables.default_worker_threads(cg) if blocks == 1 else PAIRED_WORKER_THREADS
    elif blocks > 1 and worker_threads > PAIRED_WORKER_THREADS:
        raise InputError(f"MPK_BLOCKS_PER_SM={blocks} with MPK_WORKER_THREADS={worker_threads}: expected at most "
                         f"{PAIRED_WORKER_THREADS} threads a block (two blocks share an SM's registers: 128 a thread at "
                         f"{PAIRED_WORKER_THREADS}); leave MPK_WORKER_THREADS unset or set it to {PAIRED_WORKER_THREADS}")
    if knobs.get("linear_mma") is None:
        knobs["linear_mma"] = tables.default_linear_mma(cg)
    if knobs.get("linear_unroll") is None:
        knobs["linear_unroll"] = tables.default_linear_unroll(cg, worker_threads)
    if knobs.get("compact_code") is None:
        knobs["compact_code"] = tables.default_compact_code(cg, knobs["linear_unroll"])
    # MPK_BATCH: the rows of a linear tile (row blocks of 16 above 16 rows), not the program's batch
    knobs.setdefault("flag_words", bool(cg.meta.get("flag_words")))  # the program's, not a knob (taskgraph.flag_words)
    # MPK_ATTN_MERGE_PHASES > 1 (the launch's size, tables.smem_bytes) runs the kernel with the phased merge
    knobs["attn_phased_merge"] = knobs.pop("attn_merge_phases", 1) > 1
    return KernelShape(tables.kernel_batch(cg), worker_threads, schedule, **knobs)


TRACE_BYTES_CAP = 256 << 20
"""Most bytes of trace records one session keeps (all workers together)."""


class Session:
    """Buffers + kernel of one compiled rank program.

    ``region``: this rank's symmetric region (mpk_dist.comm.SymmetricBuffer, its ``peer_ptrs`` the
    regions of every rank as reached from here); None allocates a world-1 region here. ``stream``:
    the CUDA stream of this rank's kernel (None: the current stream). ``trace_steps``: steps of
    trace records to keep room for (0 = no trace). ``cooperative``: launch cooperatively (one grid
    on the GPU); a TP group on one GPU launches plainly after its own co-residency check.
    """

    def __init__(self, cg, weights: dict[str, torch.Tensor], device: torch.device, schedule: str = "aot",
                 worker_threads: int | None = 256, timeout_s: float = 5.0, trace: bool | int = False, num_sched: int = 4,
                 compiler: str | None = None, model: str = "-", linear_rows: int = 1, linear_unroll: int | None = None,
                 prefetch_kb: int = -1, region=None, stream=None,
                 cooperative: bool = True, superopt: bool = True, linear_mma: bool | None = None,
                 prefetch_plan: bool = True, linear_tma: bool = False, linear_pipe: bool = False,
                 attn_prefetch: bool = True, bulk_prefetch: bool = False, prefetch_ahead: bool = False,
                 attn_stage_kv: bool = False, load_ahead: bool = True, min_carveout: bool = False,
                 weight_evict_first: bool = False, compact_code: bool | None = None,
                 prefetch_level_kb: int | None = None, blocks_per_sm: int = 1, plan_behind_attention: bool = False,
                 prefetch_next_kb: int | None = None, layer_aligned_workers: bool = False,
                 prefetch_behind_attention_kb: int | None = None, exact_partials: bool = True,
                 attn_merge_phases: int = 1):
        if cg.meta["abi_version"] != ABI_VERSION:
            raise InputError(f"task graph ABI: expected version {ABI_VERSION}, got {cg.meta['abi_version']}")
        tables.check_supported(cg)
        if layer_aligned_workers and schedule == "aot":  # record-level: the aot worker lists only (same binary)
            from mpk_dist.taskgraph.serialize import layer_aligned_workers as realign

            cg = realign(cg)
        if schedule == "jit" and int(cg.meta["world_size"]) > 1:
            raise InputError("--schedule jit: expected tp 1 (jit scheduling of peer-signalled events comes with "
                             "the TP issue), got tp > 1; use --schedule aot")
        self.cg, self.device, self.schedule = cg, device, schedule
        self.batch, self.world, self.rank = int(cg.meta["batch"]), int(cg.meta["world_size"]), int(cg.meta["rank"])
        self.max_steps, self.workers = int(cg.meta["max_steps"]), int(cg.meta["workers"])
        self.timeout_s, self.stream, self.cooperative = timeout_s, stream, cooperative
        # Room for every task of `trace_steps` steps (True: all steps), capped at TRACE_BYTES_CAP of records.
        trace_steps = self.max_steps if trace is True else int(trace)
        per_worker = tables.max_tasks_per_worker(cg) * min(trace_steps, self.max_steps)
        self.trace_cap = min(per_worker, TRACE_BYTES_CAP // (TRACE_DTYPE.itemsize * self.workers)) if trace_steps > 0 else 0
        self.trace_from = 0
        self.final = tables.final_task(cg)
        t0 = time.perf_counter()
        shape = kernel_shape(cg, worker_threads, schedule, linear_rows=linear_rows, linear_unroll=linear_unroll,
                             prefetch_kb=prefetch_kb, superopt=superopt,
                             linear_mma=linear_mma, linear_tma=linear_tma, linear_pipe=linear_pipe,
                             attn_prefetch=attn_prefetch, load_ahead=load_ahead,
                             weight_evict_first=weight_evict_first, compact_code=compact_code,
                             blocks_per_sm=blocks_per_sm, attn_merge_phases=attn_merge_phases)
        self.source, self.build = build_kernel(shape, model=model,
                                               rank=self.rank, world=self.world, input_hash=tables_hash(cg.arrays),
                                               compiler=compiler, program=cg)
        self.build_s = time.perf_counter() - t0
        worker_threads = shape.worker_threads  # None above: the program's choice, resolved once by kernel_shape
        self.worker_threads = worker_threads
        self.block_threads = worker_threads + (32 if schedule == "jit" else 0)
        # Record-level: split-KV tiles stage their cache rows in shared memory when the stage fits.
        self.stage_kv = attn_stage_kv and tables.kv_stage_fits(cg, worker_threads, weight_ring=linear_tma)
        self.smem = tables.smem_bytes(cg, worker_threads, weight_ring=linear_tma, stage_kv=self.stage_kv,
                                      linear_mma=shape.linear_mma, linear_unroll=shape.linear_unroll,
                                      exact_partials=exact_partials, attn_merge_phases=attn_merge_phases)
        t0 = time.perf_counter()
        self.kernel = LoadedKernel(self.build.cubin, device.index or 0, self.block_threads, self.smem,
                                   min_carveout=min_carveout)
        self.load_s = time.perf_counter() - t0
        self.layout = comm_layout(cg)
        if region is None:
            from mpk_dist.comm.symmetric import allocate_local_group

            region = allocate_local_group(1, self.layout.nbytes, device)[0]
        if region.nbytes < self.layout.nbytes or len(region.peer_ptrs) != self.world:
            raise InputError(f"symmetric region of rank {self.rank}: expected >= {self.layout.nbytes} bytes and "
                             f"{self.world} peers, got {region.nbytes} bytes and {len(region.peer_ptrs)} peers")
        self.region = region
        self.peer_regions = None  # every rank's region when they live in this process (local transport)
        self.use_prefetch_plan = prefetch_plan
        # Record-level switches (no rebuild): bulk-copy prefetches; hoisting needs the aot worker order.
        self.bulk_prefetch, self.prefetch_ahead = bulk_prefetch, prefetch_ahead and schedule == "aot"
        # None: the tuned default for this batch (prefetch_plan.default_level_kb; None there too: the kernel's cap)
        if prefetch_level_kb is None:
            from mpk_dist.runtime.prefetch_plan import default_level_kb

            prefetch_level_kb = default_level_kb(self.batch, self.world, shape.linear_mma)
        self.prefetch_level_kb = prefetch_level_kb
        # Record-level too: plan behind batch-1 attention; the next linear task's head during a narrow wait (aot only:
        # the jit schedule has no fixed next task).
        self.plan_behind_attention = plan_behind_attention
        # Record-level too: the batch-1 tiles behind attention prefetch this many KB instead of the kernel's cap.
        self.prefetch_behind_attention_kb = prefetch_behind_attention_kb
        self.prefetch_next_kb = prefetch_next_kb if schedule == "aot" else None
        self.passes = None  # a PassChannel once enable_passes (persistent passes, pass_io.py)
        self._alloc(weights, num_sched)

    def enable_passes(self, inputs: list[tuple[str, int]], wait_s: float) -> None:
        """Serve passes into one launch: step_begin waits for the host's pass (mpk_dist.runtime.pass_io)."""
        from mpk_dist.runtime.pass_io import PassChannel

        self.passes = PassChannel(self, inputs, wait_s)

    # -- memory ------------------------------------------------------------------------------------
    def _dev(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(self.device)

    def _alloc(self, weights: dict[str, torch.Tensor], num_sched: int) -> None:
        cg, dev = self.cg, self.device
        self.tabs = {k: self._dev(v) for k, v in cg.arrays.items()}
        self.bufs: list[torch.Tensor | None] = []
        special = cg.meta["special"]
        self.pinned: dict[str, torch.Tensor] = {}
        for i, b in enumerate(cg.meta["buffers"]):
            shape, dt = tuple(b["shape"]), _TORCH[b["dtype"]]
            if b["kind"] == "weight":
                w = weights.get(b["name"])
                if w is None or tuple(w.shape) != shape or w.dtype != dt:
                    raise InputError(f"weight {b['name']}: expected {shape} {dt}, got "
                                     f"{None if w is None else (tuple(w.shape), w.dtype)}")
                t = w.contiguous()
            elif b["kind"] == "const":
                t = torch.from_numpy(np.ascontiguousarray(cg.consts[b["name"]])).to(dev, dt).reshape(shape)
            elif b["kind"] == "comm":  # a view into the symmetric region, where peers write it
                t = self._region_view(self.layout.buffer_offsets[i], self.layout.buffer_bytes[i], dt).reshape(shape)
            elif i == special["token_out"]:
                t = _pinned(shape, dt)  # mapped: the host streams tokens from it while the kernel runs
                self.pinned["token_out"] = t
            else:
                t = torch.zeros(shape, dtype=dt, device=dev)
            self.bufs.append(t)
        addrs = [self._addr(t) for t in self.bufs]
        self.buf_base = torch.tensor(addrs, dtype=torch.int64, device=dev)
        arg_addr = resolve_args(cg.arrays["args"], addrs, [t.element_size() for t in self.bufs])  # into the records
        E, T, W = cg.arrays["events"].shape[0], cg.arrays["tasks"].shape[0], self.workers
        # Counters [E] then tallies [E], contiguous at the start of the region (the kernel reads
        # events[E + e] for the tallies; one zero_() clears both).
        self.events = self._region_view(self.layout.counters_offset, 8 * E, torch.int32)
        base, evs = peer_tables(self.layout, self.rank, addrs, list(self.region.peer_ptrs))
        self.peer_base = torch.from_numpy(base.copy()).to(dev)
        self.peer_events = torch.from_numpy(evs.copy()).to(dev)
        self.peer_quota = self._dev(peer_quota(cg))
        plan, ahead = self._prefetch_plan() if self.use_prefetch_plan else (None, None)
        # argument addresses and the plan live here
        records, task_rec = build_records(cg, arg_addr, plan, ahead, bulk_prefetch=self.bulk_prefetch,
                                          stage_kv=self.stage_kv)
        self.records, self.task_rec = self._dev(records), self._dev(task_rec)
        dep_ptr, dep_task, dep_off = tables.dependents(cg)
        self.deps = [self._dev(dep_ptr), self._dev(dep_task), self._dev(dep_off)]
        self.num_sched = max(1, min(num_sched, W))
        self.queue_cap = _pow2(2 * tables.max_tasks_per_worker(cg) + 8)
        self.sched_cap = _pow2(2 * E + 8)
        z32 = lambda n: torch.zeros(int(n), dtype=torch.int32, device=dev)  # noqa: E731
        self.launched, self.queue_tail, self.sched_tail = z32(T), z32(W), z32(self.num_sched)
        self.queues = z32(W * self.queue_cap * QUEUE_SLOT_WORDS)
        self.sched_queues = z32(self.num_sched * self.sched_cap * QUEUE_SLOT_WORDS)
        self.done, self.halt, self.trace_len = z32(self.batch), z32(1), z32(W)
        self.trace = torch.zeros(max(1, W * self.trace_cap * TRACE_DTYPE.itemsize), dtype=torch.uint8, device=dev)
        self.pinned["progress"] = _pinned(2, torch.int32)
        self.pinned["step_end_ns"] = _pinned(self.max_steps + 1, torch.int64)
        self.pinned["error"] = _pinned(ctypes_size(ErrorRecord), torch.uint8)
        self.stop_ids = z32(1)
        self.logits_dump: torch.Tensor | None = None
        self.params_dev = torch.zeros(ctypes_size(RuntimeParams), dtype=torch.uint8, device=dev)

    def _prefetch_plan(self) -> tuple[np.ndarray, np.ndarray | None]:
        """(per-task L2 prefetch bytes, per-task bytes of the next task hoisted into its wait or None)
        (prefetch_plan.py) for this GPU's L2; ranks sharing one GPU (local transport: a stream per rank)
        split it."""
        from mpk_dist.runtime.prefetch_plan import plan_tables

        l2 = int(getattr(torch.cuda.get_device_properties(self.device), "L2_cache_size", 0)) if self.device.type == "cuda" else 0
        share = self.world if self.stream is not None else 1
        l2 = (l2 or DEFAULT_L2_BYTES) // share
        level = None if self.prefetch_level_kb is None else self.prefetch_level_kb * 1024
        return plan_tables(self.cg, self.workers, l2, level, hoist=self.prefetch_ahead,
                           behind_attention=self.plan_behind_attention, next_bytes=(self.prefetch_next_kb or 0) * 1024,
                           behind_attention_bytes=None if self.prefetch_behind_attention_kb is None
                           else self.prefetch_behind_attention_kb * 1024)

    def _region_view(self, offset: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        """A typed view of bytes [offset, offset + nbytes) of this rank's symmetric region."""
        return self.region.local[offset:offset + nbytes].view(dtype)

    def counters(self) -> np.ndarray:
        """This rank's event counters (uint32 values as int64) after a launch."""
        E = self.cg.arrays["events"].shape[0]
        return self.events[:E].cpu().numpy().astype(np.uint32).astype(np.int64)

    def _on_stream(self):
        """Context that puts this session's host-issued device work on its stream."""
        if self.stream is None or self.device.type != "cuda":
            return contextlib.nullcontext()
        return torch.cuda.stream(self.stream)

    def _addr(self, t: torch.Tensor | None) -> int:
        if t is None:
            return 0
        return host_device_pointer(t.data_ptr()) if t.device.type == "cpu" else t.data_ptr()

    def buffer(self, name: str) -> torch.Tensor:
        """The tensor of a named ABI buffer (e.g. 'logits', 'L0.k_cache')."""
        for b, t in zip(self.cg.meta["buffers"], self.bufs):
            if b["name"] == name:
                return t
        raise KeyError(name)

    def reset(self) -> None:
        """New generation: counters, tallies, KV cache (state buffers) and flags back to zero.

        At tp > 1 no peer may signal these counters until every rank has reset: the group orders
        the device and (ipc) waits for every rank before any kernel starts.
        """
        with self._on_stream():
            for b, t in zip(self.cg.meta["buffers"], self.bufs):
                if b["kind"] == "state":
                    t.zero_()
            for t in (self.events, self.launched, self.done):
                t.zero_()

    # -- launch --------------------------------------------------------------------------------------
    def fill_forced(self, prompts: list[list[int]], force: list[int] | None, n_steps: int) -> None:
        """forced_tokens rows: the prompt (steps 0..T-1), then teacher-forced ids, else -1."""
        sp = self.cg.meta["special"]
        T = len(prompts[0])
        forced = np.full((self.max_steps, self.batch), -1, np.int32)
        forced[:T] = np.asarray(prompts, np.int32).T
        if force:
            k = min(len(force), max(0, n_steps - T))
            forced[T:T + k] = np.asarray(force[:k], np.int32)[:, None]
        with self._on_stream():
            self.bufs[sp["forced_tokens"]].copy_(torch.from_numpy(forced))
            self.bufs[sp["start_pos"]].zero_()

    def launch(self, s0: int, s1: int, prompt_len: int, max_new: int, stop_ids: tuple[int, ...], stop_on_done: bool,
               want_logits: bool, inject_hang_task: int = -1, trace_from: int | None = None) -> None:
        """Start steps [s0, s1) in one persistent kernel on the session's stream (returns at once)."""
        self.prepare(s0, s1, prompt_len, max_new, stop_ids, stop_on_done, want_logits, inject_hang_task, trace_from)
        self.start()

    def prepare(self, s0: int, s1: int, prompt_len: int, max_new: int, stop_ids: tuple[int, ...], stop_on_done: bool,
                want_logits: bool, inject_hang_task: int = -1, trace_from: int | None = None) -> None:
        """Everything of a launch but the launch: per-launch state zeroed and RuntimeParams filled (on
        the session's stream). ``trace_from``: first traced step (default s0)."""
        if s1 > self.max_steps:
            raise InputError(f"steps: expected <= {self.max_steps} (max_seq_len), got {s1}")
        for k in ("progress", "error", "step_end_ns"):
            self.pinned[k].zero_()
        if self.passes is not None:
            self.passes.reset()
        with self._on_stream():
            for t in (self.queues, self.queue_tail, self.sched_queues, self.sched_tail, self.halt, self.trace_len):
                t.zero_()
            for b, t in zip(self.cg.meta["buffers"], self.bufs):
                if b["kind"] == "ticket":  # a launch stopped mid-step (timeout, error) may have left counts
                    t.zero_()
            self.stop_ids = torch.tensor(list(stop_ids) or [-1], dtype=torch.int32, device=self.device)
            self._fill_params(s0, s1, prompt_len, max_new, stop_ids, stop_on_done, want_logits, inject_hang_task,
                              s0 if trace_from is None else trace_from)

    def _fill_params(self, s0, s1, prompt_len, max_new, stop_ids, stop_on_done, want_logits, inject_hang_task,
                     trace_from) -> None:
        sp, cg = self.cg.meta["special"], self.cg
        logits = self.bufs[sp["logits"]]
        if want_logits:
            n_gen = max(1, s1 - (prompt_len - 1))
            if self.logits_dump is None or self.logits_dump.shape[0] < n_gen:
                self.logits_dump = torch.empty((n_gen, *logits.shape), dtype=torch.float32, device=self.device)
        p = RuntimeParams()
        for name in ("tasks", "waits", "signals", "args", "params", "buffers", "worker_offsets", "worker_tasks"):
            setattr(p, name, self.tabs[name].data_ptr())
        p.event_tab = self.tabs["events"].data_ptr()
        p.buf_base, p.peer_base, p.peer_events = self.buf_base.data_ptr(), self.peer_base.data_ptr(), self.peer_events.data_ptr()
        p.peer_quota = self.peer_quota.data_ptr()
        p.events = self.events.data_ptr()
        p.dep_ptr, p.dep_task, p.dep_offset = (d.data_ptr() for d in self.deps)
        p.launched, p.queues, p.queue_tail = self.launched.data_ptr(), self.queues.data_ptr(), self.queue_tail.data_ptr()
        p.sched_queues, p.sched_tail = self.sched_queues.data_ptr(), self.sched_tail.data_ptr()
        p.next_token = self.bufs[sp["next_token"]].data_ptr()
        p.token_out = self._addr(self.pinned["token_out"])
        p.logits = logits.data_ptr()
        p.stop_ids, p.done = self.stop_ids.data_ptr(), self.done.data_ptr()
        p.logits_dump = self.logits_dump.data_ptr() if want_logits else 0
        p.step_end_ns = self._addr(self.pinned["step_end_ns"])
        p.progress, p.error = self._addr(self.pinned["progress"]), self._addr(self.pinned["error"])
        p.halt = self.halt.data_ptr()
        p.trace = self.trace.data_ptr() if self.trace_cap else 0
        p.trace_len = self.trace_len.data_ptr()
        p.records, p.task_rec = self.records.data_ptr(), self.task_rec.data_ptr()
        p.timeout_ns = int(self.timeout_s * 1e9)
        p.num_tasks, p.num_events = cg.arrays["tasks"].shape[0], cg.arrays["events"].shape[0]
        p.num_workers, p.num_buffers = self.workers, len(self.bufs)
        p.world, p.rank, p.final_task = self.world, self.rank, self.final
        p.batch, p.vocab = self.batch, int(logits.shape[-1])
        p.prompt_len, p.max_new_tokens = prompt_len, max_new
        p.num_stop, p.stop_on_done = len(stop_ids), int(stop_on_done)
        p.step_begin, p.step_end = s0, s1
        p.queue_cap, p.sched_cap, p.num_sched = self.queue_cap, self.sched_cap, self.num_sched
        p.trace_cap, p.inject_hang_task, p.abi_version = self.trace_cap, inject_hang_task, ABI_VERSION
        p.trace_from = trace_from
        if self.passes is not None:
            self.passes.fill(p)
        self.trace_from = trace_from
        self.params_dev.copy_(torch.frombuffer(bytearray(to_bytes(p)), dtype=torch.uint8))
        self._steps = (s0, s1)

    def start(self) -> None:
        """Launch the prepared kernel on the session's stream (returns at once)."""
        self._launched_at = time.perf_counter()
        self.kernel.launch(self.workers, self.params_dev.data_ptr(), self._stream().cuda_stream,
                           cooperative=self.cooperative)

    def _stream(self):
        return self.stream if self.stream is not None else torch.cuda.current_stream(self.device)

    def finished(self) -> bool:
        """True once the kernel of the last launch has ended (non-blocking)."""
        return self._stream().query()

    def deadline(self) -> float:
        """perf_counter time by which the last launch must have ended (the host-side bound)."""
        s0, s1 = self._steps
        return self._launched_at + self.timeout_s * 3 + 0.05 * (s1 - s0) + 10.0

    def restart_deadline(self) -> None:
        """Count the host-side bound of the running launch from now: a resident launch (persistent
        passes) that was just told to end may have run far longer than any one step."""
        self._launched_at = time.perf_counter()

    def progress(self) -> int:
        """Steps finished so far (read from mapped pinned memory while the kernel runs)."""
        return int(self.pinned["progress"][0])

    def wait(self, on_step=None) -> None:
        """Wait for the kernel (bounded), streaming progress to ``on_step(step)``; raise on a watchdog record."""
        stream = self._stream()
        s0, s1 = self._steps
        deadline = self.deadline()
        seen = s0
        while not stream.query():
            now = self.progress()
            while on_step is not None and seen < now:
                on_step(seen)
                seen += 1
            if time.perf_counter() > deadline:
                raise DeviceTimeout(f"mega-kernel: expected it to finish within {deadline - self._launched_at:.0f} s, "
                                    f"got no end (progress {now}/{s1} steps); the watchdog did not fire, the GPU may "
                                    "be stuck; restart the process")
            time.sleep(0.0002)
        stream.synchronize()
        while on_step is not None and seen < self.progress():
            on_step(seen)
            seen += 1
        self.raise_on_error()

    def error_record(self) -> ErrorRecord:
        """The watchdog record of the last launch (code 0: none)."""
        return ErrorRecord.from_buffer_copy(self.pinned["error"].numpy().tobytes())

    def raise_on_error(self) -> None:
        """Raise DeviceTimeout naming task, event, step, SM and rank when the last launch failed."""
        msg = self.error_message()
        if msg is not None:
            raise DeviceTimeout(msg)

    def error_message(self) -> str | None:
        """The watchdog record of the last launch as one message (None when there is none)."""
        from mpk_dist.runtime.diagnosis import error_message

        return error_message(self)

    def root_cause(self, step: int) -> str:
        """The first producer that had its inputs at ``step`` but left its event short (own counters)."""
        from mpk_dist.runtime.diagnosis import root_cause

        return root_cause(self.cg, self.counters(), step)

    def tallies_of(self, r: int) -> np.ndarray | None:
        """Rank r's tallies of SIG_ALL_RANKS signals per event (int64 [E]), read from its region:
        own memory, a region of this process (local transport), or through the IPC mapping (ipc);
        None when a peer's region cannot be read (the peer process is gone)."""
        E = self.cg.arrays["events"].shape[0]
        try:
            if r == self.rank:
                t = self.events[E:2 * E]
            elif self.peer_regions is not None:
                t = self.peer_regions[r].local[4 * E:8 * E].view(torch.int32)
            else:
                from mpk_dist.comm.symmetric import peer_view

                t = peer_view(self.region, r, torch.int32, 2 * E)[E:]
            return t.cpu().numpy().astype(np.uint32).astype(np.int64)
        except Exception:  # noqa: BLE001 - a dead peer's mapping: diagnosis only, never fatal
            return None

    def trace_records(self) -> list[np.ndarray]:
        """Per worker: the trace records of the last launch."""
        if not self.trace_cap:
            return []
        raw = self.trace.cpu().numpy().view(TRACE_DTYPE).reshape(self.workers, self.trace_cap)
        lens = np.minimum(self.trace_len.cpu().numpy(), self.trace_cap)
        return [raw[w, :lens[w]] for w in range(self.workers)]


def trace_window(sessions, steps: int) -> int:
    """First step to trace so that the LAST steps of a ``steps``-step launch fit every session's trace
    buffer: a long prompt's steps would otherwise fill it before the decode steps (each worker keeps its
    records in order and drops what does not fit)."""
    fit = min(s.trace_cap // max(1, tables.max_tasks_per_worker(s.cg)) for s in sessions)
    return max(0, steps - fit)


def resolve_args(args: np.ndarray, addrs: list[int], elem_bytes: list[int]) -> np.ndarray:
    """Device address of every argument row: buffer base + OFFSET * element size (0 for NULL_BUFFER),
    as int64 (the bit pattern of the uint64 address)."""
    from mpk_dist.taskgraph.abi import ARG_COLS, NULL_BUFFER

    buf, off = args[:, ARG_COLS["BUFFER"]].astype(np.int64), args[:, ARG_COLS["OFFSET"]].astype(np.int64)
    base = np.array(addrs + [0], dtype=np.uint64)[np.where(buf == NULL_BUFFER, len(addrs), buf)]
    size = np.array(elem_bytes + [0], dtype=np.uint64)[np.where(buf == NULL_BUFFER, len(addrs), buf)]
    out = np.where(buf == NULL_BUFFER, np.uint64(0), base + off.astype(np.uint64) * size)
    return out.astype(np.uint64).view(np.int64)


def _pinned(shape, dtype: torch.dtype) -> torch.Tensor:
    """Zeroed page-locked host memory (device-visible under UVA); plain memory without a GPU (tests)."""
    t = torch.zeros(shape, dtype=dtype)
    return t.pin_memory() if torch.cuda.is_available() else t


def ctypes_size(cls) -> int:
    """sizeof of a ctypes struct."""
    import ctypes

    return ctypes.sizeof(cls)

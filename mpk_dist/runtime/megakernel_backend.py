"""The mega-kernel backend: the whole generation (prefill as decode steps, greedy argmax or seeded
temperature sampling, stop on EOS / max tokens, teacher forcing, logits dump) runs in ONE persistent
kernel launch per rank. Sampling happens in the kernel (Gumbel-max in argmax_partial, top-p through
the nucleus stages, ``mpk_dist.taskgraph.sampling_rng``); the per-launch words reach it through the
``sampling`` buffer. top_p < 1 runs the programs compiled with those stages (``group(B, nucleus=True)``).

Tensor parallelism: one kernel per TP rank (mpk_dist.runtime.group). ``--transport local`` drives
every rank from this process on one GPU (own stream and SM share each); ``--transport ipc`` is one
rank per process under mpirun/srun. Tokens are read from the lowest driven rank (every rank selects
the same token); logits are merged from the ranks' vocabulary slices.

``generate`` streams tokens from mapped pinned memory while the kernel runs (``on_token``), and
reports per-token latencies from device timestamps (%globaltimer at the end of each step). At
tp > 1 it also reports the exposed communication of the decode steps (``extra['exposed_comm_share']``,
mpk_dist.runtime.comm_profile) from trace records of those steps. ``prefill`` / ``decode`` give the
one-step-per-launch mode (StepBackend API); KV cache and counters carry over between those launches.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import torch

from mpk_dist.backends.base import GenerateRequest, GenerateResult, StepBackend
from mpk_dist.errors import BackendUnavailable, InputError
from mpk_dist.models import build_graph
from mpk_dist.runtime.tables import WORKER_THREADS_WIDE, padded_batch
from mpk_dist.runtime.transport import IpcTransport, LocalTransport, check_options
from mpk_dist.taskgraph.sampling_rng import check_device_sampling, sampling_words

SCHEDULES = ("aot", "jit")
# Kernel knobs chosen by scripts/tune_sweep.py on an H200 (docs/PERF.md, 2026-11-29): 512 worker
# threads keep twice the weight bytes in flight per SM, and a 64 KB cap on the L2 prefetch of a
# linear tile stops 132 whole-tile prefetches (> the 60 MB L2) evicting each other (qwen3-8b b1:
# 8.36 -> 6.32 ms/token, same tokens). 1024 threads changed block-reduction order and tokens.
DEFAULT_WORKER_THREADS = WORKER_THREADS_WIDE  # the paged serving kernels' (decode programs: tables.default_worker_threads)
DEFAULT_PREFETCH_KB = 64

SWITCHES = (
    # linear tiles on tensor cores (csrc/tasks/linear_mma.cuh; another summation order); default (None): from
    # tables.MMA_MIN_BATCH rows on, set 0 or 1 to force
    ("linear_mma", "MPK_LINEAR_MMA", None),
    # weights through a shared-memory ring by bulk copies (csrc/tasks/weight_stream.cuh; same sums)
    ("linear_tma", "MPK_LINEAR_TMA", False),
    # software-pipelined linear tiles: the next chunk's loads in flight while one is summed (gemv_pipe.cuh; same bits)
    ("linear_pipe", "MPK_LINEAR_PIPE", False),
    # whole-tile L2 prefetch of linears that wait on a narrow op (mpk_dist/runtime/prefetch_plan.py)
    ("prefetch_plan", "MPK_PREFETCH_PLAN", True),
    # attention tiles pull their cache rows into L2 before their wait (csrc/tasks/attention.cuh; same bits)
    ("attn_prefetch", "MPK_ATTN_PREFETCH", True),
    # batch-1 GEMV tiles load a round's x vectors before any use, as the weights (linear.cuh load_x_round; same
    # bits). Loading the epilogue's residual at the row's start as well measured slower (docs/PERF.md v0.9)
    ("load_ahead", "MPK_LOAD_AHEAD", True),
    # linear tiles' weight loads marked first to leave L2, so the code, cache rows and activations stay there
    # (csrc/tasks/common.cuh ld_weight_v4; same bits)
    ("weight_evict_first", "MPK_WEIGHT_EVICT_FIRST", False),
    # L2 prefetches through the bulk-copy engine instead of one instruction per line (common.cuh; same bits)
    ("bulk_prefetch", "MPK_BULK_PREFETCH", False),
    # aot: a narrow-waiting linear tile's prefetch issued during its worker's previous (attention) task's
    # wait (prefetch_plan.hoist_ahead; same bits)
    ("prefetch_ahead", "MPK_PREFETCH_AHEAD", False),
    # the whole-tile plan behind a narrow attention op in batch-1 programs too (prefetch_plan.py
    # NO_PLAN_BEHIND_ATTENTION_MAX_BATCH: measured 0.5-0.6% slower on an H200, docs/PERF.md v0.30; same bits)
    ("plan_behind_attention", "MPK_PLAN_BEHIND_ATTENTION", False),
    # aot: every layer's ops on the same workers (the round-robin cursor back at worker 0 at each layer's first op,
    # serialize.layer_aligned_workers), so a narrow op's tiles run on the same SMs each layer; same binary and bits
    ("layer_aligned_workers", "MPK_LAYER_ALIGNED_WORKERS", False),
    # split-KV tiles copy their range's cache rows into shared memory at once, then walk them there
    # (csrc/tasks/attention_split.cuh KvStage; a record flag, same bits). Off: measured no faster at context
    # ~512 (docs/PERF.md v0.9: the walk's rows are in L2 already, the tile's time is elsewhere)
    ("attn_stage_kv", "MPK_ATTN_STAGE_KV", False),
    # the kernel's preferred shared-memory carveout as small as its blocks need, the rest L1 data cache
    # (mpk_dist/runtime/loader.py carveout_percent; launch setting, same binary and bits)
    ("min_carveout", "MPK_MIN_CARVEOUT", False),
    # the code-size variants (codegen.CODE_SIZE_DEFINES; same bits); default (None): batch-1 programs at unroll 4
    # (tables.default_compact_code), set 0 or 1 to force
    ("compact_code", "MPK_COMPACT_CODE", None),
    # the launch's room for the tensor-core tiles' split-K partials: the least that keeps every tile's slices
    # (mpk_dist/runtime/mma_room.py; launch setting, same binary and bits); 0: a fixed room of
    # tables.MMA_PARTIAL_PAIRS_PER_WARP partials a warp above the staged rows (up to v0.44)
    ("exact_partials", "MPK_MMA_PARTIAL_EXACT", True),
)
"""On/off kernel switches read from the environment: (Session keyword, variable, default)."""

PROFILE_STEPS = 128
"""Decode steps whose trace records are kept for the exposed-communication figure (tp > 1)."""
TRACE_STEPS = 32
"""--trace keeps the records of the last TRACE_STEPS steps of a launch: a whole 480-token prompt's steps
made a trace of ~8 M records on qwen3-8b that took minutes to write, and trace-summary needs a few steps."""


def _nucleus(sp) -> bool:
    """Whether a request needs the programs with the top-p stages."""
    return sp.temperature > 0 and sp.top_p < 1.0


class MegakernelBackend(StepBackend):
    """One persistent kernel per TP rank.

    Options beyond the StepBackend ones: ``schedule`` aot|jit (jit only at tp 1), ``transport``
    local|ipc, ``sms`` (SMs the group may use), ``trace`` (Chrome trace path), ``timeout_s``
    (watchdog), ``comm_profile`` (default on at tp > 1; MPK_COMM_PROFILE=0 turns it off), test hooks
    ``inject_hang_task`` / ``inject_hang_rank`` (that task never signals, on that rank or all),
    ``fuse`` (fused linears: True, False or names incl. the opt-in 'attn_prep'; MPK_FUSE_ATTN_PREP=1 adds
    'attn_prep'), ``attn_splits`` (split-KV attention: N or 'auto', the default: one sequence in ~132 SMs / kv heads
    ranges of >= 32 positions unless o_proj's weights outlast the walk, unsplit from 2 sequences
    (lowering_attention.resolve_splits); 1 = one attention tile per kv head),
    ``superopt`` (fused linears run superoptimizer-generated bodies; default on, --no-superopt or
    MPK_SUPEROPT=0 for off).
    """

    name = "megakernel"

    def __init__(self, cfg, source, tp: int = 1, device: str | torch.device = "cuda", max_seq_len: int = 512,
                 schedule: str = "aot", trace: str | None = None, timeout_s: float = 5.0,
                 worker_threads: int | None = None,
                 sms: int | None = None, transport: str | None = None, compiler: str | None = None,
                 inject_hang_task: int = -1, on_token=None, linear_rows: int | None = None,
                 inject_hang_rank: int | None = None, comm_profile: bool | None = None, fuse=True,
                 attn_splits="auto", superopt=None):
        from mpk_dist.taskgraph.lowering_attention import check_attn_splits

        self.fuse = fusions_from_env(fuse)
        # The switches that decide a batch's fusions are taken now, with the rest of the configuration: a
        # program compiled later (another batch) must not see an environment the caller has since restored.
        self.batch_switches = {v: os.environ[v] for v in BATCH_FUSION_SWITCHES if v in os.environ}
        self.superopt = superopt_from_env(superopt)
        self.attn_splits = check_attn_splits(attn_splits)  # split-KV attention (taskgraph.lowering_attention)
        if schedule not in SCHEDULES:
            raise InputError(f"--schedule: expected one of {SCHEDULES}, got {schedule!r}")
        self.transport_name = check_options(tp, transport, schedule)
        if timeout_s <= 0:
            raise InputError(f"--timeout: expected a positive number of seconds, got {timeout_s}")
        self.device = torch.device(device)
        self._check_device()
        self.cfg, self.tp, self.max_seq_len, self.schedule = cfg, tp, max_seq_len, schedule
        self.vocab_size = cfg.vocab_size
        self.trace_path, self.timeout_s, self.worker_threads = trace, timeout_s, worker_threads
        self.compiler, self.inject_hang_task, self.on_token = compiler, inject_hang_task, on_token
        self.inject_hang_rank = inject_hang_rank
        self.linear_rows = linear_rows_from_env(linear_rows)
        self.kernel_tuning = tuning_from_env(worker_threads)  # KernelShape knobs (MPK_* overrides)
        self.worker_threads = self.kernel_tuning.pop("worker_threads")
        self.transport = self._make_transport()
        from mpk_dist.runtime.partition import workers_per_rank

        # One worker per resident block: blocks_per_sm of them on every SM the rank may use. The two blocks of an
        # SM pair up by %smid (csrc/runtime/worker_index.cuh), which needs the whole GPU to themselves.
        blocks = self.kernel_tuning.get("blocks_per_sm", 1)
        if blocks > 1 and (self.transport.ranks_per_gpu > 1 or sms is not None):
            raise InputError(f"MPK_BLOCKS_PER_SM={blocks}: expected one rank per GPU and every SM (no --sms); got "
                             f"{self.transport.ranks_per_gpu} rank(s) per GPU and --sms {sms}; unset MPK_BLOCKS_PER_SM")
        self.workers = workers_per_rank(self._num_sms(), self.transport.ranks_per_gpu, sms) * blocks
        want = tp > 1 if comm_profile is None else comm_profile
        self.comm_profile = want and os.environ.get("MPK_COMM_PROFILE", "1") != "0"
        from mpk_dist.weights import load_rank_weights

        self.weights = [load_rank_weights(build_graph(cfg, tp=tp, rank=r, batch=1, max_seq_len=max_seq_len), source,
                                          self.device) for r in self.transport.ranks]
        self.groups: dict = {}
        self.last_session = None
        self.batch = 0
        self._step = 0

    def _check_device(self) -> None:
        if self.device.type != "cuda":
            raise BackendUnavailable(f"--backend megakernel: expected a CUDA device, got {self.device}")

    def _num_sms(self) -> int:
        return torch.cuda.get_device_properties(self.device).multi_processor_count

    def _make_transport(self):
        if self.transport_name == "local":
            return LocalTransport(self.tp, self.device)
        if self.device.index is not None:
            raise InputError(f"--device with --transport ipc: expected cuda (each rank picks its GPU by local rank), "
                             f"got {self.device}; use CUDA_VISIBLE_DEVICES to choose GPUs")
        t = IpcTransport(self.tp)
        self.device = t.device
        return t

    # -- groups and sessions ---------------------------------------------------------------------------
    def group(self, batch: int, nucleus: bool = False):
        """The compiled programs + buffers of every driven rank for ``batch`` sequences (built once).

        ``nucleus``: the programs with the top-p stages (``compile_rank_programs(nucleus=True)``): the
        same kernel binary, other task tables and buffers. A batch above 16 is compiled as the next
        multiple of 16 (``tables.padded_batch``; the callers pad their rows)."""
        batch = padded_batch(batch)
        if (batch, nucleus) not in self.groups:
            from mpk_dist.runtime.group import RankGroup
            from mpk_dist.taskgraph.program_cache import compile_rank_programs_cached

            t0 = time.perf_counter()
            cgs, cached = compile_rank_programs_cached(self.cfg, tp=self.tp, batch=batch, sms=self.workers,
                                                       max_seq_len=self.max_seq_len, ranks=self.transport.ranks,
                                                       fuse=fusions_for_batch(self.fuse, batch, self.batch_switches),
                                                       attn_splits=self.attn_splits, nucleus=nucleus)
            compile_s = time.perf_counter() - t0
            trace = TRACE_STEPS if self.trace_path else (PROFILE_STEPS if self.comm_profile else 0)
            kw = dict(schedule=self.schedule, worker_threads=self.worker_threads, timeout_s=self.timeout_s, trace=trace,
                      compiler=self.compiler, model=self.cfg.architecture or self.cfg.family,
                      linear_rows=self.linear_rows, superopt=self.superopt, **self.kernel_tuning)
            g = RankGroup(cgs, self.weights, self.transport, self.device, kw)
            for s in g.sessions:
                s.taskgraph_s, s.taskgraph_cached = compile_s, cached
            self.groups[(batch, nucleus)] = g
        return self.groups[(batch, nucleus)]

    def session(self, batch: int):
        """The lowest driven rank's session for ``batch`` (rank 0 under --transport local)."""
        return self.group(batch).lead

    def build_info(self, batch: int = 1, nucleus: bool = False) -> dict:
        """Compile/load timings of a session (cold compile vs cached cubin, load) and the TP layout."""
        s = self.group(batch, nucleus).lead
        return {"taskgraph_s": s.taskgraph_s, "taskgraph_cached": s.taskgraph_cached,
                "kernel_build_s": s.build_s, "kernel_cached": s.build.cached,
                "compiler": s.build.compiler, "load_s": s.load_s, "cubin": str(s.build.path), "workers": s.workers,
                "smem_bytes": s.smem, "block_threads": s.block_threads, "tp": self.tp,
                "transport": self.transport_name, "ranks_per_gpu": self.transport.ranks_per_gpu}

    def _inject(self) -> dict[int, int]:
        if self.inject_hang_task < 0:
            return {}
        return {r: self.inject_hang_task for r in self.transport.ranks
                if self.inject_hang_rank is None or r == self.inject_hang_rank}

    # -- whole generation in one launch ----------------------------------------------------------------
    def generate(self, req: GenerateRequest) -> GenerateResult:
        """Prefill (as decode steps) + decode up to ``max_new_tokens`` in ONE launch per rank."""
        B, T, steps = self._check_request(req)
        g = self.group(padded_batch(B), _nucleus(req.sampling))  # > 16 rows: a multiple of 16 (row blocks)
        self.last_session = g.lead
        g.reset()
        g.fill_forced(_pad_rows(req.prompts, g.lead.batch), req.force_tokens, steps)
        self._fill_sampling(g, req.sampling)
        # --trace: the last steps whose records fit (decode steps first); else the comm profile's decode steps
        from mpk_dist.runtime.session import trace_window

        trace_from = trace_window(g.sessions, steps) if self.trace_path else T
        g.launch(0, steps, T, req.max_new_tokens, tuple(req.stop_ids), req.force_tokens is None, req.want_logits,
                 self._inject(), trace_from)
        tok_rows = g.lead.pinned["token_out"]

        def on_step(step: int) -> None:
            if self.on_token is not None and step >= T - 1:
                self.on_token(step - (T - 1), tok_rows[step].tolist())

        g.wait(on_step)
        return self._result(g, req, B, T)

    @staticmethod
    def _fill_sampling(g, sp) -> None:
        """The launch's sampling words (temperature, top_p, seed) into every driven rank's buffer; the
        top-p histograms zeroed (the kernel leaves them zero after each step; this covers a launch
        that stopped mid-step)."""
        words = torch.from_numpy(sampling_words(sp.temperature, sp.top_p, sp.seed))
        for x in g.sessions:
            with x._on_stream():
                x.bufs[x.cg.meta["special"]["sampling"]].copy_(words)
                for b, t in zip(x.cg.meta["buffers"], x.bufs):
                    if b["name"].endswith(".hist"):
                        t.zero_()

    def _check_request(self, req: GenerateRequest) -> tuple[int, int, int]:
        lengths = {len(p) for p in req.prompts}
        if len(lengths) != 1 or 0 in lengths:
            raise InputError(f"prompts: expected non-empty prompts of equal length in one batch, got lengths {sorted(lengths)}")
        check_device_sampling(req.sampling)
        if req.max_new_tokens < 1:
            raise InputError(f"max_new_tokens: expected >= 1, got {req.max_new_tokens}")
        B, T = len(req.prompts), lengths.pop()
        steps = T + req.max_new_tokens - 1
        if steps > self.max_seq_len:
            raise InputError(f"sequence length: expected prompt + new tokens - 1 <= {self.max_seq_len} (--max-seq-len), "
                             f"got {steps}")
        for p in req.prompts:
            if min(p) < 0 or max(p) >= self.vocab_size:
                raise InputError(f"token id: expected 0 <= id < {self.vocab_size}, got {min(p)}..{max(p)}")
        return B, T, steps

    def _result(self, g, req: GenerateRequest, B: int, T: int) -> GenerateResult:
        s = g.lead
        done_steps = s.progress()
        n_gen = max(0, done_steps - (T - 1))
        rows = s.pinned["token_out"][T - 1:T - 1 + n_gen].tolist()
        out: list[list[int]] = [[] for _ in range(B)]
        finished = [False] * B
        for row in rows:  # the same bookkeeping as StepBackend.generate
            for b in range(B):
                if not finished[b]:
                    out[b].append(int(row[b]))
                    finished[b] = int(row[b]) in req.stop_ids
        ns = s.pinned["step_end_ns"][: done_steps + 1].tolist()
        prefill_ms = (ns[T] - ns[0]) / 1e6 if done_steps >= T else 0.0
        per_token = [(ns[i + 1] - ns[i]) / 1e6 for i in range(T, done_steps)]
        logits = g.logits(lambda x: x.logits_dump[:n_gen], self.vocab_size) if req.want_logits else None
        logits = logits[:, :B].cpu() if logits is not None else None  # the padding rows dropped
        extra = {"schedule": self.schedule, "launches": 1, "steps": done_steps,
                 **self.build_info(padded_batch(B), _nucleus(req.sampling))}
        if self.comm_profile:
            extra.update(self._exposure(g, T, done_steps))
        if self.trace_path:
            extra["trace"] = str(self._write_trace(g))
        return GenerateResult(out, prefill_ms, per_token, logits, extra)

    def _exposure(self, g, first_decode: int, done_steps: int) -> dict:
        """Exposed communication of the traced decode steps, worst rank (ipc: gathered on rank 0)."""
        from mpk_dist.runtime import comm_profile as cp
        from mpk_dist.runtime.tables import max_tasks_per_worker

        rows = []
        for s in g.sessions:
            rng = cp.profiled_steps(s.trace_from, done_steps, s.trace_cap, max_tasks_per_worker(s.cg))
            steps = range(max(rng.start, first_decode), rng.stop)
            if getattr(s, "comm_wait_mask", None) is None:
                s.comm_wait_mask = cp.comm_wait_tasks(s.cg)
            rows.append(cp.step_exposure(s.trace_records(), s.comm_wait_mask, s.pinned["step_end_ns"].numpy(), steps))
        if self.transport_name == "ipc":
            got = self.transport.gather([rows[0]], "exposed communication")
            rows = got if got is not None else rows
        return cp.summarize(rows)

    def _write_trace(self, g) -> Path:
        """One Chrome trace of every driven rank (pid = rank); under ipc, rank r > 0 writes <name>.rank<r>.json."""
        from mpk_dist.runtime.trace import chrome_trace, write_trace

        recs = [s.trace_records() for s in g.sessions]
        starts = [int(r["start_ns"].min()) for per in recs for r in per if len(r)]
        t0 = min(starts) if starts else 0
        events = []
        for s, per in zip(g.sessions, recs):
            events += chrome_trace(s.cg, per, s.rank, t0=t0)["traceEvents"]
        path = Path(self.trace_path)
        if self.transport_name == "ipc" and g.lead.rank > 0:
            path = path.with_name(f"{path.stem}.rank{g.lead.rank}{path.suffix or '.json'}")
        meta = {"generator": "mpk_dist.runtime.trace", "tp": self.tp, "transport": self.transport_name,
                "batch": self.batch}
        try:  # what each op must read, for `trace-summary --levels STEP --bandwidth GBS` (mpk_dist.bench.op_bytes)
            from mpk_dist.bench.op_bytes import kv_bytes_per_position, op_bytes

            meta.update(op_bytes=op_bytes(self.cfg, self.tp, max(self.batch, 1)),
                        kv_bytes_per_position=kv_bytes_per_position(self.cfg, self.tp, max(self.batch, 1)))
        except ValueError:
            pass  # a tensor no op is known to read: the trace without bytes (trace-summary says so if asked)
        return write_trace(path, {"traceEvents": events, "displayTimeUnit": "ns", "otherData": meta})

    # -- one step per launch (StepBackend API) --------------------------------------------------------
    def reset(self, batch: int) -> None:
        """Start a new sequence batch: KV cache and counters zeroed; next step is 0."""
        self.batch, self._step = batch, 0
        self.group(padded_batch(batch)).reset()

    def _run_steps(self, tokens_by_step: list[list[int]], first_pos: int) -> torch.Tensor:
        g = self.group(padded_batch(self.batch))
        s = g.lead
        n = len(tokens_by_step)
        if self._step != first_pos:
            raise InputError(f"position: expected {self._step} (the next step of this batch), got {first_pos}")
        if self._step + n > s.max_steps:
            raise InputError(f"sequence length: expected <= {s.max_steps} steps (--max-seq-len), got {self._step + n}")
        sp = s.cg.meta["special"]
        rows = torch.tensor([_pad_rows(r, s.batch) for r in tokens_by_step], dtype=torch.int32)  # [n, padded B]
        for x in g.sessions:
            with x._on_stream():
                x.bufs[sp["forced_tokens"]][self._step:self._step + n].copy_(rows)
        g.launch(self._step, self._step + n, 1 << 30, 1 << 30, (), False, False, self._inject())
        g.wait()
        self._step += n
        logits = g.logits(lambda x: x.bufs[sp["logits"]], self.vocab_size, everywhere=True)
        return None if logits is None else logits[:self.batch]

    def prefill(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Prompts [B, T] as T decode steps in one launch; logits of the last token [B, V]."""
        pos = positions.reshape(-1, positions.shape[-1])[0].tolist()
        return self._run_steps(tokens.T.tolist(), int(pos[0]))

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One decode step per launch: tokens [B] at positions [B] (all equal) -> logits [B, V]."""
        return self._run_steps([tokens.tolist()], int(positions.reshape(-1)[0]))


def _pad_rows(rows: list, n: int) -> list:
    """``rows`` (one per sequence) padded to ``n`` by repeating the last: a batch above 16 runs as a
    multiple of 16 rows (``tables.padded_batch``); the copies' results are dropped."""
    return list(rows) + [rows[-1]] * (n - len(rows))


DEFAULT_ATTN_FUSIONS = ("attn_prep", "attn_merge")
"""Attention fusions the megakernel backend adds to ``fuse=True``: GPU-checked bit-identical to the unfused
split program (qwen3-0.6b b1/b4, tp 1/2/4) and together 5.259 -> 5.129 ms on qwen3-8b, 1.430 -> 1.351 ms on
qwen3-0.6b at context ~512 (docs/PERF.md v0.8). Not in ``fusion.FUSIONS``: compile_rank_programs' and the
interpreter's ``fuse=True`` keep the unfused attention."""


DEFAULT_SILU_EPI = True
"""``fuse=True`` includes 'silu_epi' (silu_mul as the gate|up projection's epilogue, norm_linear_silu tiles); the
programs take it at batch 1 (``fusions_for_batch``, ``SILU_EPI_MAX_BATCH``). GPU-checked bit-identical to the 'silu' prologue program
(qwen3-0.6b b1 and b2) and faster on every batch-1 model at context ~512 (docs/PERF.md v0.20, ms, one process each):
qwen3-8b 4.837 / 4.834 vs 4.908 / 4.906, llama3-8b 4.626 / 4.630 vs 4.727 / 4.731, qwen3-1.7b 1.694 / 1.690 vs
1.725 / 1.725, qwen3-0.6b 1.143 / 1.141 vs 1.151 / 1.152. Not in ``fusion.FUSIONS`` (the interpreter's and
compile_rank_programs' ``fuse=True`` keep the silu prologue)."""


def _fusion_switch(var: str, environ=None, allowed=("0", "1")) -> str:
    """The value of a fusion switch: '' (unset) or one of ``allowed``; anything else is refused by name."""
    knob = (os.environ if environ is None else environ).get(var, "")
    if knob not in ("", *allowed):
        raise InputError(f"{var}: expected one of {', '.join(allowed)}, got {knob!r}")
    return knob


def fusions_from_env(fuse=True) -> frozenset[str]:
    """The fusion set of ``fuse`` (mpk_dist.taskgraph.fusion; fused linears default on since verified on an
    H200). ``fuse=True`` also gets ``DEFAULT_ATTN_FUSIONS`` unless MPK_FUSE_ATTN_PREP=0 / MPK_FUSE_ATTN_MERGE=0
    turn one off; an explicit fusion list gets them only when the variable is 1. MPK_FUSE_NORM=0,
    MPK_FUSE_SILU=0 and MPK_FUSE_RESIDUAL=0 drop one of the linears' fusions. ``fuse=True`` also gets 'silu_epi'
    (``DEFAULT_SILU_EPI``) unless MPK_FUSE_SILU_EPI=0; an explicit list gets it when the variable is 1.
    MPK_FLAG_WORDS=1 adds 'flags' (the residual stream handed over as flagged words; needs 'residual'; off), =2 also
    'flags16' (the bf16 vectors the down and o_proj projections read). MPK_FUSE_SILU_DOWN=1 adds 'silu_down' (the
    down projection folded into the gate|up tiles as atomic split-K partials; needs 'silu_epi' and 'residual', so
    batch-1 programs at tp 1 unless MPK_FUSE_SILU_EPI=1; not bit-reproducible; off: measured slower, PERF.md v0.35)."""
    from mpk_dist.taskgraph.fusion import fusion_set

    out = set(fusion_set(fuse))
    for var, name in (("MPK_FUSE_NORM", "norm"), ("MPK_FUSE_SILU", "silu"), ("MPK_FUSE_RESIDUAL", "residual")):
        if _fusion_switch(var) == "0":  # one default fusion off (an A/B of it on the GPU)
            out.discard(name)
    for var, name in (("MPK_FUSE_ATTN_PREP", "attn_prep"), ("MPK_FUSE_ATTN_MERGE", "attn_merge")):
        knob = _fusion_switch(var)
        if knob == "1" or (knob == "" and fuse is True):
            out.add(name)
    knob = _fusion_switch("MPK_FUSE_SILU_EPI")  # silu_mul as the gate|up projection's epilogue (DEFAULT_SILU_EPI)
    if knob == "1" or (knob == "" and fuse is True):
        out.add("silu_epi")
    if _fusion_switch("MPK_FUSE_SILU_DOWN") == "1" and {"silu_epi", "residual"} <= out:  # off: measured slower (v0.35)
        out.add("silu_down")
    flags = _fusion_switch("MPK_FLAG_WORDS", allowed=("0", "1", "2"))  # off by default: measured slower (PERF.md v0.34)
    if flags in ("1", "2") and "residual" in out:  # activations as flagged words (taskgraph.flag_words)
        out |= {"flags", "flags16"} if flags == "2" else {"flags"}
    return frozenset(out)


SILU_FUSE_MAX_BATCH = 2
"""Largest kernel batch whose programs fuse silu_mul into the down projection. A fused down tile computes
silu(gate) * up of every batch row over the whole intermediate size as its prologue, and each of the ~128
tiles repeats it; unfused, silu_mul is one more level that computes each element once. Measured (docs/PERF.md
v0.13, qwen3-8b unless named, ms): batch 8 (MMA) 7.22 fused vs 6.52 unfused, batch 4 (MMA) 7.66 vs 7.04,
batch 2 6.40 vs 6.49, batch 1 4.97 vs 4.91 (qwen3-0.6b 1.26 vs 1.31, qwen3-1.7b equal): the fusion pays up to
two rows; batch 3 is not measured."""


SILU_EPI_MAX_BATCH = 1
"""Largest kernel batch whose programs take silu_mul as the gate|up projection's epilogue (fusion 'silu_epi')
unless MPK_FUSE_SILU_EPI=1 asks for it. Measured on an H200 (docs/PERF.md v0.20, qwen3-8b, context ~512, ms, one
process each): batch 1 4.837 / 4.834 with it vs 4.908 / 4.906 (and every other batch-1 model faster), but batch 2
6.618 / 6.627 vs 6.384 / 6.365 (silu in the down tiles' prologue) and batch 3 7.688 / 7.671 vs 7.525 / 7.517 (silu
its own level); batch 8 with the pair tiles on tensor cores (v0.28, one process) 5.781 / 5.774 vs 5.735 / 5.738.
On an H100 at batch 8: +4.3% (v0.43) and +4.9% (v0.45) with its launch past the SM's 100 KB shared-memory step, still
+2.8% (v0.46: 6.922 / 6.935 vs 6.733 / 6.749) in the exact split-K room that keeps it under the step."""


BATCH_FUSION_SWITCHES = ("MPK_FUSE_SILU", "MPK_FUSE_SILU_EPI")  # the variables fusions_for_batch reads


def fusions_for_batch(fuse: frozenset, batch: int, environ=None) -> frozenset:
    """The fusions of a program of ``batch`` rows: ``fuse`` without 'silu' above SILU_FUSE_MAX_BATCH, unless
    MPK_FUSE_SILU=1 asks for it at every batch; without 'silu_epi' above SILU_EPI_MAX_BATCH unless
    MPK_FUSE_SILU_EPI=1 (its gate|up tiles run on tensor cores too where the program's linears do:
    csrc/tasks/fused_gemv.cuh gemv_fused). ``environ``: where to read those switches (default os.environ)."""
    out = set(fuse)
    if "silu" in out and batch > SILU_FUSE_MAX_BATCH and _fusion_switch("MPK_FUSE_SILU", environ) != "1":
        out.discard("silu")
    if "silu_epi" in out and batch > SILU_EPI_MAX_BATCH and _fusion_switch("MPK_FUSE_SILU_EPI", environ) != "1":
        out.discard("silu_epi")
    return frozenset(out)


def superopt_from_env(superopt=None) -> bool:
    """Generated bodies for the fused linears (runtime.superopt_tasks): ``superopt`` when given, else on
    unless MPK_SUPEROPT=0 (off for a whole job, e.g. every rank under mpirun, without a flag on each)."""
    return os.environ.get("MPK_SUPEROPT", "1") != "0" if superopt is None else bool(superopt)


def linear_rows_from_env(linear_rows: int | None = None) -> int:
    """Rows per warp in flight in linear tiles: 1 is the GPU-verified default; MPK_LINEAR_ROWS=2|4 tries
    the variant that keeps more loads in flight for short K (not yet measured)."""
    rows = int(linear_rows or os.environ.get("MPK_LINEAR_ROWS", "1"))
    if rows not in (1, 2, 4, 8):
        raise InputError(f"MPK_LINEAR_ROWS: expected 1, 2, 4 or 8, got {rows}")
    return rows


@contextlib.contextmanager
def scoped_env(env: dict[str, str], keys=()):
    """Set the variables ``env`` (e.g. MPK_* switches, read when a backend is made) for the ``with`` block,
    then restore every variable of ``env`` and of ``keys`` as it was (absent ones removed again)."""
    saved = {k: os.environ.get(k) for k in {*env, *keys}}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def tuning_from_env(worker_threads: int | None, environ=None) -> dict:
    """Kernel knobs {linear_unroll, worker_threads, prefetch_kb[, linear_mma, linear_tma, linear_pipe,
    prefetch_plan, attn_prefetch, blocks_per_sm]}: MPK_LINEAR_UNROLL, MPK_WORKER_THREADS, MPK_PREFETCH_KB,
    MPK_BLOCKS_PER_SM and the SWITCHES override the defaults (loads in flight per lane: None, the program's choice,
    tables.default_linear_unroll; ``worker_threads``, None: the program's choice, tables.default_worker_threads;
    DEFAULT_PREFETCH_KB of a
    linear tile's weights into L2; each switch's default) so a GPU session can sweep them
    (scripts/tune_sweep.py); a bad value is refused with the allowed ones."""
    from mpk_dist.runtime.codegen import LINEAR_UNROLLS, WORKER_THREADS

    env = os.environ if environ is None else environ
    out = {}
    for key, var, default, ok, allowed in (
            ("linear_unroll", "MPK_LINEAR_UNROLL", None, lambda v: v in LINEAR_UNROLLS,
             ", ".join(map(str, LINEAR_UNROLLS))),
            ("worker_threads", "MPK_WORKER_THREADS", worker_threads, lambda v: v in WORKER_THREADS,
             ", ".join(map(str, WORKER_THREADS))),
            ("prefetch_kb", "MPK_PREFETCH_KB", DEFAULT_PREFETCH_KB, lambda v: v >= -1,
             "-1 (whole tile) or a cap in KB >= 0")):
        raw = env.get(var, "")
        if not raw:
            out[key] = default
            continue
        try:
            val = int(raw)
        except ValueError:
            val = None
        if val is None or not ok(val):
            raise InputError(f"{var}: expected one of {allowed}, got {raw!r}")
        out[key] = val
    # Worker blocks per SM (codegen.BLOCKS_PER_SM): only when set away from 1, so the default dict is unchanged.
    raw = env.get("MPK_BLOCKS_PER_SM", "")
    if raw:
        from mpk_dist.runtime.codegen import BLOCKS_PER_SM

        if not raw.isdigit() or int(raw) not in BLOCKS_PER_SM:
            raise InputError(f"MPK_BLOCKS_PER_SM: expected one of {', '.join(map(str, BLOCKS_PER_SM))}, got {raw!r}")
        if int(raw) != 1:
            out["blocks_per_sm"] = int(raw)
    # The unsplit attention tiles' block merge in this many phases: above 1, a kernel with the phased merge
    # (KernelShape.attn_phased_merge) and the launch's shared memory for that many (lowering_attention.merge_smem_bytes;
    # the kernel takes the phases its launch holds). Only when set.
    raw = env.get("MPK_ATTN_MERGE_PHASES", "")
    if raw:
        from mpk_dist.taskgraph.lowering_attention import ATTN_MERGE_PHASES

        if not raw.isdigit() or int(raw) not in ATTN_MERGE_PHASES:
            raise InputError(f"MPK_ATTN_MERGE_PHASES: expected one of {', '.join(map(str, ATTN_MERGE_PHASES))} "
                             f"(phases of the attention tiles' block merge), got {raw!r}")
        out["attn_merge_phases"] = int(raw)
    # The full-width linear tiles' prefetch from the task records instead of the compiled MPK_PREFETCH_KB cap
    # (prefetch_plan level_bytes): one binary measured at several caps. Only when set (same binary).
    raw = env.get("MPK_PREFETCH_LEVEL_KB", "")
    if raw:
        if not raw.isdigit():
            raise InputError(f"MPK_PREFETCH_LEVEL_KB: expected a cap in KB >= 0 (unset: the kernel's MPK_PREFETCH_KB), "
                             f"got {raw!r}")
        out["prefetch_level_kb"] = int(raw)
    # aot: a linear tile waiting on a narrow op also prefetches up to this many KB of its worker's next linear task
    # (prefetch_plan.prefetch_next; REC_PREFETCH_NEXT, same binary and bits). Only when set.
    raw = env.get("MPK_PREFETCH_NEXT_KB", "")
    if raw:
        if not raw.isdigit():
            raise InputError(f"MPK_PREFETCH_NEXT_KB: expected a size in KB >= 0 (unset or 0: none), got {raw!r}")
        if int(raw) > 0:
            out["prefetch_next_kb"] = int(raw)
    # The batch-1 linear tiles behind attention prefetch this many KB into L2 instead of the kernel's cap
    # (prefetch_plan._behind_attention_bytes; the same binary and bits). Only when set.
    raw = env.get("MPK_PREFETCH_BEHIND_ATTENTION_KB", "")
    if raw:
        if not raw.isdigit():
            raise InputError(f"MPK_PREFETCH_BEHIND_ATTENTION_KB: expected a size in KB >= 0 (unset: the kernel's "
                             f"MPK_PREFETCH_KB cap), got {raw!r}")
        if env.get("MPK_PLAN_BEHIND_ATTENTION", "") == "1":
            raise InputError("MPK_PREFETCH_BEHIND_ATTENTION_KB: expected MPK_PLAN_BEHIND_ATTENTION unset or 0 (both "
                             "plan the tiles behind batch-1 attention), got MPK_PLAN_BEHIND_ATTENTION=1")
        out["prefetch_behind_attention_kb"] = int(raw)
    # Switches whose key appears only when set away from the default, so the default dict (and every
    # Session built from it) is what it was before the switch existed; a switch whose default depends on the
    # program (None) appears whenever it is set.
    for key, var, default in SWITCHES:
        raw = env.get(var, "")
        if raw not in ("", "0", "1"):
            raise InputError(f"{var}: expected one of 0, 1, got {raw!r}")
        if raw and (raw == "1") != default:
            out[key] = raw == "1"
    return out

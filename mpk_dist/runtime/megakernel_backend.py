"""The mega-kernel backend: the whole generation (prefill as decode steps, greedy argmax, stop on
EOS / max tokens, teacher forcing, logits dump) runs in ONE persistent kernel launch per request.

``generate`` streams tokens from mapped pinned memory while the kernel runs (``on_token``), and
reports per-token latencies from device timestamps (%globaltimer at the end of each step).
``prefill`` / ``decode`` give the one-step-per-launch mode (StepBackend API) for embedding into
other engines; KV cache and event counters carry over between those launches.
"""

from __future__ import annotations

import os
import time

import torch

from mpk_dist.backends.base import GenerateRequest, GenerateResult, StepBackend
from mpk_dist.errors import BackendUnavailable, InputError
from mpk_dist.models import build_graph
from mpk_dist.runtime.session import Session

SCHEDULES = ("aot", "jit")


class MegakernelBackend(StepBackend):
    """One persistent kernel per TP rank (tp 1 here; the comm hooks exist for tp > 1)."""

    name = "megakernel"

    def __init__(self, cfg, source, tp: int = 1, device: str | torch.device = "cuda", max_seq_len: int = 512,
                 schedule: str = "aot", trace: str | None = None, timeout_s: float = 5.0, worker_threads: int = 256,
                 sms: int | None = None, transport: str | None = None, compiler: str | None = None,
                 inject_hang_task: int = -1, on_token=None, linear_rows: int | None = None):
        if schedule not in SCHEDULES:
            raise InputError(f"--schedule: expected one of {SCHEDULES}, got {schedule!r}")
        if tp != 1:
            raise BackendUnavailable(f"--backend megakernel: expected --tp 1 (tensor parallelism in the mega-kernel "
                                     f"comes with the TP issue), got {tp}; use --backend torch for tp > 1")
        if transport not in (None, "local"):
            raise InputError(f"--transport: expected local (or none) at tp 1, got {transport!r}")
        if timeout_s <= 0:
            raise InputError(f"--timeout: expected a positive number of seconds, got {timeout_s}")
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise BackendUnavailable(f"--backend megakernel: expected a CUDA device, got {self.device}")
        from mpk_dist.weights import load_rank_weights

        self.cfg, self.tp, self.max_seq_len, self.schedule = cfg, tp, max_seq_len, schedule
        self.vocab_size = cfg.vocab_size
        self.trace_path, self.timeout_s, self.worker_threads = trace, timeout_s, worker_threads
        self.compiler, self.inject_hang_task, self.on_token = compiler, inject_hang_task, on_token
        # Rows per warp in flight in linear tiles: 1 is the GPU-verified default; MPK_LINEAR_ROWS=2|4
        # tries the variant that keeps more loads in flight for short K (not yet measured).
        self.linear_rows = int(linear_rows or os.environ.get("MPK_LINEAR_ROWS", "1"))
        if self.linear_rows not in (1, 2, 4, 8):
            raise InputError(f"MPK_LINEAR_ROWS: expected 1, 2, 4 or 8, got {self.linear_rows}")
        self.sms = sms or torch.cuda.get_device_properties(self.device).multi_processor_count
        graph = build_graph(cfg, tp=tp, rank=0, batch=1, max_seq_len=max_seq_len)
        self.weights = load_rank_weights(graph, source, self.device)
        self.sessions: dict[int, Session] = {}
        self.last_session: Session | None = None
        self.batch = 0
        self._step = 0

    # -- sessions ------------------------------------------------------------------------------------
    def session(self, batch: int) -> Session:
        """The compiled program + buffers for ``batch`` sequences (built once, then cached)."""
        if batch not in self.sessions:
            from mpk_dist.taskgraph.compiler import compile_rank_programs

            t0 = time.perf_counter()
            cg = compile_rank_programs(self.cfg, tp=1, batch=batch, sms=self.sms, max_seq_len=self.max_seq_len)[0]
            compile_s = time.perf_counter() - t0
            s = Session(cg, self.weights, self.device, self.schedule, self.worker_threads, self.timeout_s,
                        self.trace_path is not None, compiler=self.compiler,
                        model=self.cfg.architecture or self.cfg.family, linear_rows=self.linear_rows)
            s.taskgraph_s = compile_s
            self.sessions[batch] = s
        return self.sessions[batch]

    def build_info(self, batch: int = 1) -> dict:
        """Compile/load timings of a session (cold compile vs cached cubin, load)."""
        s = self.session(batch)
        return {"taskgraph_s": s.taskgraph_s, "kernel_build_s": s.build_s, "kernel_cached": s.build.cached,
                "compiler": s.build.compiler, "load_s": s.load_s, "cubin": str(s.build.path), "workers": s.workers,
                "smem_bytes": s.smem, "block_threads": s.block_threads}

    # -- whole generation in one launch ----------------------------------------------------------------
    def generate(self, req: GenerateRequest) -> GenerateResult:
        """Prefill (as decode steps) + decode up to ``max_new_tokens`` in ONE kernel launch."""
        lengths = {len(p) for p in req.prompts}
        if len(lengths) != 1 or 0 in lengths:
            raise InputError(f"prompts: expected non-empty prompts of equal length in one batch, got lengths {sorted(lengths)}")
        if req.sampling.temperature > 0:
            raise InputError(f"--temperature: expected 0 (greedy; on-device sampling is not implemented yet), "
                             f"got {req.sampling.temperature}")
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
        s = self.session(B)
        self.last_session = s
        s.reset()
        s.fill_forced(req.prompts, req.force_tokens, steps)
        stop = tuple(req.stop_ids)
        s.launch(0, steps, T, req.max_new_tokens, stop, req.force_tokens is None, req.want_logits,
                 self.inject_hang_task)
        tok_rows = s.pinned["token_out"]

        def on_step(step: int) -> None:
            if self.on_token is not None and step >= T - 1:
                self.on_token(step - (T - 1), tok_rows[step].tolist())

        s.wait(on_step)
        return self._result(s, req, B, T)

    def _result(self, s: Session, req: GenerateRequest, B: int, T: int) -> GenerateResult:
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
        logits = s.logits_dump[:n_gen].float().cpu() if req.want_logits else None
        extra = {"schedule": self.schedule, "launches": 1, "steps": done_steps, **self.build_info(B)}
        if self.trace_path:
            from mpk_dist.runtime.trace import chrome_trace, write_trace

            extra["trace"] = str(write_trace(self.trace_path, chrome_trace(s.cg, s.trace_records(), s.rank)))
        return GenerateResult(out, prefill_ms, per_token, logits, extra)

    # -- one step per launch (StepBackend API) --------------------------------------------------------
    def reset(self, batch: int) -> None:
        """Start a new sequence batch: KV cache and counters zeroed; next step is 0."""
        self.batch, self._step = batch, 0
        self.session(batch).reset()

    def _run_steps(self, tokens_by_step: list[list[int]], first_pos: int) -> torch.Tensor:
        s = self.session(self.batch)
        n = len(tokens_by_step)
        if self._step != first_pos:
            raise InputError(f"position: expected {self._step} (the next step of this batch), got {first_pos}")
        if self._step + n > s.max_steps:
            raise InputError(f"sequence length: expected <= {s.max_steps} steps (--max-seq-len), got {self._step + n}")
        sp = s.cg.meta["special"]
        forced = s.bufs[sp["forced_tokens"]]
        forced[self._step:self._step + n].copy_(torch.tensor(tokens_by_step, dtype=torch.int32))  # [n, B]
        s.launch(self._step, self._step + n, 1 << 30, 1 << 30, (), False, False, self.inject_hang_task)
        s.wait()
        self._step += n
        return s.bufs[sp["logits"]].float().clone()

    def prefill(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Prompts [B, T] as T decode steps in one launch; logits of the last token [B, V]."""
        pos = positions.reshape(-1, positions.shape[-1])[0].tolist()
        return self._run_steps(tokens.T.tolist(), int(pos[0]))

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One decode step per launch: tokens [B] at positions [B] (all equal) -> logits [B, V]."""
        return self._run_steps([tokens.tolist()], int(positions.reshape(-1)[0]))

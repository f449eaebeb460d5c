"""``--backend interpreter``: the compiled task graph run on the CPU by the interpreter.

The CPU path of ``mpk-dist run`` (backend ``auto`` on a machine without a GPU). Every rank's program
is compiled for the batch, weights are loaded per rank, and each ``prefill``/``decode`` call is one
launch of the interpreter (prefill runs the prompt as forced decode steps). Races raise.

``generate`` with temperature > 0 samples IN the task graph, as the mega-kernel does: the whole
generation is one launch (prompt rows forced, later rows take the token argmax_select chose), the
sampling words go into the ``sampling`` buffer, and argmax_partial draws the same Gumbel noise
(``mpk_dist.taskgraph.sampling_rng``) as the kernel; top_p < 1 runs the program with the nucleus
stages. Greedy requests keep the step-wise loop.
"""

from __future__ import annotations

import time

import torch

from mpk_dist.backends.base import GenerateRequest, GenerateResult, StepBackend
from mpk_dist.config import ModelConfig
from mpk_dist.errors import BackendUnavailable, InputError
from mpk_dist.models import build_graph
from mpk_dist.taskgraph.compiler import compile_rank_programs
from mpk_dist.taskgraph.interpreter import Interpreter
from mpk_dist.taskgraph.sampling_rng import check_device_sampling, sampling_words

DEFAULT_SMS = 16
"""Tiles are sized for this many workers on the CPU (fewer, larger tiles run faster in Python)."""


class InterpreterBackend(StepBackend):
    """Step backend over ``mpk_dist.taskgraph.interpreter.Interpreter``.

    Options: ``sms`` (tile sizing), ``seed`` (schedule), ``schedule`` 'jit' (any ready task) or
    'aot' (per-worker lists), ``check_races`` (default True), ``weights`` (per-rank dicts, instead
    of loading from ``source``), ``fuse`` (fused linears, ``mpk_dist.taskgraph.fusion``; default on, as the mega-kernel),
    ``attn_splits`` (split-KV attention, N or 'auto'; default 1).
    """

    name = "interpreter"

    def __init__(self, cfg: ModelConfig, source, tp: int = 1, device: str | torch.device = "cpu",
                 max_seq_len: int = 512, sms: int = DEFAULT_SMS, seed: int = 0, schedule: str = "jit",
                 check_races: bool = True, weights: list[dict[str, torch.Tensor]] | None = None, fuse=True,
                 attn_splits=1, **_opts):
        self.device = torch.device(device)
        if self.device.type != "cpu":
            raise BackendUnavailable(f"--backend interpreter: expected device cpu, got {self.device}; "
                                     "the interpreter runs on the CPU (use --backend megakernel on a GPU)")
        if schedule not in ("jit", "aot"):
            raise InputError(f"--schedule: expected jit or aot, got {schedule!r}")
        self.cfg, self.tp, self.max_seq_len = cfg, tp, max_seq_len
        self.sms, self.seed, self.schedule, self.check_races = sms, seed, schedule, check_races
        from mpk_dist.taskgraph.fusion import fusion_set

        self.fuse = fusion_set(fuse)
        from mpk_dist.taskgraph.lowering_attention import check_attn_splits

        self.attn_splits = check_attn_splits(attn_splits)
        self.vocab_size = cfg.vocab_size
        if weights is None:
            from mpk_dist.weights import load_rank_weights

            weights = [load_rank_weights(build_graph(cfg, tp=tp, rank=r, batch=1, max_seq_len=max_seq_len), source)
                       for r in range(tp)]
        self.weights = weights
        self.batch, self.nucleus = 0, False
        self.interp: Interpreter | None = None
        self._launches = 0

    def reset(self, batch: int, nucleus: bool = False) -> None:
        """Compile for ``batch`` sequences (cached) and clear the KV caches. ``nucleus``: the program
        with the top-p stages (``compile_rank_programs(nucleus=True)``)."""
        if (batch, nucleus) != (self.batch, self.nucleus) or self.interp is None:
            programs = compile_rank_programs(self.cfg, self.tp, batch=batch, sms=self.sms, max_seq_len=self.max_seq_len,
                                             fuse=self.fuse, attn_splits=self.attn_splits, nucleus=nucleus)
            self.interp = Interpreter(programs, self.weights, seed=self.seed, mode=self.schedule,
                                      check_races=self.check_races)
            self.batch, self.nucleus = batch, nucleus
        self.interp.reset_state()

    def _launch(self, forced: torch.Tensor, start: torch.Tensor, full: bool = False):
        if self.interp is None:
            raise InputError("interpreter backend: call reset(batch) before prefill/decode")
        if int(start.max()) + forced.shape[0] > self.max_seq_len:
            raise InputError(f"sequence length: expected at most {self.max_seq_len} tokens (--max-seq-len), "
                             f"got {int(start.max()) + forced.shape[0]}")
        if int(forced.max()) >= self.vocab_size or int(forced[0].min()) < 0 or (not full and int(forced.min()) < 0):
            raise InputError(f"token id: expected 0 <= id < {self.vocab_size}, got {forced.tolist()}")
        self.interp.rng.seed(self.seed + self._launches)  # a different valid order every launch
        self._launches += 1
        res = self.interp.run(forced.shape[0], forced, start)
        return res if full else res.captured["logits"][-1].float()

    def prefill(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Prompts [B, T] as T forced decode steps in one launch; logits [B, V] of the last token."""
        tokens = tokens.to(torch.int32).cpu()
        positions = positions.to(torch.int32).cpu()
        T = tokens.shape[1]
        if not torch.equal(positions, positions[:, :1] + torch.arange(T, dtype=torch.int32)):
            raise InputError("positions: expected consecutive positions per sequence, got " + str(positions.tolist()))
        return self._launch(tokens.t().contiguous(), positions[:, 0])

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One decode step for tokens [B] at positions [B]; logits [B, V]."""
        return self._launch(tokens.to(torch.int32).cpu().reshape(1, -1), positions.to(torch.int32).cpu())

    def generate(self, req: GenerateRequest) -> GenerateResult:
        """Greedy: the step-wise loop; temperature > 0: one launch that samples in the task graph."""
        if req.sampling.temperature <= 0:
            return super().generate(req)
        check_device_sampling(req.sampling)
        lengths = {len(p) for p in req.prompts}
        if len(lengths) != 1 or 0 in lengths:
            raise InputError(f"prompts: expected non-empty prompts of equal length in one batch, got lengths "
                             f"{sorted(lengths)}")
        if req.max_new_tokens < 1:
            raise InputError(f"max_new_tokens: expected >= 1, got {req.max_new_tokens}")
        B, T = len(req.prompts), lengths.pop()
        steps = T + req.max_new_tokens - 1
        forced = torch.full((steps, B), -1, dtype=torch.int32)
        forced[:T] = torch.tensor(req.prompts, dtype=torch.int32).T
        if req.force_tokens:  # teacher forcing: generated step i feeds force_tokens[i]
            k = min(len(req.force_tokens), steps - T)
            forced[T:T + k] = torch.tensor(req.force_tokens[:k], dtype=torch.int32)[:, None]
        self.reset(B, nucleus=req.sampling.top_p < 1.0)
        words = torch.from_numpy(sampling_words(req.sampling.temperature, req.sampling.top_p, req.sampling.seed))
        for r in range(self.tp):
            self.interp.buffer(r, "sampling").copy_(words)
        t0 = time.perf_counter()
        res = self._launch(forced, torch.zeros(B, dtype=torch.int32), full=True)
        ms = (time.perf_counter() - t0) * 1e3
        out: list[list[int]] = [[] for _ in range(B)]
        for row in res.tokens[T - 1:].tolist():  # the same stop bookkeeping as StepBackend.generate
            for b in range(B):
                if not out[b] or out[b][-1] not in req.stop_ids:
                    out[b].append(int(row[b]))
        logits = res.captured["logits"][T - 1:].float() if req.want_logits else None
        per_step = ms / steps  # one launch: its time spread evenly over the steps (extra['timing'] says so)
        return GenerateResult(out, per_step * T, [per_step] * (req.max_new_tokens - 1), logits,
                              {"launches": 1, "sampling": "in-graph", "timing": "launch time / steps"})

"""The interface every decode backend implements, and the shared step-wise generation loop.

A backend owns the weights and KV cache of all the TP ranks it drives (one process may drive all
ranks: the torch reference, the interpreter, the mega-kernel's ``local`` transport). The engine
talks to it through ``generate``; step-wise backends implement ``prefill`` and ``decode`` and
inherit ``generate`` from ``StepBackend``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    """Greedy when temperature == 0; otherwise temperature + top-p sampling from a seeded generator."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0


@dataclass
class GenerateRequest:
    """One batch of prompts to continue. ``force_tokens`` (teacher forcing) replaces sampled ids as
    the next inputs: row b of step i feeds force_tokens[i] (same id for every sequence)."""

    prompts: list[list[int]]
    max_new_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop_ids: tuple[int, ...] = ()
    force_tokens: list[int] | None = None
    want_logits: bool = False


@dataclass
class GenerateResult:
    """Generated ids per sequence, timings, and (if asked) the logits of every step [steps, B, V]."""

    tokens: list[list[int]]
    prefill_ms: float
    per_token_ms: list[float]
    logits: torch.Tensor | None = None
    extra: dict = field(default_factory=dict)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """Next ids [B] from logits [B, V] (float32): argmax, or temperature + nucleus sampling."""
    if params.temperature <= 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < params.top_p  # always keeps the top token
        sorted_p = sorted_p * keep
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(logits.device)


class StepBackend:
    """Base class of backends that run one forward step per call.

    Subclasses set ``name``, ``tp``, ``vocab_size`` and implement ``reset(batch)``,
    ``prefill(tokens [B, T], positions [B, T]) -> logits [B, V]`` (logits of the last token) and
    ``decode(tokens [B], positions [B]) -> logits [B, V]``; all logits are float32 over the FULL
    vocabulary (gathered from the ranks' slices).
    """

    name = "abstract"
    tp = 1
    vocab_size = 0
    device = torch.device("cpu")

    def reset(self, batch: int) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def prefill(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError

    def synchronize(self) -> None:
        """Wait for queued device work (so host timers measure it)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def generate(self, req: GenerateRequest) -> GenerateResult:
        """Prefill the prompts (equal lengths), then decode up to ``max_new_tokens`` steps."""
        lengths = {len(p) for p in req.prompts}
        if len(lengths) != 1:
            raise ValueError("step-wise backends need prompts of equal length in one batch")
        B, T = len(req.prompts), lengths.pop()
        self.reset(B)
        gen = torch.Generator().manual_seed(req.sampling.seed)
        prompt = torch.tensor(req.prompts, dtype=torch.int32, device=self.device)
        pos = torch.arange(T, dtype=torch.int32, device=self.device).expand(B, T).contiguous()
        self.synchronize()
        t0 = time.perf_counter()
        logits = self.prefill(prompt, pos)
        self.synchronize()
        prefill_ms = (time.perf_counter() - t0) * 1e3
        out: list[list[int]] = [[] for _ in range(B)]
        all_logits, per_token = [], []
        done = torch.zeros(B, dtype=torch.bool)
        for step in range(req.max_new_tokens):
            if req.want_logits:
                all_logits.append(logits.float().cpu())
            nxt = sample(logits, req.sampling, gen).to(torch.int32)
            feed = nxt.clone()
            if req.force_tokens is not None and step < len(req.force_tokens):
                feed.fill_(req.force_tokens[step])
            for b in range(B):
                if not done[b]:
                    out[b].append(int(nxt[b]))
                    done[b] = bool(int(nxt[b]) in req.stop_ids)
            if step == req.max_new_tokens - 1 or (bool(done.all()) and req.force_tokens is None):
                break
            t1 = time.perf_counter()
            logits = self.decode(feed.to(self.device), torch.full((B,), T + step, dtype=torch.int32, device=self.device))
            self.synchronize()
            per_token.append((time.perf_counter() - t1) * 1e3)
        logits_t = torch.stack(all_logits) if all_logits else None
        return GenerateResult(out, prefill_ms, per_token, logits_t)

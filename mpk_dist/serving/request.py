"""A serving request, its per-request state while it runs, and its result with latency figures.

Times are seconds on the server's clock, whose 0 is the start of ``Server.run`` (arrival times in a
workload file are on the same scale). A token's time is the end of the step that produced it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Request:
    """What a client submits. ``force_tokens`` (teacher forcing): after the prompt, feed these ids
    instead of the generated ones (output j is still the greedy choice after input j)."""

    id: int
    prompt: tuple[int, ...]
    max_new_tokens: int
    arrival_time: float = 0.0
    stop_ids: tuple[int, ...] = ()
    force_tokens: tuple[int, ...] | None = None
    want_logits: bool = False

    @property
    def max_positions(self) -> int:
        """KV positions the request may ever occupy: the prompt and every output fed back."""
        return len(self.prompt) + self.max_new_tokens - 1


@dataclass
class RequestState:
    """A request being served: its slot, progress through the prompt, outputs so far."""

    req: Request
    slot: int
    reserved_pages: int
    admit_time: float
    computed: int = 0  # positions already written to the KV cache
    tokens: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def prefilling(self) -> bool:
        """True while prompt tokens remain to be processed."""
        return self.computed < len(self.req.prompt)

    def next_input(self) -> int:
        """The id fed at position ``computed`` once the prompt is done (teacher-forced or generated)."""
        j = self.computed - len(self.req.prompt)  # outputs fed so far
        if self.req.force_tokens is not None and j < len(self.req.force_tokens):
            return int(self.req.force_tokens[j])
        return self.tokens[j]

    def emit(self, token: int, t: float, logits: torch.Tensor | None) -> None:
        """Record output token ``token`` produced at time ``t``; sets ``finish_reason`` when done."""
        self.tokens.append(int(token))
        self.token_times.append(t)
        if logits is not None:
            self.logits.append(logits)
        if int(token) in self.req.stop_ids:
            self.finish_reason = "stop"
        elif len(self.tokens) >= self.req.max_new_tokens:
            self.finish_reason = "length"


@dataclass
class RequestOutput:
    """A finished request: tokens, timestamps (s, server clock) and derived latencies."""

    id: int
    prompt_len: int
    tokens: list[int]
    arrival_time: float
    admit_time: float
    token_times: list[float]
    finish_reason: str
    logits: torch.Tensor | None = None  # [outputs, V] float32 when the request asked for them

    @property
    def ttft(self) -> float:
        """Time to first token (s): first output's time minus arrival."""
        return self.token_times[0] - self.arrival_time

    @property
    def e2e_latency(self) -> float:
        """End-to-end latency (s): last output's time minus arrival."""
        return self.token_times[-1] - self.arrival_time

    @property
    def itls(self) -> list[float]:
        """Inter-token latencies (s): gaps between consecutive outputs."""
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first (s); None for a single output."""
        n = len(self.tokens)
        return (self.e2e_latency - self.ttft) / (n - 1) if n > 1 else None

    @classmethod
    def from_state(cls, st: RequestState) -> "RequestOutput":
        """Freeze a finished ``RequestState``."""
        lg = torch.stack(st.logits) if st.logits else None
        return cls(st.req.id, len(st.req.prompt), list(st.tokens), st.req.arrival_time, st.admit_time,
                   list(st.token_times), st.finish_reason or "unfinished", lg)

"""Search configuration and the per-process search context (target facts, oracle, counters)."""

from __future__ import annotations

import multiprocessing
import time
from dataclasses import dataclass, field, replace

from mpk_dist.errors import MpkError
from mpk_dist.superopt.prune import SubexprOracle
from mpk_dist.superopt.target import Target


@dataclass(frozen=True)
class SearchConfig:
    """Bounds of the search; every field is part of the disk-cache key."""

    max_kernel_ops: int = 2
    max_block_ops: int = 6
    max_custom_inputs: int = 0   # 0: as many as the target has inputs
    max_block_outputs: int = 2
    max_grid_dims: int = 1
    grid_counts: tuple = (2, 4, 8, 16, 32, 64, 128, 256)
    loop_counts: tuple = (2, 4, 8, 16, 32, 64)
    prune: bool = True
    keep: int = 6           # verified candidates to return
    trials: int = 3         # finite-field trials per candidate
    dedup: bool = True      # last custom ops: one state per distinct future (blockmemo)


POOL_GRACE_S = 120.0
"""How long after the search's deadline a worker process's result may still arrive: a worker checks the deadline
between enumeration steps (one layout's step took up to ~20 s); past this the worker is taken as lost."""


@dataclass
class Context:
    """What one process needs while searching: target, config, oracle, deadline, counters."""

    target: Target
    config: SearchConfig
    deadline: float
    oracle: SubexprOracle = None
    counts: dict = field(default_factory=lambda: {"explored": 0, "pruned": 0})
    remote: dict = field(default_factory=dict)   # counters reported by worker processes
    progress: object = None                       # callable(stats) or None
    _last_tick: float = 0.0

    def __post_init__(self) -> None:
        if self.config.max_custom_inputs == 0:
            n = len(self.target.graph.input_names())
            self.config = replace(self.config, max_custom_inputs=n)
        if self.oracle is None:
            self.oracle = SubexprOracle(self.target.out_expr, self.target.closure)

    def keep(self, e) -> bool:
        """Pruning decision for a new tensor's abstract expression (always True unpruned).

        ``e``: the expression, or a callable returning it (built only when pruning needs it)."""
        self.counts["explored"] += 1
        if self.progress is not None and not self.counts["explored"] & 1023:
            self.tick()
        if not self.config.prune:
            return True
        if callable(e):
            e = e()
        if self.oracle.is_sub(e):
            return True
        self.counts["pruned"] += 1
        return False

    def timed_out(self) -> bool:
        return time.monotonic() > self.deadline

    def pool_result(self, task, what: str):
        """``task.get()`` of a worker-process task, bounded by the deadline plus ``POOL_GRACE_S``: a worker that
        died (a lost task never completes) raises a clear error instead of hanging the search."""
        wait = max(0.0, self.deadline - time.monotonic()) + POOL_GRACE_S
        try:
            return task.get(timeout=wait)
        except multiprocessing.TimeoutError:
            raise MpkError(f"superopt: {what}: expected the worker process's result within {POOL_GRACE_S:.0f} s of "
                           f"the search deadline, got none after {wait:.0f} s (the worker died or hung)") from None

    def tick(self, force: bool = False) -> None:
        """Report progress at most every 0.2 s."""
        now = time.monotonic()
        if self.progress is not None and (force or now - self._last_tick > 0.2):
            self._last_tick = now
            self.progress(self.stats())

    def add_remote(self, delta: dict) -> None:
        """Add counters a worker process reported."""
        for k, v in delta.items():
            self.remote[k] = self.remote.get(k, 0) + v
        self.tick()

    def stats(self) -> dict:
        """Counters of this process, its oracle, and what workers reported."""
        out = dict(self.counts)
        out.update(self.oracle.stats)
        for k, v in self.remote.items():
            out[k] = out.get(k, 0) + v
        return out

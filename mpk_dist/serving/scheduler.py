"""Continuous batching: between two passes, retire finished requests and admit queued ones.

Each pass is one RAGGED batch (``StepBatch``): one token per running request past its prompt
(decode) plus prompt chunks of requests still in prefill, at most ``max_tokens`` tokens. Order in
the pass: decode tokens first, then prompt chunks in admission order (FCFS; a long prompt is split
over several passes, chunked prefill). A request emits a token in a pass when that pass holds its
last prompt token or its decode token; ``logit_rows`` lists those rows so only they reach the head.

Admission is FCFS and never over-commits: a request is admitted only if a slot is free and the
pages it can ever need (prompt + max_new_tokens - 1 positions) fit in the free pages minus what
already-running requests have reserved but not yet taken. So nothing is preempted and ``grow``
never runs out. Pages are taken lazily, as positions reach them, and all return at retirement.

Page order: a pass's releases, then its allocations, each in slot order, as the device allocator
(task kind page_alloc) applies them; so a host ``PagePool`` holds the ids the device computes, and a
``PageCounts`` pool (the device backends: ids on the GPU) the same counts. ``release_slots`` of a
pass flags the slots released since the previous pass.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np
import torch

from mpk_dist.errors import InputError
from mpk_dist.serving.pages import PageCounts
from mpk_dist.serving.request import Request, RequestOutput, RequestState


@dataclass
class StepBatch:
    """One pass: per-token inputs [N], page table [MB, MP], rows that get logits [R], release flags [MB].

    ``emitters[r]`` is the request state whose next token comes from logits row r. ``page_table`` is
    None when the pool holds no page ids (``PageCounts``: the device allocates). ``release`` [MB]:
    nonzero for the slots released since the previous pass (the device frees their pages first).
    """

    tokens: np.ndarray
    positions: np.ndarray
    slots: np.ndarray
    page_table: np.ndarray | None
    logit_rows: np.ndarray
    emitters: list[RequestState] = field(default_factory=list)
    scheduled: list[tuple[RequestState, int]] = field(default_factory=list)  # (state, tokens this pass)
    num_prefill_tokens: int = 0  # prompt tokens in the pass
    release: np.ndarray | None = None  # i32 [MB] release flags (None: no slot released)

    @property
    def num_tokens(self) -> int:
        """N, tokens in the pass."""
        return len(self.tokens)

    def tensors(self, device: torch.device | str = "cpu", pad_tokens: int = 0, pad_rows: int = 0) -> dict:
        """The graph inputs as int32 tensors; padding tokens get slot -1, padding rows -1.

        ``pad_rows``: rows of ``logit_rows``, ``release_slots`` (0) and of ``page_table`` (a program
        compiled for more sequence rows than the pool has slots: the extra rows hold no page, -1).
        ``page_table`` only when the pool has page ids."""
        def pad(a: np.ndarray, n: int, fill: int) -> torch.Tensor:
            out = np.full((max(n, len(a)), *a.shape[1:]), fill, dtype=np.int32)
            out[: len(a)] = a
            return torch.from_numpy(out).to(device)
        release = self.release if self.release is not None else np.zeros(0, np.int32)
        out = {"tokens": pad(self.tokens, pad_tokens, 0), "positions": pad(self.positions, pad_tokens, 0),
               "seq_slots": pad(self.slots, pad_tokens, -1), "logit_rows": pad(self.logit_rows, pad_rows, -1),
               "release_slots": pad(release, max(pad_rows, len(release)), 0)}
        if self.page_table is not None:
            out["page_table"] = pad(self.page_table, pad_rows, -1)
        return out


class Scheduler:
    """Request queue, running set and page pool; ``plan`` builds a pass, ``commit`` applies its tokens."""

    def __init__(self, pool: PageCounts, max_tokens: int):
        if max_tokens < pool.max_seqs:
            raise InputError(f"max_tokens_per_step: expected >= max_batch ({pool.max_seqs}) so every running "
                             f"request gets its decode token, got {max_tokens}")
        self.pool, self.max_tokens = pool, int(max_tokens)
        self.queue: list[tuple[float, int, Request]] = []
        self.running: list[RequestState] = []
        self.finished: list[RequestOutput] = []

    def submit(self, req: Request) -> None:
        """Queue a request (it becomes eligible at its arrival time)."""
        if len(req.prompt) < 1 or req.max_new_tokens < 1:
            raise InputError(f"request {req.id}: expected a non-empty prompt and max_new_tokens >= 1, "
                             f"got {len(req.prompt)} prompt tokens, max_new_tokens={req.max_new_tokens}")
        if req.max_positions > self.pool.max_len:
            raise InputError(f"request {req.id}: expected prompt + output <= {self.pool.max_len + 1} tokens "
                             f"(max_seq_len), got {len(req.prompt)} + {req.max_new_tokens}; raise max_seq_len")
        if self.pool.pages_for(req.max_positions) > self.pool.num_pages:
            raise InputError(f"request {req.id}: needs {self.pool.pages_for(req.max_positions)} pages, the pool "
                             f"has {self.pool.num_pages}; raise num_pages")
        heapq.heappush(self.queue, (req.arrival_time, req.id, req))

    @property
    def idle(self) -> bool:
        """No request queued or running."""
        return not self.queue and not self.running

    def next_arrival(self) -> float | None:
        """Arrival time of the first queued request."""
        return self.queue[0][0] if self.queue else None

    def _outstanding(self) -> int:
        """Pages running requests have reserved but not yet taken."""
        return sum(st.reserved_pages - int(self.pool.pages_used[st.slot]) for st in self.running)

    def _retire(self) -> None:
        done = [st for st in self.running if st.finish_reason is not None]
        self.running = [st for st in self.running if st.finish_reason is None]
        for st in sorted(done, key=lambda st: st.slot):  # slot order: the device frees pages in this order
            self.pool.release_slot(st.slot)
            self.finished.append(RequestOutput.from_state(st))

    def _admit(self, now: float) -> None:
        while self.queue and self.queue[0][0] <= now and self.pool.num_free_slots:
            req = self.queue[0][2]
            need = self.pool.pages_for(req.max_positions)
            if need > self.pool.num_free - self._outstanding():
                break  # FCFS: later requests wait behind this one (no starvation of long prompts)
            heapq.heappop(self.queue)
            self.running.append(RequestState(req, self.pool.acquire_slot(), need, now))

    def plan(self, now: float) -> StepBatch:
        """Retire finished requests, admit arrived ones, and lay out the next pass (maybe empty)."""
        self._retire()
        self._admit(now)
        toks, pos, slots, rows, emitters, sched, lens = [], [], [], [], [], [], {}
        budget, n_prefill = self.max_tokens, 0
        decoding = [st for st in self.running if not st.prefilling]
        for st in decoding + [st for st in self.running if st.prefilling]:
            if budget == 0:
                break
            if st.prefilling:
                p = len(st.req.prompt)
                n = min(budget, p - st.computed)
                ids = list(st.req.prompt[st.computed: st.computed + n])
                n_prefill += n
            else:
                n, ids = 1, [st.next_input()]
            lens[st.slot] = st.computed + n
            toks += ids
            pos += range(st.computed, st.computed + n)
            slots += [st.slot] * n
            budget -= n
            sched.append((st, n))
            if st.computed + n >= len(st.req.prompt):  # last prompt token or a decode token
                rows.append(len(toks) - 1)
                emitters.append(st)
        for s in sorted(lens):  # slot order: the device pops pages in this order
            self.pool.grow(s, lens[s])
        i32 = lambda x: np.asarray(x, dtype=np.int32)  # noqa: E731
        # NOTE: a snapshot: later plans grow the live table, and a pass must see its own layout.
        table = self.pool.page_table.copy() if hasattr(self.pool, "page_table") else None
        # An empty pass is not run: its releases wait for the next pass that is.
        release = self.pool.take_releases() if toks else None
        return StepBatch(i32(toks), i32(pos), i32(slots), table, i32(rows), emitters, sched, n_prefill, release)

    def commit(self, batch: StepBatch, logits: torch.Tensor, now: float) -> None:
        """Apply a pass: advance each request past its tokens, append greedy tokens from ``logits`` [R, V]."""
        for st, n in batch.scheduled:
            st.computed += n
        if len(batch.emitters):
            nxt = logits[: len(batch.emitters)].argmax(dim=-1).tolist()
            for r, st in enumerate(batch.emitters):
                st.emit(nxt[r], now, logits[r].float().cpu().clone() if st.req.want_logits else None)

    def drain(self) -> list[RequestOutput]:
        """Retire what finished in the last pass and return every finished request, by id."""
        self._retire()
        return sorted(self.finished, key=lambda o: o.id)

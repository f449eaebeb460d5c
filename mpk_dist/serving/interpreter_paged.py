"""The paged, ragged pass on the task-graph interpreter: the compiled task stream the mega-kernel
will run, executed on the CPU in random valid orders with race detection.

One pass = one launch of one step: the host pads the pass to the compiled N tokens (slot -1),
writes ``seq_slots`` and ``release_slots`` into every rank's input buffers, feeds the tokens as the
forced tokens of step 0 and the positions as ``start_pos``; the page pools are state buffers and
persist across launches. Pages are allocated on the "device": the program's page_alloc task keeps
the free stack and the page table in state buffers (initialised once here, ``page_state``), so the
server's pool holds counts only (``pages_on_device``) and ``check_pages`` compares the two.
``logit_rows`` (padded to MB with -1) is written too: a ``gather_rows`` task picks those token rows, so the head runs over the MB sequences and row b of the [MB, V]
logits belongs to ``logit_rows[b]``. ``gather_last=False`` compiles the head over all N token rows
instead and picks the rows on the host (the behaviour before gather_rows; kept for comparisons).

``persistent_passes`` P > 0: the persistent form (docs/SERVING.md "Persistent passes"): one launch of
a P-step program runs P passes, pass s as step s, the host posting each pass into the running launch
(forced_tokens row s, start_pos = positions - s, slots, release flags, logit rows) and reading the
logits once the step's final task has run (``taskgraph.interpreter.PersistentLaunch``); a new launch after P.
"""

from __future__ import annotations

import torch

from mpk_dist.config import ModelConfig
from mpk_dist.errors import InputError
from mpk_dist.models.llama import PagedSpec, build_paged_graph
from mpk_dist.serving.scheduler import StepBatch
from mpk_dist.taskgraph.interpreter import Interpreter
from mpk_dist.taskgraph.paged_compiler import (PASS_INPUTS, PERSISTENT_INPUTS, compile_paged_programs, page_state,
                                               persistent_pass_inputs)


class InterpreterPagedBackend:
    """Paged-KV step backend over the interpreter: ``step(batch) -> logits [R, V]`` (float32)."""

    name = "interpreter"
    pages_on_device = True  # page ids live in the program's buffers (page_alloc); the server counts pages

    def __init__(self, cfg: ModelConfig, source, spec: PagedSpec, tp: int = 1, device: str = "cpu", sms: int = 8,
                 seed: int = 0, schedule: str = "jit", check_races: bool = True, weights=None,
                 gather_last: bool = True, persistent_passes: int = 0):
        if str(device) != "cpu":
            raise InputError(f"interpreter serving backend: expected device cpu, got {device}")
        self.cfg, self.spec, self.tp, self.seed = cfg, spec, tp, seed
        self.vocab_size = cfg.vocab_size
        self.device = torch.device("cpu")
        if weights is None:
            from mpk_dist.weights import load_rank_weights

            weights = [load_rank_weights(build_paged_graph(cfg, spec, tp=tp, rank=r), source) for r in range(tp)]
        self.gather_last = gather_last
        if persistent_passes < 0 or (persistent_passes and not gather_last):
            raise InputError(f"persistent_passes: expected >= 0 (and gather_last), got {persistent_passes}")
        self.persistent_passes = persistent_passes
        self.programs = compile_paged_programs(cfg, spec, tp, sms=sms, gather_last=gather_last,
                                               max_steps=max(1, persistent_passes))
        self.interp = Interpreter(self.programs, weights, seed=seed, mode=schedule, check_races=check_races)
        self.interp.reset_state()
        for r in range(tp):  # the allocator's state at server start: every page free
            for name, a in page_state(self.programs[r]).items():
                self.interp.buffer(r, name).copy_(torch.from_numpy(a))
        self.launches = 0
        self.launch = None  # the running PersistentLaunch (persistent_passes > 0)

    def step(self, batch: StepBatch) -> torch.Tensor:
        """Run one pass as one launch; logits of the ``logit_rows`` rows."""
        N = self.spec.max_tokens
        if batch.num_tokens > N:
            raise InputError(f"pass: expected at most {N} tokens (compiled max_tokens), got {batch.num_tokens}")
        if len(batch.logit_rows) > self.spec.max_seqs:
            raise InputError(f"pass: expected at most {self.spec.max_seqs} rows with logits (compiled max_seqs), "
                             f"got {len(batch.logit_rows)}")
        x = batch.tensors("cpu", pad_tokens=N, pad_rows=self.spec.max_seqs)
        if self.persistent_passes:
            return self._persistent_step(x, len(batch.logit_rows))
        for r in range(self.tp):
            for name in (n for n in PASS_INPUTS if self.gather_last or n != "logit_rows"):  # gathered head only
                self.interp.buffer(r, name).copy_(x[name])
        self.interp.rng.seed(self.seed + self.launches)  # a different valid order every launch
        self.launches += 1
        res = self.interp.run(1, x["tokens"].reshape(1, N), x["positions"])
        logits = res.captured["logits"][0]
        if not self.gather_last:  # [N, V]: pick the rows here
            return logits[torch.from_numpy(batch.logit_rows).long()].float()
        return logits[: len(batch.logit_rows)].float()  # [MB, V]: row b = token row logit_rows[b]

    def _persistent_step(self, x: dict, rows: int) -> torch.Tensor:
        """Post the pass into the running launch (a new one after P passes); logits of its rows."""
        from mpk_dist.taskgraph.interpreter import PersistentLaunch

        if self.launch is None or self.launch.posted == self.persistent_passes:
            if self.launch is not None:
                self.launch.finish()  # the last pass's tail, then the launch ends
            self.interp.rng.seed(self.seed + self.launches)
            self.launches += 1
            self.launch = PersistentLaunch(self.interp, self.persistent_passes, PERSISTENT_INPUTS)
        s = self.launch.posted
        values = persistent_pass_inputs(x, s)

        def write(r: int) -> None:
            for name, v in values.items():
                buf = self.interp.buffer(r, name)
                (buf[s] if name == "forced_tokens" else buf).copy_(v)  # forced_tokens: this step's row

        self.launch.post(s, write)
        self.launch.wait_final(s)
        logits = torch.cat([self.interp.buffer(r, "logits") for r in range(self.tp)], dim=-1)
        return logits[:rows].float().clone()

    def device_pages(self) -> list[dict]:
        """Every rank's page-allocator state (``tasks.page_alloc.STATE_BUFFERS``) as numpy arrays."""
        from mpk_dist.taskgraph.tasks.page_alloc import STATE_BUFFERS

        return [{n: self.interp.buffer(r, n).numpy().copy() for n in STATE_BUFFERS} for r in range(self.tp)]

    def check_pages(self, pool) -> None:
        """The device allocator's state after the last pass agrees on every rank and with ``pool``'s counts."""
        from mpk_dist.serving.pages import check_device_pages

        check_device_pages(self.device_pages(), pool)

    def synchronize(self) -> None:
        """Nothing queued: the interpreter is synchronous."""

"""The paged, ragged pass on the task-graph interpreter: the compiled task stream the mega-kernel
will run, executed on the CPU in random valid orders with race detection.

One pass = one launch of one step: the host pads the pass to the compiled N tokens (slot -1),
writes ``seq_slots`` and ``page_table`` into every rank's input buffers, feeds the tokens as the
forced tokens of step 0 and the positions as ``start_pos``; the page pools are state buffers and
persist across launches. The head runs over all N rows (no gather_rows task yet), and the rows of
``logit_rows`` are picked on the host.
"""

from __future__ import annotations

import torch

from mpk_dist.config import ModelConfig
from mpk_dist.errors import InputError
from mpk_dist.models.llama import PagedSpec, build_paged_graph
from mpk_dist.serving.scheduler import StepBatch
from mpk_dist.taskgraph.interpreter import Interpreter
from mpk_dist.taskgraph.paged_compiler import compile_paged_programs


class InterpreterPagedBackend:
    """Paged-KV step backend over the interpreter: ``step(batch) -> logits [R, V]`` (float32)."""

    name = "interpreter"

    def __init__(self, cfg: ModelConfig, source, spec: PagedSpec, tp: int = 1, device: str = "cpu", sms: int = 8,
                 seed: int = 0, schedule: str = "jit", check_races: bool = True, weights=None):
        if str(device) != "cpu":
            raise InputError(f"interpreter serving backend: expected device cpu, got {device}")
        self.cfg, self.spec, self.tp, self.seed = cfg, spec, tp, seed
        self.vocab_size = cfg.vocab_size
        self.device = torch.device("cpu")
        if weights is None:
            from mpk_dist.weights import load_rank_weights

            weights = [load_rank_weights(build_paged_graph(cfg, spec, tp=tp, rank=r), source) for r in range(tp)]
        self.programs = compile_paged_programs(cfg, spec, tp, sms=sms)
        self.interp = Interpreter(self.programs, weights, seed=seed, mode=schedule, check_races=check_races)
        self.interp.reset_state()
        self.launches = 0

    def step(self, batch: StepBatch) -> torch.Tensor:
        """Run one pass as one launch; logits of the ``logit_rows`` rows."""
        N = self.spec.max_tokens
        if batch.num_tokens > N:
            raise InputError(f"pass: expected at most {N} tokens (compiled max_tokens), got {batch.num_tokens}")
        x = batch.tensors("cpu", pad_tokens=N)
        for r in range(self.tp):
            self.interp.buffer(r, "seq_slots").copy_(x["seq_slots"])
            self.interp.buffer(r, "page_table").copy_(x["page_table"])
        self.interp.rng.seed(self.seed + self.launches)  # a different valid order every launch
        self.launches += 1
        res = self.interp.run(1, x["tokens"].reshape(1, N), x["positions"])
        logits = res.captured["logits"][0]  # [N, V]
        return logits[torch.from_numpy(batch.logit_rows).long()].float()

    def synchronize(self) -> None:
        """Nothing queued: the interpreter is synchronous."""

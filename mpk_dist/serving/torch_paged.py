"""The torch reference of a paged, ragged pass: every rank's paged graph run op by op in this process.

Same op semantics as ``mpk_dist.backends.torch_backend`` (which evaluates the three paged op kinds
too); TP ranks are simulated in one process with ``LocalComm`` (fp32 sum, residual added once).
A pass takes any number of tokens (a prompt of thousands of tokens is ONE pass, not one decode
step per token); the page pools persist across passes.
"""

from __future__ import annotations

import torch

from mpk_dist.backends import torch_ops as T
from mpk_dist.backends.torch_backend import LocalComm, run_graphs
from mpk_dist.config import ModelConfig
from mpk_dist.errors import InputError
from mpk_dist.models.llama import PagedSpec, build_paged_graph
from mpk_dist.serving.scheduler import StepBatch
from mpk_dist.weights import TORCH_DTYPES, load_rank_weights


class TorchPagedBackend:
    """Paged-KV step backend: ``step(batch) -> logits [R, V]`` (float32, full vocabulary).

    ``weights``: per-rank weight dicts to share with another backend (default: read ``source``).
    """

    name = "torch"

    def __init__(self, cfg: ModelConfig, source, spec: PagedSpec, tp: int = 1, device: str | torch.device = "cpu",
                 weights: list[dict[str, torch.Tensor]] | None = None):
        self.cfg, self.spec, self.tp, self.device = cfg, spec, tp, torch.device(device)
        self.vocab_size = cfg.vocab_size
        self.graphs = [build_paged_graph(cfg, spec, tp=tp, rank=r) for r in range(tp)]
        self.weights = weights or [load_rank_weights(g, source, self.device) for g in self.graphs]
        self._dtypes = {t.name: TORCH_DTYPES[t.dtype] for t in self.graphs[0].tensors.values()}
        self.pools = [{s.name: torch.zeros(s.shape, dtype=TORCH_DTYPES[s.dtype], device=self.device)
                       for s in g.by_kind("state")} for g in self.graphs]
        self.comm = LocalComm()

    def reset(self) -> None:
        """Zero the page pools (not needed for correctness: pages are written before they are read)."""
        for pool in self.pools:
            for t in pool.values():
                t.zero_()

    def kv_bytes(self) -> int:
        """Bytes of all ranks' page pools."""
        return sum(t.numel() * t.element_size() for p in self.pools for t in p.values())

    def step(self, batch: StepBatch) -> torch.Tensor:
        """Run one pass; logits [len(logit_rows), V] of the rows that emit a token."""
        if batch.num_tokens > self.spec.max_tokens or len(batch.logit_rows) > self.spec.max_seqs:
            raise InputError(f"pass: expected at most {self.spec.max_tokens} tokens and {self.spec.max_seqs} "
                             f"sequences, got {batch.num_tokens} and {len(batch.logit_rows)}")
        if batch.num_tokens and int(batch.tokens.max()) >= self.vocab_size:
            raise InputError(f"token id: expected 0 <= id < {self.vocab_size}, got {int(batch.tokens.max())}")
        inputs = batch.tensors(self.device)
        # once per pass, from the host arrays: no device->host sync inside the layers
        layout = T.paged_layout(batch.positions, batch.slots, self.spec.page_size, self.device)
        envs = [{**w, **p, **inputs, "__dtypes__": self._dtypes, "__paged_layout__": layout}
                for w, p in zip(self.weights, self.pools)]
        run_graphs(self.graphs, envs, self.comm)
        return torch.cat([env["logits"] for env in envs], dim=-1).float()

    def synchronize(self) -> None:
        """Wait for queued device work (host timers then measure it)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

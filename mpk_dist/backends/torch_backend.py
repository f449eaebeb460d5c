"""The torch reference backend: runs every rank's op graph op by op.

All TP ranks live in this process; communication ops are evaluated collectively (all_reduce sums
the ranks' partials in fp32 and adds the residual once; all_gather stacks). This is the
correctness reference for every other backend and the kernel-per-layer speed baseline:
mode 'eager', 'graph' (decode step captured in a CUDA graph) or 'compile' (torch.compile, with
CUDA graphs on a GPU).
"""

from __future__ import annotations

import torch

from mpk_dist.backends import torch_ops as T
from mpk_dist.backends.base import StepBackend
from mpk_dist.config import ModelConfig
from mpk_dist.errors import BackendUnavailable, InputError
from mpk_dist.models import build_graph
from mpk_dist.weights import TORCH_DTYPES, load_rank_weights

MODES = ("eager", "graph", "compile")


def _run_local_op(op, env: dict, attrs: dict) -> None:
    """Evaluate one non-communication op of one rank in place in ``env``."""
    x = [env[n] for n in op.inputs]
    k = op.kind
    if k == "embedding":
        env[op.outputs[0]] = T.embedding(x[0], x[1], attrs["vocab_start"])
    elif k == "rms_norm":
        env[op.outputs[0]] = T.rms_norm(x[0], x[1], attrs["eps"])
    elif k == "linear":
        out_dtype = env["__dtypes__"][op.outputs[0]]
        env[op.outputs[0]] = T.linear(x[0], x[1], out_dtype)
    elif k == "qkv_prep":
        qn, kn = (x[2], x[3]) if attrs.get("qk_norm") else (None, None)
        env[op.outputs[0]] = T.qkv_prep(x[0], x[1], qn, kn, x[-2], x[-1], attrs)
    elif k == "attention":
        env[op.outputs[0]] = T.attention(x[0], x[1], x[2], x[3], attrs)
    elif k == "silu_mul":
        env[op.outputs[0]] = T.silu_mul(x[0])
    elif k == "add":
        env[op.outputs[0]] = x[0] + x[1]
    elif k == "argmax_partial":
        env[op.outputs[0]] = T.argmax_partial(x[0], attrs["vocab_start"])
    elif k == "argmax_select":
        env[op.outputs[0]] = T.argmax_select(x[0])
    elif k == "qkv_prep_paged":  # paged graphs (mpk_dist.serving): qkv, pos, slots, page_table, (norms), pools
        qn, kn = (x[4], x[5]) if attrs.get("qk_norm") else (None, None)
        layout = env.get("__paged_layout__")
        env[op.outputs[0]] = T.qkv_prep_paged(x[0], x[1], x[2], x[3], qn, kn, x[-2], x[-1], attrs,
                                              None if layout is None else layout.live)
    elif k == "paged_attention":
        env[op.outputs[0]] = T.paged_attention(*x, attrs, layout=env.get("__paged_layout__"))
    elif k == "gather_rows":
        env[op.outputs[0]] = T.gather_rows(x[0], x[1])
    else:
        raise NotImplementedError(f"torch backend: op kind {k!r}")


class LocalComm:
    """Collectives among ranks that all live in this process (lists hold one tensor per rank)."""

    def all_reduce(self, partials: list[torch.Tensor]) -> list[torch.Tensor]:
        """fp32 sum of every rank's partial, returned to every rank."""
        total = sum(p.float() for p in partials)
        return [total] * len(partials)

    def all_gather(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        """Every rank's tensor stacked along a new leading axis, returned to every rank."""
        stacked = torch.stack(xs)
        return [stacked] * len(xs)


def run_graphs(graphs: list, envs: list[dict], comm=None) -> None:
    """Execute the ranks' graphs op by op; ``envs[i]`` maps tensor names to ``graphs[i]``'s tensors.

    ``comm`` performs the communication ops (default: all ranks are in ``graphs``).
    """
    comm = comm or LocalComm()
    for idx, op0 in enumerate(graphs[0].ops):
        ops = [g.ops[idx] for g in graphs]
        if op0.kind == "all_reduce":
            totals = comm.all_reduce([env[op.inputs[0]] for op, env in zip(ops, envs)])
            for op, env, total in zip(ops, envs, totals):
                res = total + env[op.inputs[1]].float() if len(op.inputs) > 1 else total
                env[op.outputs[0]] = res.to(env["__dtypes__"][op.outputs[0]])
        elif op0.kind == "all_gather":
            gathered = comm.all_gather([env[op.inputs[0]] for op, env in zip(ops, envs)])
            for op, env, g in zip(ops, envs, gathered):
                env[op.outputs[0]] = g
        else:
            for op, env in zip(ops, envs):
                _run_local_op(op, env, op.attrs)
                out = op.outputs[0]
                # every op's result takes its declared dtype (e.g. the fp32 residual stream)
                env[out] = env[out].to(env["__dtypes__"][out])


class TorchBackend(StepBackend):
    """Op-by-op execution of the per-rank graphs with a static KV cache."""

    def __init__(self, cfg: ModelConfig, source, tp: int = 1, device: str | torch.device = "cpu",
                 max_seq_len: int = 512, mode: str = "eager", ranks: list[int] | None = None, comm=None):
        if mode not in MODES:
            raise BackendUnavailable(f"torch backend mode: expected one of {MODES}, got {mode!r}")
        self.device = torch.device(device)
        if mode == "graph" and self.device.type != "cuda":
            raise BackendUnavailable("torch-graph: CUDA graphs need a GPU; use --backend torch on a CPU")
        self.cfg, self.tp, self.mode, self.max_seq_len = cfg, tp, mode, max_seq_len
        self.name = {"eager": "torch", "graph": "torch-graph", "compile": "torch-compile"}[mode]
        self.vocab_size = cfg.vocab_size
        self.ranks = list(range(tp)) if ranks is None else ranks
        self.comm = comm or LocalComm()
        self.graphs = [build_graph(cfg, tp=tp, rank=r, batch=1, max_seq_len=max_seq_len) for r in self.ranks]
        self.weights = [load_rank_weights(g, source, self.device) for g in self.graphs]
        self._dtypes = {t.name: TORCH_DTYPES[t.dtype] for t in self.graphs[0].tensors.values()}
        T.probe_fp32_out(self.device)
        self.batch = 0
        self._graph = None
        self._compiled = None

    def weight_bytes(self) -> int:
        """Bytes of all ranks' weights."""
        return sum(t.numel() * t.element_size() for w in self.weights for t in w.values())

    def reset(self, batch: int) -> None:
        """Allocate (or zero) the KV caches for ``batch`` sequences."""
        if batch != self.batch:
            self.states = []
            for g in self.graphs:
                st = {s.name: torch.zeros((batch, *s.shape[1:]), dtype=TORCH_DTYPES[s.dtype], device=self.device)
                      for s in g.by_kind("state")}
                self.states.append(st)
            if self.mode == "compile" and self.device.type == "cuda":
                # The caches are updated in place by the compiled step; CUDA-graph trees only keep
                # graphs whose mutated inputs live at fixed addresses (otherwise they fall back to
                # plain launches), so declare them, and the weights, static.
                for t in [*(x for s in self.states for x in s.values()), *(x for w in self.weights for x in w.values())]:
                    torch._dynamo.mark_static_address(t)
            self.batch = batch
            self._graph = None
            self._compiled = None
        else:
            for st in self.states:
                for t in st.values():
                    t.zero_()

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        envs = [{**w, **s, "tokens": tokens, "positions": positions, "__dtypes__": self._dtypes}
                for w, s in zip(self.weights, self.states)]
        run_graphs(self.graphs, envs, self.comm)
        if len(envs) == self.tp:
            return torch.cat([env["logits"] for env in envs], dim=-1)
        # one rank per process: gather the vocabulary slices ([tp, ..., V/tp] -> [..., V])
        slices = self.comm.all_gather([envs[0]["logits"]])[0]
        return torch.cat(list(slices), dim=-1)

    def _check(self, tokens: torch.Tensor, positions: torch.Tensor) -> None:
        if int(positions.max()) >= self.max_seq_len:
            raise InputError(f"sequence length: expected at most {self.max_seq_len} tokens (--max-seq-len), "
                             f"got position {int(positions.max())}")
        if int(tokens.max()) >= self.vocab_size or int(tokens.min()) < 0:
            raise InputError(f"token id: expected 0 <= id < {self.vocab_size}, got {int(tokens.max())}")

    def prefill(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Process prompts [B, T] in one pass; logits of the last token [B, V]."""
        self._check(tokens, positions)
        return self._forward(tokens, positions)[:, -1].float()

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One decode step for [B] tokens; logits [B, V]."""
        if self.mode == "eager":
            self._check(tokens, positions)
            return self._forward(tokens, positions).float()
        if self.mode == "compile":
            if self._compiled is None:
                opts = {"mode": "reduce-overhead"} if self.device.type == "cuda" else {}
                self._compiled = torch.compile(self._forward, dynamic=False, **opts)
            out = self._compiled(tokens, positions)
            return out.float().clone()
        return self._graph_decode(tokens, positions)

    def _graph_decode(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self._graph is None:
            self._static_tokens = tokens.clone()
            self._static_pos = positions.clone()
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                saved = [{k: v.clone() for k, v in s.items()} for s in self.states]
                self._forward(self._static_tokens, self._static_pos)  # warm-up outside capture
                for s, c in zip(self.states, saved):
                    for k in s:
                        s[k].copy_(c[k])
            torch.cuda.current_stream(self.device).wait_stream(stream)
            self._graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self._graph):
                self._static_out = self._forward(self._static_tokens, self._static_pos)
        self._static_tokens.copy_(tokens)
        self._static_pos.copy_(positions)
        self._graph.replay()
        return self._static_out.float()

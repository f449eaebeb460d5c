"""Helpers for task-graph tests and diff tests: fp32 tiny models, per-rank weights, reference runs,
and graph mutations (drop one wait or signal) used to prove every dependency edge is necessary."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from mpk_dist.backends.torch_backend import TorchBackend
from mpk_dist.config import ModelConfig
from mpk_dist.models import build_graph
from mpk_dist.models.presets import get_preset
from mpk_dist.taskgraph.abi import EVENT_COLS, TASK_COLS
from mpk_dist.taskgraph.compiler import compile_rank_programs
from mpk_dist.taskgraph.serialize import CompiledGraph
from mpk_dist.weights import SyntheticSource, load_rank_weights

MAX_SEQ = 64


def fp32(name: str, **changes) -> ModelConfig:
    """A preset in float32 (so the comparison tolerance is 1e-5), with optional field changes."""
    return dataclasses.replace(get_preset(name), dtype="float32", **changes)


def programs(cfg: ModelConfig, tp: int, sms: int = 8, batch: int = 1, fuse=False,
             attn_splits=1) -> list[CompiledGraph]:
    """Compiled, validated programs of every rank (``fuse``, ``attn_splits``: as compile_rank_programs)."""
    return compile_rank_programs(cfg, tp, batch=batch, sms=sms, max_seq_len=MAX_SEQ, fuse=fuse,
                                 attn_splits=attn_splits)


def weights(cfg: ModelConfig, tp: int, seed: int = 1, batch: int = 1) -> list[dict[str, torch.Tensor]]:
    """Per-rank weights from the synthetic source."""
    src = SyntheticSource(cfg, seed=seed)
    return [load_rank_weights(build_graph(cfg, tp=tp, rank=r, batch=batch, max_seq_len=MAX_SEQ), src)
            for r in range(tp)]


def reference(cfg: ModelConfig, tp: int, feed: list[list[int]], start: int | torch.Tensor = 0, seed: int = 1):
    """TorchBackend logits [steps, B, V] and greedy tokens [steps, B] when step s feeds feed[s]
    (a row of -1 = feed the previous step's greedy token); ``start``: the first position, one for every
    sequence or a tensor of one per sequence."""
    ref = TorchBackend(cfg, SyntheticSource(cfg, seed=seed), tp=tp, max_seq_len=MAX_SEQ)
    B = len(feed[0])
    ref.reset(B)
    logits, toks, prev = [], [], None
    for s, row in enumerate(feed):
        tok = torch.tensor([prev[b] if v < 0 else v for b, v in enumerate(row)], dtype=torch.int32)
        lg = ref.decode(tok, (torch.as_tensor(start, dtype=torch.int32).expand(B) + s).to(torch.int32))
        prev = lg.argmax(-1).tolist()
        logits.append(lg)
        toks.append(prev)
    return torch.stack(logits), torch.tensor(toks, dtype=torch.int32)


def max_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| per step (a, b: [steps, ...]); returns the worst step."""
    a, b = a.reshape(a.shape[0], -1).double(), b.reshape(b.shape[0], -1).double()
    return float(((a - b).abs().amax(1) / b.abs().amax(1)).max())


def _drop_row(cg: CompiledGraph, table: str, k: int, begin: str, end: str) -> None:
    a = cg.arrays[table]
    cg.arrays[table] = np.delete(a, k, axis=0)
    t = cg.arrays["tasks"]
    t[:, TASK_COLS[begin]] -= (t[:, TASK_COLS[begin]] > k).astype(np.int32)
    t[:, TASK_COLS[end]] -= (t[:, TASK_COLS[end]] > k).astype(np.int32)


def drop_wait(cg: CompiledGraph, k: int) -> CompiledGraph:
    """A copy without wait-list row k (the task no longer waits on that event)."""
    out = cg.copy()
    _drop_row(out, "waits", k, "WAIT_BEGIN", "WAIT_END")
    return out


def drop_signal(cg: CompiledGraph, k: int) -> CompiledGraph:
    """A copy without signal-list row k, the event's trigger count lowered to match."""
    out = cg.copy()
    e, tgt = (int(x) for x in out.arrays["signals"][k])
    out.arrays["events"][e, EVENT_COLS["TRIGGERS"]] -= out.meta["world_size"] if tgt == -2 else 1
    _drop_row(out, "signals", k, "SIGNAL_BEGIN", "SIGNAL_END")
    return out


def rows_of_layer(cg: CompiledGraph, layer: int, begin: str, end: str) -> list[int]:
    """Wait- or signal-list rows that belong to tasks of one layer."""
    t = cg.arrays["tasks"]
    rows = []
    for row in t[t[:, TASK_COLS["LAYER"]] == layer]:
        rows += range(int(row[TASK_COLS[begin]]), int(row[TASK_COLS[end]]))
    return rows


def mutation_caught(mutated: list[CompiledGraph], ws, baseline: torch.Tensor, feed: torch.Tensor,
                    start: torch.Tensor | None = None, seeds: int = 3) -> bool:
    """True when the interpreter notices a mutated program (a dropped wait or signal): in one of ``seeds``
    random valid orders it deadlocks (DeviceTimeout), races (RaceError), or its logits differ from
    ``baseline``. ``start``: the start positions (default zeros, one per sequence of ``feed``)."""
    from mpk_dist.errors import DeviceTimeout
    from mpk_dist.taskgraph.interpreter import Interpreter
    from mpk_dist.taskgraph.race import RaceError

    start = torch.zeros(feed.shape[1], dtype=torch.int32) if start is None else start
    for seed in range(seeds):
        try:
            res = Interpreter(mutated, ws, seed=seed, on_race="raise").run(2, feed, start)
        except (DeviceTimeout, RaceError):
            return True
        if not torch.equal(res.captured["logits"], baseline):
            return True
    return False


def uncaught_edge_deletions(cgs: list[CompiledGraph], ws, layer: int, feed: torch.Tensor,
                            start: torch.Tensor | None = None) -> tuple[list[str], int]:
    """Delete each wait row and each signal row of ``layer``'s tasks in turn (on every rank) and run
    ``mutation_caught`` against the unmutated programs' logits; (the deletions nobody noticed, rows tried)."""
    from mpk_dist.taskgraph.interpreter import Interpreter

    start = torch.zeros(feed.shape[1], dtype=torch.int32) if start is None else start
    baseline = Interpreter(cgs, ws, seed=0).run(2, feed, start).captured["logits"]
    missed, tried = [], 0
    for what, begin, end, mutate in (("wait", "WAIT_BEGIN", "WAIT_END", drop_wait),
                                     ("signal", "SIGNAL_BEGIN", "SIGNAL_END", drop_signal)):
        for k in rows_of_layer(cgs[0], layer, begin, end):
            tried += 1
            if not mutation_caught([mutate(cg, k) for cg in cgs], ws, baseline, feed, start):
                missed.append(f"{what} row {k}")
    return missed, tried


def preset_or_short(name: str) -> ModelConfig:
    """A preset, or 'qwen3-0.6b-2l': qwen3-0.6b's layer shapes (16 q / 8 kv heads of 128) with 2 layers and a
    512-token vocabulary, small enough for the interpreter."""
    if name == "qwen3-0.6b-2l":
        return dataclasses.replace(get_preset("qwen3-0.6b"), num_layers=2, vocab_size=512)
    return get_preset(name)


def assert_schedules_match_reference(cfg: ModelConfig, tp: int, cgs: list[CompiledGraph], ws, steps: int = 8,
                                     seeds: int = 3) -> None:
    """Greedy from token 7 for ``steps`` steps in ``seeds`` random orders (jit and aot alternating): fp32 logits
    within 1e-5 max relative error of the torch reference and the same tokens."""
    from mpk_dist.taskgraph.interpreter import Interpreter

    feed = [[7]] + [[-1]] * (steps - 1)
    ref_logits, ref_tokens = reference(cfg, tp, feed)
    for seed in range(seeds):
        res = Interpreter(cgs, ws, seed=seed, mode="aot" if seed % 2 else "jit").run(
            steps, torch.tensor(feed), torch.tensor([0]))
        assert max_rel_err(res.captured["logits"], ref_logits) <= 1e-5, f"schedule seed {seed}"
        assert torch.equal(res.tokens, ref_tokens), f"schedule seed {seed}"

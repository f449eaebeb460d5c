"""Decode benchmark: several backends on the same model in ONE run, with the floor measured alongside.

floor (ms/token) = bytes one decode step must move / memory read bandwidth measured in this run.
Bytes: every weight of every rank except the embedding tables (of which only B rows are read),
plus the KV cache read at the benchmark's context length. On a GPU the bandwidth is timed as a
large reduction (read-only), like the decode step itself; on a CPU the same code times host memory.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import torch

from mpk_dist.backends.base import GenerateRequest, SamplingParams
from mpk_dist.bench.progress import track
from mpk_dist.engine import RunSpec, build_backend

BANDWIDTH_BYTES_GPU = 4 << 30  # well past the 60 MB L2, so the figure is HBM's
BANDWIDTH_BYTES_CPU = 256 << 20


# Reductions run, untimed, before the timed ones: long enough for the clocks to leave their idle state (two untimed
# sums were ~3 ms of load). It does not remove the spread between samples: on an H100, with it, one process's
# samples before and after its runs differed by -3.0% to +2.0% (docs/PERF.md v0.48), hence bench's second sample.
BANDWIDTH_WARMUP_S = {"cuda": 0.5, "cpu": 0.05}


def measure_read_bandwidth(device: torch.device, repeats: int = 10, warmup_s: float | None = None) -> float:
    """Bytes/s of a large sum over a buffer (read-bound): the median of ``repeats`` timings, after at least two
    untimed sums and ``warmup_s`` seconds of them (``BANDWIDTH_WARMUP_S`` of the device type by default)."""
    nbytes = BANDWIDTH_BYTES_GPU if device.type == "cuda" else BANDWIDTH_BYTES_CPU
    warmup_s = BANDWIDTH_WARMUP_S.get(device.type, 0.0) if warmup_s is None else warmup_s
    x = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=device)
    t_end, warm = time.perf_counter() + warmup_s, 0
    while warm < 2 or time.perf_counter() < t_end:
        x.sum(dtype=torch.float32)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        warm += 1
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            x.sum(dtype=torch.float32)
            end.record()
            end.synchronize()
            t = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            x.sum(dtype=torch.float32)
            t = time.perf_counter() - t0
        times.append(t)
    del x
    times.sort()
    return nbytes / times[len(times) // 2]


def step_bytes(cfg, tp: int, batch: int, context: int) -> int:
    """Bytes a decode step must read at batch ``batch`` and context length ``context`` (all ranks)."""
    from mpk_dist.bench.op_bytes import element_bytes
    from mpk_dist.weights import expected_tensors

    elt = element_bytes(cfg)
    total = 0
    for name, shape in expected_tensors(cfg).items():
        n = 1
        for s in shape:
            n *= s
        if name == "model.embed_tokens.weight":
            n = batch * cfg.hidden_size  # only the B looked-up rows
            if cfg.tie_word_embeddings:
                n += shape[0] * shape[1]  # the tied lm_head streams the whole table
        total += n * elt
    kv_heads_total = max(cfg.num_kv_heads, tp)  # replicated KV heads are read by each rank
    total += 2 * cfg.num_layers * kv_heads_total * cfg.head_dim * context * batch * elt
    return total


@dataclass
class BenchCase:
    """One backend's measurements."""

    backend: str
    prefill_ms: list[float] = field(default_factory=list)
    decode_step_ms: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    extra: dict = field(default_factory=dict)


def run_case(spec: RunSpec, model, prompt: list[int], output_len: int, iters: int, warmup: int, progress: bool) -> BenchCase:
    """Warm up, then time ``iters`` generations of ``output_len`` tokens (no early stop)."""
    _, backend = build_backend(spec, model)
    req = GenerateRequest([prompt] * spec.batch, output_len, SamplingParams(), stop_ids=())
    case = BenchCase(backend.name)
    for _ in range(warmup):
        backend.generate(req)
    for _ in track(range(iters), total=iters, description=f"{backend.name}", enabled=progress):
        res = backend.generate(req)
        case.prefill_ms.append(res.prefill_ms)
        case.decode_step_ms.extend(res.per_token_ms)
        case.tokens = res.tokens[0]
        case.extra.update(res.extra)
    del backend
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return case


def random_prompt(vocab: int, length: int, seed: int) -> list[int]:
    """A reproducible prompt of ``length`` ids."""
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(length)]

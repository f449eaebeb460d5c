"""Serving workloads: a JSONL request file, or a seeded synthetic one (Poisson arrivals).

One JSON object per line (blank lines and lines starting with ``#`` are skipped)::

    {"arrival_time": 0.25, "prompt_ids": [1, 2, 3], "output_len": 16}
    {"arrival_time": 0.50, "prompt_len": 128, "output_len": 32}

``arrival_time`` (seconds after the start, default 0), ``prompt_ids`` OR ``prompt_len`` (ids are
then drawn from the seeded generator), ``output_len`` (tokens to generate, >= 1).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from mpk_dist.errors import InputError

_KEYS = {"arrival_time", "prompt_ids", "prompt_len", "output_len"}


@dataclass(frozen=True)
class WorkItem:
    """One request of a workload."""

    arrival_time: float
    prompt_ids: tuple[int, ...]
    output_len: int


def _random_ids(rng: random.Random, n: int, vocab: int) -> tuple[int, ...]:
    return tuple(rng.randrange(vocab) for _ in range(n))


def _item(obj, where: str, rng: random.Random, vocab: int) -> WorkItem:
    if not isinstance(obj, dict):
        raise InputError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    unknown = set(obj) - _KEYS
    if unknown:
        raise InputError(f"{where}: expected keys from {sorted(_KEYS)}, got unknown {sorted(unknown)}")
    if ("prompt_ids" in obj) == ("prompt_len" in obj):
        raise InputError(f"{where}: expected exactly one of prompt_ids or prompt_len, got {sorted(obj)}")
    out_len, t = obj.get("output_len"), obj.get("arrival_time", 0.0)
    if not isinstance(out_len, int) or out_len < 1:
        raise InputError(f"{where}: expected output_len an integer >= 1, got {out_len!r}")
    if not isinstance(t, (int, float)) or t < 0:
        raise InputError(f"{where}: expected arrival_time a number >= 0 (seconds), got {t!r}")
    if "prompt_ids" in obj:
        ids = obj["prompt_ids"]
        if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and 0 <= i < vocab for i in ids):
            raise InputError(f"{where}: expected prompt_ids a non-empty list of ids in [0, {vocab}), got {ids!r}")
        return WorkItem(float(t), tuple(ids), out_len)
    n = obj["prompt_len"]
    if not isinstance(n, int) or n < 1:
        raise InputError(f"{where}: expected prompt_len an integer >= 1, got {n!r}")
    return WorkItem(float(t), _random_ids(rng, n, vocab), out_len)


def load_requests(path: str | Path, vocab_size: int, seed: int = 0) -> list[WorkItem]:
    """Parse a JSONL workload; errors name the file and line."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise InputError(f"--requests: expected a readable JSONL file, got {str(path)!r} ({exc.strerror})") from None
    rng, items = random.Random(seed), []
    for k, line in enumerate(lines, 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputError(f"{path}:{k}: expected one JSON object per line, got invalid JSON ({exc.msg})") from None
        items.append(_item(obj, f"{path}:{k}", rng, vocab_size))
    if not items:
        raise InputError(f"--requests {path}: expected at least one request, got none")
    return items


def synthetic(n: int, rate: float, prompt_len: int, output_len: int, vocab_size: int, seed: int = 0) -> list[WorkItem]:
    """``n`` requests with Poisson arrivals at ``rate`` req/s (inf = all at time 0), random prompts."""
    if n < 1 or prompt_len < 1 or output_len < 1 or rate <= 0:
        raise InputError(f"--synthetic/--rate/--prompt-len/--output-len: expected positive values, got "
                         f"{n}, {rate}, {prompt_len}, {output_len}")
    rng, t, items = random.Random(seed), 0.0, []
    for _ in range(n):
        items.append(WorkItem(t, _random_ids(rng, prompt_len, vocab_size), output_len))
        if rate != float("inf"):
            t += rng.expovariate(rate)
    return items


def write_requests(items: list[WorkItem], path: str | Path) -> None:
    """Write a workload as JSONL (prompt ids explicit), readable by ``load_requests``."""
    with open(path, "w") as f:
        for it in items:
            f.write(json.dumps({"arrival_time": it.arrival_time, "prompt_ids": list(it.prompt_ids),
                                "output_len": it.output_len}) + "\n")

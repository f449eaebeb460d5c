"""Read a mega-kernel profile (Chrome / Perfetto trace JSON) and derive per-layer time and exposed communication.

Expected events (others are ignored): complete events ``{"ph": "X", "name": str, "ts": us,
"dur": us, "tid": sm_id, "pid": rank, "args": {"layer": int, "op": str}}``. The file is either a
JSON list of events or an object with ``traceEvents``.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from mpk_dist.errors import InputError

# Op names (or prefixes) that are communication tasks in our task graphs.
COMM_OPS = ("all_reduce", "all_gather", "allreduce", "allgather", "reduce_scatter", "comm", "send", "recv")


@dataclass(frozen=True)
class TraceEvent:
    """One task execution on one SM: start ``ts`` and duration ``dur`` in microseconds."""

    name: str
    ts: float
    dur: float
    sm: int
    rank: int
    layer: int | None
    op: str

    @property
    def end(self) -> float:
        """Finish time in microseconds."""
        return self.ts + self.dur


def is_comm(op: str) -> bool:
    """True for communication tasks (all-reduce, all-gather, sends...)."""
    return op.lower().startswith(COMM_OPS)


def _event(raw: dict, path: Path) -> TraceEvent:
    """Convert one raw 'X' event, naming the file and event when a field is bad."""
    try:
        args = raw.get("args") or {}
        layer = args.get("layer")
        return TraceEvent(
            name=str(raw.get("name", "")), ts=float(raw["ts"]), dur=float(raw["dur"]),
            sm=int(raw.get("tid", 0)), rank=int(raw.get("pid", 0)),
            layer=int(layer) if layer is not None else None,
            op=str(args.get("op") or raw.get("name", "")),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise InputError(
            f"{path}: expected trace events with numeric ts, dur, tid and args.layer, got {raw!r} ({exc})"
        ) from None


def load_trace(path: str | Path) -> list[TraceEvent]:
    """Complete ('X') events of a trace file, sorted by start time."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise InputError(f"{path}: expected a Chrome/Perfetto trace JSON, got {exc}") from None
    raw_events = data.get("traceEvents", []) if isinstance(data, dict) else data
    if not isinstance(raw_events, list):
        raise InputError(f"{path}: expected a list of events or {{'traceEvents': [...]}}, got {type(raw_events).__name__}")
    events = [_event(e, path) for e in raw_events if isinstance(e, dict) and e.get("ph") == "X"]
    if not events:
        raise InputError(f"{path}: expected complete events (\"ph\": \"X\"), got none")
    return sorted(events, key=lambda e: (e.ts, e.sm))


def layer_spans(events: list[TraceEvent]) -> dict[int, tuple[float, float]]:
    """For each layer, (first start, last end) in microseconds over all SMs and ranks."""
    spans: dict[int, tuple[float, float]] = {}
    for e in events:
        if e.layer is None:
            continue
        start, end = spans.get(e.layer, (e.ts, e.end))
        spans[e.layer] = (min(start, e.ts), max(end, e.end))
    return dict(sorted(spans.items()))


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Merge overlapping intervals."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _covered(intervals: list[tuple[float, float]], mask: list[tuple[float, float]]) -> float:
    """Length of ``intervals`` (merged) not covered by ``mask`` (merged)."""
    total = 0.0
    for start, end in intervals:
        length = end - start
        for m_start, m_end in mask:
            overlap = min(end, m_end) - max(start, m_start)
            if overlap > 0:
                length -= overlap
        total += length
    return total


def exposed_comm_share(events: list[TraceEvent], comm: Callable[[str], bool] = is_comm) -> float:
    """Fraction of wall time in which some SM communicates and no SM computes (worst rank).

    That is the communication the mega-kernel failed to hide behind compute; 0 when fully hidden.
    """
    worst = 0.0
    by_rank: dict[int, list[TraceEvent]] = defaultdict(list)
    for e in events:
        by_rank[e.rank].append(e)
    for rank_events in by_rank.values():
        wall = max(e.end for e in rank_events) - min(e.ts for e in rank_events)
        if wall <= 0:
            continue
        comm_iv = _union([(e.ts, e.end) for e in rank_events if comm(e.op)])
        compute_iv = _union([(e.ts, e.end) for e in rank_events if not comm(e.op)])
        worst = max(worst, _covered(comm_iv, compute_iv) / wall)
    return worst

"""Per-task timestamps from the kernel -> a Chrome/Perfetto trace (JSON), and its summary.

One complete event ("ph": "X") per executed task: process = TP rank, thread = worker (SM slot),
name = op name, category = task kind, args = task id, step, layer, tile. Times in microseconds
relative to the earliest task start. ``summarize`` computes time per op kind and idle time per
worker from such a file (what ``mpk-dist trace-summary`` prints).
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

import numpy as np

from mpk_dist.errors import InputError
from mpk_dist.runtime.params import TRACE_MARKS
from mpk_dist.taskgraph.abi import TASK_COLS


def chrome_trace(cg, per_worker: list[np.ndarray], rank: int = 0, t0: int | None = None) -> dict:
    """Build the trace dict from per-worker TraceRecord arrays of one launch.

    Each task gives a 'wait' event (category "wait": from the worker turning to the task until its
    inputs were ready) and the task's own event (name = op, category = task kind) for the run; its
    args carry ``prep_us`` (issuing the weight and descriptor prefetches, inside the wait),
    ``post_us`` (barrier, step epilogue and signals after the body, inside the run) and ``mark<k>_us``
    for each phase mark the body set (time from the start of the run).
    Times are relative to ``t0`` (device ns; default the earliest start here): ranks traced on one
    clock share one t0 so their events line up.
    """
    if t0 is None:
        starts = [int(r["start_ns"].min()) for r in per_worker if len(r)]
        t0 = min(starts) if starts else 0
    ops, tasks = cg.meta["ops"], cg.arrays["tasks"]
    events = []
    for w, recs in enumerate(per_worker):
        events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": w, "args": {"name": f"worker {w}"}})
        for r in recs:
            t = int(r["task_id"])
            op = ops[int(tasks[t, TASK_COLS["OP_INDEX"]])]
            start, wait, run = (int(r["start_ns"]) - t0) / 1e3, int(r["wait_ns"]) / 1e3, int(r["run_ns"]) / 1e3
            args = {"task": t, "step": int(r["step"]), "layer": op["layer"], "tile": int(tasks[t, TASK_COLS["TILE"]])}
            if "prep_ns" in recs.dtype.names:  # the per-task overheads inside wait and run (TraceRecord)
                args = {**args, "prep_us": int(r["prep_ns"]) / 1e3, "post_us": int(r["post_ns"]) / 1e3}
            if "mark_ns" in recs.dtype.names:  # phase marks the body set (csrc/runtime/trace_marks.cuh), from ready
                args.update({f"mark{k}_us": int(m) / 1e3 for k, m in enumerate(r["mark_ns"]) if m})
            if wait > 0:
                events.append({"name": "wait", "cat": "wait", "ph": "X", "pid": rank, "tid": w, "ts": start,
                               "dur": wait, "args": args})
            events.append({"name": op["name"], "cat": op["kind"], "ph": "X", "pid": rank, "tid": w,
                           "ts": start + wait, "dur": run, "args": args})
    events.append({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}})
    return {"traceEvents": events, "displayTimeUnit": "ns",
            "otherData": {"generator": "mpk_dist.runtime.trace", "workers": len(per_worker)}}


def write_trace(path: str | Path, trace: dict) -> Path:
    """Write a trace dict as JSON; returns the path."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(trace))
    return p


def load_trace_with_meta(path: str | Path) -> tuple[list[dict], dict]:
    """The complete ('X') events of a Chrome trace file and its ``otherData`` (what the writer recorded beside the
    events: tp, transport, op_bytes, ...; {} when it has none), from one read of the file; raises InputError on a
    bad file."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise InputError(f"trace file: expected readable Chrome-trace JSON, got {type(exc).__name__}: {exc}") from None
    evs = data.get("traceEvents", data) if isinstance(data, dict) else data
    if not isinstance(evs, list):
        raise InputError(f"trace file {path}: expected a traceEvents list, got {type(evs).__name__}")
    meta = data.get("otherData", {}) if isinstance(data, dict) else {}
    return [e for e in evs if isinstance(e, dict) and e.get("ph") == "X"], meta if isinstance(meta, dict) else {}


def load_trace(path: str | Path) -> list[dict]:
    """The complete ('X') events of a Chrome trace file; raises InputError on a bad file."""
    return load_trace_with_meta(path)[0]


def op_floor(meta: dict, step: int, bandwidth_gbs: float) -> dict:
    """What ``layer_profile`` needs to set each op against its bytes: the trace's ``op_bytes`` (per op of one layer,
    and once-a-step ops) and ``kv_bytes_per_position`` (mpk_dist.bench.op_bytes), the context of decode step ``step``
    (step + 1 cache positions) and the read bandwidth in GB/s. InputError when the trace has no op bytes (written
    before they were recorded, or by another tool) or the bandwidth is not positive."""
    if not bandwidth_gbs or bandwidth_gbs <= 0:
        raise InputError(f"--bandwidth: expected the read bandwidth in GB/s (> 0, e.g. what bench printed), got {bandwidth_gbs}")
    ob = meta.get("op_bytes")
    if not isinstance(ob, dict) or not ob:
        raise InputError("trace: expected otherData.op_bytes (written by `mpk-dist bench --trace` since docs/PERF.md "
                         "v0.43), got none; re-trace the run to compare its ops with their bytes")
    return {"op_bytes": {str(k): int(v) for k, v in ob.items()},
            "kv_bytes_per_position": int(meta.get("kv_bytes_per_position", 0)), "context": step + 1,
            "bandwidth_gbs": float(bandwidth_gbs)}


def summarize(events: list[dict]) -> dict:
    """Run time per op kind (sum, tasks, share) and busy/idle time per (rank, worker).

    Events of category "wait" (a worker waiting for a task's inputs) count as idle. Idle time of a
    worker = the trace span (first event start to last event end, over all workers) minus the
    time it ran tasks; "wait" is the part of that idle time spent waiting on a next task's events.
    """
    if not events:
        raise InputError("trace: expected at least one task event, got none (was the run traced?)")
    t_min = min(e["ts"] for e in events)
    span = max(e["ts"] + e.get("dur", 0) for e in events) - t_min
    kinds: dict[str, list[float]] = defaultdict(lambda: [0.0, 0, 0.0, 0.0])  # run, tasks, prep, post
    busy: dict[tuple, float] = defaultdict(float)
    waiting: dict[tuple, float] = defaultdict(float)
    for e in events:
        key = (e.get("pid", 0), e.get("tid", 0))
        if e.get("cat") == "wait":
            waiting[key] += e.get("dur", 0)
            continue
        k = kinds[e.get("cat") or e.get("name", "?")]
        k[0] += e.get("dur", 0)
        k[1] += 1
        k[2] += e.get("args", {}).get("prep_us", 0.0)
        k[3] += e.get("args", {}).get("post_us", 0.0)
        busy[key] += e.get("dur", 0)
    total = sum(v[0] for v in kinds.values()) or 1.0
    per_kind = sorted(((n, v[0], v[1], v[0] / total) for n, v in kinds.items()), key=lambda x: -x[1])
    overheads = {n: (v[2] / max(v[1], 1), v[3] / max(v[1], 1)) for n, v in kinds.items()}
    keys = sorted(set(busy) | set(waiting))
    per_worker = [(k, busy[k], max(0.0, span - busy[k]), waiting[k]) for k in keys]
    return {"span_us": span, "kinds": per_kind, "workers": per_worker, "overheads": overheads}


def levels(events: list[dict], step: int, rank: int = 0) -> list[dict]:
    """Per op of one step on one rank, in start order: tasks, first start, last end, median run, how
    spread its tiles' starts and ends are, and the gap from the previous op's last end to its first
    start. What shows where a decode step loses time between levels (a late tile holds the next level).
    ``last_ready_us`` / ``last_run_us``: when the tile that ends last had its inputs ready, and its run (the op's
    critical tile: its end is the op's).
    ``mark_median_us``: per phase mark, the median over the tiles that set it (None: no tile did);
    ``wait_median_us``: the median time its tiles waited (turning to the task -> inputs ready, 0 for a tile that
    did not wait), ``prep_median_us`` the median part of that spent issuing its prefetches (TraceRecord.prep_ns);
    ``post_median_us``: the median part of its tiles' runs after the body's block barrier (the fence and the signals,
    TraceRecord.post_ns: the producer's share of a level's hand-over; None where no tile has it).
    ``tail_us``: how long the op's last TAIL_FRACTION of tiles keep it open after the others have ended (its last end
    minus the end of the tile at the 1 - TAIL_FRACTION rank; 0 for an op of one tile): in a wide level, the time with
    fewer SMs streaming than fill the HBM."""
    by_op: dict[str, list[dict]] = defaultdict(list)
    waited: dict[int, float] = {}
    for e in events:
        a = e.get("args", {})
        if a.get("step") != step or e.get("pid", 0) != rank:
            continue
        if e.get("cat") == "wait":
            waited[a.get("task", -1)] = e["dur"]
        else:
            by_op[e["name"]].append(e)
    if not by_op:
        raise InputError(f"trace: expected task events of step {step} on rank {rank}, got none")
    rows, prev_end = [], None
    for name, es in sorted(by_op.items(), key=lambda kv: min(e["ts"] for e in kv[1])):
        starts = np.array([e["ts"] for e in es])
        ends = starts + np.array([e["dur"] for e in es])
        last = int(np.argmax(ends))
        rows.append({"op": name, "kind": es[0].get("cat", "?"), "tasks": len(es), "start_us": float(starts.min()),
                     "end_us": float(ends.max()), "run_median_us": float(np.median(ends - starts)),
                     "last_ready_us": float(starts[last]), "last_run_us": float(ends[last] - starts[last]),
                     "start_spread_us": float(starts.max() - starts.min()),
                     "end_spread_us": float(ends.max() - ends.min()),
                     "gap_us": None if prev_end is None else float(starts.min() - prev_end),
                     "mark_median_us": [_median_arg(es, f"mark{k}_us") for k in range(TRACE_MARKS)],
                     "wait_median_us": float(np.median([waited.get(e["args"].get("task", -1), 0.0) for e in es])),
                     "prep_median_us": _median_arg(es, "prep_us"), "post_median_us": _median_arg(es, "post_us"),
                     "tail_us": _tail(ends)})
        prev_end = float(ends.max())
    return rows


TAIL_FRACTION = 0.1
"""``levels``' tail: the last tenth of an op's tiles (13 of a 128-tile level)."""


def _tail(ends: np.ndarray) -> float:
    """Last end minus the end of the tile at rank ceil((1 - TAIL_FRACTION) n) - 1 of the sorted ends (0 for one tile)."""
    e = np.sort(ends)
    k = max(0, int(np.ceil((1.0 - TAIL_FRACTION) * len(e))) - 1)
    return float(e[-1] - e[k])


def _median_present(values) -> float | None:
    """The median of the values that are not None; None when none is."""
    vals = [v for v in values if v is not None]
    return float(np.median(vals)) if vals else None


def _median_arg(events: list[dict], key: str) -> float | None:
    return _median_present(e.get("args", {}).get(key) for e in events)


def _cell(value: float | None, width: int) -> str:
    """A right-aligned 2-decimal column, blank where no tile set the value."""
    return " " * width if value is None else f"{value:>{width}.2f}"


def format_levels(rows: list[dict]) -> str:
    """``levels`` as a table; the phase-mark columns (median time from the run's start to mark k) appear
    when some op's tiles set marks."""
    marks = [k for k in range(TRACE_MARKS) if any(r["mark_median_us"][k] is not None for r in rows)]
    out = [f"{'op':<22}{'kind':<16}{'tasks':>6}{'start':>11}{'span':>8}{'run med':>9}{'start spr':>10}"
           f"{'end spr':>9}{'tail':>7}{'gap':>7}{'wait med':>9}{'prep med':>9}{'post med':>9}"
           + "".join(f"{f'mark{k}':>8}" for k in marks)]
    for r in rows:
        gap = "" if r["gap_us"] is None else f"{r['gap_us']:.2f}"
        mk = [r["mark_median_us"][k] for k in marks]
        out.append(f"{r['op']:<22}{r['kind']:<16}{r['tasks']:>6}{r['start_us']:>11.1f}{r['end_us'] - r['start_us']:>8.2f}"
                   f"{r['run_median_us']:>9.2f}{r['start_spread_us']:>10.2f}{r['end_spread_us']:>9.2f}"
                   f"{_cell(r.get('tail_us'), 7)}{gap:>7}"
                   f"{r['wait_median_us']:>9.2f}{_cell(r['prep_median_us'], 9)}{_cell(r.get('post_median_us'), 9)}"
                   + "".join(_cell(m, 8) for m in mk))
    return "\n".join(out)


_LAYER_OP = re.compile(r"^L(\d+)\.(.+)$")


def layer_profile(rows: list[dict], floor: dict | None = None) -> list[dict]:
    """``levels`` rows folded over the layers: per op of a layer ("L<i>.<op>", by <op>) and per op outside them
    (embedding, lm_head, ...), in first-start order: how many layers, the medians of span, run, gap and wait, and
    ``adds_us``: the time the op adds to the step's timeline, summed over its layers (its last end minus the previous
    op's last end, the first op its span; an op that ends before the previous one adds 0), with ``share`` of the step
    (first start to last end). The ``adds`` of all ops sum to the step: the table says where a step's time goes.
    ``lag_us`` splits ``adds_us``: the part before the op's critical tile (the one ending last) had its inputs ready,
    i.e. the previous op's end -> that tile ready (the signal reaching its waiter, the wait's barrier; 0 where the
    tile was ready before the previous op ended), summed over the layers; the rest of ``adds_us`` is that tile's run.
    Rows without ``last_ready_us`` (older callers) count no lag. ``post_median_us``: the median over the layers of
    the op's post medians (the fence and signals after its tiles' bodies; None where no row has one);
    ``tail_median_us``: the median of its rows' ``tail_us`` (None where no row has one).
    ``floor`` (``op_floor``): also ``bytes`` (what the op reads in one of its layers: its weights, and for the
    attention its cache rows at the step's context), ``floor_us`` (those bytes at the read bandwidth, summed over its
    layers) and ``over_us`` (``adds_us`` minus ``floor_us``: the time the op holds the step above the floor); an op
    that reads no weights (silu_mul, step_begin, argmax, ...) has bytes 0. An op's name is matched by its part
    before a '/' (attention/split -> attention)."""
    if not rows:
        raise InputError("trace: expected the levels of a step, got none")
    groups: dict[str, list[dict]] = {}
    first = prev_end = rows[0]["start_us"]  # rows come in start order: the step's timeline starts here
    for r in rows:
        m = _LAYER_OP.match(r["op"])
        adds = max(0.0, r["end_us"] - prev_end)
        ready = r.get("last_ready_us", prev_end)
        groups.setdefault(m.group(2) if m else r["op"], []).append(
            {**r, "adds_us": adds, "lag_us": min(adds, max(0.0, ready - prev_end)), "in_layer": bool(m)})
        prev_end = max(prev_end, r["end_us"])
    step = prev_end - first
    out = []
    for key, rs in groups.items():
        adds = sum(r["adds_us"] for r in rs)
        out.append({"op": key, "kind": rs[0]["kind"], "layers": len(rs) if rs[0]["in_layer"] else 0,
                    "span_median_us": float(np.median([r["end_us"] - r["start_us"] for r in rs])),
                    "run_median_us": float(np.median([r["run_median_us"] for r in rs])),
                    "gap_median_us": _median_present(r["gap_us"] for r in rs),
                    "wait_median_us": float(np.median([r["wait_median_us"] for r in rs])),
                    "post_median_us": _median_present(r.get("post_median_us") for r in rs),
                    "tail_median_us": _median_present(r.get("tail_us") for r in rs),
                    "adds_us": adds, "lag_us": sum(r["lag_us"] for r in rs),
                    "share": adds / step if step > 0 else 0.0})
        if floor is not None:
            base = key.split("/")[0]
            nbytes = floor["op_bytes"].get(base, 0)
            if base == "attention":
                nbytes += floor["kv_bytes_per_position"] * floor["context"]
            fl = len(rs) * nbytes / (floor["bandwidth_gbs"] * 1e3)  # B / (GB/s) in us
            out[-1].update({"bytes": nbytes, "floor_us": fl, "over_us": adds - fl})
    return out


def format_layer_profile(prof: list[dict]) -> str:
    """``layer_profile`` as a table, with the step's total; "lag" is the part of "adds" before each op's critical tile
    was ready, "post med" the median fence-and-signals part of its tiles' runs, "tail med" the median time its last
    tenth of tiles kept it open (blank where the trace has none). With a floor (``layer_profile(rows, floor)``) also
    "MB" (an op's bytes in one layer), "floor (us)" (its bytes at the read bandwidth over its layers) and
    "over (us)" (adds minus floor)."""
    with_floor = any("floor_us" in p for p in prof)
    fl_head = f"{'MB':>9}{'floor (us)':>11}{'over (us)':>10}" if with_floor else ""
    out = [f"{'op (over layers)':<22}{'kind':<22}{'layers':>7}{'span med':>9}{'run med':>9}{'gap med':>9}"
           f"{'wait med':>9}{'post med':>9}{'tail med':>9}{'adds (us)':>11}{'lag (us)':>10}{'share':>8}" + fl_head]
    for p in prof:
        fl = (f"{p['bytes'] / 1e6:>9.2f}{p['floor_us']:>11.1f}{p['over_us']:>10.1f}" if "floor_us" in p
              else (" " * 30 if with_floor else ""))
        out.append(f"{p['op']:<22}{p['kind']:<22}{p['layers'] or '-':>7}{p['span_median_us']:>9.2f}"
                   f"{p['run_median_us']:>9.2f}{_cell(p['gap_median_us'], 9)}{p['wait_median_us']:>9.2f}"
                   f"{_cell(p.get('post_median_us'), 9)}{_cell(p.get('tail_median_us'), 9)}{p['adds_us']:>11.1f}"
                   f"{p.get('lag_us', 0.0):>10.1f}{p['share']:>8.1%}" + fl)
    total_fl = ""
    if with_floor:
        total_fl = (f"{'':>9}{sum(p.get('floor_us', 0.0) for p in prof):>11.1f}"
                    f"{sum(p.get('over_us', p['adds_us']) for p in prof):>10.1f}")
    out.append(f"{'step':<22}{'':<22}{'':>7}{'':>9}{'':>9}{'':>9}{'':>9}{'':>9}{'':>9}{sum(p['adds_us'] for p in prof):>11.1f}"
               f"{sum(p.get('lag_us', 0.0) for p in prof):>10.1f}{sum(p['share'] for p in prof):>8.1%}" + total_fl)
    return "\n".join(out)


def format_summary(s: dict) -> str:
    """The summary as text tables (op kinds by run time; per-worker busy/idle/wait)."""
    lines = [f"trace span: {s['span_us']:.1f} us", "",
             f"{'op kind':<20}{'run (us)':>12}{'tasks':>8}{'share':>8}{'prep/task':>11}{'post/task':>11}"]
    for name, t, n, share in s["kinds"]:
        prep, post = s.get("overheads", {}).get(name, (0.0, 0.0))
        lines.append(f"{name:<20}{t:>12.1f}{n:>8d}{share:>8.1%}{prep:>11.2f}{post:>11.2f}")
    idle = [w[2] for w in s["workers"]]
    lines += ["", f"{'rank/worker':<14}{'busy (us)':>12}{'idle (us)':>12}{'of which wait':>15}{'idle %':>8}"]
    for (pid, tid), b, i, wt in s["workers"]:
        lines.append(f"{f'{pid}/{tid}':<14}{b:>12.1f}{i:>12.1f}{wt:>15.1f}{i / max(s['span_us'], 1e-9):>8.1%}")
    lines.append(f"idle per worker: mean {np.mean(idle):.1f} us, max {np.max(idle):.1f} us over {len(idle)} workers")
    return "\n".join(lines)

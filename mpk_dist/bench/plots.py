"""PNG plots of benchmark records and of a kernel trace (matplotlib, imported lazily, Agg backend).

- :func:`plot_latency`: per model, ms/token (p50) against tp (one line per backend and batch) and
  against batch (one line per backend and tp), with the floor dashed when the records carry it.
- :func:`plot_timeline`: per-SM task timeline of a trace, coloured by layer, communication
  hatched, plus per-layer durations.
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path
from typing import Any

from mpk_dist.bench.trace import TraceEvent, is_comm, layer_spans
from mpk_dist.errors import BackendUnavailable


def _pyplot():
    """matplotlib.pyplot with the non-interactive Agg backend."""
    try:
        import matplotlib
    except ImportError:
        raise BackendUnavailable(
            "plots: expected matplotlib, got ImportError; pip install 'mpk_dist[report]' or drop --plots"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _series(records: list[dict[str, Any]], x_key: str, line_key: str) -> dict[tuple, list[tuple]]:
    """{(backend, line value): sorted [(x, p50, floor)]} for one model's records."""
    series: dict[tuple, list[tuple]] = defaultdict(list)
    for rec in records:
        series[(rec["backend"], rec[line_key])].append((rec[x_key], rec["ms_per_token_p50"], rec.get("floor_ms_per_token")))
    return {k: sorted(v) for k, v in sorted(series.items(), key=lambda kv: (str(kv[0][0]), kv[0][1]))}


def _axis(ax, series: dict[tuple, list[tuple]], x_label: str, line_label: str) -> None:
    """Draw one panel: a line per (backend, value), floors dashed."""
    for (backend, value), points in series.items():
        xs = [p[0] for p in points]
        ax.plot(xs, [p[1] for p in points], marker="o", label=f"{backend} {line_label}={value}")
        floors = [(p[0], p[2]) for p in points if p[2]]
        if floors:
            ax.plot([f[0] for f in floors], [f[1] for f in floors], linestyle="--", color="grey", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel(x_label)
    ax.set_ylabel("ms / token (p50)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)


def _safe(name: str) -> str:
    """A model name usable in a file name."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


def plot_latency(records: list[dict[str, Any]], out_dir: str | Path) -> list[Path]:
    """Write latency_<model>.png per model; return the paths."""
    plt = _pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    by_model: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for rec in records:
        by_model[rec["model"]].append(rec)
    paths = []
    for model, recs in sorted(by_model.items()):
        fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
        _axis(left, _series(recs, "tp", "batch"), "tensor-parallel degree", "batch")
        _axis(right, _series(recs, "batch", "tp"), "batch size", "tp")
        fig.suptitle(f"{model}: decode latency per token (dashed: floor)")
        fig.tight_layout()
        path = out / f"latency_{_safe(model)}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def plot_timeline(events: list[TraceEvent], out_png: str | Path, title: str = "") -> Path:
    """Per-SM timeline (rows = SMs of the first rank) coloured by layer, with layer durations below."""
    plt = _pyplot()
    rank = min(e.rank for e in events)
    mine = [e for e in events if e.rank == rank]
    t0 = min(e.ts for e in mine)
    spans = layer_spans(mine)
    cmap = plt.get_cmap("tab20")
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(12, 6), gridspec_kw={"height_ratios": [3, 1]})
    by_sm: dict[int, list[TraceEvent]] = defaultdict(list)
    for e in mine:
        by_sm[e.sm].append(e)
    for sm, sm_events in by_sm.items():
        # One broken_barh call per (layer, comm) group: thousands of tasks stay fast to draw.
        groups: dict[tuple, list[tuple[float, float]]] = defaultdict(list)
        for e in sm_events:
            groups[(e.layer or 0, is_comm(e.op))].append((e.ts - t0, e.dur))
        for (layer, comm), bars in groups.items():
            top.broken_barh(bars, (sm - 0.4, 0.8), facecolors=cmap(layer % 20),
                            hatch="////" if comm else "", linewidth=0)
    top.set_ylabel("SM")
    top.set_xlabel("time (us)")
    top.set_title(title or f"rank {rank}: tasks per SM, colour = layer, hatched = communication")
    layers = list(spans)
    bottom.bar([str(l) for l in layers], [spans[l][1] - spans[l][0] for l in layers],
               color=[cmap(l % 20) for l in layers])
    bottom.set_xlabel("layer")
    bottom.set_ylabel("span (us)")
    fig.tight_layout()
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out

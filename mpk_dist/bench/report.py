"""Merge benchmark records into one table: terminal (rich or plain), CSV and Markdown.

Rows are sorted by model, backend, transport, tp, batch and replicas. Each column is
(header with unit, how to read it from a record, how to print it); the same list drives every
output, so the three formats never disagree.
"""

from __future__ import annotations

import csv
import io
import sys
from pathlib import Path
from typing import Any, Callable, TextIO


def _check(rec: dict[str, Any]) -> str:
    """Correctness column: OK / FAILED when the bench recorded a check, '-' otherwise."""
    value = rec.get("correct", (rec.get("extra") or {}).get("correct"))
    return "-" if value is None else ("OK" if value else "FAILED")


def _pct(value: Any) -> Any:
    """Fraction to percent (None stays None)."""
    return None if value is None else 100.0 * value


# (header, getter, format for text outputs)
COLUMNS: list[tuple[str, Callable[[dict[str, Any]], Any], str]] = [
    ("model", lambda r: r["model"], "{}"),
    ("backend", lambda r: r["backend"], "{}"),
    ("transport", lambda r: r.get("transport"), "{}"),
    ("tp", lambda r: r["tp"], "{}"),
    ("batch", lambda r: r["batch"], "{}"),
    ("dp", lambda r: r.get("dp_replicas", 1), "{}"),
    ("p50 ms/tok", lambda r: r["ms_per_token_p50"], "{:.3f}"),
    ("p90 ms/tok", lambda r: r.get("ms_per_token_p90"), "{:.3f}"),
    ("p99 ms/tok", lambda r: r.get("ms_per_token_p99"), "{:.3f}"),
    ("tok/s", lambda r: r.get("tokens_per_s_total") or r.get("tokens_per_s"), "{:.1f}"),
    ("floor ms", lambda r: r.get("floor_ms_per_token"), "{:.3f}"),
    ("x floor", lambda r: r.get("ratio_to_floor"), "{:.2f}"),
    ("exposed comm %", lambda r: _pct(r.get("exposed_comm_share")), "{:.1f}"),
    ("prefill ms", lambda r: None if r.get("prefill_latency") is None else 1e3 * r["prefill_latency"], "{:.2f}"),
    ("check", _check, "{}"),
    ("gpu", lambda r: r.get("gpu"), "{}"),
    ("git", lambda r: (r.get("git_commit") or "")[:10] or None, "{}"),
]

SORT_KEYS = ("model", "backend", "transport", "tp", "batch", "dp_replicas")


def sort_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Records in table order (None sorts first, numbers numerically)."""
    def key(rec: dict[str, Any]) -> tuple:
        return tuple((rec.get(k) is not None, rec.get(k) if rec.get(k) is not None else 0) for k in SORT_KEYS)

    return sorted(records, key=key)


def table_rows(records: list[dict[str, Any]]) -> list[list[Any]]:
    """Raw cell values (numbers stay numbers) in table order."""
    return [[get(rec) for _, get, _ in COLUMNS] for rec in sort_records(records)]


def _text(value: Any, fmt: str) -> str:
    """One cell as text; missing values print as '-'."""
    return "-" if value is None else fmt.format(value)


def text_rows(records: list[dict[str, Any]]) -> list[list[str]]:
    """Formatted cells in table order."""
    return [[_text(v, fmt) for v, (_, _, fmt) in zip(row, COLUMNS)] for row in table_rows(records)]


def headers() -> list[str]:
    """Column headers with units."""
    return [name for name, _, _ in COLUMNS]


def write_csv(records: list[dict[str, Any]], path: str | Path) -> Path:
    """CSV with full-precision numbers (empty cell for missing values)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(headers())
        for row in table_rows(records):
            writer.writerow(["" if v is None else v for v in row])
    return path


def to_markdown(records: list[dict[str, Any]]) -> str:
    """A GitHub-flavoured Markdown table (numbers right-aligned)."""
    numeric = {i for i, (_, _, fmt) in enumerate(COLUMNS) if fmt != "{}"} | {3, 4, 5}
    lines = ["| " + " | ".join(headers()) + " |",
             "|" + "|".join("---:" if i in numeric else "---" for i in range(len(COLUMNS))) + "|"]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in text_rows(records)]
    return "\n".join(lines) + "\n"


def plain_table(records: list[dict[str, Any]]) -> str:
    """Fixed-width text table (used when rich is not installed)."""
    rows = [headers()] + text_rows(records)
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    out = io.StringIO()
    for n, row in enumerate(rows):
        out.write("  ".join(cell.rjust(w) for cell, w in zip(row, widths)).rstrip() + "\n")
        if n == 0:
            out.write("  ".join("-" * w for w in widths) + "\n")
    return out.getvalue()


def print_table(records: list[dict[str, Any]], file: TextIO | None = None, use_rich: bool | None = None) -> None:
    """Print the merged table: rich when installed and writing to a terminal, else plain text."""
    file = file or sys.stdout
    if use_rich is None:
        use_rich = file.isatty()
    if use_rich:
        try:
            from rich.console import Console
            from rich.table import Table
        except ImportError:
            use_rich = False
    if not use_rich:
        file.write(plain_table(records))
        return
    table = Table(title=f"mpk-dist results ({len(records)} runs)")
    for i, name in enumerate(headers()):
        table.add_column(name, justify="right" if COLUMNS[i][2] != "{}" or i in (3, 4, 5) else "left")
    for row in text_rows(records):
        table.add_row(*row)
    # Off a terminal rich would squeeze the table into 80 columns; give it room instead.
    width = None if file.isatty() else max(120, len(plain_table(records).splitlines()[0]) + 3 * len(COLUMNS) + 4)
    Console(file=file, width=width).print(table)

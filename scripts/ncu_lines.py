#!/usr/bin/env python3
"""Top source lines of an Nsight Compute PC-sampling profile, with their main stall reasons.

Input: the CSV of ``ncu --import P.ncu-rep --page source --csv --print-source cuda,sass`` (gzip or plain) of a
kernel built with ``-lineinfo`` (``MPK_NVCC_EXTRA_FLAGS=-lineinfo``). The export lists, per source file, each
line's aggregated counters; this prints the lines with the most warp samples over all files, the stall reasons
that make up each, and a per-file total. Why: the mega-kernel's SASS carries no per-task function names, so
samples only say which task kind they belong to through the source line.

Usage: ``python3 scripts/ncu_lines.py ncu_cuda_sass.csv.gz [--top 40] [--file attention]``
"""

from __future__ import annotations

import argparse
import csv
import gzip
import io
from collections import defaultdict

SAMPLES = "Warp Stall Sampling (All Samples)"


def read_lines(path: str) -> dict[tuple[str, int], dict[str, float]]:
    """{(file, line): {counter: value}} from the cuda,sass export (source-line rows only)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", errors="replace") as f:
        text = f.read()
    out: dict[tuple[str, int], dict[str, float]] = {}
    current, header = "?", None
    for row in csv.reader(io.StringIO(text)):
        if not row:
            continue
        if row[0] in ("File Path", "File Name"):
            current, header = row[1], None
            continue
        if row[0] == "Line No":
            header = row
            continue
        if header is None or not row[0].strip().isdigit():
            continue  # a SASS row of the line above, or a preamble row
        vals = {}
        for name, v in zip(header, row):
            if name.startswith("stall_") and "Not Issued" not in name or name == SAMPLES:
                try:
                    vals[name] = float(v)
                except ValueError:
                    pass
        out[(current, int(row[0]))] = vals | {"_src": row[1] if len(row) > 1 else ""}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--file", default="", help="only files whose path contains this")
    a = ap.parse_args()
    lines = read_lines(a.csv)
    total = sum(v.get(SAMPLES, 0) for v in lines.values()) or 1
    per_file: dict[str, float] = defaultdict(float)
    for (f, _), v in lines.items():
        per_file[f] += v.get(SAMPLES, 0)
    print(f"{int(total)} samples; per file:")
    for f, s in sorted(per_file.items(), key=lambda x: -x[1])[:15]:
        print(f"  {100 * s / total:6.2f}%  {f}")
    chosen = [(k, v) for k, v in lines.items() if a.file in k[0]]
    chosen.sort(key=lambda kv: -kv[1].get(SAMPLES, 0))
    print(f"\ntop {a.top} lines{' in *' + a.file + '*' if a.file else ''}:")
    for (f, ln), v in chosen[:a.top]:
        s = v.get(SAMPLES, 0)
        stalls = sorted(((n[6:], x) for n, x in v.items() if n.startswith("stall_") and x), key=lambda t: -t[1])[:3]
        why = ", ".join(f"{n} {100 * x / s:.0f}%" for n, x in stalls) if s else ""
        print(f"{100 * s / total:6.2f}%  {f.split('/')[-1]}:{ln}  [{why}]  {v['_src'].strip()[:90]}")


if __name__ == "__main__":
    main()

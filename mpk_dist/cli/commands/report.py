"""``mpk-dist report``: merge bench JSON files into a table (terminal, CSV, Markdown) and plots.

    mpk-dist report results/*.json --csv out.csv --markdown out.md --plots plots/ --trace trace.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``report`` parser."""
    parser = subparsers.add_parser(
        "report", help="merge bench results into a table and plots",
        description="Merge mpk-dist bench --output-json files (or directories of them) into one table.",
    )
    parser.add_argument("results", nargs="+", help="result JSON files or directories holding them")
    parser.add_argument("--csv", metavar="FILE", help="write the table as CSV")
    parser.add_argument("--markdown", metavar="FILE", help="write the table as Markdown")
    parser.add_argument("--plots", metavar="DIR", help="write PNG plots (latency vs tp and batch per backend)")
    parser.add_argument("--trace", metavar="TRACE_JSON",
                        help="also plot a per-layer timeline of this Chrome/Perfetto trace (into --plots or .)")
    parser.add_argument("--plain", action="store_true", help="plain-text table even when rich is installed")
    parser.set_defaults(func=run)


def _trace_summary(path: str, out_dir: Path) -> None:
    """Plot the trace timeline and print per-layer spans and the exposed communication share."""
    from mpk_dist.bench.plots import plot_timeline
    from mpk_dist.bench.trace import exposed_comm_share, layer_spans, load_trace

    events = load_trace(path)
    png = plot_timeline(events, out_dir / f"timeline_{Path(path).stem}.png")
    spans = layer_spans(events)
    print(f"trace {path}: {len(events)} tasks, {len(spans)} layers, "
          f"exposed communication {100 * exposed_comm_share(events):.1f}% of wall time")
    for layer, (start, end) in spans.items():
        print(f"  layer {layer:3d}: {end - start:10.2f} us")
    print(f"wrote {png}")


def run(args: argparse.Namespace) -> int:
    """Load the records, print the table, write the requested files."""
    from mpk_dist.bench.progress import track
    from mpk_dist.bench.report import print_table, to_markdown, write_csv
    from mpk_dist.bench.results import load_results

    paths = list(args.results)
    records = []
    for path in track(paths, description="loading results", enabled=len(paths) > 50 and sys.stderr.isatty()):
        records.extend(load_results([path]))
    print_table(records, use_rich=False if args.plain else None)
    if args.csv:
        print(f"wrote {write_csv(records, args.csv)}")
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(to_markdown(records))
        print(f"wrote {args.markdown}")
    if args.plots:
        from mpk_dist.bench.plots import plot_latency

        for png in plot_latency(records, args.plots):
            print(f"wrote {png}")
    if args.trace:
        _trace_summary(args.trace, Path(args.plots or "."))
    return 0

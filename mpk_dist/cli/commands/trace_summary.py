"""``mpk-dist trace-summary FILE.json``: time per op kind and idle time per SM of a mega-kernel trace."""

from __future__ import annotations

import json


def register(subparsers) -> None:
    """Add the trace-summary sub-command."""
    p = subparsers.add_parser("trace-summary", help="summarise a --trace file: time per op kind, idle time per SM")
    p.add_argument("file", metavar="FILE.json", help="Chrome/Perfetto trace written by --trace")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--levels", type=int, default=None, metavar="STEP",
                   help="instead: per op of decode step STEP (rank 0), its span, tiles' start/end spread and the "
                        "gap after the previous op (where a step loses time between levels), then the same folded "
                        "over the layers with the time each op adds to the step")
    p.add_argument("--bandwidth", type=float, default=None, metavar="GBS",
                   help="with --levels: the read bandwidth in GB/s (what bench printed for the traced run); the folded "
                        "table then sets each op against the bytes it reads (MB, its floor at this bandwidth, and the "
                        "time it adds above that floor)")
    p.set_defaults(func=run)


def run(args) -> int:
    """Print the summary; InputError (exit 2) for a missing or malformed file."""
    from mpk_dist.runtime.trace import format_summary, load_trace, summarize

    if args.bandwidth is not None and args.levels is None:
        from mpk_dist.errors import InputError

        raise InputError("--bandwidth: expected with --levels STEP (it sets the folded per-op table against the floor)")
    if args.levels is not None:
        from mpk_dist.runtime.trace import format_layer_profile, format_levels, layer_profile, levels, load_trace_with_meta, op_floor

        events, meta = load_trace_with_meta(args.file)  # one read of a trace that may hold millions of events
        rows = levels(events, args.levels)
        floor = None if args.bandwidth is None else op_floor(meta, args.levels, args.bandwidth)
        if args.json:
            print(json.dumps(rows if floor is None else {"levels": rows, "layers": layer_profile(rows, floor)}))
        else:  # per op, then the same folded over the layers: where the step's time goes
            print(format_levels(rows) + "\n\n" + format_layer_profile(layer_profile(rows, floor)))
        return 0
    s = summarize(load_trace(args.file))
    if args.json:
        print(json.dumps({"span_us": s["span_us"],
                          "kinds": [{"kind": k, "us": t, "tasks": n, "share": sh, "prep_us_per_task": s["overheads"][k][0],
                                     "post_us_per_task": s["overheads"][k][1]} for k, t, n, sh in s["kinds"]],
                          "workers": [{"rank": pw[0], "worker": pw[1], "busy_us": b, "idle_us": i, "wait_us": w}
                                      for pw, b, i, w in s["workers"]]}))
    else:
        print(format_summary(s))
    return 0

"""``mpk-dist superopt``: run the superoptimizer on one of the fusable LLM patterns.

Example: ``mpk-dist superopt --pattern rmsnorm_linear --shape M=8,K=4096,N=1024``. A progress line
on stderr updates while the search runs; the chosen µGraph, the runners-up and the search
statistics print on stdout (``--json`` prints them as JSON instead). ``--compare-prune`` runs the
search with and without abstract-expression pruning (same bounds, ``--timeout`` each) and prints
both statistics and whether the best graphs are the same (docs/SUPEROPT.md "Results").
"""

from __future__ import annotations

import json
import sys
import time

from mpk_dist.errors import InputError

# Search bounds per pattern: the smallest that contain the fused forms (docs/SUPEROPT.md).
PATTERN_BOUNDS = {
    "rmsnorm_linear": {"max_kernel_ops": 2, "max_block_ops": 6},
    "silu_mul_linear": {"max_kernel_ops": 2, "max_block_ops": 4},
    "attention_decode": {"max_kernel_ops": 2, "max_block_ops": 4},
    "qk_norm_rope": {"max_kernel_ops": 2, "max_block_ops": 5},
}


def parse_shape(text: str | None) -> dict:
    """``"M=8,K=4096"`` -> {"M": 8, "K": 4096}."""
    if not text:
        return {}
    out = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        if not sep or not value.strip().isdigit():
            raise InputError(f"--shape: expected NAME=INT[,NAME=INT...], got {text!r}; "
                             "e.g. --shape M=8,K=4096,N=1024")
        out[key.strip()] = int(value)
    return out


def parse_counts(text: str | None, flag: str) -> tuple | None:
    """``"16,32"`` -> (16, 32); None when the flag is absent."""
    if text is None:
        return None
    parts = [x.strip() for x in text.split(",")]
    if not parts or not all(x.isdigit() and int(x) >= 1 for x in parts):
        raise InputError(f"{flag}: expected positive integers separated by commas, got "
                         f"{text!r}; e.g. {flag} 64,128")
    return tuple(sorted({int(x) for x in parts}))


def register(subparsers) -> None:
    """Add the ``superopt`` sub-command."""
    from mpk_dist.superopt.patterns import DEFAULT_SHAPES

    p = subparsers.add_parser(
        "superopt", help="search fused µGraphs for an LLM subgraph (CPU)",
        description="Superoptimize one pattern: enumerate µGraphs, prune with z3, verify over "
                    "finite fields and against torch, rank by the cost model.")
    p.add_argument("--pattern", required=True, choices=sorted(DEFAULT_SHAPES))
    p.add_argument("--shape", default=None,
                   help="sizes, e.g. M=8,K=4096,N=1024 (defaults: "
                        + "; ".join(f"{k}: {v}" for k, v in DEFAULT_SHAPES.items()) + ")")
    p.add_argument("--max-kernel-ops", type=int, default=None)
    p.add_argument("--max-block-ops", type=int, default=None)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds (default 120)")
    p.add_argument("--processes", type=int, default=None, help="worker processes (default: CPUs)")
    p.add_argument("--grid-counts", default=None,
                   help="grid block counts to try per axis, e.g. 64,128 (default 2..256)")
    p.add_argument("--loop-counts", default=None,
                   help="for-loop iteration counts to try, e.g. 16 (default 2..64)")
    p.add_argument("--no-prune", action="store_true", help="disable abstract-expression pruning")
    p.add_argument("--compare-prune", action="store_true",
                   help="run with and without pruning (--timeout each); print both stats and "
                        "whether the best graphs are equal (exit 1 unless equal and complete)")
    p.add_argument("--no-cache", action="store_true", help="ignore and do not write the cache")
    p.add_argument("--top", type=int, default=3, help="runners-up to print (default 3)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run)


class _Progress:
    """One stderr line, rewritten in place (only when stderr is a terminal, else every 5 s)."""

    def __init__(self, label: str = "superopt") -> None:
        self.label = label
        self.start = time.monotonic()
        self.tty = sys.stderr.isatty()
        self.last = 0.0

    def __call__(self, s: dict) -> None:
        now = time.monotonic()
        if not self.tty and now - self.last < 5.0:
            return
        self.last = now
        line = (f"{self.label}: {now - self.start:6.1f} s  explored {s.get('explored', 0):>10,}  "
                f"pruned {s.get('pruned', 0):>10,}  z3 {s.get('z3_queries', 0):>6,}")
        print(("\r" + line) if self.tty else line, end="" if self.tty else "\n",
              file=sys.stderr, flush=True)

    def done(self) -> None:
        if self.tty:
            print(file=sys.stderr)


def _bounds(args) -> dict:
    bounds = dict(PATTERN_BOUNDS[args.pattern])
    if args.max_kernel_ops is not None:
        bounds["max_kernel_ops"] = args.max_kernel_ops
    if args.max_block_ops is not None:
        bounds["max_block_ops"] = args.max_block_ops
    for key, flag in (("grid_counts", "--grid-counts"), ("loop_counts", "--loop-counts")):
        counts = parse_counts(getattr(args, key), flag)
        if counts is not None:
            bounds[key] = counts
    return bounds


def run(args) -> int:
    """Run the search and print the result; exit 1 when nothing verified."""
    from mpk_dist.superopt import superoptimize
    from mpk_dist.superopt.patterns import build

    if args.compare_prune and args.no_prune:
        raise InputError("superopt: expected at most one of --compare-prune and --no-prune, got "
                         "both; --compare-prune already runs the search without pruning")
    g = build(args.pattern, parse_shape(args.shape))
    bounds = _bounds(args)
    if args.compare_prune:
        return _run_compare(args, g, bounds)
    progress = _Progress()
    res = superoptimize(g, timeout_s=args.timeout, prune=not args.no_prune,
                        processes=args.processes, cache=not args.no_cache,
                        progress=progress, **bounds)
    progress.done()
    if args.json:
        print(json.dumps({"pattern": args.pattern, "stats": res.stats,
                          "best": str(res.best) if res.best else None,
                          "candidates": [{"cost": c.cost, "text": str(c)}
                                         for c in res.candidates]}, indent=2, default=str))
    else:
        _print_text(res, args)
    return 0 if res.best is not None else 1


def _run_compare(args, g, bounds: dict) -> int:
    """Both searches, a table of their stats and the verdict; exit 0 only when the comparison
    is complete (no timeout) and the best graphs are equal."""
    from mpk_dist.superopt.compare import compare_prune

    bars: dict = {}

    def report(flag: str, stats: dict) -> None:
        if flag not in bars:  # first call: that search starts (elapsed is per search)
            bars[flag] = _Progress(f"superopt prune={flag}")
        bars[flag](stats)

    cmp = compare_prune(g, timeout_s=args.timeout, processes=args.processes,
                        cache=not args.no_cache, progress=report, **bounds)
    for bar in bars.values():
        bar.done()
    ok = cmp.complete and bool(cmp.same_best)
    if args.json:
        print(json.dumps({"pattern": args.pattern, "shape": args.shape, "bounds": bounds,
                          "rows": cmp.rows(), "complete": cmp.complete,
                          "same_best": cmp.same_best,
                          "best": str(cmp.pruned.best) if cmp.pruned.best else None},
                         indent=2, default=str))
        return 0 if ok else 1
    print(f"pattern {args.pattern}  shape {args.shape or 'default'}  bounds "
          + " ".join(f"{k}={v}" for k, v in bounds.items()) + f"  timeout {args.timeout:g} s each")
    print(cmp.table())
    print(cmp.verdict())
    if cmp.pruned.best is not None:
        print("\nbest (prune=on) " + str(cmp.pruned.best))
    return 0 if ok else 1


def _print_text(res, args) -> None:
    s = res.stats
    print(f"pattern {args.pattern}  shape {args.shape or 'default'}  "
          f"{'(cached) ' if s.get('cached') else ''}{s['seconds']:.2f} s")
    print("stats: " + ", ".join(f"{k}={v}" for k, v in s.items() if k != "seconds"))
    if res.best is None:
        print("no verified µGraph found: raise --max-kernel-ops/--max-block-ops or --timeout")
        return
    print("\nbest " + str(res.best))
    for i, c in enumerate(res.candidates[1:1 + args.top], start=2):
        print(f"\n#{i}: est {c.cost['time_us']:.2f} us, {len(c.kernel_ops)} kernel op(s), "
              f"{c.cost['dram_bytes'] / 1e6:.3f} MB")

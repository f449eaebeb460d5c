"""``mpk-dist bench-linear``: one linear tile kind alone over a whole weight matrix of a preset, at
several batches, scalar vs tensor-core tiles; achieved GB/s and the fraction of the read bandwidth
measured in the same run (mpk_dist.bench.linear_alone):

    mpk-dist bench-linear --model qwen3-8b --batches 1,4,8,16 --output-json linear.json
"""

from __future__ import annotations


def register(subparsers) -> None:
    """Add ``bench-linear`` to the CLI."""
    from mpk_dist.bench.linear_alone import MATRICES, VARIANTS

    p = subparsers.add_parser("bench-linear", help="a linear tile alone over a weight matrix: GB/s and %% of the "
                                                   "read bandwidth, scalar vs tensor-core tiles (GPU)")
    p.add_argument("--model", default="qwen3-8b", help="preset whose layer shapes are used (default qwen3-8b)")
    p.add_argument("--tp", type=int, default=1, help="shapes of one rank at this tensor parallelism (default 1)")
    p.add_argument("--matrices", default=",".join(MATRICES), help=f"comma list of {', '.join(MATRICES)}")
    p.add_argument("--batches", default="1,4,8,16", help="comma list of batches 1..16 (default 1,4,8,16)")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help="comma list of scalar, mma, tma, pipe (mma runs for batch >= 2 only; default all)")
    p.add_argument("--threads", type=int, default=512, help="worker threads per block, as MPK_WORKER_THREADS "
                                                            "(default 512)")
    p.add_argument("--unroll", type=int, default=8, help="16-byte weight loads in flight per lane, as "
                                                         "MPK_LINEAR_UNROLL (default 8)")
    p.add_argument("--iters", type=int, default=50, help="launches per timing (default 50)")
    p.add_argument("--sms", type=int, default=None, help="tiles per matrix as the lowering makes them for this many "
                                                         "SMs (default: the GPU's SM count)")
    p.add_argument("--output-json", default=None, metavar="PATH", help="write the environment and rows as JSON")
    p.set_defaults(func=main)


def options(args):
    """Checked ``BenchOptions`` from the parsed flags (InputError on a bad value)."""
    from mpk_dist.bench.linear_alone import MATRICES, VARIANTS, BenchOptions, parse_batches, parse_list
    from mpk_dist.errors import InputError
    from mpk_dist.runtime.codegen import LINEAR_UNROLLS, WORKER_THREADS

    if args.threads not in WORKER_THREADS:
        raise InputError(f"--threads: expected one of {', '.join(map(str, WORKER_THREADS))}, got {args.threads}")
    if args.unroll not in LINEAR_UNROLLS:
        raise InputError(f"--unroll: expected one of {', '.join(map(str, LINEAR_UNROLLS))}, got {args.unroll}")
    if args.iters < 1 or (args.sms is not None and args.sms < 1):
        raise InputError(f"--iters/--sms: expected positive integers, got {args.iters}/{args.sms}")
    return BenchOptions(model=args.model, tp=args.tp, matrices=parse_list(args.matrices, MATRICES, "--matrices"),
                        batches=parse_batches(args.batches), variants=parse_list(args.variants, VARIANTS, "--variants"),
                        threads=args.threads, unroll=args.unroll, iters=args.iters, sms=args.sms,
                        output_json=args.output_json)


def main(args) -> int:
    """Validate the flags, then measure (0 when every row's output matched torch)."""
    from mpk_dist.bench.linear_alone import matrix_shapes, run
    from mpk_dist.models.presets import get_preset

    opts = options(args)
    matrix_shapes(get_preset(opts.model), opts.tp)  # shape errors before the GPU check
    return run(opts)

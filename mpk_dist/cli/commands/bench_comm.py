"""``mpk-dist bench-comm``: flag ping-pong latency and a one-shot bf16 all-reduce between GPUs, ours
(the mega-kernel's transport) against NCCL, in one run; one process per GPU under MPI:

    launch/mpirun.sh -n 2 bench-comm --output-json comm.json
"""

from __future__ import annotations


def register(subparsers) -> None:
    """Add ``bench-comm`` to the CLI."""
    p = subparsers.add_parser("bench-comm", help="GPU-to-GPU ping-pong latency and a small all-reduce: ours vs NCCL "
                                                 "(under MPI: launch/mpirun.sh -n 2 bench-comm)")
    p.add_argument("--size-bytes", type=int, default=16384, help="all-reduce size in bytes of bf16 (default 16384)")
    p.add_argument("--iters", type=int, default=1000, help="timed all-reduces / round trips per test (default 1000)")
    p.add_argument("--warmup", type=int, default=20, help="untimed ones before each test (default 20)")
    p.add_argument("--graph-len", type=int, default=100, help="all-reduces per captured CUDA graph (default 100)")
    p.add_argument("--timeout", type=float, default=30.0, metavar="S",
                   help="limit of every wait, in the kernels and between ranks (default 30 s)")
    p.add_argument("--output-json", default=None, metavar="PATH", help="write the results as JSON (rank 0)")
    p.set_defaults(func=main)


def main(args) -> int:
    """Validate the flags, then run the benchmark on this rank (0 when every check passed)."""
    from mpk_dist.bench.comm import CommOptions, check_options, run

    opts = CommOptions(size_bytes=args.size_bytes, iters=args.iters, warmup=args.warmup, graph_len=args.graph_len,
                       timeout_s=args.timeout, output_json=args.output_json)
    check_options(opts)
    return run(opts)

"""Per-rank launch check, run by the Slurm templates before the benchmark.

    srun --mpi=pmix python -m mpk_dist.dist.preflight --tp 8

Each rank prints one line ``preflight rank=R/N local=L/M node=H device=D visible=V source=S`` and
the job stops (exit 2, one-line error) when a TP group spans nodes, so a misplaced job fails in
seconds instead of after model loading. ``device`` is ``-`` when no GPU is visible (CPU tests).
"""

from __future__ import annotations

import argparse
import os
import sys

from mpk_dist.dist.env import check_tp_group_on_one_node, rank_info, select_device, visible_devices
from mpk_dist.errors import BackendUnavailable, MpkError


def describe(tp: int) -> str:
    """Check this rank's placement for TP degree ``tp`` and return its preflight line."""
    info = rank_info()
    check_tp_group_on_one_node(info, tp)
    visible = visible_devices()
    try:
        device = str(select_device(info))
    except BackendUnavailable:
        device = "-"
    return (f"preflight rank={info.rank}/{info.world_size} local={info.local_rank}/{info.local_world_size} "
            f"node={info.node_name} device={device} visible={','.join(visible) if visible else '-'} "
            f"source={info.source} tp={tp}")


def main(argv: list[str] | None = None) -> int:
    """Entry point; exit status 2 with one line on stderr for placement errors."""
    parser = argparse.ArgumentParser(prog="python -m mpk_dist.dist.preflight")
    parser.add_argument("--tp", type=int, default=int(os.environ.get("MPK_TP", "1")),
                        help="processes per tensor-parallel group (consecutive ranks)")
    args = parser.parse_args(argv)
    try:
        print(describe(args.tp), flush=True)
    except MpkError as exc:
        print(f"mpk-dist preflight: error: {exc}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

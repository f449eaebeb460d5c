"""Run under mpirun by tests/dist/test_gather.py: exercise rank detection and gathering for real.

Each rank prints one JSON line ``{"rank": ..., ...}``; the test parses them.
"""

import json
import os
import sys

from mpk_dist.dist.env import check_tp_group_on_one_node, rank_info, rank_info_from_env, rank_info_from_mpi
from mpk_dist.dist.gather import allgather, gather_to_rank0
from mpk_dist.errors import DeviceTimeout, MpkError


def main() -> None:
    """Gather, allgather, TP check, then a gather that one rank skips (must time out on rank 0)."""
    env_info = rank_info_from_env()
    mpi_info = rank_info_from_mpi()
    info = rank_info()  # MPI is live now, so this must agree with mpi4py
    out = {"rank": info.rank, "env": list(env_info.__dict__.values())[:4], "mpi": [mpi_info.rank, mpi_info.world_size]}
    out["gathered"] = gather_to_rank0({"rank": info.rank, "sq": info.rank * info.rank})
    out["all"] = allgather(info.rank * 10)
    # Back-to-back gathers: non-root ranks race ahead into the next round, so a receiver that
    # mixed rounds up would put a round-r+1 value into round r (seen before the per-source fix).
    rounds = [gather_to_rank0((r, info.rank)) for r in range(30)]
    out["rounds_ok"] = all(g == [(r, k) for k in range(info.world_size)] for r, g in enumerate(rounds)) if info.rank == 0 else None
    check_tp_group_on_one_node(info, 2)
    try:
        check_tp_group_on_one_node(info, 2, hostnames=["a", "b"] * (info.world_size // 2))
        out["spanning"] = "accepted"
    except MpkError as exc:
        out["spanning"] = str(exc)
    skipper = info.world_size - 1
    if info.rank != skipper:
        try:
            gather_to_rank0("late", timeout_s=float(os.environ.get("JOB_TIMEOUT", "1")))
            out["timeout"] = None
        except DeviceTimeout as exc:
            out["timeout"] = str(exc)
    print(json.dumps(out), flush=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()

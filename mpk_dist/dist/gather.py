"""Bounded-time collection of small Python objects (results, host names) across MPI ranks.

mpi4py's ``comm.gather`` blocks forever when one rank never arrives (it crashed, or took another
code path). These helpers use point-to-point messages and poll them against a deadline, so a
missing rank becomes a :class:`~mpk_dist.errors.DeviceTimeout` that names it instead of a hang.
Without MPI (or with one rank) they return ``[obj]`` and touch nothing.

The deadline is ``timeout_s`` or ``MPK_GATHER_TIMEOUT_S`` (default 600 s).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from mpk_dist.errors import BackendUnavailable, DeviceTimeout, InputError

# Tags of our messages; distinct from anything the runtime sends (it uses buffers, not tags).
_GATHER_TAG = 0x6D70  # 'mp'
_BCAST_TAG = 0x6D71
DEFAULT_TIMEOUT_S = 600.0


def _timeout(timeout_s: float | None) -> float:
    """The deadline length in seconds from the argument or MPK_GATHER_TIMEOUT_S."""
    if timeout_s is not None:
        return float(timeout_s)
    raw = os.environ.get("MPK_GATHER_TIMEOUT_S")
    if raw is None:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise InputError(f"MPK_GATHER_TIMEOUT_S: expected a positive number of seconds, got {raw!r}")
    return value


def world_comm() -> Any | None:
    """MPI.COMM_WORLD when this process runs under an MPI launcher (or MPI is live), else None."""
    from mpk_dist.dist.env import launched_by_mpi

    if "mpi4py.MPI" not in sys.modules and not launched_by_mpi():
        return None
    try:
        from mpi4py import MPI
    except ImportError:
        raise BackendUnavailable(
            "result gathering: expected mpi4py under an MPI launcher, got ImportError; pip install mpi4py"
        ) from None
    return MPI.COMM_WORLD


def _sleep(poll: float) -> float:
    """Sleep, then return the next (longer, capped) polling interval."""
    time.sleep(poll)
    return min(poll * 2, 0.01)


def _recv_from_all(comm: Any, sources: set[int], tag: int, deadline: float, what: str) -> dict[int, Any]:
    """Receive one object from each rank in ``sources`` (any order) before ``deadline``."""
    got: dict[int, Any] = {}
    poll = 0.0005
    while len(got) < len(sources):
        # NOTE: probe each missing source, never ANY_SOURCE: a rank that already left this
        # gather may have sent its message for the NEXT one, and only per-source ordering
        # (MPI's non-overtaking rule) tells the two apart.
        arrived = [src for src in sorted(sources - got.keys()) if comm.iprobe(source=src, tag=tag)]
        for src in arrived:
            got[src] = comm.recv(source=src, tag=tag)  # already here: returns promptly
        if arrived:
            continue
        if time.monotonic() > deadline:
            missing = sorted(sources - got.keys())
            raise DeviceTimeout(
                f"{what}: expected a message from ranks {sorted(sources)}, got none from ranks {missing} "
                f"before the deadline; check that those ranks did not fail earlier "
                "(MPK_GATHER_TIMEOUT_S raises the limit)"
            )
        poll = _sleep(poll)
    return got


def _send_and_wait(comm: Any, obj: Any, dest: int, tag: int, deadline: float, what: str) -> None:
    """Send ``obj`` to ``dest`` and poll the request until it completes or the deadline passes."""
    request = comm.isend(obj, dest=dest, tag=tag)
    poll = 0.0005
    while not request.Test():
        if time.monotonic() > deadline:
            raise DeviceTimeout(
                f"{what}: expected rank {dest} to receive from rank {comm.Get_rank()}, got no receive "
                "before the deadline; rank 0 probably failed (MPK_GATHER_TIMEOUT_S raises the limit)"
            )
        poll = _sleep(poll)


def gather_to_rank0(obj: Any, *, timeout_s: float | None = None, comm: Any | None = None) -> list[Any] | None:
    """Collect ``obj`` from every rank: a list in rank order on rank 0, None on other ranks.

    Without MPI (or with a single rank) returns ``[obj]``. Raises DeviceTimeout when a rank does
    not take part within the deadline. Objects are pickled; keep them small (results, names).
    """
    comm = comm if comm is not None else world_comm()
    if comm is None or comm.Get_size() == 1:
        return [obj]
    deadline = time.monotonic() + _timeout(timeout_s)
    rank, size = comm.Get_rank(), comm.Get_size()
    if rank != 0:
        _send_and_wait(comm, obj, 0, _GATHER_TAG, deadline, "gather_to_rank0")
        return None
    got = _recv_from_all(comm, set(range(1, size)), _GATHER_TAG, deadline, "gather_to_rank0")
    return [obj] + [got[r] for r in range(1, size)]


def allgather(obj: Any, *, timeout_s: float | None = None, comm: Any | None = None) -> list[Any]:
    """Collect ``obj`` from every rank and give the rank-ordered list to every rank.

    Same deadline and MPI rules as :func:`gather_to_rank0`.
    """
    comm = comm if comm is not None else world_comm()
    if comm is None or comm.Get_size() == 1:
        return [obj]
    deadline = time.monotonic() + _timeout(timeout_s)
    gathered = gather_to_rank0(obj, timeout_s=max(deadline - time.monotonic(), 0.001), comm=comm)
    if comm.Get_rank() == 0:
        for dest in range(1, comm.Get_size()):
            _send_and_wait(comm, gathered, dest, _BCAST_TAG, deadline, "allgather")
        return gathered  # type: ignore[return-value]
    return _recv_from_all(comm, {0}, _BCAST_TAG, deadline, "allgather")[0]

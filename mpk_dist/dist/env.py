"""Rank, local rank and GPU of this process, as the MPI launcher sees them.

Sources, in order of trust:

1. mpi4py, when MPI is already initialised in this process (someone imported ``mpi4py.MPI``).
2. The launcher's environment: Open MPI (``OMPI_COMM_WORLD_*``), MPICH hydra / Intel MPI
   (``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID``, ``MPI_LOCALNRANKS``).
3. ``srun --mpi=pmix`` started us directly: ``PMIX_RANK`` plus Slurm's step variables, used only
   when ``SLURM_PROCID`` equals ``PMIX_RANK`` (proof that srun, not mpirun, placed this task).
4. mpi4py as a last resort when a PMIx launcher is detected but the environment is incomplete
   (this initialises MPI).
5. Otherwise a single process: rank 0 of 1.

NOTE: ``SLURM_PROCID`` / ``SLURM_LOCALID`` alone are never trusted: under ``mpirun`` inside an
allocation every rank inherits the values of the Slurm step that started mpirun's daemons.
"""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass
from typing import Mapping

from mpk_dist.errors import BackendUnavailable, InputError

# Variables whose presence means an MPI launcher started this process.
LAUNCHER_VARS = ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE", "MPI_LOCALNRANKS")


@dataclass(frozen=True)
class RankInfo:
    """Where this process sits among all processes of the job.

    ``rank`` is in ``[0, world_size)``; ``local_rank`` in ``[0, local_world_size)`` counts the
    processes on this node. ``source`` says which mechanism produced the numbers (for messages).
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_name: str
    source: str = "single"


def launched_by_mpi(environ: Mapping[str, str] | None = None) -> bool:
    """True when an MPI launcher (mpirun, mpiexec, srun --mpi=pmix) started this process."""
    env = os.environ if environ is None else environ
    return any(name in env for name in LAUNCHER_VARS)


def _int(env: Mapping[str, str], name: str) -> int:
    """Read an integer launcher variable, naming it when it is malformed."""
    value = env[name]
    try:
        return int(value)
    except ValueError:
        raise InputError(
            f"{name}: expected an integer set by the MPI launcher, got {value!r}; "
            "unset it or start the job with mpirun/srun"
        ) from None


def _node_name(env: Mapping[str, str]) -> str:
    """Host name as the launcher reports it (PMIx knows it), else the kernel's."""
    return env.get("PMIX_HOSTNAME") or socket.gethostname()


def rank_info_from_env(environ: Mapping[str, str] | None = None) -> RankInfo | None:
    """Rank information from launcher variables only; None when they do not say enough."""
    env = os.environ if environ is None else environ
    node = _node_name(env)
    if "OMPI_COMM_WORLD_RANK" in env and "OMPI_COMM_WORLD_SIZE" in env:
        world = _int(env, "OMPI_COMM_WORLD_SIZE")
        local_size = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE") if "OMPI_COMM_WORLD_LOCAL_SIZE" in env else world
        local = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK") if "OMPI_COMM_WORLD_LOCAL_RANK" in env else 0
        return _checked(RankInfo(_int(env, "OMPI_COMM_WORLD_RANK"), world, local, local_size, node, "openmpi"))
    if "PMI_RANK" in env and "PMI_SIZE" in env:
        world = _int(env, "PMI_SIZE")
        local = _int(env, "MPI_LOCALRANKID") if "MPI_LOCALRANKID" in env else 0
        local_size = _int(env, "MPI_LOCALNRANKS") if "MPI_LOCALNRANKS" in env else world
        return _checked(RankInfo(_int(env, "PMI_RANK"), world, local, local_size, node, "pmi"))
    if "PMIX_RANK" in env and env.get("SLURM_PROCID") == env["PMIX_RANK"] and "SLURM_STEP_NUM_TASKS" in env:
        # srun --mpi=pmix placed this task itself, so its step variables describe MPI ranks.
        world = _int(env, "SLURM_STEP_NUM_TASKS")
        local = _int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0
        local_size = _slurm_tasks_on_this_node(env, world)
        return _checked(RankInfo(_int(env, "PMIX_RANK"), world, local, local_size, node, "pmix+slurm"))
    return None


def _slurm_tasks_on_this_node(env: Mapping[str, str], world: int) -> int:
    """Tasks of this step on this node, from SLURM_STEP_TASKS_PER_NODE ('2(x3),1' format)."""
    spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    node_id = int(env.get("SLURM_NODEID", "0"))
    if not spec:
        return world
    counts: list[int] = []
    for part in spec.split(","):
        count, _, repeat = part.partition("(x")
        counts.extend([int(count)] * (int(repeat.rstrip(")")) if repeat else 1))
    return counts[node_id] if node_id < len(counts) else world


def _checked(info: RankInfo) -> RankInfo:
    """Refuse impossible combinations instead of running with a wrong rank."""
    if not (0 <= info.rank < info.world_size and 0 <= info.local_rank < info.local_world_size):
        raise InputError(
            f"rank info from {info.source}: expected 0 <= rank < world_size and "
            f"0 <= local_rank < local_world_size, got rank {info.rank} of {info.world_size}, "
            f"local {info.local_rank} of {info.local_world_size}; check the launcher's environment"
        )
    return info


def rank_info_from_mpi() -> RankInfo:
    """Rank information from mpi4py (initialises MPI if needed); local rank via host names."""
    from mpi4py import MPI

    from mpk_dist.dist.gather import allgather

    comm = MPI.COMM_WORLD
    node = _node_name(os.environ) if "PMIX_HOSTNAME" in os.environ else MPI.Get_processor_name()
    hosts = allgather(node, comm=comm)
    rank = comm.Get_rank()
    local_rank = sum(1 for r in range(rank) if hosts[r] == node)
    local_size = sum(1 for h in hosts if h == node)
    return _checked(RankInfo(rank, comm.Get_size(), local_rank, local_size, node, "mpi4py"))


def _mpi_initialized() -> bool:
    """True when mpi4py is imported and MPI is live (initialised, not finalised)."""
    mpi = sys.modules.get("mpi4py.MPI")
    return mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized()


def rank_info(environ: Mapping[str, str] | None = None) -> RankInfo:
    """This process's :class:`RankInfo`; a process started without a launcher is rank 0 of 1.

    Raises MpkError when a launcher is detected but neither its variables nor mpi4py can say
    which rank we are (e.g. PMIx without Slurm step variables and no mpi4py).
    """
    env = os.environ if environ is None else environ
    if environ is None and _mpi_initialized():
        return rank_info_from_mpi()
    info = rank_info_from_env(env)
    if info is not None:
        return info
    if launched_by_mpi(env):
        try:
            import mpi4py  # noqa: F401  (probe only; rank_info_from_mpi imports MPI)
        except ImportError:
            raise BackendUnavailable(
                "rank detection: expected Open MPI / MPICH launcher variables or mpi4py, got only "
                f"{sorted(k for k in LAUNCHER_VARS if k in env)}; pip install mpi4py"
            ) from None
        return rank_info_from_mpi()
    return RankInfo(0, 1, 0, 1, _node_name(env), "single")


def visible_devices(environ: Mapping[str, str] | None = None) -> list[str] | None:
    """Entries of CUDA_VISIBLE_DEVICES (None when unset). CUDA stops at the first invalid entry."""
    env = os.environ if environ is None else environ
    value = env.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    entries: list[str] = []
    for item in (part.strip() for part in value.split(",")):
        if not item or item.startswith("-"):
            break
        entries.append(item)
    return entries


def _cuda_device_count() -> int:
    """GPUs the CUDA driver reports (0 without torch or CUDA)."""
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count()


def select_device(info: RankInfo, environ: Mapping[str, str] | None = None, num_devices: int | None = None) -> int:
    """Index (within the visible devices) of the GPU this rank should use.

    - Slurm ``--gpus-per-task=1`` (or any launcher that hides all GPUs but one): 0.
    - Slurm ``--gres=gpu:N`` / a plain node: all GPUs visible, pick by local rank.
    - More local ranks than GPUs: ranks share GPUs round-robin (needs MPS; see
      :func:`mpk_dist.dist.mps.require_mps_if_shared`).
    Raises BackendUnavailable when no GPU is visible.
    """
    visible = visible_devices(environ)
    if visible is not None and len(visible) == 1:
        return 0
    count = num_devices if num_devices is not None else (len(visible) if visible is not None else _cuda_device_count())
    if count <= 0:
        env = os.environ if environ is None else environ
        raise BackendUnavailable(
            f"GPU selection for rank {info.rank}: expected at least one visible CUDA device, got 0 "
            f"(CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES')!r}); "
            "request GPUs (sbatch --gpus-per-task=1 or --gres=gpu:N) or use --backend interpreter"
        )
    return info.local_rank % count


def tp_groups_spanning_nodes(hostnames: list[str], tp: int) -> list[tuple[int, list[str]]]:
    """Groups (index, distinct hosts) whose consecutive ``tp`` ranks are not all on one node."""
    bad = []
    for group in range(len(hostnames) // tp):
        hosts = hostnames[group * tp:(group + 1) * tp]
        if len(set(hosts)) > 1:
            bad.append((group, sorted(set(hosts))))
    return bad


def _check_divides(info: RankInfo, tp: int) -> None:
    """A TP degree must be positive and divide the number of processes."""
    if tp < 1 or info.world_size % tp:
        raise InputError(
            f"tp: expected a positive divisor of the number of processes ({info.world_size}), got {tp}; "
            f"start tp x replicas processes (e.g. mpirun -n {max(tp, 1)})"
        )


def check_tp_group_on_one_node(info: RankInfo, tp: int, hostnames: list[str] | None = None) -> None:
    """Refuse a tensor-parallel group whose ranks live on different nodes.

    A TP group is ``tp`` consecutive ranks (group g = ranks g*tp .. g*tp+tp-1). Host names come
    from ``hostnames`` when given, else from an allgather over MPI; without mpi4py the check
    assumes the launcher placed ranks in contiguous blocks per node (mpirun --map-by slot, srun's
    default block distribution). Raises MpkError naming the group and its hosts.
    """
    if info.world_size == 1:
        return  # one process holds every TP rank of its group (local transport)
    _check_divides(info, tp)
    if hostnames is None:
        hostnames = _gather_hostnames(info)
    if hostnames is None:
        first_on_node = info.rank - info.local_rank
        group_start = info.rank - info.rank % tp
        if group_start < first_on_node or group_start + tp > first_on_node + info.local_world_size:
            _raise_spanning(tp, [(info.rank // tp, [info.node_name, "another node"])])
        return
    bad = tp_groups_spanning_nodes(hostnames, tp)
    if bad:
        _raise_spanning(tp, bad)


def _gather_hostnames(info: RankInfo) -> list[str] | None:
    """Host names of all ranks through MPI, or None when mpi4py is not available."""
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return None
    from mpk_dist.dist.gather import allgather, world_comm

    comm = world_comm()
    if comm is None or comm.Get_size() != info.world_size:
        return None  # the RankInfo did not come from this MPI job (e.g. built by hand)
    return allgather(info.node_name, comm=comm)


def _raise_spanning(tp: int, bad: list[tuple[int, list[str]]]) -> None:
    """Build the one-line error for TP groups that cross nodes."""
    group, hosts = bad[0]
    raise InputError(
        f"TP group {group} (ranks {group * tp}-{group * tp + tp - 1}): expected all {tp} ranks on one "
        f"node, got ranks on {', '.join(hosts)} ({len(bad)} group(s) span nodes); tensor parallelism "
        f"across nodes is not supported (docs/SCALE.md): place {tp} consecutive ranks per node, e.g. "
        f"sbatch --ntasks-per-node={tp} or mpirun --map-by ppr:{tp}:node"
    )

"""How the TP ranks of one mega-kernel group reach each other (``--transport local|ipc``).

A transport says which ranks this process drives, on which GPU, how the ranks' symmetric regions
are allocated (and their peer pointers obtained), and how the host sides of the ranks wait for each
other (every such wait is bounded):

* ``local``: every rank in this process on one GPU; regions are plain allocations of one context,
  so peer pointers are just their addresses; each rank's kernel gets its own stream and SM share.
* ``ipc``: one process per rank under mpirun/srun (rank from mpk_dist.dist.env, never SLURM_*);
  regions exported as CUDA IPC handles and exchanged over MPI (mpk_dist.comm.allocate_ipc); ranks
  sharing a GPU need an MPS daemon (contexts of different processes time-slice otherwise).
"""

from __future__ import annotations

import dataclasses

import torch

from mpk_dist.errors import BackendUnavailable, InputError

TRANSPORTS = ("local", "ipc")


def check_options(tp: int, transport: str | None, schedule: str) -> str:
    """Validate the TP options of the mega-kernel; returns the transport name (default local)."""
    transport = transport or "local"
    if transport not in TRANSPORTS:
        raise InputError(f"--transport: expected one of {', '.join(TRANSPORTS)}, got {transport!r}")
    if tp < 1:
        raise InputError(f"--tp: expected a positive number of ranks, got {tp}")
    if tp > 1 and schedule != "aot":
        raise InputError(f"--schedule: expected aot at --tp {tp} (the jit scheduler does not yet learn of events "
                         f"completed by a peer's signal), got {schedule!r}; use --schedule aot")
    if tp == 1 and transport == "ipc":
        raise InputError("--transport ipc: expected --tp > 1 (one process per rank), got --tp 1; drop --transport")
    return transport


class LocalTransport:
    """All ``world`` ranks in this process, on one GPU."""

    name = "local"

    def __init__(self, world: int, device: torch.device):
        self.world, self.device = world, torch.device(device)
        self.ranks = list(range(world))
        self.ranks_per_gpu = world

    def allocate(self, nbytes: int) -> list:
        """One symmetric region per rank (mpk_dist.comm.allocate_local_group)."""
        from mpk_dist.comm.symmetric import allocate_local_group

        return allocate_local_group(self.world, nbytes, self.device)

    def barrier(self, what: str) -> None:
        """Nothing to wait for: every rank is this process (device ordering is the caller's)."""

    def allgather(self, obj, what: str) -> list:
        """Objects of the driven ranks are already here: the caller passes the list itself."""
        return obj

    def gather(self, obj, what: str) -> list:
        """As ``allgather`` (this process holds every rank)."""
        return obj


class IpcTransport:
    """This process is one rank of a TP group of ``tp`` consecutive MPI ranks (group g = ranks
    g*tp .. g*tp+tp-1; several groups are data-parallel replicas, e.g. ``mpk-dist bench --dp``)."""

    name = "ipc"

    def __init__(self, tp: int, info=None, comm=None, timeout_s: float | None = None):
        from mpk_dist.dist.env import check_tp_group_on_one_node, rank_info

        self.info = info or rank_info()
        if self.info.world_size % tp or self.info.world_size < tp:
            raise InputError(f"--transport ipc: expected a multiple of {tp} processes (one per rank: mpirun -np {tp}), "
                             f"got {self.info.world_size} ({self.info.source}); start mpirun -np {tp}, or use "
                             "--transport local for all ranks in one process")
        check_tp_group_on_one_node(self.info, tp)
        self.world, self.rank = tp, self.info.rank % tp
        self.ranks, self.timeout_s = [self.rank], timeout_s
        world_comm = comm if comm is not None else _world_comm()
        # NOTE: Split is an unbounded collective, so every rank first proves it is here (bounded).
        _allgather(world_comm, None, "transport start", timeout_s)
        self.comm = world_comm if world_comm.Get_size() == tp else world_comm.Split(self.info.rank // tp, self.info.rank)
        self.device = self._select_device()
        from mpk_dist.runtime.partition import max_ranks_per_device

        # Every process of the job counts (replicas may share GPUs too); UUIDs are unique per GPU.
        uuids = _allgather(world_comm, device_uuid(self.device), "device ids", timeout_s)
        self.ranks_per_gpu = max_ranks_per_device(uuids)
        self.sharing = uuids.count(uuids[self.info.rank])
        require_mps(self.info, self.sharing)

    def _select_device(self) -> torch.device:
        """This rank's GPU (by local rank; see pick_device), made current."""
        device = torch.device("cuda", pick_device(self.info))
        torch.cuda.set_device(device)
        return device

    def allocate(self, nbytes: int) -> list:
        """This rank's region, its peers' mapped through CUDA IPC handles (exchanged with a bounded gather)."""
        from mpk_dist.comm.symmetric import allocate_ipc

        return [allocate_ipc(nbytes, self.device, self.comm, self.rank, self.world, timeout_s=self.timeout_s)]

    def barrier(self, what: str) -> None:
        """Every rank of the group arrives, or DeviceTimeout names the missing ranks (MPK_GATHER_TIMEOUT_S)."""
        _allgather(self.comm, None, what, self.timeout_s)

    def allgather(self, obj, what: str) -> list:
        """``obj`` is a one-element list (this rank's); returns every group rank's element in rank order."""
        return _allgather(self.comm, obj[0], what, self.timeout_s)

    def gather(self, obj, what: str) -> list | None:
        """Every group rank's element on group rank 0 (None on other ranks), bounded."""
        from mpk_dist.dist.gather import gather_to_rank0

        got = gather_to_rank0((what, obj[0]), comm=self.comm, timeout_s=self.timeout_s)
        if got is None:
            return None
        check_in_step(got, what)
        return [o for _, o in got]


def _allgather(comm, obj, what: str, timeout_s: float | None) -> list:
    """``obj`` of every rank of ``comm`` in rank order (bounded; checks the ranks are in step)."""
    from mpk_dist.dist.gather import allgather

    got = allgather((what, obj), comm=comm, timeout_s=timeout_s)
    check_in_step(got, what)
    return [o for _, o in got]


def check_in_step(got: list[tuple[str, object]], what: str) -> None:
    """Every rank's message must come from the same point of the program (else the ranks diverged)."""
    where = [w for w, _ in got]
    if any(w != what for w in where):
        bad = next(r for r, w in enumerate(where) if w != what)
        raise InputError(f"rank group: expected every rank at '{what}', got rank {bad} at '{where[bad]}'; the ranks "
                         "run different requests or options (start every rank with the same command line)")


def _world_comm():
    """MPI.COMM_WORLD (mpi4py is needed for --transport ipc)."""
    try:
        from mpi4py import MPI
    except ImportError:
        raise BackendUnavailable("--transport ipc: expected mpi4py (CUDA IPC handles travel over MPI), got "
                                 "ImportError; pip install mpi4py, or use --transport local") from None
    return MPI.COMM_WORLD


def pick_device(info, environ=None) -> int:
    """The GPU index of this rank: by local rank, or 0 when CUDA_VISIBLE_DEVICES shows one device."""
    from mpk_dist.dist.env import select_device

    return select_device(info, environ)


def device_uuid(device: torch.device) -> str:
    """A physical id of the GPU (UUID; bus id as a fallback) that is equal across processes."""
    props = torch.cuda.get_device_properties(device)
    uuid = getattr(props, "uuid", None)
    if uuid is not None:
        return str(uuid)
    return f"{props.name}:{getattr(props, 'pci_bus_id', device.index)}"


def require_mps(info, sharing: int, environ=None) -> None:
    """Ranks sharing one GPU need MPS; the error also offers --transport local."""
    if sharing <= 1:
        return
    from mpk_dist.dist.mps import require_mps_if_shared

    try:
        # `sharing` ranks of this node on ONE device: the same test as local ranks > visible devices.
        require_mps_if_shared(dataclasses.replace(info, local_world_size=sharing), 1, environ)
    except BackendUnavailable as exc:
        raise BackendUnavailable(f"{exc}; or use --transport local (all ranks in one process, no MPS needed)") from None

"""Kernel-per-layer baseline with one process per TP rank: torch + torch.distributed (NCCL on GPUs,
gloo on CPUs), started under ``mpirun``/``srun``.

The same op graph as ``TorchBackend``, but this process holds only its own rank's weights; the
communication ops become ``all_reduce`` / ``all_gather`` collectives. NCCL refuses two ranks on one
GPU, so ranks sharing a GPU are refused here with a message that says what to use instead.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from mpk_dist.backends.torch_backend import TorchBackend
from mpk_dist.errors import BackendUnavailable, InputError

# Every collective and the rendezvous give up after this long (a dead peer must not hang the job).
DIST_TIMEOUT_S = float(os.environ.get("MPK_DIST_TIMEOUT_S", "120"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def init_process_group(rank: int, world_size: int, device: torch.device) -> None:
    """Rendezvous through MPI (rank 0 picks an address and port), then create the torch group."""
    if dist.is_initialized():
        return
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    addr = comm.bcast((socket.gethostname(), _free_port()) if rank == 0 else None, root=0)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://{addr[0]}:{addr[1]}",
                            rank=rank, world_size=world_size, timeout=timedelta(seconds=DIST_TIMEOUT_S),
                            **({"device_id": device} if device.type == "cuda" else {}))


class DistComm:
    """Collectives of one rank over the default process group."""

    def __init__(self, world_size: int):
        self.world_size = world_size

    def all_reduce(self, partials: list[torch.Tensor]) -> list[torch.Tensor]:
        """Sum in fp32 across ranks (list of this rank's single tensor)."""
        total = partials[0].float()
        dist.all_reduce(total)
        return [total]

    def all_gather(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        """Stack every rank's tensor along a new leading axis."""
        x = xs[0].contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x)  # list form: supported by both gloo and NCCL
        return [torch.stack(parts)]


class TorchDistBackend(TorchBackend):
    """``TorchBackend`` for the one rank this process owns."""

    def __init__(self, cfg, source, tp: int, rank_info, device: str | torch.device | None = None, **kw):
        if rank_info.world_size != tp:
            raise InputError(f"--tp {tp}: expected as many MPI ranks as tp, got {rank_info.world_size} "
                             f"(run `mpirun -np {tp} mpk-dist ...`)")
        if torch.cuda.is_available():
            visible = torch.cuda.device_count()
            if rank_info.local_world_size > visible:
                raise BackendUnavailable(
                    f"torch backends under MPI: {rank_info.local_world_size} ranks on this node share "
                    f"{visible} GPU(s), but NCCL needs one GPU per rank; use one GPU per rank, or "
                    "--backend megakernel with --transport local (all ranks in one process)")
            from mpk_dist.dist.env import select_device

            device = torch.device("cuda", select_device(rank_info))
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
        init_process_group(rank_info.rank, tp, device)
        super().__init__(cfg, source, tp=tp, device=device, ranks=[rank_info.rank], comm=DistComm(tp), **kw)

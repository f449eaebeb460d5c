"""Allocation of symmetric buffers and their peer-pointer tables.

``SymmetricBuffer`` is one rank's view: its own buffer (a torch tensor of bytes) and
``peer_ptrs[r]``, the device address at which this rank's kernel reaches rank r's buffer
(``peer_ptrs[rank]`` is its own). The table is what the kernel gets; layout inside the buffer is the
runtime's business.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import torch

from mpk_dist.errors import BackendUnavailable

IPC_HANDLE_BYTES = 64  # sizeof(CUipcMemHandle)
# Allocation granularity: keeps every rank's buffer equally aligned for 16-byte vector access.
ALIGN_BYTES = 256


@dataclass
class SymmetricBuffer:
    """This rank's symmetric buffer and the addresses of every rank's buffer as seen from here."""

    rank: int
    world_size: int
    nbytes: int
    local: torch.Tensor  # uint8 [nbytes] on this rank's device
    peer_ptrs: list[int]
    _closers: list = field(default_factory=list, repr=False)

    def peer_table(self) -> torch.Tensor:
        """int64 [world_size] of peer base addresses, on this rank's device (the kernel's argument)."""
        return torch.tensor(self.peer_ptrs, dtype=torch.int64, device=self.local.device)

    def close(self) -> None:
        """Unmap peers' memory opened through IPC (own memory is freed with the tensor)."""
        for close in self._closers:
            close()
        self._closers.clear()


def _round_up(n: int) -> int:
    return (n + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


def allocate_local_group(world_size: int, nbytes: int, device: torch.device | str) -> list[SymmetricBuffer]:
    """Symmetric buffers of ``world_size`` ranks that all live in this process (``--transport local``)."""
    nbytes = _round_up(nbytes)
    bufs = [torch.zeros(nbytes, dtype=torch.uint8, device=device) for _ in range(world_size)]
    ptrs = [b.data_ptr() for b in bufs]
    return [SymmetricBuffer(r, world_size, nbytes, bufs[r], list(ptrs)) for r in range(world_size)]


def _check(result, what: str):
    """Unwrap a cuda-python driver call's (status, value...) tuple, raising on failure."""
    from cuda.bindings import driver

    status, *rest = result
    if status != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(status)
        raise BackendUnavailable(f"{what}: CUDA driver error {name.decode() if name else status}")
    return rest[0] if len(rest) == 1 else rest


def handle_to_bytes(handle) -> bytes:
    """The 64 bytes of a CUipcMemHandle (what travels between processes)."""
    return ctypes.string_at(handle.getPtr(), IPC_HANDLE_BYTES)


def handle_from_bytes(data: bytes):
    """A CUipcMemHandle from its 64 bytes; raises ValueError on any other length."""
    from cuda.bindings import driver

    if not isinstance(data, (bytes, bytearray)) or len(data) != IPC_HANDLE_BYTES:
        raise ValueError(f"IPC handle: expected {IPC_HANDLE_BYTES} bytes, got "
                         f"{len(data) if isinstance(data, (bytes, bytearray)) else type(data).__name__}")
    handle = driver.CUipcMemHandle()
    ctypes.memmove(handle.getPtr(), bytes(data), IPC_HANDLE_BYTES)
    return handle


def allocate_ipc(nbytes: int, device: torch.device, comm, rank: int, world_size: int,
                 timeout_s: float | None = None) -> SymmetricBuffer:
    """One rank of an ``--transport ipc`` group: allocate, export, exchange handles over MPI, import.

    ``comm`` is an mpi4py communicator of exactly the TP group. The buffer is allocated by torch
    (cudaMalloc through the caching allocator) and exported as the base of its allocation plus an
    offset, so peers map the right bytes. The exchange is bounded (mpk_dist.dist.gather: a rank that
    never arrives raises DeviceTimeout naming it; ``timeout_s`` or MPK_GATHER_TIMEOUT_S).
    """
    from cuda.bindings import driver

    from mpk_dist.dist.gather import allgather

    nbytes = _round_up(nbytes)
    local = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    torch.cuda.synchronize(device)
    ptr = local.data_ptr()
    base, _size = _check(driver.cuMemGetAddressRange(ptr), "cuMemGetAddressRange")
    offset = ptr - int(base)
    handle = _check(driver.cuIpcGetMemHandle(base), "cuIpcGetMemHandle")
    everyone = allgather((handle_to_bytes(handle), offset, nbytes), comm=comm, timeout_s=timeout_s)
    sizes = [n for _, _, n in everyone]
    if len(set(sizes)) != 1 or len(everyone) != world_size:
        raise BackendUnavailable(f"symmetric buffer: expected {world_size} ranks with equal sizes, got sizes {sizes}; "
                                 "every rank must build the same program (same model, --tp, --batch, --sms)")
    peers, closers = [], []
    for r, (data, off, _n) in enumerate(everyone):
        if r == rank:
            peers.append(ptr)
            continue
        mapped = _check(driver.cuIpcOpenMemHandle(handle_from_bytes(data),
                                                  driver.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS),
                        f"cuIpcOpenMemHandle of rank {r}'s buffer")
        peers.append(int(mapped) + off)
        closers.append(lambda m=mapped: driver.cuIpcCloseMemHandle(m))
    return SymmetricBuffer(rank, world_size, nbytes, local, peers, closers)


def peer_view(buf: SymmetricBuffer, r: int, dtype: torch.dtype, numel: int, offset_bytes: int = 0) -> torch.Tensor:
    """A torch tensor over rank r's buffer as reachable from this rank (for tests and host checks)."""
    ptr = buf.peer_ptrs[r] + offset_bytes

    class _Iface:
        __cuda_array_interface__ = {"shape": (numel,), "typestr": {torch.float32: "<f4", torch.int32: "<i4",
                                                                   torch.uint8: "|u1"}[dtype],
                                    "data": (ptr, False), "version": 3}

    return torch.as_tensor(_Iface(), device=buf.local.device)

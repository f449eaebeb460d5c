"""Symmetric buffers for the mega-kernel's communication tasks.

Every TP rank allocates a buffer of the same size; each rank's kernel receives a table of peer base
pointers and reaches peers with plain loads/stores. Transports differ only in how the table is
built: ``local`` (all ranks in this process) or ``ipc`` (one process per rank, CUDA IPC handles
exchanged over MPI).
"""

from mpk_dist.comm.symmetric import SymmetricBuffer, allocate_ipc, allocate_local_group

__all__ = ["SymmetricBuffer", "allocate_local_group", "allocate_ipc"]

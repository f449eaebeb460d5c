"""Process-level distribution: who am I, which GPU is mine, and how results come home.

- :mod:`mpk_dist.dist.env`: rank / local rank from the MPI launcher (mpirun, srun --mpi=pmix,
  MPICH hydra), GPU selection, the check that a TP group stays on one node.
- :mod:`mpk_dist.dist.gather`: bounded-time gather of Python objects to rank 0 (mpi4py).
- :mod:`mpk_dist.dist.mps`: the CUDA MPS daemon that lets ranks share one GPU.

Nothing here imports mpi4py at module import time; MPI is touched only when a function needs it.
"""

from mpk_dist.dist.env import RankInfo, check_tp_group_on_one_node, rank_info, select_device
from mpk_dist.dist.gather import allgather, gather_to_rank0

__all__ = [
    "RankInfo",
    "allgather",
    "check_tp_group_on_one_node",
    "gather_to_rank0",
    "rank_info",
    "select_device",
]

"""How the SMs of one GPU are shared between the mega-kernels of the TP ranks that run on it.

Every rank's kernel is persistent and spins on events its peers signal, so ALL kernels on a GPU
must be resident at once: a kernel whose blocks wait for SMs held by a spinning peer never starts,
and the peer never finishes (the deadlock upstream projects hit with two grids on two streams).
Each rank therefore gets a disjoint share: grid = SMs // ranks_on_gpu blocks, and the group is
refused unless ranks_on_gpu x grid blocks fit the occupancy the driver reports.
"""

from __future__ import annotations

from mpk_dist.errors import BackendUnavailable, InputError


def workers_per_rank(num_sms: int, ranks_on_gpu: int, sms: int | None = None) -> int:
    """Worker blocks (= task-graph workers) of each rank's kernel.

    ``sms`` (``--sms``) caps the SMs the whole group may use (default: all of them). Raises
    InputError when fewer than one SM would be left per rank.
    """
    if ranks_on_gpu < 1:
        raise InputError(f"ranks on one GPU: expected >= 1, got {ranks_on_gpu}")
    if sms is not None and not 1 <= sms <= num_sms:
        raise InputError(f"--sms: expected 1..{num_sms} (the GPU's SMs), got {sms}")
    total = sms or num_sms
    share = total // ranks_on_gpu
    if share < 1:
        raise InputError(f"SM share: expected at least 1 SM per rank, got {total} SMs for {ranks_on_gpu} ranks on "
                         "one GPU; use fewer ranks per GPU or more SMs (--sms)")
    return share


def check_coresident(grid: int, kernels: int, blocks_per_sm: int, num_sms: int) -> None:
    """Refuse a launch whose ``kernels`` grids of ``grid`` blocks cannot all be resident at once."""
    capacity = blocks_per_sm * num_sms
    if grid < 1 or kernels * grid > capacity:
        raise BackendUnavailable(
            f"mega-kernel co-residency: expected {kernels} kernel(s) x {grid} blocks <= {blocks_per_sm} blocks/SM x "
            f"{num_sms} SMs = {capacity}, got {kernels * grid}; every rank's persistent kernel must be resident at "
            "once (peers spin on each other): use fewer ranks per GPU, --sms, or --transport ipc over several GPUs")


def max_ranks_per_device(device_ids: list[str]) -> int:
    """The most ranks of a group that share one GPU (``device_ids``: one physical id per rank, e.g.
    the GPU's UUID; indices would not do, since CUDA_VISIBLE_DEVICES may differ between ranks).

    Every rank of a group uses this same number for its SM share, so all ranks compile the task
    graph for the same worker count (their graphs must be structurally identical).
    """
    if not device_ids:
        raise ValueError("device_ids: expected one entry per rank, got none")
    return max(device_ids.count(d) for d in set(device_ids))

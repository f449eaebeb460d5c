"""Layout of a rank's symmetric region and the peer tables the kernel reads.

Every rank allocates ONE symmetric region (same size on every rank, reachable by every peer):

    [counters: uint32 x E][tallies: uint32 x E][comm buffer b0][comm buffer b1]...

* counters: the rank's event counters. Peers add to them (SIG_ALL_RANKS signals), so they must be
  peer-visible even though most events are local.
* tallies: ``tallies[e]`` counts the SIG_ALL_RANKS signals THIS rank has sent to event e. Only the
  watchdog reads them (a peer whose wait on e timed out names the rank whose tally is short).
* comm buffers (ABI kind ``comm``: all-reduce receive buffers, the argmax gather buffer), each
  aligned to ``ALIGN`` bytes for 16-byte vector access.

Every rank's graph is structurally identical, so the layout is the same on every rank; ``signature``
lets the ranks of an ipc group check that before they trust each other's offsets.

Peer tables (``RuntimeParams.peer_base`` [WORLD * NB], ``peer_events`` [WORLD]): row r of
peer_base holds rank r's address of every comm buffer; this rank's own row holds all its buffers
(so ``peer_arg(i, rank)`` equals ``arg(i)``); other ranks' non-comm buffers are 0 (never reachable:
a task body that tried would fault instead of silently touching a peer's private memory).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from mpk_dist.taskgraph.abi import DTYPE_BYTES, SIG_ALL_RANKS, SIGNAL_COLS

ALIGN = 256
"""Bytes; every part of the region starts on this boundary (same as mpk_dist.comm.symmetric)."""


def _up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class CommLayout:
    """Byte offsets of one rank's symmetric region (identical on every rank of a group)."""

    num_events: int
    counters_offset: int
    tallies_offset: int
    buffer_offsets: dict[int, int]  # buffer id -> byte offset (comm buffers only)
    buffer_bytes: dict[int, int]
    nbytes: int

    @property
    def signature(self) -> str:
        """Hash of the layout; equal on every rank of a correctly built group."""
        text = f"{self.num_events}:{sorted(self.buffer_offsets.items())}:{sorted(self.buffer_bytes.items())}:{self.nbytes}"
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def comm_layout(cg) -> CommLayout:
    """The region layout of a compiled rank program (``meta['buffers']`` kinds and sizes)."""
    E = int(cg.arrays["events"].shape[0])
    counters = 0
    tallies = 4 * E  # right after the counters: the kernel addresses them as events[E + e]
    off = _up(tallies + 4 * E)
    offsets, sizes = {}, {}
    for b, info in enumerate(cg.meta["buffers"]):
        if info["kind"] != "comm":
            continue
        n = int(np.prod(info["shape"])) if info["shape"] else 1
        offsets[b], sizes[b] = off, n * DTYPE_BYTES[info["dtype"]]
        off = _up(off + sizes[b])
    return CommLayout(E, counters, tallies, offsets, sizes, max(off, ALIGN))


def peer_quota(cg) -> np.ndarray:
    """int32 [E]: SIG_ALL_RANKS signallers of each event per step on ONE rank (0 for local events).

    A rank's tally for event e must reach (s + 1 + offset) x quota[e] by the time a wait at step s
    is met; a shorter tally after a timeout names that rank as the missing one.
    """
    sig = cg.arrays["signals"]
    E = int(cg.arrays["events"].shape[0])
    remote = sig[sig[:, SIGNAL_COLS["TARGET"]] == SIG_ALL_RANKS, SIGNAL_COLS["EVENT"]]
    return np.bincount(remote, minlength=E).astype(np.int32)


def peer_tables(layout: CommLayout, rank: int, own_addrs: list[int], region_ptrs: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(peer_base int64 [WORLD * NB], peer_events int64 [WORLD]) as the kernel reads them.

    ``own_addrs[b]``: this rank's device address of buffer b; ``region_ptrs[r]``: the address at
    which this rank reaches rank r's symmetric region (its own region at index ``rank``).
    """
    world, nb = len(region_ptrs), len(own_addrs)
    if not 0 <= rank < world:
        raise ValueError(f"rank: expected 0 <= rank < {world}, got {rank}")
    base = np.zeros((world, nb), np.uint64)
    for r, region in enumerate(region_ptrs):
        if r == rank:
            base[r] = np.asarray(own_addrs, np.uint64)
            continue
        for b, off in layout.buffer_offsets.items():
            base[r, b] = int(region) + off
    events = np.asarray([int(p) + layout.counters_offset for p in region_ptrs], np.uint64)
    return base.reshape(-1).view(np.int64), events.view(np.int64)

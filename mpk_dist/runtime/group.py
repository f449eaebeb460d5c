"""The TP ranks this process drives, as one unit: sessions, symmetric regions, launch, wait, results.

``local``: every rank of the group, each with its own stream and an SM share (grid = SMs / tp);
``ipc``: this process's one rank, its peers in other processes. Either way a launch is

    every rank: prepare (per-launch state, on its stream)  ->  device synchronised  ->
    every rank of the group has reached this point (ipc: bounded barrier)  ->  kernels started back to back

so no peer can signal a counter that a rank has not zeroed yet. ``wait`` polls every driven kernel
(each bounded by its session's deadline), streams rank 0's tokens, then raises one DeviceTimeout
carrying every rank's watchdog record, the ones that name a peer first.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from mpk_dist.errors import DeviceTimeout, InputError
from mpk_dist.runtime import tables
from mpk_dist.runtime.comm_layout import comm_layout
from mpk_dist.runtime.partition import check_coresident
from mpk_dist.runtime.session import Session
from mpk_dist.taskgraph.abi import TASK_COLS

STRUCTURE = ("tasks", "events", "waits", "signals", "worker_offsets", "worker_tasks")
"""Arrays that every rank's program must share (ranks differ only in arguments and parameters)."""


def structure_hash(cg) -> str:
    """Hash of the rank-independent arrays plus the symmetric layout (equal on every rank)."""
    from mpk_dist.runtime.codegen import tables_hash

    return tables_hash({k: cg.arrays[k] for k in STRUCTURE}) + ":" + comm_layout(cg).signature


def vocab_start(cg) -> int:
    """First vocabulary id of this rank's logits slice (INDEX_BASE of its first argmax_partial tile)."""
    from mpk_dist.taskgraph.tasks import BY_NAME

    op = BY_NAME["argmax_partial"].opcode
    first = int(np.nonzero(cg.arrays["tasks"][:, TASK_COLS["OPCODE"]] == op)[0][0])
    return tables.task_params(cg, first)["INDEX_BASE"]


def merge_vocab(slices: list[torch.Tensor], starts: list[int], vocab: int) -> torch.Tensor:
    """Concatenate per-rank logits slices [..., V/tp] along the vocabulary in id order, checking
    that they tile [0, vocab) exactly."""
    order = sorted(range(len(slices)), key=lambda i: starts[i])
    at = 0
    for i in order:
        if starts[i] != at:
            raise InputError(f"logits slices: expected rank slices to tile the vocabulary, got a slice at {starts[i]} "
                             f"where {at} was next")
        at += slices[i].shape[-1]
    if at != vocab:
        raise InputError(f"logits slices: expected {vocab} ids in all, got {at}")
    return torch.cat([slices[i] for i in order], dim=-1)


class RankGroup:
    """Sessions of the ranks this process drives for one batch size (index 0 = lowest rank)."""

    def __init__(self, cgs: list, weights: list[dict], transport, device: torch.device, session_kw: dict,
                 own_streams: bool = False):
        self.transport, self.device, self.own_streams = transport, device, own_streams
        self.ranks = [int(cg.meta["rank"]) for cg in cgs]
        self.world = int(cgs[0].meta["world_size"])
        hashes = transport.allgather([structure_hash(cg) for cg in cgs], "program structure")
        if len(set(hashes)) != 1:
            bad = next(r for r, h in enumerate(hashes) if h != hashes[0])
            raise InputError(f"TP group: expected every rank's task graph to share one structure, got rank {bad} "
                             "different from rank 0; start every rank with the same model, --batch and --sms")
        regions = transport.allocate(comm_layout(cgs[0]).nbytes)
        # own_streams: a kernel that stays resident (persistent passes) must not sit on the default stream
        multi = (own_streams or (self.world > 1 and transport.name == "local")) and device.type == "cuda"
        self.sessions = []
        for cg, w, region in zip(cgs, weights, regions):
            stream = torch.cuda.Stream(device) if multi else None
            self.sessions.append(Session(cg, w, device, region=region, stream=stream, cooperative=self.world == 1,
                                         **session_kw))
        if transport.name == "local":
            for s in self.sessions:  # the host reads peers' tallies directly (error diagnosis)
                s.peer_regions = regions
        k = self.sessions[0].kernel
        check_coresident(self.sessions[0].workers, transport.ranks_per_gpu, k.blocks_per_sm, k.num_sms)

    @property
    def lead(self) -> Session:
        """The lowest driven rank's session (rank 0 under local; this process's rank under ipc)."""
        return self.sessions[0]

    def reset(self) -> None:
        """KV caches, counters and tallies of every driven rank back to zero."""
        for s in self.sessions:
            s.reset()

    def fill_forced(self, prompts: list[list[int]], force: list[int] | None, n_steps: int) -> None:
        """The same forced-token rows on every rank."""
        for s in self.sessions:
            s.fill_forced(prompts, force, n_steps)

    def launch(self, s0: int, s1: int, prompt_len: int, max_new: int, stop_ids: tuple[int, ...], stop_on_done: bool,
               want_logits: bool, inject_hang: dict[int, int] | None = None, trace_from: int | None = None) -> None:
        """Prepare every rank, order the device, meet the peers, start the kernels back to back.

        ``inject_hang``: rank -> task that runs but never signals (test hook)."""
        inject_hang = inject_hang or {}
        for r, s in zip(self.ranks, self.sessions):
            s.prepare(s0, s1, prompt_len, max_new, stop_ids, stop_on_done, want_logits, inject_hang.get(r, -1),
                      trace_from)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # every rank's resets and prepares done on the device
        self.transport.barrier(f"launch of steps {s0}..{s1}")
        started = []
        try:
            for s in self.sessions:
                s.start()
                started.append(s)
        except BaseException:
            # A rank that did not start leaves its peers waiting: let their watchdogs end them
            # (bounded) so no kernel still runs when the error reaches the caller.
            for s in started:
                while not s.finished() and time.perf_counter() < s.deadline():
                    time.sleep(0.001)
            raise

    def wait(self, on_step=None) -> None:
        """Wait (bounded) for every driven kernel, streaming the lead rank's progress; raise one
        DeviceTimeout with every rank's watchdog record when any failed."""
        lead = self.lead
        seen = lead._steps[0]
        deadline = max(s.deadline() for s in self.sessions)
        while not all(s.finished() for s in self.sessions):
            now = lead.progress()
            while on_step is not None and seen < now:
                on_step(seen)
                seen += 1
            if time.perf_counter() > deadline:
                stuck = [r for r, s in zip(self.ranks, self.sessions) if not s.finished()]
                raise DeviceTimeout(f"mega-kernel: expected every rank's kernel to finish within "
                                    f"{deadline - lead._launched_at:.0f} s, got no end on ranks {stuck} (progress "
                                    f"{now}/{lead._steps[1]} steps); the watchdog did not fire, the GPU may be stuck; "
                                    "restart the process")
            time.sleep(0.0002)
        for s in self.sessions:
            s._stream().synchronize()
        while on_step is not None and seen < lead.progress():
            on_step(seen)
            seen += 1
        self.raise_on_error()

    def raise_on_error(self) -> None:
        """One DeviceTimeout naming each failed rank's record; ranks that name a peer come first."""
        msgs = [(r, s.error_message(), s.error_record().peer) for r, s in zip(self.ranks, self.sessions)]
        failed = [(r, m, peer) for r, m, peer in msgs if m is not None]
        if not failed:
            return
        failed.sort(key=lambda x: (not (0 <= x[2] != x[0]), x[0]))
        if len(failed) == 1:
            raise DeviceTimeout(failed[0][1])
        raise DeviceTimeout(" || ".join(f"rank {r}: {m}" for r, m, _ in failed))

    def logits(self, per_session, vocab: int, everywhere: bool = False, host: bool = False) -> torch.Tensor | None:
        """Full-vocabulary logits from every rank's slice (``per_session(s)`` -> [..., V/tp] on the
        device). local: merged on the device, or with ``host`` copied slice by slice and merged on the
        host (copies only, no device kernel: what a host may do while a persistent launch is resident,
        since a kernel launch can wait on CUDA's lazy module loading, which waits for the resident
        kernel). ipc: merged on rank 0 (None elsewhere), or on every rank with ``everywhere`` (the
        one-step API samples on every rank)."""
        starts = [vocab_start(s.cg) for s in self.sessions]
        if self.transport.name == "local":
            if host:
                return merge_vocab([per_session(s).cpu().float() for s in self.sessions], starts, vocab)
            return merge_vocab([per_session(s).float() for s in self.sessions], starts, vocab)
        mine = (starts[0], per_session(self.lead).float().cpu())
        got = (self.transport.allgather([mine], "logits slices") if everywhere
               else self.transport.gather([mine], "logits slices"))
        if got is None:
            return None
        return merge_vocab([t for _, t in got], [st for st, _ in got], vocab)

"""One rank of a ``--transport ipc`` group with the CUDA parts faked, run under a real mpirun by
tests/runtime/test_transport.py: the host side of the ipc transport (rank split, bounded gathers,
structure check, region pointer exchange, peer tables, pre-launch barrier, logits gathered and
merged on rank 0, exposure gathered) on a machine without a GPU.

    python tests/runtime/ipc_cpu_job.py ok|hoststall

Each rank prints one JSON line {"rank": r, ...}; an MpkError is printed under "error" (exit 3).
"""

from __future__ import annotations

import json
import sys
import time
import types

import numpy as np
import torch


class FakeKernel:
    blocks_per_sm, num_sms = 1, 8

    def __init__(self, *args, **kwargs):
        self.launches = []

    def launch(self, grid, params_ptr, stream, cooperative=True):
        self.launches.append((grid, cooperative))


class FakeStream:
    cuda_stream = 0

    def query(self):
        return True

    def synchronize(self):
        pass


def fake_finished(sess) -> bool:
    """The device 'ran' steps s0..s1-1: token = step, 1 ms per step, logits dump = rank + 1."""
    s0, s1 = sess._steps
    sess.pinned["token_out"][s0:s1] = torch.arange(s0, s1, dtype=torch.int32)[:, None]
    sess.pinned["step_end_ns"][s0:s1 + 1] = torch.arange(s0, s1 + 1) * 1_000_000
    sess.pinned["progress"][0] = s1
    if sess.logits_dump is not None:
        sess.logits_dump.fill_(float(sess.rank + 1))
    return True


def install_fakes(seen: dict) -> None:
    from mpk_dist.comm.symmetric import SymmetricBuffer
    from mpk_dist.runtime import megakernel_backend as MB
    from mpk_dist.runtime import session as S
    from mpk_dist.runtime import transport as T

    S.build_kernel = lambda *a, **k: ("src", types.SimpleNamespace(cubin=b"", cached=True, compiler="fake", path="x"))
    S.LoadedKernel = FakeKernel
    S.host_device_pointer = lambda p: p
    S.Session._stream = lambda self: FakeStream()
    S.Session.finished = fake_finished
    MB.MegakernelBackend._check_device = lambda self: None
    MB.MegakernelBackend._num_sms = lambda self: 8
    T.IpcTransport._select_device = lambda self: torch.device("cpu")
    T.device_uuid = lambda device: "GPU-one"  # every rank on one GPU
    T.require_mps = lambda info, sharing, environ=None: seen.setdefault("sharing", sharing)

    def allocate(self, nbytes):  # a CPU region; the "peer pointers" travel through the bounded gather
        local = torch.zeros(nbytes, dtype=torch.uint8)
        ptrs = T._allgather(self.comm, local.data_ptr(), "fake ipc handles", self.timeout_s)
        seen["region_ptrs"] = ptrs
        return [SymmetricBuffer(self.rank, self.world, nbytes, local, ptrs)]

    T.IpcTransport.allocate = allocate


def main() -> int:
    from mpk_dist.backends.base import GenerateRequest
    from mpk_dist.dist.env import rank_info
    from mpk_dist.errors import MpkError
    from mpk_dist.model_source import open_model
    from mpk_dist.runtime.comm_layout import comm_layout
    from mpk_dist.runtime.megakernel_backend import MegakernelBackend

    mode = sys.argv[1]
    seen: dict = {}
    install_fakes(seen)
    info = rank_info()
    out: dict = {"rank": info.rank}
    try:
        m = open_model("tiny")
        b = MegakernelBackend(m.config, m.weights, tp=2, device="cpu", transport="ipc", max_seq_len=32)
        s = b.session(1)
        if mode == "hoststall":
            b.transport.timeout_s = 2.0  # only the pre-launch barrier is short (start-up skew is not)
            if info.rank == 1:
                time.sleep(8)
                print(json.dumps(out), flush=True)
                return 0
        res = b.generate(GenerateRequest([[1, 2, 3]], 4, want_logits=True))
        lay = comm_layout(s.cg)
        base = s.peer_base.numpy().view(np.uint64).reshape(2, -1)
        other = 1 - s.rank
        out.update(
            tp_rank=s.rank, sharing=seen.get("sharing"), grid=s.kernel.launches[-1][0],
            cooperative=s.kernel.launches[-1][1], tokens=res.tokens,
            logits=None if res.logits is None else [list(res.logits.shape), float(res.logits[..., :256].mean()),
                                                     float(res.logits[..., 256:].mean())],
            peers_ok=all(int(base[other, b_]) == seen["region_ptrs"][other] + off for b_, off in lay.buffer_offsets.items()),
            events_ok=[int(x) for x in s.peer_events.numpy().view(np.uint64)] == seen["region_ptrs"],
            share=res.extra.get("exposed_comm_share"), by_rank=res.extra.get("exposed_comm_share_by_rank"))
        b.reset(1)
        out["step_logits"] = list(b.prefill(torch.tensor([[1, 2]]), torch.tensor([[0, 1]])).shape)
    except MpkError as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
        print(json.dumps(out), flush=True)
        return 3
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

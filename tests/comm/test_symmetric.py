"""Symmetric buffers: local groups on the CPU; IPC across processes on a GPU (mpirun, marked gpu)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from mpk_dist.comm.symmetric import ALIGN_BYTES, allocate_local_group


def test_local_group_tables_point_at_every_rank():
    bufs = allocate_local_group(3, 1000, "cpu")
    assert all(b.nbytes % ALIGN_BYTES == 0 and b.nbytes >= 1000 for b in bufs)
    ptrs = [b.local.data_ptr() for b in bufs]
    assert len(set(ptrs)) == 3
    for b in bufs:
        assert b.peer_ptrs == ptrs and b.peer_ptrs[b.rank] == b.local.data_ptr()


_IPC_SCRIPT = textwrap.dedent("""
    import torch
    from mpi4py import MPI
    from mpk_dist.comm.symmetric import allocate_ipc, peer_view
    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    buf = allocate_ipc(4096, dev, comm, rank, world)
    comm.Barrier()
    for r in range(world):  # write my rank into slot[rank] of every peer
        peer_view(buf, r, torch.float32, world * 4)[rank * 4:(rank + 1) * 4] = float(rank + 1)
    torch.cuda.synchronize(dev)
    comm.Barrier()
    mine = buf.local.view(torch.float32)[: world * 4].cpu()
    expect = torch.arange(1, world + 1, dtype=torch.float32).repeat_interleave(4)
    assert torch.equal(mine, expect), (rank, mine)
    comm.Barrier()
    buf.close()
    print("IPC-OK", rank)
""")


@pytest.mark.gpu
@pytest.mark.mpi
def test_ipc_ranks_write_into_each_other(tmp_path):
    assert torch.cuda.is_available(), "needs a GPU"
    script = tmp_path / "ipc.py"
    script.write_text(_IPC_SCRIPT)
    proc = subprocess.run([shutil.which("mpirun"), "--allow-run-as-root", "--oversubscribe", "-np", "2",
                           sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout.count("IPC-OK") == 2

"""GPU + MPI test of ``mpk-dist bench-comm``: two processes, one GPU each, started by
launch/mpirun.sh; the all-reduce results must be right and the latencies sane."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu, pytest.mark.mpi]

REPO = Path(__file__).resolve().parents[2]


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.skipif(_gpus() < 2, reason="needs 2 GPUs (one per rank)")
def test_bench_comm_two_ranks(tmp_path):
    out = tmp_path / "comm.json"
    env = {**os.environ, "MPK_DIST": f"{sys.executable} -m mpk_dist",
           "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "MPK_GATHER_TIMEOUT_S": "60"}
    cmd = [str(REPO / "launch" / "mpirun.sh"), "-n", "2", "bench-comm", "--iters", "300", "--timeout", "20",
           "--output-json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    tail = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, tail
    rec = json.loads(out.read_text())
    assert rec["ok"] is True and rec["ranks"] == 2 and not rec["failures"], tail
    assert 0 < rec["pingpong_one_way_us"] < 100, tail
    for row in rec["rows"][:-1]:  # all-reduce rows: ours and NCCL per call
        assert row["ok"], row
        assert 0 < row["ours_us"] < 1000 and 0 < row["nccl_us"] < 1000, row
    assert "# OK" in proc.stdout and "| allreduce eager" in proc.stdout

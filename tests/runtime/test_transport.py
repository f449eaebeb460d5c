"""CPU tests of the TP options, SM shares and transport checks (mpk_dist.runtime.transport, partition)."""

from __future__ import annotations

import time

import pytest

from mpk_dist.dist.env import RankInfo
from mpk_dist.errors import BackendUnavailable, InputError
from mpk_dist.runtime.partition import check_coresident, max_ranks_per_device, workers_per_rank
from mpk_dist.runtime.transport import IpcTransport, check_in_step, check_options, pick_device, require_mps


def test_options_refuse_what_tp_cannot_run():
    assert check_options(2, None, "aot") == "local" and check_options(4, "ipc", "aot") == "ipc"
    assert check_options(1, "local", "jit") == "local"
    with pytest.raises(InputError, match="--schedule: expected aot at --tp 2"):
        check_options(2, "local", "jit")
    with pytest.raises(InputError, match="--transport ipc: expected --tp > 1"):
        check_options(1, "ipc", "aot")
    with pytest.raises(InputError, match="--transport: expected one of local, ipc, got 'nccl'"):
        check_options(2, "nccl", "aot")
    with pytest.raises(InputError, match="--tp: expected a positive"):
        check_options(0, None, "aot")


def test_sm_shares_are_disjoint_and_co_resident():
    assert workers_per_rank(132, 1) == 132 and workers_per_rank(132, 2) == 66 and workers_per_rank(132, 4) == 33
    assert workers_per_rank(132, 4, sms=64) == 16
    assert 4 * workers_per_rank(132, 4) <= 132
    with pytest.raises(InputError, match="--sms: expected 1..132"):
        workers_per_rank(132, 2, sms=200)
    with pytest.raises(InputError, match="at least 1 SM per rank, got 3 SMs for 4 ranks"):
        workers_per_rank(132, 4, sms=3)
    check_coresident(66, 2, 1, 132)  # exactly fits
    with pytest.raises(BackendUnavailable, match=r"expected 2 kernel\(s\) x 67 blocks <= 1 blocks/SM x 132 SMs = 132, got 134"):
        check_coresident(67, 2, 1, 132)
    check_coresident(67, 2, 2, 132)  # two blocks per SM leave room


def test_ranks_per_device_counts_physical_gpus():
    assert max_ranks_per_device(["GPU-a", "GPU-b", "GPU-a", "GPU-b"]) == 2
    assert max_ranks_per_device(["GPU-a"] * 4) == 4
    assert max_ranks_per_device(["GPU-a", "GPU-b", "GPU-c"]) == 1


def test_gpu_by_local_rank_unless_one_device_is_visible():
    info = RankInfo(rank=6, world_size=8, local_rank=2, local_world_size=4, node_name="n")
    assert pick_device(info, {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}) == 2
    assert pick_device(info, {"CUDA_VISIBLE_DEVICES": "3"}) == 0, "the launcher gave this rank one GPU"


def test_sharing_a_gpu_without_mps_is_refused(tmp_path):
    info = RankInfo(rank=1, world_size=2, local_rank=1, local_world_size=2, node_name="n")
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path / "pipe")}  # no daemon there
    require_mps(info, 1, env)  # one rank per GPU: nothing to check
    with pytest.raises(BackendUnavailable) as exc:
        require_mps(info, 2, env)
    msg = str(exc.value)
    assert "expected an MPS daemon when 2 ranks share 1 GPU" in msg
    assert "launch/mps.sh" in msg and "--transport local" in msg


def test_ipc_needs_tp_processes_per_group():
    info = RankInfo(rank=0, world_size=3, local_rank=0, local_world_size=3, node_name="n", source="openmpi")
    with pytest.raises(InputError, match=r"expected a multiple of 2 processes .*mpirun -np 2.*got 3 \(openmpi\)"):
        IpcTransport(2, info=info)


def test_ranks_out_of_step_are_named():
    check_in_step([("launch", 1), ("launch", 2)], "launch")
    with pytest.raises(InputError, match="expected every rank at 'launch', got rank 1 at 'logits slices'"):
        check_in_step([("launch", 1), ("logits slices", 2)], "launch")


def test_ipc_handle_bytes_round_trip():
    pytest.importorskip("cuda.bindings")
    from cuda.bindings import driver

    from mpk_dist.comm.symmetric import IPC_HANDLE_BYTES, handle_from_bytes, handle_to_bytes

    data = bytes(range(IPC_HANDLE_BYTES))
    h = handle_from_bytes(data)
    assert isinstance(h, driver.CUipcMemHandle) and handle_to_bytes(h) == data
    assert handle_to_bytes(handle_from_bytes(bytearray(data[::-1]))) == data[::-1]
    with pytest.raises(ValueError, match="expected 64 bytes, got 63"):
        handle_from_bytes(data[:-1])


def _mpirun(n: int, *args: str, env: dict | None = None, timeout: float = 120):
    """Run tests/runtime/ipc_cpu_job.py on n ranks; (return code, {rank: row}, output)."""
    import json
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    cmd = [shutil.which("mpirun") or "mpirun", "-n", str(n), "--oversubscribe"]
    if os.geteuid() == 0:
        cmd.insert(1, "--allow-run-as-root")
    full = {**os.environ, "PYTHONPATH": f"{repo}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **(env or {})}
    proc = subprocess.run([*cmd, sys.executable, str(repo / "tests/runtime/ipc_cpu_job.py"), *args],
                          capture_output=True, text=True, timeout=timeout, env=full)
    rows = {}
    for line in proc.stdout.splitlines():
        if line.startswith('{"rank"'):
            row = json.loads(line)
            rows[row["rank"]] = row
    return proc.returncode, rows, proc.stdout[-2000:] + proc.stderr[-2000:]


@pytest.mark.mpi
def test_ipc_host_path_under_mpirun():
    """Two real MPI processes, CUDA faked: regions' pointers exchanged, peer tables built from them,
    kernels started after the barrier, logits slices merged on rank 0 in vocabulary order, the
    exposure gathered, the one-step API's logits on every rank; a rank that never reaches the
    launch makes rank 0's bounded barrier name it."""
    rc, rows, out = _mpirun(2, "ok", env={"MPK_GATHER_TIMEOUT_S": "60"})
    assert rc == 0 and sorted(rows) == [0, 1], out
    for r, row in rows.items():
        assert row["tp_rank"] == r and row["sharing"] == 2 and row["grid"] == 4 and not row["cooperative"], row
        assert row["peers_ok"] and row["events_ok"] and row["tokens"] == [[2, 3, 4, 5]], row
        assert row["step_logits"] == [1, 512], "the one-step API gathers the logits on every rank"
    assert rows[0]["logits"] == [[4, 1, 512], 1.0, 2.0], "rank 0 merges rank 0's then rank 1's slice"
    assert rows[1]["logits"] is None, "only rank 0 holds the merged logits"
    assert rows[0]["share"] == 0.0 and rows[0]["by_rank"] == [0.0, 0.0]
    t0 = time.perf_counter()
    rc, rows, out = _mpirun(2, "hoststall", env={"MPK_GATHER_TIMEOUT_S": "60"})
    assert rc != 0, out
    assert "DeviceTimeout" in rows[0]["error"] and "ranks [1]" in rows[0]["error"], out
    assert time.perf_counter() - t0 < 50, "the 2 s barrier, not the 60 s start-up bound, ended the job"

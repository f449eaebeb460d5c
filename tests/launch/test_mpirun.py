"""launch/mpirun.sh and launch/mps.sh: command line, environment of the ranks, MPS lifetime, Ctrl-C.

The MPS control binary is replaced by a fake (MPK_MPS_CONTROL) that creates and removes the
control fifo like the real daemon and logs what it was asked; the ranks are real mpirun ranks.
"""

import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MPIRUN_SH = REPO / "launch" / "mpirun.sh"
MPS_SH = REPO / "launch" / "mps.sh"

FAKE_CONTROL = textwrap.dedent("""\
    #!/bin/sh
    # Like CUDA 13's daemon: -d leaves a live process named in a pid file and a 'control' entry;
    # quit ends the process and removes the pid file but leaves 'control' behind (stale socket).
    pidfile="$CUDA_MPS_PIPE_DIRECTORY/nvidia-cuda-mps-control.pid"
    if [ "$1" = "-d" ]; then
      echo "start $CUDA_MPS_PIPE_DIRECTORY" >> "$FAKE_MPS_LOG"
      sleep 300 </dev/null >/dev/null 2>&1 &
      echo $! > "$pidfile"; : > "$CUDA_MPS_PIPE_DIRECTORY/control"; exit 0
    fi
    read cmd; echo "$cmd $CUDA_MPS_PIPE_DIRECTORY" >> "$FAKE_MPS_LOG"
    if [ "$cmd" = quit ] && [ -f "$pidfile" ]; then kill "$(cat "$pidfile")"; rm -f "$pidfile"; fi
    exit 0
""")


@pytest.fixture
def env(tmp_path):
    fake = tmp_path / "fake-mps-control"
    fake.write_text(FAKE_CONTROL)
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    return {**os.environ, "MPK_MPS_CONTROL": str(fake), "FAKE_MPS_LOG": str(tmp_path / "mps.log"),
            "TMPDIR": str(tmp_path), "MPK_TEST_VALUE": "forwarded"}


def _log(env):
    path = Path(env["FAKE_MPS_LOG"])
    return path.read_text().split() if path.exists() else []


def test_dry_run_shows_binding_exports_and_mps(env):
    out = subprocess.run([str(MPIRUN_SH), "-n", "4", "--gpus", "2", "--dry-run", "bench", "--tp", "4"],
                         env=env, capture_output=True, text=True, timeout=30, check=True).stdout
    assert "ranks: 4, gpus: 2, mps: start in" in out
    for flag in ("-n 4", "--map-by slot", "--bind-to numa", "-x NCCL_NVLS_ENABLE", "-x MPK_TEST_VALUE",
                 "-x TORCH_SYMM_MEM_DISABLE_MULTICAST", "-x NVSHMEM_DISABLE_NVLS", "-x CUDA_MPS_PIPE_DIRECTORY"):
        assert flag in out
    assert ("--allow-run-as-root" in out) == (os.geteuid() == 0)
    assert out.rstrip().endswith("bench --tp 4")
    one_per_gpu = subprocess.run([str(MPIRUN_SH), "--gpus", "2", "--dry-run", "--exec", "true"], env=env,
                                 capture_output=True, text=True, timeout=30, check=True).stdout
    assert "ranks: 2, gpus: 2, mps: off" in one_per_gpu and "CUDA_MPS" not in one_per_gpu


def test_bad_flags(env):
    for args, msg in ((["-n", "0"], "-n: expected a positive number"), (["--mps", "x", "-n", "1"], "--mps: expected auto"),
                      (["-n", "3", "--gpus", "1", "--mps", "off"], "expected at most one rank per GPU without MPS")):
        proc = subprocess.run([str(MPIRUN_SH), *args, "--exec", "true"], env=env, capture_output=True, text=True, timeout=30)
        assert proc.returncode == 2 and msg in proc.stderr


@pytest.mark.mpi
def test_ranks_share_gpu_with_private_mps(env, tmp_path):
    probe = ("import os; from mpk_dist.dist.mps import mps_active; print('RANK', os.environ['OMPI_COMM_WORLD_RANK'], os.environ['NCCL_NVLS_ENABLE'], "
             "os.environ['TORCH_SYMM_MEM_DISABLE_MULTICAST'], os.environ['NVSHMEM_DISABLE_NVLS'], "
             "os.environ['MPK_TEST_VALUE'], mps_active())")
    env = {**env, "PYTHONPATH": f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}"}
    proc = subprocess.run([str(MPIRUN_SH), "-n", "2", "--gpus", "1", "--exec", sys.executable, "-c", probe],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    rows = sorted(line.split()[1:] for line in proc.stdout.splitlines() if line.startswith("RANK"))
    assert rows == [["0", "0", "1", "1", "forwarded", "True"], ["1", "0", "1", "1", "forwarded", "True"]]
    log = _log(env)
    assert log[0] == "start" and log[2] == "quit" and log[1] == log[3]
    assert not Path(log[1]).parent.exists()  # the private MPS directory is removed


@pytest.mark.mpi
def test_failing_rank_still_stops_mps(env):
    proc = subprocess.run([str(MPIRUN_SH), "-n", "2", "--gpus", "1", "--exec", sys.executable, "-c", "raise SystemExit(3)"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert _log(env)[::2] == ["start", "quit"]


@pytest.mark.mpi
def test_ctrl_c_stops_ranks_and_mps(env, tmp_path):
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    body = f"import os, time; open('{pid_dir}/' + str(os.getpid()), 'w').close(); time.sleep(60)"
    proc = subprocess.Popen([str(MPIRUN_SH), "-n", "2", "--gpus", "1", "--exec", sys.executable, "-c", body],
                            env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 30
    while len(list(pid_dir.iterdir())) < 2:
        assert time.monotonic() < deadline and proc.poll() is None, "ranks did not start"
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
    # 130 from the launcher's INT trap, or mpirun's own status when it exits first: never 0.
    assert proc.wait(timeout=30) != 0
    assert _log(env)[::2] == ["start", "quit"]
    time.sleep(0.5)
    alive = [p.name for p in pid_dir.iterdir() if _alive(int(p.name))]
    assert alive == [], f"ranks still running after Ctrl-C: {alive}"


def _alive(pid: int) -> bool:
    """True for a running process; a zombie (dead, not yet reaped by a non-reaping init) is dead."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def test_mps_sh_start_status_stop(env, tmp_path):
    d = tmp_path / "mps"
    run = lambda *a: subprocess.run([str(MPS_SH), *a, str(d)], env=env, capture_output=True, text=True, timeout=30)
    assert run("status").returncode == 1
    started = run("start")
    assert started.returncode == 0 and f"export CUDA_MPS_PIPE_DIRECTORY={d}/pipe" in started.stdout
    assert run("status").returncode == 0
    assert run("stop").returncode == 0 and run("status").returncode == 1
    assert _log(env) == ["start", f"{d}/pipe", "quit", f"{d}/pipe"]

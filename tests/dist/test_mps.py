"""MPS helpers against a fake nvidia-cuda-mps-control that behaves like the real one's pipe."""

import os
import stat
import textwrap

import pytest

from mpk_dist.dist.env import RankInfo
from mpk_dist.dist.mps import _pid_alive, mps_active, mps_env, require_mps_if_shared, start_mps, stop_mps
from mpk_dist.errors import BackendUnavailable

FAKE_CONTROL = textwrap.dedent("""\
    #!/bin/sh
    # Like CUDA 13's daemon: a live process named in a pid file, and a 'control' entry that
    # stays behind after quit.
    pidfile="$CUDA_MPS_PIPE_DIRECTORY/nvidia-cuda-mps-control.pid"
    if [ "$1" = "-d" ]; then
      sleep 300 </dev/null >/dev/null 2>&1 &
      echo $! > "$pidfile"; : > "$CUDA_MPS_PIPE_DIRECTORY/control"; exit 0
    fi
    read cmd
    if [ "$cmd" = quit ] && [ -f "$pidfile" ]; then kill "$(cat "$pidfile")"; rm -f "$pidfile"; fi
""")


@pytest.fixture
def fake_control(tmp_path, monkeypatch):
    path = tmp_path / "fake-mps-control"
    path.write_text(FAKE_CONTROL)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("MPK_MPS_CONTROL", str(path))
    return path


def test_start_and_stop_private_daemon(tmp_path, fake_control):
    env = start_mps(tmp_path / "mps", timeout_s=5)
    assert env == mps_env(tmp_path / "mps")
    assert mps_active(env)
    pid = int(open(env["CUDA_MPS_PIPE_DIRECTORY"] + "/nvidia-cuda-mps-control.pid").read())
    assert stop_mps(env, timeout_s=5)
    assert not mps_active(env)
    assert os.path.exists(env["CUDA_MPS_PIPE_DIRECTORY"] + "/control")  # stale, yet not "active"
    assert not _pid_alive(pid)  # the daemon process itself is gone


def test_old_style_fifo_without_pid_file(tmp_path):
    pipe = tmp_path / "pipe"
    pipe.mkdir()
    assert not mps_active({"CUDA_MPS_PIPE_DIRECTORY": str(pipe)})
    os.mkfifo(pipe / "control")
    assert mps_active({"CUDA_MPS_PIPE_DIRECTORY": str(pipe)})


def test_missing_binary(tmp_path, monkeypatch):
    monkeypatch.setenv("MPK_MPS_CONTROL", "no-such-mps-control")
    with pytest.raises(BackendUnavailable, match="MPS: expected no-such-mps-control on PATH"):
        start_mps(tmp_path)


def test_shared_gpus_need_mps(tmp_path, fake_control):
    info = RankInfo(0, 4, 0, 4, "n0")
    require_mps_if_shared(info, 4, {})  # one GPU each: fine
    with pytest.raises(BackendUnavailable, match="expected an MPS daemon when 4 ranks share 2 GPU"):
        require_mps_if_shared(info, 2, {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path / "none")})
    env = start_mps(tmp_path / "mps", timeout_s=5)
    require_mps_if_shared(info, 2, env)
    stop_mps(env)

"""MPS helpers against a fake nvidia-cuda-mps-control that behaves like the real one's pipe."""

import os
import stat
import textwrap

import pytest

from mpk_dist.dist.env import RankInfo
from mpk_dist.dist.mps import mps_active, mps_env, require_mps_if_shared, start_mps, stop_mps
from mpk_dist.errors import BackendUnavailable

FAKE_CONTROL = textwrap.dedent("""\
    #!/bin/sh
    # -d: create the control fifo like the daemon does; stdin "quit": remove it.
    if [ "$1" = "-d" ]; then mkfifo "$CUDA_MPS_PIPE_DIRECTORY/control"; exit 0; fi
    read cmd; [ "$cmd" = quit ] && rm -f "$CUDA_MPS_PIPE_DIRECTORY/control"
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
    assert stat.S_ISFIFO(os.stat(env["CUDA_MPS_PIPE_DIRECTORY"] + "/control").st_mode)
    assert stop_mps(env, timeout_s=5)
    assert not mps_active(env)


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

"""The CUDA MPS daemon that lets several ranks share one GPU.

Without MPS, contexts of different processes on one GPU time-slice: a flag round trip between two
persistent kernels took ~5.9 ms on an H200 against 1.8 us with MPS (docs/ARCHITECTURE.md), so a
mega-kernel waiting on a peer would crawl. Ranks sharing a GPU therefore need a running MPS
daemon, and we refuse to start without one.

We always run a *private* daemon (own pipe and log directories) so a job never talks to, or
stops, a daemon that belongs to someone else. launch/mps.sh is the shell twin of this module.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import time
from pathlib import Path
from typing import Mapping

from mpk_dist.dist.env import RankInfo
from mpk_dist.errors import BackendUnavailable, DeviceTimeout

DEFAULT_PIPE_DIR = "/tmp/nvidia-mps"  # where CUDA looks when CUDA_MPS_PIPE_DIRECTORY is unset
PID_FILE = "nvidia-cuda-mps-control.pid"  # written by the control daemon in its pipe directory


def control_binary() -> str:
    """Path of nvidia-cuda-mps-control (MPK_MPS_CONTROL overrides it, e.g. for tests)."""
    return os.environ.get("MPK_MPS_CONTROL", "nvidia-cuda-mps-control")


def mps_env(base_dir: str | Path) -> dict[str, str]:
    """Environment that points CUDA clients and the daemon at a private MPS under ``base_dir``."""
    base = Path(base_dir)
    return {
        "CUDA_MPS_PIPE_DIRECTORY": str(base / "pipe"),
        "CUDA_MPS_LOG_DIRECTORY": str(base / "log"),
    }


def _pid_alive(pid: int) -> bool:
    """True for a live process (a zombie, dead but unreaped, is not alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def mps_active(environ: Mapping[str, str] | None = None) -> bool:
    """True when an MPS control daemon serves the pipe directory named by the environment.

    NOTE: CUDA 13's daemon makes ``control`` a socket that stays behind after ``quit`` (seen on
    an H200), so its existence proves nothing; the daemon's pid file naming a live process does.
    Drivers without a pid file use a ``control`` fifo that disappears with the daemon.
    """
    env = os.environ if environ is None else environ
    pipe_dir = Path(env.get("CUDA_MPS_PIPE_DIRECTORY", DEFAULT_PIPE_DIR))
    pid_file = pipe_dir / PID_FILE
    if pid_file.exists():
        digits = "".join(ch for ch in pid_file.read_text() if ch.isdigit())
        return bool(digits) and _pid_alive(int(digits))
    try:
        return stat.S_ISFIFO((pipe_dir / "control").stat().st_mode)
    except OSError:
        return False


def start_mps(base_dir: str | Path, timeout_s: float = 10.0) -> dict[str, str]:
    """Start a private MPS control daemon; return the environment its clients need.

    Raises BackendUnavailable when the control binary is missing, DeviceTimeout when its control
    pipe does not appear within ``timeout_s``.
    """
    binary = control_binary()
    if shutil.which(binary) is None:
        raise BackendUnavailable(
            f"MPS: expected {binary} on PATH (ranks share a GPU), got nothing; install the NVIDIA "
            "driver utilities or start one rank per GPU"
        )
    env = mps_env(base_dir)
    for path in env.values():
        Path(path).mkdir(parents=True, exist_ok=True)
    subprocess.run([binary, "-d"], env={**os.environ, **env}, check=True, timeout=timeout_s)
    deadline = time.monotonic() + timeout_s
    while not mps_active(env):
        if time.monotonic() > deadline:
            raise DeviceTimeout(
                f"MPS: expected a running control daemon in {env['CUDA_MPS_PIPE_DIRECTORY']} within "
                f"{timeout_s:g} s, got none; see {env['CUDA_MPS_LOG_DIRECTORY']}/control.log"
            )
        time.sleep(0.05)
    return env


def stop_mps(env: Mapping[str, str], timeout_s: float = 10.0) -> bool:
    """Ask the daemon of ``env`` to quit; True when it has exited afterwards."""
    if not mps_active(env):
        return True
    subprocess.run(
        [control_binary()], input=b"quit\n", env={**os.environ, **env}, check=False, timeout=timeout_s
    )
    deadline = time.monotonic() + timeout_s
    while mps_active(env) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not mps_active(env)


def require_mps_if_shared(info: RankInfo, num_devices: int, environ: Mapping[str, str] | None = None) -> None:
    """Refuse ranks that share a GPU when no MPS daemon is running (they would time-slice)."""
    if num_devices <= 0 or info.local_world_size <= num_devices or mps_active(environ):
        return
    raise BackendUnavailable(
        f"GPU sharing: expected an MPS daemon when {info.local_world_size} ranks share {num_devices} "
        f"GPU(s) on {info.node_name}, got none (no live daemon in CUDA_MPS_PIPE_DIRECTORY); "
        "start the job with launch/mpirun.sh (it starts a private MPS) or run launch/mps.sh start"
    )

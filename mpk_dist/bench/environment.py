"""What a benchmark ran on: GPU, library versions, git commit, host and date.

Every probe is best effort and fast: a missing library gives ``None``, never an exception, so a
result can always be written. Heavy imports (torch, mpi4py) happen only inside the probes, and
mpi4py's MPI module is read only when it is already loaded or an MPI launcher started us
(importing it otherwise would initialise MPI as a side effect).
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parents[2]


def _dist_version(name: str) -> str | None:
    """Installed version of a distribution, or None."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _torch_probe() -> dict[str, Any]:
    """torch, CUDA and NCCL versions and the GPU name, as torch sees them."""
    try:
        import torch
    except ImportError:
        return {"torch": None, "cuda": None, "nccl": None, "gpu": None, "gpu_count": 0}
    nccl = None
    try:
        raw = torch.cuda.nccl.version()
        nccl = ".".join(str(p) for p in raw) if isinstance(raw, tuple) else str(raw)
    except Exception:  # CPU-only builds raise various errors here; NCCL is then simply absent
        nccl = None
    gpu, count = None, 0
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        gpu = torch.cuda.get_device_name(torch.cuda.current_device())
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "nccl": nccl, "gpu": gpu, "gpu_count": count}


def _mpi_probe() -> str | None:
    """MPI library name and version (first line of MPI_Get_library_version)."""
    from mpk_dist.dist.env import launched_by_mpi

    if "mpi4py.MPI" not in sys.modules and not launched_by_mpi():
        return None
    try:
        from mpi4py import MPI
    except ImportError:
        return None
    return MPI.Get_library_version().strip().splitlines()[0].strip()


def git_commit() -> str | None:
    """Commit of the source tree, with '+dirty' when tracked files differ from it (a copied working
    tree, e.g. on a GPU machine, keeps an older .git); MPK_GIT_COMMIT wins, for installed copies."""
    if os.environ.get("MPK_GIT_COMMIT"):
        return os.environ["MPK_GIT_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "-C", str(_REPO), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5
        )
        if out.returncode != 0 or not out.stdout.strip():
            return None
        dirty = subprocess.run(["git", "-C", str(_REPO), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() + ("+dirty" if dirty.returncode == 0 and dirty.stdout.strip() else "")


def collect_environment() -> dict[str, Any]:
    """GPU, versions, git commit, host name and UTC date of this process, as one dict."""
    from mpk_dist import __version__

    probe = _torch_probe()
    return {
        "gpu": probe["gpu"] or f"cpu ({platform.machine()})",
        "gpu_count": probe["gpu_count"],
        "versions": {
            "mpk_dist": __version__,
            "python": platform.python_version(),
            "torch": probe["torch"],
            "cuda": probe["cuda"],
            "nccl": probe["nccl"],
            "mpi": _mpi_probe(),
            "mpi4py": _dist_version("mpi4py"),
        },
        "git_commit": git_commit(),
        "hostname": socket.gethostname(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }

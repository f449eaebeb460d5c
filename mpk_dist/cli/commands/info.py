"""``mpk-dist info``: what this machine has (GPUs, CUDA, NCCL, MPI, compilers) and which backends run here."""

from __future__ import annotations

import importlib.util
import platform
import shutil
import subprocess


def _try(fn, default="not available"):
    try:
        return fn()
    except Exception as exc:  # each probe may fail independently; report, don't crash
        return f"{default} ({type(exc).__name__}: {exc})" if str(exc) else default


def collect() -> dict:
    """A dict of facts about this machine's GPU, CUDA, NCCL and MPI stack."""
    import torch

    from mpk_dist import __version__

    info = {"mpk_dist": __version__, "python": platform.python_version(), "torch": torch.__version__,
            "torch_cuda": torch.version.cuda or "none (CPU build)"}
    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            gpus.append(f"{i}: {p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs, sm_{p.major}{p.minor}")
    info["gpus"] = gpus or ["none"]
    info["nccl"] = _try(lambda: ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "no GPU")
    info["mpi"] = _try(lambda: __import__("mpi4py.MPI", fromlist=["MPI"]).Get_library_version().splitlines()[0].strip())
    info["mpirun"] = shutil.which("mpirun") or "not on PATH"
    nvcc = shutil.which("nvcc")
    info["nvcc"] = _try(lambda: subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=10).stdout.strip().splitlines()[-1]) if nvcc else "not on PATH"
    info["cuda_python"] = "installed" if importlib.util.find_spec("cuda") else "missing"
    info["nvrtc"] = "importable" if importlib.util.find_spec("cuda.core") else "missing"
    info["z3"] = "installed" if importlib.util.find_spec("z3") else "missing"
    backends = ["torch", "interpreter"]
    if torch.cuda.is_available():
        backends = ["megakernel", "torch", "torch-graph", "torch-compile", "interpreter"]
    else:
        backends.append("torch-compile")
    info["backends"] = backends
    return info


def register(subparsers) -> None:
    """Add ``info`` to the CLI."""
    p = subparsers.add_parser("info", help="print GPUs, CUDA, NCCL, MPI and the backends available here")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=main)


def main(args) -> int:
    """Print the facts."""
    import json

    info = collect()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    for key, val in info.items():
        val = ", ".join(val) if isinstance(val, list) else val
        print(f"{key:12s} {val}")
    return 0

"""Backend names on the command line -> backend objects.

``auto`` picks the mega-kernel on a machine with a CUDA GPU and the task-graph interpreter
otherwise. Backends are imported lazily so a machine without CUDA can still run the others.
"""

from __future__ import annotations

import importlib

from mpk_dist.errors import BackendUnavailable, InputError

BACKENDS = ("auto", "megakernel", "interpreter", "torch", "torch-graph", "torch-compile")

# name -> (module, class, extra constructor options)
_IMPLS = {
    "megakernel": ("mpk_dist.runtime.megakernel_backend", "MegakernelBackend", {}),
    "interpreter": ("mpk_dist.taskgraph.interpreter_backend", "InterpreterBackend", {}),
    "torch": ("mpk_dist.backends.torch_backend", "TorchBackend", {"mode": "eager"}),
    "torch-graph": ("mpk_dist.backends.torch_backend", "TorchBackend", {"mode": "graph"}),
    "torch-compile": ("mpk_dist.backends.torch_backend", "TorchBackend", {"mode": "compile"}),
}


def _cuda_available() -> bool:
    import torch  # lazy: the CLI parses its flags before paying for torch

    return torch.cuda.is_available()


def resolve_backend(name: str) -> str:
    """Map ``auto`` to a concrete backend for this machine; validate other names."""
    if name not in BACKENDS:
        raise BackendUnavailable(f"--backend: expected one of {', '.join(BACKENDS)}, got {name!r}")
    if name == "auto":
        return "megakernel" if _cuda_available() else "interpreter"
    return name


def default_device(name: str) -> str:
    """The device a backend runs on by default: the interpreter on the CPU, others on the GPU if any."""
    if name == "interpreter" or not _cuda_available():
        return "cpu"
    return "cuda"


# backend option -> the command-line flag that sets it (for error messages)
_OPTION_FLAGS = {"schedule": "--schedule", "trace": "--trace", "timeout_s": "--timeout", "transport": "--transport",
                 "fuse": "--fuse/--no-fuse", "attn_splits": "--attn-splits", "superopt": "--no-superopt"}


def _check_options(name: str, cls, opts: dict) -> None:
    """Refuse options the backend does not take, naming the flag and the backends that take it."""
    import inspect

    params = inspect.signature(cls.__init__).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    for key in opts:
        if key not in params:
            takers = [n for n, (m, c, _) in _IMPLS.items() if n != name and _takes(m, c, key)]
            flag = _OPTION_FLAGS.get(key, key)
            raise InputError(f"{flag}: not an option of --backend {name}; it applies to {', '.join(takers) or 'no backend'}")


def _takes(module_name: str, cls_name: str, key: str) -> bool:
    import inspect

    try:
        cls = getattr(importlib.import_module(module_name), cls_name)
    except ImportError:
        return False
    return key in inspect.signature(cls.__init__).parameters


def create_backend(name: str, cfg, source, tp: int = 1, device: str | None = None, max_seq_len: int = 512, **opts):
    """Instantiate backend ``name`` (after ``resolve_backend``) for all ``tp`` ranks of a model."""
    name = resolve_backend(name)
    module_name, cls_name, extra = _IMPLS[name]
    if name == "megakernel" and not _cuda_available():
        raise BackendUnavailable("--backend megakernel: no CUDA GPU visible; use --backend interpreter (CPU) or torch")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise BackendUnavailable(f"--backend {name}: not available in this installation ({exc})") from None
    cls = getattr(module, cls_name)
    _check_options(name, cls, opts)
    if name.startswith("torch") and tp > 1:
        from mpk_dist.dist.env import rank_info

        info = rank_info()
        if info.world_size > 1:  # under mpirun/srun: one process per TP rank, torch.distributed
            from mpk_dist.backends.torch_dist import TorchDistBackend

            return TorchDistBackend(cfg, source, tp, info, max_seq_len=max_seq_len, **{**extra, **opts})
    return cls(cfg, source, tp=tp, device=device or default_device(name), max_seq_len=max_seq_len, **{**extra, **opts})

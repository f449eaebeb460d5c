"""Compile a generated mega-kernel source to a cubin, cached by content hash.

The cache key covers the source text, every header it includes (transitively, found on the include
path), the compiler flags, the target arch, the compiler's CUDA version and the package version, so
editing any header under csrc/ triggers a rebuild. Two compilers: ``nvcc`` when it is on PATH (or
``MPK_NVCC``), else NVRTC through cuda-python's ``cuda.core.Program`` (which needs an include
directory holding cuda_bf16.h: ``MPK_CUDA_INCLUDE``, ``CUDA_HOME/include`` or the nvidia pip wheels).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from mpk_dist import __version__
from mpk_dist.errors import BackendUnavailable

CSRC = Path(__file__).resolve().parent.parent.parent / "csrc"
if not CSRC.is_dir():  # installed package: csrc ships as mpk_dist/csrc
    CSRC = Path(__file__).resolve().parent.parent / "csrc"
DEFAULT_ARCH = "sm_90a"
BASE_FLAGS = ("-std=c++17", "-O3")
_INCLUDE_RE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.M)


class BuildError(BackendUnavailable):
    """The CUDA compiler rejected a generated source (the message holds its log)."""


@dataclass
class BuildResult:
    """A compiled kernel image and how it was obtained."""

    cubin: bytes
    key: str
    path: Path
    cached: bool
    seconds: float
    compiler: str
    log: str = ""
    headers: list[Path] = field(default_factory=list)


def cache_root() -> Path:
    """Where cubins live: ``$MPK_CACHE_DIR/kernels`` or ``~/.cache/mpk_dist/kernels``."""
    base = os.environ.get("MPK_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "mpk_dist")
    return Path(base) / "kernels"


def included_headers(source: str, include_dirs: list[Path]) -> list[Path]:
    """Every quoted ``#include`` reachable from ``source``, resolved on ``include_dirs`` (sorted)."""
    seen: dict[Path, None] = {}
    stack = [(source, None)]
    while stack:
        text, here = stack.pop()
        for name in _INCLUDE_RE.findall(text):
            dirs = ([here] if here else []) + list(include_dirs)
            for d in dirs:
                cand = (d / name).resolve()
                if cand.is_file():
                    if cand not in seen:
                        seen[cand] = None
                        stack.append((cand.read_text(), cand.parent))
                    break
    return sorted(seen)


def nvcc_path() -> str | None:
    """The nvcc to use (``MPK_NVCC`` overrides PATH), or None."""
    return os.environ.get("MPK_NVCC") or shutil.which("nvcc")


def compiler_version(compiler: str) -> str:
    """A string naming the compiler and its CUDA version (part of the cache key)."""
    if compiler == "nvcc":
        out = subprocess.run([nvcc_path(), "--version"], capture_output=True, text=True, check=False).stdout
        m = re.search(r"release ([\d.]+), V([\d.]+)", out)
        return f"nvcc {m.group(2) if m else out.strip()[-40:]}"
    try:
        from cuda.bindings import nvrtc

        err, major, minor = nvrtc.nvrtcVersion()
    except Exception as exc:  # library missing: cuda-pathfinder raises its own error type
        raise BuildError(f"NVRTC: expected libnvrtc (pip install nvidia-cuda-nvrtc, or mpk_dist[nvrtc]), got "
                         f"{type(exc).__name__}; or put nvcc on PATH") from None
    return f"nvrtc {major}.{minor}"


def pick_compiler(prefer: str | None = None) -> str:
    """'nvcc' when available (or asked for), else 'nvrtc'; ``MPK_COMPILER`` overrides."""
    choice = prefer or os.environ.get("MPK_COMPILER") or ("nvcc" if nvcc_path() else "nvrtc")
    if choice not in ("nvcc", "nvrtc"):
        raise BuildError(f"MPK_COMPILER: expected nvcc or nvrtc, got {choice!r}")
    if choice == "nvcc" and not nvcc_path():
        raise BuildError("compiler: expected nvcc on PATH (or MPK_NVCC), got none; set MPK_COMPILER=nvrtc")
    return choice


def cache_key(source: str, headers: list[Path], flags: tuple[str, ...], arch: str, compiler_ver: str) -> str:
    """sha256 over everything that changes the binary."""
    h = hashlib.sha256()
    for part in (source, arch, compiler_ver, __version__, "\0".join(flags)):
        h.update(part.encode())
        h.update(b"\0")
    for p in headers:
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:32]


def _nvcc_compile(src: Path, out: Path, flags: tuple[str, ...], arch: str, include_dirs: list[Path]) -> str:
    num = arch.removeprefix("sm_")
    cmd = [nvcc_path(), "-cubin", f"-gencode=arch=compute_{num},code=sm_{num}", *flags,
           *[f"-I{d}" for d in include_dirs], "-o", str(out), str(src)]
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise BuildError(f"nvcc failed on {src} (exit {res.returncode}):\n{res.stderr[-6000:]}")
    return res.stderr


def cuda_include_dir() -> Path | None:
    """A directory holding cuda_bf16.h for NVRTC."""
    cands = [os.environ.get("MPK_CUDA_INCLUDE"), os.environ.get("CUDA_HOME") and os.path.join(os.environ["CUDA_HOME"], "include")]
    nv = nvcc_path()
    if nv:
        cands.append(str(Path(nv).resolve().parent.parent / "include"))
    try:
        import nvidia.cuda_runtime as rt  # pip wheel layout

        cands += [os.path.join(p, "include") for p in rt.__path__]
    except ImportError:
        pass
    cands += ["/usr/local/cuda/include"]
    for c in cands:
        if c and Path(c, "cuda_bf16.h").is_file():
            return Path(c)
    return None


def _nvrtc_compile(source: str, flags: tuple[str, ...], arch: str, include_dirs: list[Path]) -> tuple[bytes, str]:
    from cuda.core import Program, ProgramOptions

    inc = cuda_include_dir()
    if inc is None:
        raise BuildError("NVRTC: expected a directory holding cuda_bf16.h, got none; set MPK_CUDA_INCLUDE")
    defines = [f[2:] for f in flags if f.startswith("-D")]
    opts = ProgramOptions(arch=arch, std="c++17", include_path=[str(d) for d in include_dirs] + [str(inc)],
                          define_macro=defines or None)
    try:
        obj = Program(source, code_type="c++", options=opts).compile("cubin")
    except Exception as exc:  # cuda.core raises its own error types; keep the log
        raise BuildError(f"NVRTC failed:\n{str(exc)[-6000:]}") from None
    return bytes(obj.code), ""


def compile_source(source: str, name: str, defines: dict[str, object] | None = None, arch: str = DEFAULT_ARCH,
                   compiler: str | None = None, include_dirs: list[Path] | None = None,
                   extra_flags: tuple[str, ...] = (), use_cache: bool = True, key_text: str | None = None) -> BuildResult:
    """Compile ``source`` to a cubin for ``arch``, or return the cached one.

    ``name`` only labels files; the key decides reuse (``key_text``: the part of the source that
    counts, default all of it). Raises ``BuildError`` with the compiler log.
    """
    include_dirs = list(include_dirs or []) + [CSRC / "runtime", CSRC / "tasks", CSRC / "comm", CSRC]
    # MPK_NVCC_EXTRA_FLAGS (e.g. "-lineinfo" so compute-sanitizer names source lines) is part of the key.
    env_flags = tuple(os.environ.get("MPK_NVCC_EXTRA_FLAGS", "").split())
    flags = (tuple(BASE_FLAGS) + tuple(f"-D{k}={v}" for k, v in sorted((defines or {}).items())) + tuple(extra_flags)
             + env_flags)
    compiler = pick_compiler(compiler)
    headers = included_headers(source, include_dirs)
    key = cache_key(source if key_text is None else key_text, headers, flags, arch, compiler_version(compiler))
    root = cache_root()
    out = root / f"{name}-{key}.cubin"
    if use_cache and out.is_file():
        t0 = time.perf_counter()
        data = out.read_bytes()
        return BuildResult(data, key, out, True, time.perf_counter() - t0, compiler, headers=headers)
    root.mkdir(parents=True, exist_ok=True)
    (root / f"{name}-{key}.cu").write_text(source)
    t0 = time.perf_counter()
    if compiler == "nvcc":
        with tempfile.TemporaryDirectory() as tmp:
            src, tmp_out = Path(tmp) / f"{name}.cu", Path(tmp) / f"{name}.cubin"
            src.write_text(source)
            log = _nvcc_compile(src, tmp_out, flags, arch, include_dirs)
            data = tmp_out.read_bytes()
    else:
        data, log = _nvrtc_compile(source, flags, arch, include_dirs)
    seconds = time.perf_counter() - t0
    tmp_path = out.with_suffix(f".tmp{os.getpid()}")
    tmp_path.write_bytes(data)
    tmp_path.replace(out)  # atomic: concurrent builders never see half a file
    return BuildResult(data, key, out, False, seconds, compiler, log, headers)

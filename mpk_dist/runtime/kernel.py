"""Build one mega-kernel binary: generated source + generated ABI header -> cached cubin."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from mpk_dist.runtime.build import BuildResult, cache_root, compile_source
from mpk_dist.runtime.codegen import KernelShape, render_source, source_for_key


def abi_include_dir() -> Path:
    """A directory holding abi_generated.h for the current ABI (content-addressed, written once)."""
    from mpk_dist.taskgraph.abi import render_cuda_abi_header

    text = render_cuda_abi_header()
    d = cache_root() / "include" / hashlib.sha256(text.encode()).hexdigest()[:16]
    f = d / "abi_generated.h"
    if not f.is_file() or f.read_text() != text:
        d.mkdir(parents=True, exist_ok=True)
        # Per-process temporary name: ranks and prebuild workers write this header at the same time.
        tmp = f.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(text)
        tmp.replace(f)
    return d


OPTIONAL_KINDS = {"silu_linear": "MPK_SILU_LINEAR_KIND", "norm_linear_silu": "MPK_SILU_EPI_KIND"}
"""Task kinds a kernel leaves out (define = 0) when its program runs none of them: a kernel that can reach both
silu kinds has a larger entry stack frame and ran 0.3-0.7% slower (csrc/runtime/dispatch.cuh run_norm_linear)."""


def kind_defines(program) -> dict[str, int]:
    """The OPTIONAL_KINDS defines of a kernel for ``program``: 0 for each such kind the program has no task of;
    MPK_SILU_DOWN=1 when its gate|up tiles carry a folded down projection (fusion 'silu_down')."""
    from mpk_dist.taskgraph.tasks import kind_params

    out = {define: 0 for name, define in OPTIONAL_KINDS.items() if kind_params(program, name, "BATCH") is None}
    h = kind_params(program, "norm_linear_silu", "H")
    if h is not None and (h[0] > 0).any():
        out["MPK_SILU_DOWN"] = 1
    return out


def build_kernel(shape: KernelShape, model: str = "-", rank: int = 0, world: int = 1, input_hash: str = "-",
                 compiler: str | None = None, arch: str = "sm_90a", use_cache: bool = True,
                 program=None) -> tuple[str, BuildResult]:
    """Generate and compile the kernel for ``shape``; returns (source, build result).

    ``program``: the compiled rank program (CompiledGraph) the kernel will run. With
    ``shape.superopt`` its fused linears get bodies generated from the superoptimizer's µGraphs at
    its shapes (mpk_dist.runtime.superopt_tasks; their folders go first on the include path). Without
    a program, a superopt build compiles the bodies checked in under csrc/tasks/generated. With a program, the
    kernel leaves out the ``OPTIONAL_KINDS`` it does not run (``kind_defines``)."""
    source = render_source(shape, model, rank, world, input_hash)
    dirs, defines = [], {}
    if shape.superopt and program is not None:
        from mpk_dist.runtime.superopt_tasks import prepare

        so = prepare(program)
        dirs, defines = so.include_dirs, dict(so.defines)
    if program is not None:
        defines.update(kind_defines(program))
    inc = abi_include_dir()
    res = compile_source(source, shape.name(), defines=defines, arch=arch, compiler=compiler,
                         include_dirs=dirs + [inc], use_cache=use_cache, key_text=source_for_key(source))
    return source, res

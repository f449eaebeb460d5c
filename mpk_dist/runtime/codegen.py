"""Generate the one .cu of a mega-kernel: wiring only (defines, includes, layout checks).

The task bodies and the runtime are the headers under csrc/; the task graph travels as data (the
ABI tables), so the source depends only on the shapes that are compile-time constants here (batch,
threads per worker, schedule). The banner names generator, package version, git commit, model,
rank and a hash of the program's tables; it is informational and excluded from the cache key
(``source_for_key``), so two models with equal compile-time shapes share one binary.
"""

from __future__ import annotations

import hashlib
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mpk_dist import __version__
from mpk_dist.runtime.params import layout_asserts

BANNER_END = "// ---- end of banner ----"
LINEAR_UNROLLS = (4, 8, 16)
"""Allowed 16-byte weight loads in flight per lane (MPK_LINEAR_UNROLL; 8 is the GPU-verified default)."""
CODE_SIZE_DEFINES = ("MPK_ROPE_NEAR", "MPK_ROWWISE_OUTLINED", "MPK_STAGE_ROW_ROLLED")
"""The code-size variants a KernelShape's compact_code turns on (each designed to leave every sum as it is: inlined
sincosf only for rope angles up to 65,536, the fused bodies' per-element fallback outlined, the prologue's staging
loop rolled; csrc/tasks/common.cuh, fused_gemv.cuh). Rendered under #ifndef, so a -D of the build still decides."""

WORKER_THREADS = (128, 256, 512, 1024)
"""Allowed worker threads per block (MPK_WORKER_THREADS; 256 is the GPU-verified default)."""
BLOCKS_PER_SM = (1, 2)
"""Allowed worker blocks per SM (MPK_BLOCKS_PER_SM; 1 is the default): 2 runs two workers on every SM, each block
at most half the SM's registers (128 a thread at 256 threads)."""


@dataclass(frozen=True)
class KernelShape:
    """Compile-time constants of one generated kernel."""

    batch: int  # MPK_BATCH: rows of every linear-kind tile, 1..16 (``tables.kernel_batch`` of the program)
    worker_threads: int = 256
    schedule: str = "aot"  # 'aot' | 'jit'
    linear_rows: int = 1  # rows per warp in flight in linear tiles (1: the GPU-verified path)
    linear_unroll: int = 8  # 16-byte weight loads in flight per lane in linear tiles
    prefetch_kb: int = -1  # L2 prefetch of a linear tile's weights before its wait: -1 whole tile, else KB cap
    superopt: bool = True  # fused linears run the superoptimizer's generated bodies (mpk_dist.runtime.superopt_tasks)
    linear_mma: bool = False  # batch >= 2 linear tiles on tensor cores (csrc/tasks/linear_mma.cuh; tolerance, not bits)
    linear_tma: bool = False  # weights streamed through a shared-memory ring by bulk copies (weight_stream.cuh; same bits)
    linear_pipe: bool = False  # next chunk's weight loads issued before this one is summed (gemv_pipe.cuh; same bits)
    attn_prefetch: bool = True  # attention tiles pull their cache rows into L2 before their wait (attention.cuh; same bits)
    load_ahead: bool = True  # batch-1 GEMV: a round's x vectors loaded before any use (linear.cuh load_x_round; same bits)
    weight_evict_first: bool = False  # linear tiles' weight loads marked first to leave L2 (common.cuh ld_weight_v4; same bits)
    compact_code: bool = False  # CODE_SIZE_DEFINES on (tables.default_compact_code; same bits)
    flag_words: bool = False  # the program hands its residual stream over as flagged words (taskgraph.flag_words)
    blocks_per_sm: int = 1  # worker blocks resident per SM (MPK_MIN_BLOCKS_PER_SM; BLOCKS_PER_SM), one worker each
    attn_phased_merge: bool = False  # unsplit attention's block merge in phases (attention.cuh; MPK_ATTN_MERGE_PHASES > 1)


    def name(self) -> str:
        """File-name label: mk_b<batch>_t<threads>_<schedule>[_r<rows>][_u<unroll>][_p<prefetch KB>][_d][_nso][_m][_tma][_pipe][_nap][_nxa][_wef][_cc][_fw][_bs<blocks per SM>][_apm]."""
        rows = f"_r{self.linear_rows}" if self.linear_rows != 1 else ""
        unroll = f"_u{self.linear_unroll}" if self.linear_unroll != 8 else ""
        pf = f"_p{self.prefetch_kb}" if self.prefetch_kb != -1 else ""
        nso = "" if self.superopt else "_nso"
        mma = "_m" if self.linear_mma else ""
        mma += "_tma" if self.linear_tma else ""
        mma += "_pipe" if self.linear_pipe else ""
        mma += "" if self.attn_prefetch else "_nap"
        mma += "" if self.load_ahead else "_nxa"
        mma += "_wef" if self.weight_evict_first else ""
        mma += "_cc" if self.compact_code else ""
        mma += "_fw" if self.flag_words else ""
        mma += f"_bs{self.blocks_per_sm}" if self.blocks_per_sm != 1 else ""
        mma += "_apm" if self.attn_phased_merge else ""
        return f"mk_b{self.batch}_t{self.worker_threads}_{self.schedule}{rows}{unroll}{pf}{nso}{mma}"


def git_commit() -> str:
    """Short commit of the source tree, or 'unknown' (no git on the device machine is fine)."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def tables_hash(arrays: dict[str, np.ndarray]) -> str:
    """sha256 (16 hex digits) of the program's ABI tables."""
    h = hashlib.sha256()
    for k in sorted(arrays):
        h.update(k.encode())
        h.update(np.ascontiguousarray(arrays[k]).tobytes())
    return h.hexdigest()[:16]


def render_source(shape: KernelShape, model: str = "-", rank: int = 0, world: int = 1, input_hash: str = "-") -> str:
    """The .cu text for ``shape`` (deterministic)."""
    if not 1 <= shape.batch <= 16:  # the register accumulators of csrc/tasks/linear.cuh (lowering.ROW_BLOCK)
        raise ValueError(f"batch: expected MPK_BATCH 1..16 (tables.kernel_batch), got {shape.batch}")
    if shape.schedule not in ("aot", "jit"):
        raise ValueError(f"schedule: expected aot or jit, got {shape.schedule!r}")
    if shape.linear_rows not in (1, 2, 4, 8):
        raise ValueError(f"linear_rows: expected 1, 2, 4 or 8, got {shape.linear_rows}")
    if shape.linear_unroll not in LINEAR_UNROLLS:
        raise ValueError(f"linear_unroll: expected one of {LINEAR_UNROLLS}, got {shape.linear_unroll}")
    if shape.prefetch_kb < -1:
        raise ValueError(f"prefetch_kb: expected -1 (whole tile) or a cap >= 0 in KB, got {shape.prefetch_kb}")
    if shape.worker_threads not in WORKER_THREADS:
        raise ValueError(f"worker_threads: expected one of {WORKER_THREADS}, got {shape.worker_threads}")
    if shape.blocks_per_sm not in BLOCKS_PER_SM:
        raise ValueError(f"blocks_per_sm: expected one of {BLOCKS_PER_SM}, got {shape.blocks_per_sm}")
    banner = [
        f"// GENERATED by mpk_dist.runtime.codegen (mpk_dist {__version__}, commit {git_commit()}); do not edit.",
        f"// model {model}, tp rank {rank}/{world}, tables {input_hash}, kernel {shape.name()}",
        BANNER_END,
    ]
    body = [
        f"#define MPK_BATCH {shape.batch}",
        f"#define MPK_WORKER_THREADS {shape.worker_threads}",
        f"#define MPK_SCHEDULE_JIT {1 if shape.schedule == 'jit' else 0}",
        f"#define MPK_LINEAR_ROWS {shape.linear_rows}",
        f"#define MPK_LINEAR_UNROLL {shape.linear_unroll}",
        f"#define MPK_PREFETCH_KB {shape.prefetch_kb}",
        f"#define MPK_SUPEROPT {1 if shape.superopt else 0}",
        f"#define MPK_LINEAR_MMA {int(shape.linear_mma)}",
        f"#define MPK_LINEAR_TMA {int(shape.linear_tma)}",
        f"#define MPK_LINEAR_PIPE {int(shape.linear_pipe)}",
        f"#define MPK_ATTN_PREFETCH {int(shape.attn_prefetch)}",
        f"#define MPK_LOAD_AHEAD {int(shape.load_ahead)}",
        f"#define MPK_WEIGHT_EVICT_FIRST {int(shape.weight_evict_first)}",
        *([f"#ifndef {d}\n#define {d} 1\n#endif" for d in CODE_SIZE_DEFINES] if shape.compact_code else []),
        *(["#define MPK_FLAG_WORDS 1"] if shape.flag_words else []),  # only then: other sources stay as they were
        *([f"#define MPK_MIN_BLOCKS_PER_SM {shape.blocks_per_sm}"] if shape.blocks_per_sm != 1 else []),  # likewise
        *(["#define MPK_ATTN_PHASED_MERGE 1"] if shape.attn_phased_merge else []),  # likewise
        "#include <cstddef>",
        '#include "abi_generated.h"  // mpk_dist.taskgraph.abi.render_cuda_abi_header()',
        '#include "megakernel.cuh"',
        "",
        layout_asserts(),
        "",
    ]
    return "\n".join(banner + body)


def source_for_key(source: str) -> str:
    """The part of a generated source that decides the binary (everything after the banner)."""
    i = source.find(BANNER_END)
    return source if i < 0 else source[i + len(BANNER_END):]

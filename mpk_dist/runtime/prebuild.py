"""Build the mega-kernels a set of runs will need, in parallel, before the runs (``scripts/prebuild_kernels.py``).

A run builds its kernel when it first needs it: ~20 s of single-threaded nvcc per distinct kernel, one
after the other (a GPU test file needs several: models x batches x schedules). The kernel a run needs
is fixed by its program's KernelShape and the superoptimizer bodies its shapes pick, neither of which
needs a GPU, so this compiles the programs here, asks ``session.kernel_shape`` (what a Session asks)
and builds the distinct kernels in a process pool into the same cache ($MPK_CACHE_DIR/kernels).
"""

from __future__ import annotations

import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass

from mpk_dist.errors import InputError


H200_SMS = 132
"""SMs of the GPU the prebuilt kernels are for (an H100 has as many): the programs are compiled for this many workers."""

TABLE_ONLY = {"prefetch_plan": "MPK_PREFETCH_PLAN", "bulk_prefetch": "MPK_BULK_PREFETCH",
              "prefetch_ahead": "MPK_PREFETCH_AHEAD", "attn_stage_kv": "MPK_ATTN_STAGE_KV",
              "min_carveout": "MPK_MIN_CARVEOUT", "prefetch_level_kb": "MPK_PREFETCH_LEVEL_KB",
              "plan_behind_attention": "MPK_PLAN_BEHIND_ATTENTION", "prefetch_next_kb": "MPK_PREFETCH_NEXT_KB",
              "layer_aligned_workers": "MPK_LAYER_ALIGNED_WORKERS",
              "prefetch_behind_attention_kb": "MPK_PREFETCH_BEHIND_ATTENTION_KB",
              "exact_partials": "MPK_MMA_PARTIAL_EXACT"}
"""Session keyword -> environment variable of the switches that change the task records or the launch, never the
kernel binary (megakernel_backend.tuning_from_env reads them with the kernel's knobs)."""


@dataclass(frozen=True)
class BuildCase:
    """One run's kernel: preset, TP degree, batch, schedule, generated bodies on/off."""

    model: str
    tp: int = 1
    batch: int = 1
    schedule: str = "aot"
    superopt: bool = True
    attn_splits: int | str = "auto"  # the backend's default; 1 = the unsplit program (other fused attention kinds)
    max_seq_len: int = 512  # the CLI's default; 'auto' may resolve otherwise at another cache length
    env: tuple = ()  # (name, value) pairs set while this case builds: a variant's MPK_* knobs and -D defines

    def label(self) -> str:
        """e.g. qwen3-0.6b tp1 b16 aot (attn_splits 1: ... aot k1; env: ... MPK_LINEAR_ROWS=2)."""
        return (f"{self.model} tp{self.tp} b{self.batch} {self.schedule}{'' if self.superopt else ' no-superopt'}"
                f"{'' if self.attn_splits == 'auto' else f' k{self.attn_splits}'}"
                f"{'' if self.max_seq_len == 512 else f' s{self.max_seq_len}'}"
                + "".join(f" {k}={v}" for k, v in self.env))


def cases(models: list[str], batches: list[int], schedules: list[str], tps: list[int],
          splits: tuple = ("auto",), max_seq_len: int = 512) -> list[BuildCase]:
    """Every combination; jit only at tp 1 (the runtime refuses jit above). ``splits``: attn_splits values
    (split and unsplit programs can differ in their generated bodies: the superoptimizer's qk_norm_rope
    applies to the unsplit attention_prep tiles, not to attention_split_prep's)."""
    return [BuildCase(m, tp, b, sch, attn_splits=k, max_seq_len=max_seq_len) for k in splits for m in models for tp in tps for b in batches
            for sch in schedules if sch == "aot" or tp == 1]


def build_one(case: BuildCase) -> tuple[str, bool, float]:
    """Compile rank 0's program and build its kernel (cache hit or nvcc) with the case's environment set;
    (kernel file, was cached, seconds)."""
    from mpk_dist.runtime.megakernel_backend import scoped_env

    with scoped_env(dict(case.env)):
        return _build_one(case)


def _build_one(case: BuildCase) -> tuple[str, bool, float]:
    from mpk_dist.models.presets import get_preset
    from mpk_dist.runtime.kernel import build_kernel
    from mpk_dist.runtime.megakernel_backend import (fusions_for_batch, fusions_from_env,
                                                     linear_rows_from_env, superopt_from_env, tuning_from_env)
    from mpk_dist.runtime.session import kernel_shape
    from mpk_dist.runtime.tables import padded_batch
    from mpk_dist.taskgraph.compiler import compile_rank_programs

    t0 = time.perf_counter()
    cfg = get_preset(case.model)
    # A run's program at 132 SMs (an H200) times the blocks an SM (MPK_BLOCKS_PER_SM: one worker each) and the case's
    # max_seq_len: 'auto' resolves there as the backend's does (lowering_attention.resolve_splits: at batch 1 the
    # cache length can decide), and the program's tile sizes choose the kernel's threads and unroll.
    batch = padded_batch(case.batch)
    tuning = tuning_from_env(None)  # the MPK_* knobs a run in this environment would use (None: the program's threads)
    cg = compile_rank_programs(cfg, tp=case.tp, batch=batch, sms=H200_SMS * tuning.get("blocks_per_sm", 1), ranks=[0],
                               fuse=fusions_for_batch(fusions_from_env(), batch), attn_splits=case.attn_splits,
                               max_seq_len=case.max_seq_len)[0]
    for table_only in TABLE_ONLY:  # not the binary
        tuning.pop(table_only, None)
    wt = tuning.pop("worker_threads")
    shape = kernel_shape(cg, wt, case.schedule, linear_rows=linear_rows_from_env(),
                         superopt=case.superopt and superopt_from_env(), **tuning)
    _, res = build_kernel(shape, program=cg)
    return res.path.name, res.cached, time.perf_counter() - t0


FAILURE_DETAIL_LINES = 6  # compiler lines quoted under a failed case (the first error ones)


def failure_summary(exc: BaseException) -> str:
    """One case's failure for the progress log: the exception's first line, then up to FAILURE_DETAIL_LINES of its
    text that name an error (nvcc's "file(line): error: ..."), so a failed build says what failed without the
    compiler's whole output."""
    lines = str(exc).splitlines() or [""]
    detail = [ln.strip() for ln in lines[1:] if "error" in ln.lower()][:FAILURE_DETAIL_LINES]
    return "\n    ".join([f"{type(exc).__name__}: {lines[0][:300]}", *(ln[:300] for ln in detail)])


def prebuild(todo: list[BuildCase], jobs: int, log=print) -> int:
    """Build every case's kernel with ``jobs`` processes; one progress line per case; returns the number
    of failed cases (each named with its error)."""
    if jobs < 1:
        raise InputError(f"--jobs: expected >= 1, got {jobs}")
    failed = 0
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        futs = {pool.submit(build_one, c): c for c in todo}
        for i, f in enumerate(as_completed(futs), 1):
            c = futs[f]
            try:
                name, cached, secs = f.result()
                log(f"[{i}/{len(todo)}] {c.label()}: {'cached' if cached else 'built'} {name} ({secs:.1f} s)")
            except Exception as exc:  # noqa: BLE001 - reported per case, the others still build
                failed += 1
                log(f"[{i}/{len(todo)}] {c.label()}: FAILED: {failure_summary(exc)}")
    log(f"prebuild: {len(todo) - failed}/{len(todo)} kernels ready in {time.perf_counter() - t0:.1f} s "
        f"({jobs} processes)")
    return failed

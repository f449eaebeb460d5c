#!/usr/bin/env python3
"""Build the mega-kernels of a set of runs in parallel before the runs (mpk_dist.runtime.prebuild).

    python3 scripts/prebuild_kernels.py                      # what the GPU test suites use
    python3 scripts/prebuild_kernels.py --models qwen3-8b --batches 1,8 --schedules aot

Honours the same environment a run does (MPK_CACHE_DIR, MPK_* kernel knobs, MPK_SUPEROPT, MPK_FUSE_ATTN_PREP).
Exit status 1 when a case failed to build (each is named).
"""

from __future__ import annotations

import argparse
import os
import sys


def _ints(text: str, what: str) -> list[int]:
    from mpk_dist.errors import InputError

    try:
        out = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        raise InputError(f"{what}: expected a comma list of positive integers, got {text!r}")
    return out


def _splits(text: str) -> tuple:
    """'auto,1,2' -> ('auto', 1, 2): the backend's default or positive KV range counts."""
    from mpk_dist.errors import InputError

    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items or any(t != "auto" and not (t.isdigit() and int(t) >= 1) for t in items):
        raise InputError(f"--attn-splits: expected a comma list of 'auto' and positive integers, got {text!r}")
    return tuple(t if t == "auto" else int(t) for t in items)


def main(argv=None) -> int:
    from mpk_dist.bench.linear_alone import parse_list
    from mpk_dist.errors import InputError
    from mpk_dist.models.presets import PRESETS
    from mpk_dist.runtime.prebuild import cases, prebuild

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="tiny,tiny-llama,qwen3-0.6b", help="presets (default: the GPU tests')")
    p.add_argument("--batches", default="1,4,16", help="batches (default 1,4,16; above 16 builds the 16-row kernel)")
    p.add_argument("--schedules", default="aot,jit", help="aot, jit (jit at tp 1 only)")
    p.add_argument("--tp", default="1,2,4", help="tensor-parallel degrees (default 1,2,4)")
    p.add_argument("--attn-splits", default="auto,1",
                   help="attn_splits of the programs: auto (the backend's default) and/or KV ranges per kv head "
                        "(1 = unsplit, 2, 4, ...); default auto,1")
    p.add_argument("--max-seq-len", type=int, default=512,
                   help="KV cache length of the runs (default 512, the CLI's; 'auto' splits at batch 1 depend on it)")
    p.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1), help="build processes (default: cores, <= 16)")
    a = p.parse_args(argv)
    try:
        if a.max_seq_len < 1:
            raise InputError(f"--max-seq-len: expected a positive cache length, got {a.max_seq_len}")
        splits = _splits(a.attn_splits)
        todo = cases(parse_list(a.models, tuple(PRESETS), "--models"), _ints(a.batches, "--batches"),
                     parse_list(a.schedules, ("aot", "jit"), "--schedules"), _ints(a.tp, "--tp"), splits,
                     a.max_seq_len)
        return 1 if prebuild(todo, a.jobs) else 0
    except InputError as exc:
        print(f"prebuild_kernels.py: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

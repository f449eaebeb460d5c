#!/usr/bin/env python3
"""Sweep the mega-kernel's compile-time knobs on one GPU, in ONE process (weights made once):
MPK_LINEAR_UNROLL, MPK_WORKER_THREADS, MPK_PREFETCH_KB (see mpk_dist.runtime.codegen.KernelShape).

    python3 scripts/tune_sweep.py --model qwen3-8b --variants "base;u16;t512;t512,u16;p64;p0"

A variant is a comma list of u<unroll>, t<threads>, p<prefetch KB>, r<rows>, m<0|1> (tensor-core linear tiles at batch >= 2), w<0|1> (whole-tile L2 prefetch of linears
after a narrow op: mpk_dist/runtime/prefetch_plan.py), b<0|1> (weights through a shared-memory ring by bulk
copies: csrc/tasks/weight_stream.cuh), l<0|1> (software-pipelined linear loads: csrc/tasks/gemv_pipe.cuh), a<0|1> (qkv_prep folded into the attention tiles: the attn_prep fusion), v<0|1> (attention tiles pull their cache
rows into L2 before their wait: csrc/tasks/attention.cuh), e<KB> (the full-width linear tiles' L2 prefetch from the
task records instead of the compiled p cap: the same binary), d<0|1> (linear weight loads marked first to leave L2:
csrc/tasks/common.cuh ld_weight_v4), j<0|1> (silu_mul as the gate|up projection's epilogue: the silu_epi fusion,
scalar linear tiles only), o<0|1> (the code-size variants, codegen.CODE_SIZE_DEFINES; on by default at batch 1 and
unroll 4), q<0|1|2> (activations handed over as flagged words, mpk_dist/taskgraph/flag_words.py: 1 the residual
stream, 2 also the bf16 vectors of o_proj and down; off), n<0|1> (the down projection folded into the gate|up tiles
as atomic split-K partials: the silu_down fusion, csrc/tasks/down_partial.cuh; off, and not bit-reproducible, so its
tokens may differ from the base's)
('base' = defaults).
NOTE: m1 changes the summation order of linear tiles, so its tokens may differ from the base's
(DIFFERS then means "check with compare_logits", not a bug by itself).
A part -D<NAME>=<value> adds that compile-time define to the variant's build (MPK_NVCC_EXTRA_FLAGS, part of the
kernel's cache key), e.g. "base;-DMPK_ROPE_SINCOS=0" for the code variants designed to leave every sum as it is.
A part MPK_<NAME>=<value> sets that environment switch for the variant (every letter above is taken), e.g.
"base;MPK_PLAN_BEHIND_ATTENTION=1;MPK_PREFETCH_NEXT_KB=256" (record-level switches: the same binary).
k<N> / kauto splits each attention tile into N (or 'auto') KV ranges with a merge (--attn-splits; another
summation order, so DIFFERS is possible). f0/f1 turns --fuse off/on (fused and unfused programs are bit-identical on the GPU); s0/s1 turns the
superoptimizer-generated task bodies off/on (--no-superopt; designed bit-identical). Every variant
runs the same greedy request; its tokens must equal the first variant's (the knobs change how bytes
move, never the arithmetic order of a row), else the row says DIFFERS and the exit code is 1.
Prints p50 ms/token, the floor measured in the same run (once, before the first variant), the ratio and the kernel
shape the variant ran (its cubin's name: threads, rows, unroll, ...; e.g. `r2` splits the program's unroll over two
rows, so at unroll 4 it is r2_u4);
--output-json keeps the rows. --prebuild-jobs N first builds every variant's kernel in N processes
(mpk_dist.runtime.prebuild; a run would build them one after the other), e.g. on a 16-core GPU machine:

    python3 scripts/tune_sweep.py --model qwen3-0.6b --prompt-len 480 --prebuild-jobs 8 \
        --variants "base;-DMPK_NORM_ONE_ROUND=1;base;-DMPK_NORM_ONE_ROUND=1"

--prebuild-only builds them and stops, without a GPU: run it on the build machine with MPK_CACHE_DIR set to a folder
that travels to the GPU machine, and the GPU run finds every kernel in its cache (scripts/gpu_check.sh --ab-prebuild).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

KNOBS = {"u": "MPK_LINEAR_UNROLL", "t": "MPK_WORKER_THREADS", "p": "MPK_PREFETCH_KB", "r": "MPK_LINEAR_ROWS",
         "m": "MPK_LINEAR_MMA", "b": "MPK_LINEAR_TMA", "a": "MPK_FUSE_ATTN_PREP",
         "w": "MPK_PREFETCH_PLAN", "l": "MPK_LINEAR_PIPE", "v": "MPK_ATTN_PREFETCH", "g": "MPK_BULK_PREFETCH",
         "h": "MPK_PREFETCH_AHEAD", "c": "MPK_FUSE_ATTN_MERGE", "x": "MPK_ATTN_STAGE_KV",
         "y": "MPK_LOAD_AHEAD", "z": "MPK_MIN_CARVEOUT", "e": "MPK_PREFETCH_LEVEL_KB",
         "d": "MPK_WEIGHT_EVICT_FIRST", "j": "MPK_FUSE_SILU_EPI", "o": "MPK_COMPACT_CODE", "q": "MPK_FLAG_WORDS",
         "n": "MPK_FUSE_SILU_DOWN", "i": "MPK_BLOCKS_PER_SM"}

EXTRA_FLAGS = "MPK_NVCC_EXTRA_FLAGS"  # defines of a variant's build (-D parts)


def parse_variant(text: str) -> tuple[dict[str, str], dict]:
    """'t512,u16,f1' -> ({'MPK_WORKER_THREADS': '512', 'MPK_LINEAR_UNROLL': '16'}, {'fuse': True});
    'base' -> ({}, {})."""
    env, opts = {}, {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        if part == "base":
            continue
        if part in ("f0", "f1"):
            opts["fuse"] = part == "f1"
            continue
        if part in ("s0", "s1"):
            opts["superopt"] = part == "s1"
            continue
        if part == "kauto" or (part[0] == "k" and part[1:].isdigit() and int(part[1:]) >= 1):
            opts["attn_splits"] = "auto" if part == "kauto" else int(part[1:])  # split-KV ranges per kv head
            continue
        if part.startswith("-D") and len(part) > 2:  # a compile-time define, e.g. -DMPK_ROPE_SINCOS=0
            env[EXTRA_FLAGS] = f"{env.get(EXTRA_FLAGS, '')} {part}".strip()
            continue
        name, eq, value = part.partition("=")
        if name.startswith("MPK_") and eq and value and name != EXTRA_FLAGS:  # any switch by name (no letter left)
            env[name] = value
            continue
        if part[0] not in KNOBS or not part[1:].lstrip("-").isdigit():
            raise SystemExit(f"tune_sweep: variant part {part!r}: expected -D<NAME>=<value>, MPK_<NAME>=<value>, u<N>, t<N>, p<N>, e<KB>, r<N>, m<0|1>, w<0|1>, b<0|1>, l<0|1>, v<0|1>, g<0|1>, h<0|1>, c<0|1>, x<0|1>, y<0|1>, d<0|1>, j<0|1>, o<0|1>, q<0|1|2>, n<0|1>, i<1|2>, "
                             "a<0|1>, f<0|1> (--fuse), s<0|1> (--superopt), k<N>|kauto (--attn-splits), or 'base'")
        env[KNOBS[part[0]]] = part[1:]
    return env, opts


def kernel_shape_name(cubin: str) -> str:
    """'/c/kernels/mk_b1_t256_aot_u4_p64-73ca....cubin' -> 'mk_b1_t256_aot_u4_p64': the shape the variant ran (its
    threads, unroll, rows...), so a knob that another default changes the meaning of shows it ('-' when unknown)."""
    name = os.path.basename(cubin)
    return name.split("-")[0] if name.endswith(".cubin") else "-"


def prebuild_cases(variants: list, model: str, batch: int, max_seq_len: int) -> list:
    """The distinct kernels of ``variants`` ([(text, (env, opts))], as parse_variant gives) for the prebuild:
    one BuildCase per distinct (env, splits, superopt), the record-level switches (prebuild.TABLE_ONLY: the same
    binary) left out of env. A variant with f0 / f1 (another fusion set than the environment's) is left to build
    when it runs."""
    from mpk_dist.runtime.prebuild import TABLE_ONLY, BuildCase

    out = []
    for _, (env, opts) in variants:
        if "fuse" in opts:
            continue
        kernel_env = {k: v for k, v in env.items() if k not in TABLE_ONLY.values()}
        case = BuildCase(model, 1, batch, "aot", superopt=opts.get("superopt", True),
                         attn_splits=opts.get("attn_splits", "auto"), max_seq_len=max_seq_len,
                         env=tuple(sorted(kernel_env.items())))
        if case not in out:
            out.append(case)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--variants", default="base;u16;t512;t512,u16;p64;p0")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--max-seq-len", type=int, help="KV cache length (default prompt + output; 'auto' splits at "
                    "batch 1 depend on it)")
    ap.add_argument("--output-json")
    ap.add_argument("--prebuild-jobs", type=int, default=0,
                    help="build the variants' kernels in this many processes first (default 0: each as it runs)")
    ap.add_argument("--prebuild-only", action="store_true",
                    help="build the variants' kernels into $MPK_CACHE_DIR and stop (no GPU needed: a machine without one "
                    "prepares the cache a GPU run then finds; --prebuild-jobs defaults to the cores here)")
    args = ap.parse_args(argv)
    max_seq = args.max_seq_len or args.prompt_len + args.output_len
    if max_seq < args.prompt_len + args.output_len:
        ap.error(f"--max-seq-len {max_seq}: expected at least prompt + output = {args.prompt_len + args.output_len}")
    variants = [(text, parse_variant(text)) for text in args.variants.split(";")]
    if args.prebuild_jobs < 0:
        ap.error(f"--prebuild-jobs {args.prebuild_jobs}: expected 0 (off) or a number of build processes")
    if args.prebuild_only and not args.prebuild_jobs:
        args.prebuild_jobs = min(os.cpu_count() or 1, 16)
    if args.prebuild_jobs:
        from mpk_dist.runtime.prebuild import prebuild

        failed = prebuild(prebuild_cases(variants, args.model, args.batch, max_seq), args.prebuild_jobs)
        if args.prebuild_only:
            left = [text for text, (_, opts) in variants if "fuse" in opts]
            if left:  # prebuild_cases leaves another fusion set's program to its run
                print(f"tune_sweep: not prebuilt (f0 / f1 build when they run): {'; '.join(left)}", file=sys.stderr)
            return 1 if failed else 0
        if failed:
            print("tune_sweep: a variant's kernel failed to build (above); its row will fail the same way",
                  file=sys.stderr)

    import torch

    from mpk_dist.bench.results import percentile
    from mpk_dist.bench.runner import measure_read_bandwidth, random_prompt, run_case, step_bytes
    from mpk_dist.engine import RunSpec
    from mpk_dist.model_source import open_model
    from mpk_dist.runtime.megakernel_backend import scoped_env

    model = open_model(args.model, seed=0, device="cuda")
    prompt = random_prompt(model.config.vocab_size, args.prompt_len, 0)
    nbytes = step_bytes(model.config, 1, args.batch, args.prompt_len + args.output_len // 2)
    rows, base_tokens, ok = [], None, True
    # One bandwidth sample for every row, taken before any kernel ran (as mpk-dist bench does): sampled after each
    # variant it read 3.7-4.3 TB/s from row to row on an H200 (docs/PERF.md v0.33), which moved the /floor column by
    # more than the variants did.
    bandwidth = measure_read_bandwidth(torch.device("cuda"))
    floor_ms = nbytes / bandwidth * 1e3
    print(f"# tune_sweep {args.model} b{args.batch} prompt {args.prompt_len} output {args.output_len} | "
          f"{torch.cuda.get_device_name()} | read bandwidth {bandwidth / 1e9:.1f} GB/s, floor {floor_ms:.3f} ms")
    print(f"{'variant':<14}{'p50 ms':>9}{'floor ms':>10}{'/floor':>8}  {'tokens':<8} kernel")
    for text, (env, opts) in variants:
        with scoped_env(env, keys=[*KNOBS.values(), EXTRA_FLAGS]):
            spec = RunSpec(model=args.model, backend="megakernel", tp=1, batch=args.batch,
                           max_new_tokens=args.output_len, max_seq_len=max_seq,
                           device="cuda", seed=0, backend_opts=opts)
            case = run_case(spec, model, prompt, args.output_len, args.iters, 1, False)
        p50 = percentile(case.decode_step_ms, 50)  # the p50 of mpk-dist bench
        base_tokens = case.tokens if base_tokens is None else base_tokens
        same = case.tokens == base_tokens
        ok &= same
        kernel = kernel_shape_name(case.extra.get("cubin", ""))
        rows.append({"variant": text, "env": env, "opts": opts, "p50_ms": p50, "floor_ms": floor_ms, "same_tokens": same,
                     "kernel": kernel})
        print(f"{text:<14}{p50:>9.3f}{floor_ms:>10.3f}{p50 / floor_ms:>8.2f}  {'same' if same else 'DIFFERS':<8} {kernel}")
        sys.stdout.flush()
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

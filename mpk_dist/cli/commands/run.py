"""``mpk-dist run``: decode a prompt and print the tokens and per-token latency."""

from __future__ import annotations

import argparse
import json
import sys

from mpk_dist.backends.registry import BACKENDS, default_device, resolve_backend
from mpk_dist.errors import InputError
from mpk_dist.models.presets import DEFAULT_PRESET


def add_model_args(p) -> None:
    """Flags shared by run and bench: model, backend, parallelism, sizes, backend options."""
    p.add_argument("--model", default=DEFAULT_PRESET, help=f"checkpoint directory or preset (default {DEFAULT_PRESET})")
    p.add_argument("--backend", default="auto", help=f"one of {', '.join(BACKENDS)} (default auto: megakernel on a GPU, interpreter on a CPU)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (default 1)")
    p.add_argument("--transport", default="local", choices=["local", "ipc"], help="how TP ranks reach each other (megakernel)")
    p.add_argument("--batch", type=int, default=1, help="sequences decoded together (the prompt is repeated)")
    p.add_argument("--max-seq-len", type=int, default=None,
                   help="KV-cache length per sequence (default: the prompt plus the tokens to generate; run "
                        "rounds it up to a multiple of 64); split-KV attention cuts its ranges from it, so a cache far longer than "
                        "the context decodes slower (docs/TASKGRAPH.md)")
    p.add_argument("--device", default=None, help="torch device (default: cuda if present, else cpu)")
    p.add_argument("--seed", type=int, default=0, help="seed for preset weights, sampling and interpreter schedules")
    p.add_argument("--schedule", default=None, choices=["jit", "aot"], help="mega-kernel task dispatch (default aot: static per-SM lists; jit: in-kernel scheduler)")
    p.add_argument("--trace", default=None, metavar="FILE.json", help="mega-kernel: write a per-task Perfetto trace")
    p.add_argument("--timeout", type=float, default=None, metavar="S", help="mega-kernel: watchdog timeout per wait (s)")
    p.add_argument("--fuse", action=argparse.BooleanOptionalAction, default=None,
                   help="megakernel/interpreter: fuse rms_norm, silu_mul and the tp-1 residual add into the linear "
                        "tiles (fewer dependent levels per step; default on: bit-identical to --no-fuse on an H200)")
    p.add_argument("--no-superopt", dest="superopt", action="store_false", default=None,
                   help="megakernel: fused linears run the hand-written bodies instead of the ones generated from "
                        "the superoptimizer's µGraphs (default: generated, searched once per shape and cached)")
    p.add_argument("--attn-splits", default=None, metavar="N|auto",
                   help="megakernel/interpreter: split each kv head's attention into N KV ranges + a merge task "
                        "(auto: from the SM count and --max-seq-len; default: auto for megakernel, 1 = unsplit for "
                        "interpreter)")


def backend_opts(args) -> dict:
    """Options that only some backends take; passed only when set, so a backend never silently ignores one."""
    opts = {}
    if args.schedule is not None:
        opts["schedule"] = args.schedule
    if args.trace is not None:
        opts["trace"] = args.trace
    if args.timeout is not None:
        opts["timeout_s"] = args.timeout
    if args.transport != "local":
        opts["transport"] = args.transport
    if args.fuse is not None:
        opts["fuse"] = args.fuse
    if args.attn_splits is not None:
        opts["attn_splits"] = args.attn_splits
    if args.superopt is False:
        opts["superopt"] = False
    return opts


def register(subparsers) -> None:
    """Add ``run`` to the CLI."""
    p = subparsers.add_parser("run", help="decode a prompt and report per-token latency (the default command)")
    add_model_args(p)
    p.add_argument("--prompt", default=None, help="prompt text")
    p.add_argument("--prompt-ids", default=None, help="prompt as token ids, e.g. 1,2,3")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--dump-logits", default=None, metavar="FILE.npy", help="save float32 logits [steps, vocab] (batch 1) or [steps, B, vocab]")
    p.add_argument("--force-tokens", default=None, help="teacher forcing: feed these ids as the next inputs")
    p.add_argument("--no-stop", action="store_true", help="ignore EOS and always produce --max-new-tokens")
    p.set_defaults(func=main)


def main(args) -> int:
    """Run the generation and print the result."""
    # Heavy imports (torch, the backends) only once a command runs, so `mpk-dist --help` and the
    # other sub-commands start fast.
    import numpy as np

    from mpk_dist.backends.base import SamplingParams
    from mpk_dist.dist.env import rank_info
    from mpk_dist.engine import (RunSpec, build_backend, check_ids, check_length, context_max_seq_len, latency_summary,
                                 make_request, parse_id_list, prompt_ids)
    from mpk_dist.model_source import open_model

    name = resolve_backend(args.backend)
    model = open_model(args.model, seed=args.seed, device=args.device or default_device(name))
    ids = prompt_ids(model, args.prompt, args.prompt_ids)
    max_seq_len = args.max_seq_len or context_max_seq_len(len(ids), args.max_new_tokens,
                                                          model.config.max_position_embeddings)
    spec = RunSpec(model=args.model, backend=args.backend, tp=args.tp, batch=args.batch,
                   max_new_tokens=args.max_new_tokens, max_seq_len=max_seq_len, device=args.device,
                   seed=args.seed, backend_opts=backend_opts(args))
    check_length(len(ids), args.max_new_tokens, max_seq_len)
    force = parse_id_list(args.force_tokens, "--force-tokens") if args.force_tokens else None
    if force:
        check_ids(force, model.config.vocab_size, "--force-tokens")
    if args.batch < 1:
        raise InputError(f"--batch: expected >= 1, got {args.batch}")
    model, backend = build_backend(spec, model)
    stop = () if args.no_stop or force else model.config.eos_token_ids
    req = make_request([ids] * args.batch, args.max_new_tokens, SamplingParams(args.temperature, args.top_p, args.seed),
                       stop, force, want_logits=args.dump_logits is not None)
    res = backend.generate(req)
    if rank_info().rank != 0:
        return 0  # under mpirun every rank decodes; rank 0 reports
    if args.dump_logits:
        logits = res.logits.numpy().astype(np.float32)
        np.save(args.dump_logits, logits[:, 0] if args.batch == 1 else logits)
    lat = latency_summary(res.per_token_ms)
    text = model.tokenizer.decode(res.tokens[0])
    if args.json:
        print(json.dumps({"model": args.model, "backend": backend.name, "tp": args.tp, "batch": args.batch,
                          "max_seq_len": max_seq_len, "prompt_ids": ids, "tokens": res.tokens[0] if args.batch == 1 else res.tokens,
                          "text": text, "prefill_ms": res.prefill_ms, "per_token_ms": res.per_token_ms,
                          "latency_ms": lat, **res.extra}))
        return 0
    out = sys.stdout
    print(f"model {args.model} | backend {backend.name} | tp {args.tp} | batch {args.batch} | prompt {len(ids)} tokens | "
          f"max_seq_len {max_seq_len}", file=out)
    print(f"tokens: {res.tokens[0]}", file=out)
    print(f"text:   {text!r}", file=out)
    print(f"prefill {res.prefill_ms:.2f} ms | per token p50 {lat['p50']:.3f} ms  p90 {lat['p90']:.3f}  "
          f"p99 {lat['p99']:.3f} | {lat['tokens_per_s']:.1f} tokens/s", file=out)
    if "kernel_build_s" in res.extra:  # the mega-kernel's start-up: cold (compiled here) or warm (cached cubin)
        x = res.extra
        total = x["taskgraph_s"] + x["kernel_build_s"] + x["load_s"]
        how = "cached cubin" if x["kernel_cached"] else f"built here: {x['compiler']}, generated bodies incl."
        tg = " (cached)" if x.get("taskgraph_cached") else ""
        print(f"start-up {'warm' if x['kernel_cached'] else 'cold'} {total:.2f} s | task graph {x['taskgraph_s']:.2f} s{tg} | "
              f"kernel {x['kernel_build_s']:.2f} s ({how}) | load {x['load_s']:.2f} s", file=out)
    return 0

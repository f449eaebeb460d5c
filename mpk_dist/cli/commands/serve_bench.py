"""``mpk-dist serve-bench``: a dynamic workload through the continuous-batching server.

Requests come from ``--requests FILE.jsonl`` (arrival time, prompt ids or length, output length;
format in mpk_dist.serving.workload) or ``--synthetic N --rate R --prompt-len L --output-len O``.
Output follows nccl-tests: a preamble, one row per request with units and a correctness column
(``--check``: greedy tokens identical to the request run alone on the static-cache torch backend),
the vLLM serving-bench summary, an OK/FAILED footer; ``--output-json`` writes the same data with
vLLM's field names (mean_ttft_ms, median_tpot_ms, p99_itl_ms, request_throughput, ...).
``--backend megakernel,torch`` serves the same workload on each backend in turn in this process (a
report each, then one comparison table); the JSON is then a list of records, one per backend.
"""

from __future__ import annotations

import datetime as _dt
import json

from mpk_dist.errors import InputError
from mpk_dist.models.presets import DEFAULT_PRESET


def register(subparsers) -> None:
    """Add ``serve-bench`` to the CLI."""
    p = subparsers.add_parser("serve-bench", help="serve a dynamic workload (continuous batching, paged KV); "
                                                   "TTFT / TPOT / ITL / E2E latency and throughput")
    p.add_argument("--model", default=DEFAULT_PRESET, help=f"checkpoint directory or preset (default {DEFAULT_PRESET})")
    p.add_argument("--backend", default="torch",
                   help="serving backend(s), comma-separated to compare them on one workload: torch (op by op), "
                        "interpreter (the compiled task graph, CPU; keep --max-tokens-per-step small), megakernel "
                        "(the compiled task graph on the GPU, one launch per pass; --max-tokens-per-step and --max-batch <= 256) "
                        "(default torch)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree, all ranks in this process (default 1)")
    p.add_argument("--device", default=None, help="torch device (default: cuda if present, else cpu)")
    p.add_argument("--seed", type=int, default=0, help="seed for preset weights and synthetic prompts")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--requests", metavar="FILE.jsonl", help="workload: one JSON object per line")
    src.add_argument("--synthetic", type=int, metavar="N", help="generate N requests (see --rate, --prompt-len, --output-len)")
    p.add_argument("--rate", type=float, default=float("inf"), help="synthetic: Poisson arrivals, req/s (default inf: all at 0)")
    p.add_argument("--prompt-len", type=int, default=128, help="synthetic: prompt tokens (default 128)")
    p.add_argument("--output-len", type=int, default=32, help="synthetic: output tokens (default 32)")
    p.add_argument("--max-batch", type=int, default=64, help="sequences served at once (default 64)")
    p.add_argument("--page-size", type=int, default=16, help="KV positions per page (default 16)")
    p.add_argument("--max-seq-len", type=int, default=None, help="prompt + output per request (default: the workload's longest)")
    p.add_argument("--num-pages", type=int, default=None, help="pages per layer pool (default: max-batch full sequences)")
    p.add_argument("--max-tokens-per-step", type=int, default=512, help="tokens per pass: decode + prompt chunks (default 512)")
    p.add_argument("--ignore-eos", action="store_true", help="always produce the requested output length")
    p.add_argument("--percentiles", default="99", help="comma-separated percentiles (vLLM --metric-percentiles, default 99)")
    p.add_argument("--warmup", type=int, default=0, metavar="K",
                   help="first serve the workload's first K requests untimed (CUDA/cuBLAS start-up out of TTFT)")
    p.add_argument("--check", action="store_true", help="compare each request's tokens with a run of it alone")
    p.add_argument("--virtual-pass-ms", type=float, default=None, metavar="MS",
                   help="deterministic clock: every pass takes MS (for tests; default: wall clock)")
    p.add_argument("--output-json", default=None, metavar="PATH", help="write the vLLM-style result JSON")
    p.add_argument("--persistent-passes", type=int, default=0, metavar="P",
                   help="megakernel/interpreter: serve up to P passes in one resident launch, each posted while it "
                        "runs (docs/SERVING.md 'Persistent passes'; default 0: one launch per pass)")
    p.set_defaults(func=main)


def _percentiles(text: str) -> list[float]:
    try:
        ps = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        ps = []
    if not ps or not all(0 < p <= 100 for p in ps):
        raise InputError(f"--percentiles: expected comma-separated numbers in (0, 100], got {text!r}")
    return ps


def _backends(text: str) -> list[str]:
    from mpk_dist.serving.server import SERVING_BACKENDS

    names = [b.strip() for b in text.split(",") if b.strip()]
    if not names or len(set(names)) != len(names) or any(n not in SERVING_BACKENDS for n in names):
        raise InputError(f"--backend: expected comma-separated names from {', '.join(SERVING_BACKENDS)}, each once, "
                         f"got {text!r}")
    return names


def _workload(args, vocab: int):
    from mpk_dist.serving.workload import load_requests, synthetic

    if args.requests:
        return load_requests(args.requests, vocab, seed=args.seed)
    return synthetic(args.synthetic, args.rate, args.prompt_len, args.output_len, vocab, seed=args.seed)


def _check_alone(model, args, items, outputs, stop_ids, max_seq_len) -> list[bool]:
    """Each request alone on the static-cache torch backend: are the greedy tokens identical?"""
    from mpk_dist.backends.base import GenerateRequest
    from mpk_dist.backends.torch_backend import TorchBackend

    ref = TorchBackend(model.config, model.weights, tp=args.tp, device=args.device or "cpu", max_seq_len=max_seq_len)
    ok = []
    for it, out in zip(items, outputs):
        res = ref.generate(GenerateRequest([list(it.prompt_ids)], max_new_tokens=it.output_len, stop_ids=stop_ids))
        ok.append(res.tokens[0] == out.tokens)
    return ok


def _print_report(args, backend, items, outputs, summary, checks, ps) -> None:
    print(f"# mpk-dist serve-bench: model {args.model}, backend {backend}, tp {args.tp}, max batch {args.max_batch}, "
          f"page size {args.page_size}, tokens/pass {args.max_tokens_per_step}, "
          f"clock {'virtual' if args.virtual_pass_ms else 'wall'}")
    print(f"# {len(items)} requests, {summary['total_input_tokens']} prompt tokens, {summary['total_output_tokens']} output tokens")
    print(f"#{'id':>5s} {'arrival':>9s} {'prompt':>7s} {'output':>7s} {'ttft':>10s} {'tpot':>9s} {'e2el':>10s}  check")
    print(f"#{'':>5s} {'(s)':>9s} {'(tok)':>7s} {'(tok)':>7s} {'(ms)':>10s} {'(ms)':>9s} {'(ms)':>10s}")
    for o, c in zip(outputs, checks):
        tpot = f"{o.tpot * 1e3:9.3f}" if o.tpot is not None else f"{'-':>9s}"
        mark = "-" if c is None else ("OK" if c else "FAILED")
        print(f" {o.id:5d} {o.arrival_time:9.3f} {o.prompt_len:7d} {len(o.tokens):7d} {o.ttft * 1e3:10.3f} {tpot} "
              f"{o.e2e_latency * 1e3:10.3f}  {mark}")
    print("============ Serving Benchmark Result ============")
    for label, key in (("Successful requests", "completed"), ("Benchmark duration (s)", "duration"),
                       ("Request throughput (req/s)", "request_throughput"),
                       ("Output token throughput (tok/s)", "output_throughput"),
                       ("Total token throughput (tok/s)", "total_token_throughput")):
        print(f"{label:<40s} {summary[key]:.2f}" if isinstance(summary[key], float) else f"{label:<40s} {summary[key]}")
    for name, title in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2EL")):
        for stat in ["mean", "median"] + [f"p{int(p) if p.is_integer() else p}" for p in ps]:
            print(f"{stat.capitalize() if stat != 'median' else 'Median'} {title} (ms):".ljust(41) + f"{summary[f'{stat}_{name}_ms']:.3f}")


def _record(args, backend, items, server, summary: dict, checks: list) -> dict:
    """The vLLM-style record plus our run parameters."""
    return {"date": _dt.datetime.now().strftime("%Y%m%d-%H%M%S"), "backend": backend, "model_id": args.model,
            "tp": args.tp, "num_prompts": len(items), "request_rate": args.rate if args.synthetic else None,
            "max_concurrency": args.max_batch, "page_size": args.page_size, "num_pages": server.pool.num_pages,
            "max_tokens_per_step": server.spec.max_tokens, "passes": len(server.passes),
            # kernel launches for those passes (compiled backends; fewer than passes with --persistent-passes)
            "launches": getattr(server.backend, "launches", None), "persistent_passes": args.persistent_passes,
            "clock": "virtual" if args.virtual_pass_ms else "wall", "correct": checks, **summary}


def _print_comparison(records: list[dict]) -> None:
    """One row per backend: the same workload's headline numbers side by side."""
    print("============ Backends on the same workload ============")
    print(f"#{'backend':>11s} {'mean ttft':>10s} {'p99 ttft':>10s} {'mean tpot':>10s} {'p99 tpot':>10s} "
          f"{'output':>9s}  check  passes/launches")
    print(f"#{'':>11s} {'(ms)':>10s} {'(ms)':>10s} {'(ms)':>10s} {'(ms)':>10s} {'(tok/s)':>9s}")
    for r in records:
        p99 = [k for k in r if k.startswith("p") and k.endswith("_ttft_ms")][-1]
        mark = "-" if all(c is None for c in r["correct"]) else ("OK" if all(r["correct"]) else "FAILED")
        launches = "-" if r.get("launches") is None else r["launches"]
        print(f" {r['backend']:>11s} {r['mean_ttft_ms']:10.3f} {r[p99]:10.3f} {r['mean_tpot_ms']:10.3f} "
              f"{r[p99.replace('ttft', 'tpot')]:10.3f} {r['output_throughput']:9.2f}  {mark:<5s}  {r['passes']}/{launches}")


def _backend_opts(args, backend: str) -> dict:
    """Options of one backend from the command line (persistent passes: megakernel and interpreter)."""
    if args.persistent_passes < 0:
        raise InputError(f"--persistent-passes: expected P >= 0, got {args.persistent_passes}")
    if args.persistent_passes and backend in ("megakernel", "interpreter"):
        return {"persistent_passes": args.persistent_passes}
    return {}


def _serve(args, model, items, backend: str, max_seq_len: int, stop_ids: tuple):
    """Serve the workload on one backend: (server, outputs)."""
    from mpk_dist.serving.server import Server, VirtualClock

    clock = VirtualClock(args.virtual_pass_ms / 1e3) if args.virtual_pass_ms else None
    server = Server(model, backend=backend, tp=args.tp, max_batch=args.max_batch, page_size=args.page_size,
                    max_seq_len=max_seq_len, num_pages=args.num_pages, max_tokens_per_step=args.max_tokens_per_step,
                    device=args.device, seed=args.seed, clock=clock, backend_opts=_backend_opts(args, backend))
    if args.warmup > 0:
        for it in items[: args.warmup]:
            server.submit(it.prompt_ids, it.output_len, 0.0, stop_ids=stop_ids)
        server.run()
        server.passes = []
    for it in items:
        server.submit(it.prompt_ids, it.output_len, it.arrival_time, stop_ids=stop_ids)
    return server, server.run()


def main(args) -> int:
    """Run the workload on each backend and report; exit 1 when --check finds a mismatch."""
    import torch

    from mpk_dist.model_source import open_model
    from mpk_dist.serving.metrics import summarize

    ps = _percentiles(args.percentiles)
    backends = _backends(args.backend)
    if args.tp < 1:
        raise InputError(f"--tp: expected >= 1, got {args.tp}")
    # The mega-kernel reads its weights on the GPU: make random preset weights there directly.
    on_gpu = "megakernel" in backends and torch.cuda.is_available()
    model = open_model(args.model, seed=args.seed, device=args.device or ("cuda" if on_gpu else "cpu"))
    items = _workload(args, model.config.vocab_size)
    longest = max(len(it.prompt_ids) + it.output_len for it in items)
    max_seq_len = args.max_seq_len or longest
    stop_ids = () if args.ignore_eos else tuple(model.config.eos_token_ids)
    records, ok = [], True
    for backend in backends:
        server, outputs = _serve(args, model, items, backend, max_seq_len, stop_ids)
        summary = summarize(outputs, ps)
        checks = (_check_alone(model, args, items, outputs, stop_ids, max_seq_len) if args.check
                  else [None] * len(outputs))
        _print_report(args, backend, items, outputs, summary, checks, ps)
        ok = ok and all(c is not False for c in checks)
        records.append(_record(args, backend, items, server, summary, checks))
        del server  # one backend's device memory at a time
    if len(records) > 1:
        _print_comparison(records)
    print(f"# {'OK' if ok else 'FAILED'}" + ("" if args.check else " (not checked: pass --check)"))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(records[0] if len(records) == 1 else records, f, indent=1)
    return 0 if ok else 1

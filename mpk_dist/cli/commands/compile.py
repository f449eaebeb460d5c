"""``mpk-dist compile``: compile a model's task graph per TP rank and dump the arrays.

Writes DIR/rank<r>/ (the .npy tables, consts.npz, meta.json: what the GPU runtime loads),
DIR/summary.json (tasks and events per op kind and layer, bytes per task, compile time),
DIR/layer<L>.dot (Graphviz picture of one layer) and DIR/abi.h (the generated C++ ABI header).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from mpk_dist.errors import InputError


def _config(model: str):
    from mpk_dist.config import load_config
    from mpk_dist.models.presets import PRESETS, get_preset

    if model in PRESETS:
        return get_preset(model)
    if Path(model).is_dir():
        return load_config(model)
    return get_preset(model)  # raises ConfigError listing the presets


def main(args) -> int:
    """Compile, validate, dump; prints one line per rank and the totals."""
    from mpk_dist.taskgraph.abi import render_cuda_abi_header
    from mpk_dist.taskgraph.compiler import compile_rank_programs
    from mpk_dist.taskgraph.serialize import save
    from mpk_dist.taskgraph.summary import layer_dot, summarize

    cfg = _config(args.model)
    ranks = None if args.rank is None else [args.rank]
    if args.rank is not None and not 0 <= args.rank < args.tp:
        raise InputError(f"--rank: expected 0 <= rank < {args.tp}, got {args.rank}")
    layer = 0 if args.layer is None else args.layer
    if not 0 <= layer < cfg.num_layers:
        raise InputError(f"--layer: expected 0 <= layer < {cfg.num_layers}, got {layer}")
    timings: dict = {}
    t0 = time.perf_counter()
    cgs = compile_rank_programs(cfg, args.tp, batch=args.batch, sms=args.sms, max_seq_len=args.max_seq_len,
                                ranks=ranks, timings=timings)
    secs = time.perf_counter() - t0
    out = Path(args.dump)
    for cg in cgs:
        save(cg, out / f"rank{cg.meta['rank']}")
    summary = summarize(cgs[0], timings)
    summary["model"] = args.model
    (out / "summary.json").write_text(json.dumps(summary) + "\n")
    (out / f"layer{layer}.dot").write_text(layer_dot(cgs[0], layer))
    (out / "abi.h").write_text(render_cuda_abi_header())
    print(f"compiled {args.model} tp={args.tp} batch={args.batch} sms={args.sms}: {summary['tasks']} tasks, "
          f"{summary['events']} events, {summary['waits']} waits, {summary['signals']} signals per rank; "
          f"{len(cgs)} rank(s) in {secs:.2f} s -> {out}")
    return 0


def register(subparsers) -> None:
    """Add the ``compile`` sub-command."""
    p = subparsers.add_parser("compile", help="compile the task graph (per TP rank) and dump its arrays")
    p.add_argument("--model", default="tiny", help="preset name or checkpoint directory (default tiny)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (default 1)")
    p.add_argument("--batch", type=int, default=1, help="sequences per step (default 1)")
    p.add_argument("--sms", type=int, default=132, help="workers (SMs) the tiles are sized for (default 132, H100/H200)")
    p.add_argument("--max-seq-len", type=int, default=512, help="KV-cache length (default 512)")
    p.add_argument("--rank", type=int, default=None, help="compile only this rank (default all)")
    p.add_argument("--layer", type=int, default=None, help="layer drawn in layer<L>.dot (default 0)")
    p.add_argument("--dump", required=True, metavar="DIR", help="output directory")
    p.set_defaults(func=main)

"""``mpk-dist export-preset NAME DIR``: write a preset's deterministic random weights as an HF checkpoint.

Useful to feed the same weights to another engine (transformers, vLLM) for comparison. Real-shape
presets are gigabytes; ``mpk-dist run --model PRESET`` never needs this (it generates them on the GPU).
"""

from __future__ import annotations

from pathlib import Path

from mpk_dist.errors import InputError
from mpk_dist.models.presets import get_preset


def register(subparsers) -> None:
    """Add ``export-preset`` to the CLI."""
    p = subparsers.add_parser("export-preset", help="write a preset's random weights as a Hugging Face checkpoint")
    p.add_argument("name", help="preset name")
    p.add_argument("out_dir", help="directory to create")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=main)


def main(args) -> int:
    """Write the checkpoint and say where."""
    from mpk_dist.model_source import write_checkpoint

    cfg = get_preset(args.name)
    out = Path(args.out_dir)
    if out.exists():
        raise InputError(f"{out}: expected a new directory, got an existing path; remove it or pick another")
    write_checkpoint(cfg, out, seed=args.seed)
    print(f"wrote {args.name} (seed {args.seed}) to {out}")
    return 0

"""The ``mpk-dist`` command line.

Each sub-command lives in its own module under ``mpk_dist.cli.commands`` and exposes
``register(subparsers)`` (adds its parser and sets ``func``). Modules are discovered, so adding a
command touches no shared file.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys

from mpk_dist import __version__
from mpk_dist.errors import MpkError


def build_parser() -> argparse.ArgumentParser:
    """Build the top-level parser with every discovered sub-command."""
    parser = argparse.ArgumentParser(
        prog="mpk-dist",
        description="Multi-GPU LLM decoding with one persistent kernel per tensor-parallel shard.",
    )
    parser.add_argument("--version", action="version", version=f"mpk-dist {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    from mpk_dist.cli import commands

    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"mpk_dist.cli.commands.{info.name}")
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script; returns the process exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version", "--debug"):
        argv = ["run", *argv]
    if argv == ["--debug"]:
        argv = ["--debug", "run"]
    args = parser.parse_args(argv)
    if args.command is None:
        args = parser.parse_args([*argv, "run"])
    debug = args.debug or os.environ.get("MPK_DEBUG", "") not in ("", "0")
    try:
        return int(args.func(args) or 0)
    except MpkError as exc:
        if debug:
            raise
        print(f"mpk-dist: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("mpk-dist: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

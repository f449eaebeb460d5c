"""Progress display for long runs: rich if installed, else tqdm, else a line every few seconds.

Use ``for x in track(items, description="decode"): ...``. Output goes to stderr so JSON or tables
on stdout stay clean; ``enabled=False`` (e.g. on ranks other than 0) makes it a plain iterator.
"""

from __future__ import annotations

import sys
import time
from typing import Iterable, Iterator, TypeVar

T = TypeVar("T")


def _plain(items: Iterable[T], total: int | None, description: str, every_s: float) -> Iterator[T]:
    """Fallback without rich or tqdm: print 'description: i/total' at most every ``every_s``."""
    last = time.monotonic()
    done = 0
    for item in items:
        yield item
        done += 1
        now = time.monotonic()
        if now - last >= every_s:
            print(f"{description}: {done}/{total if total is not None else '?'}", file=sys.stderr, flush=True)
            last = now


def track(items: Iterable[T], *, total: int | None = None, description: str = "", enabled: bool = True,
          backend: str | None = None) -> Iterator[T]:
    """Iterate over ``items`` while showing progress; ``backend`` forces 'rich', 'tqdm' or 'plain'."""
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    if not enabled:
        return iter(items)
    if backend in (None, "rich"):
        try:
            from rich.console import Console
            from rich.progress import track as rich_track

            return iter(rich_track(items, total=total, description=description, console=Console(stderr=True)))
        except ImportError:
            if backend == "rich":
                raise
    if backend in (None, "tqdm"):
        try:
            from tqdm import tqdm

            return iter(tqdm(items, total=total, desc=description, file=sys.stderr))
        except ImportError:
            if backend == "tqdm":
                raise
    return _plain(items, total, description, every_s=5.0)

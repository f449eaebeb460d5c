"""On-disk cache of compiled task-graph programs, so that a warm start loads them instead of compiling.

Lowering, event reduction, serialization and validation of qwen3-8b take 2-3 s on an H200 host (docs/PERF.md
v0.10: 2.90 s of a 3.13 s warm start); loading the saved arrays takes milliseconds.

Key: sha256 over the model config (every field except ``extra``, which the compiler never reads), every
argument of ``compile_rank_programs`` that shapes the output, the ABI version, and the text of every Python
source file of the installed ``mpk_dist`` package: the compiler's output depends on code spread over graph/,
taskgraph/, sharding and models/, so any code change is a miss rather than a stale program. Entries live in
``$MPK_CACHE_DIR/taskgraphs/<key>/rank<r>/`` in ``serialize.save``'s layout; an entry is written to a
temporary directory and renamed into place, so a concurrent start never reads half of one. An entry that
cannot be read (deleted files, another ABI) is compiled again and replaced. ``MPK_TASKGRAPH_CACHE=0`` turns the
cache off.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import shutil
from pathlib import Path

from mpk_dist.config import ModelConfig
from mpk_dist.taskgraph.abi import ABI_VERSION
from mpk_dist.taskgraph.serialize import CompiledGraph, load, save

PACKAGE_DIR = Path(__file__).resolve().parent.parent


def cache_dir() -> Path:
    """``$MPK_CACHE_DIR/taskgraphs`` (default ``~/.cache/mpk_dist/taskgraphs``), beside the kernels."""
    from mpk_dist.model_source import cache_dir as cache_root

    return cache_root() / "taskgraphs"


def enabled() -> bool:
    """False when ``MPK_TASKGRAPH_CACHE`` is 0 (compile every time, write nothing)."""
    return os.environ.get("MPK_TASKGRAPH_CACHE", "1") != "0"


@functools.lru_cache(maxsize=1)
def package_source_digest() -> str:
    """sha256 of every ``.py`` file of the package (path and text), computed once per process."""
    h = hashlib.sha256()
    for p in sorted(PACKAGE_DIR.rglob("*.py")):
        h.update(str(p.relative_to(PACKAGE_DIR)).encode())
        h.update(b"\0")
        h.update(p.read_bytes())
    return h.hexdigest()


def program_key(cfg: ModelConfig, **args) -> str:
    """The cache key of the programs ``compile_rank_programs(cfg, **args)`` returns (see the module doc)."""
    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "extra"}
    text = json.dumps({"config": fields, "args": args, "abi": ABI_VERSION, "code": package_source_digest()},
                      sort_keys=True, default=lambda o: dataclasses.asdict(o) if dataclasses.is_dataclass(o) else repr(o))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _load_entry(d: Path, ranks: list[int]) -> list[CompiledGraph] | None:
    try:
        return [load(d / f"rank{r}") for r in ranks]
    except Exception:  # a partial or foreign entry: compile again (the caller replaces it)
        return None


def _store_entry(d: Path, ranks: list[int], cgs: list[CompiledGraph]) -> None:
    tmp = d.parent / f".{d.name}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    for r, cg in zip(ranks, cgs):
        save(cg, tmp / f"rank{r}")
    shutil.rmtree(d, ignore_errors=True)  # an unreadable entry of the same key
    try:
        os.replace(tmp, d)
    except OSError:  # another process placed the same entry first: keep theirs
        shutil.rmtree(tmp, ignore_errors=True)


def compile_rank_programs_cached(cfg: ModelConfig, tp: int, batch: int = 1, sms: int = 132, max_seq_len: int = 512,
                                 ranks: list[int] | None = None, fuse=False, attn_splits=1,
                                 nucleus: bool = False) -> tuple[list[CompiledGraph], bool]:
    """``compile_rank_programs`` (validated) through the disk cache: (programs, True when loaded from it)."""
    from mpk_dist.taskgraph.compiler import compile_rank_programs
    from mpk_dist.taskgraph.fusion import fusion_set
    from mpk_dist.taskgraph.lowering_attention import check_attn_splits

    ranks = list(range(tp)) if ranks is None else list(ranks)
    kw = dict(tp=tp, batch=batch, sms=sms, max_seq_len=max_seq_len, ranks=ranks, fuse=fuse, attn_splits=attn_splits,
              nucleus=nucleus)
    if not enabled():
        return compile_rank_programs(cfg, **kw), False
    # The key takes the arguments in their checked, normalized form (fuse=True and its names list agree).
    key = program_key(cfg, **{**kw, "fuse": sorted(fusion_set(fuse)), "attn_splits": check_attn_splits(attn_splits)})
    d = cache_dir() / key
    if d.is_dir():
        cgs = _load_entry(d, ranks)
        if cgs is not None:
            return cgs, True
    cgs = compile_rank_programs(cfg, **kw)
    try:
        d.parent.mkdir(parents=True, exist_ok=True)
        _store_entry(d, ranks, cgs)
    except OSError:  # a read-only or full cache directory costs the next start its compile, nothing else
        pass
    return cgs, False

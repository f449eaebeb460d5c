"""Checking and reporting of ``mpk-dist bench-comm`` (mpk_dist/bench/comm.py runs it): result
comparison, one table row per test from every rank's figures, the nccl-tests-like text and its JSON
copy. Pure functions of plain data, so they are tested on CPU with fake rows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mpk_dist.bench.comm import CommOptions

SCHEMA = "mpk_dist.bench_comm/1"


def compare(name: str, got, want, rel_tol: float = 0.0) -> tuple[bool, str]:
    """(ok, detail): ``got`` equals ``want`` within ``rel_tol`` x max|want| (0: bit for bit)."""
    g, w = got.detach().float().cpu(), want.detach().float().cpu()
    if g.shape != w.shape:
        return False, f"{name}: expected shape {tuple(w.shape)}, got {tuple(g.shape)}"
    diff = (g - w).abs().nan_to_num(nan=float("inf"))
    limit = rel_tol * float(w.abs().max())
    bad = int((diff > limit).sum())
    if bad == 0:
        return True, f"{name}: OK"
    i = int(diff.argmax())
    return False, (f"{name}: expected the sum within {limit:g}, got {bad} wrong element(s); first worst at {i}: "
                   f"got {float(g[i]):g}, expected {float(w[i]):g}")


def nccl_tolerance(world: int) -> float:
    """Relative error a bf16 reduction may add: one bf16 rounding (2^-8) per addition."""
    return world * 2.0 ** -8


ROW_SPECS = (  # (test, ours key, NCCL key, checks that decide the row)
    ("allreduce eager", "ours_eager_us", "nccl_eager_us", ("ours eager", "ours fresh slots", "nccl eager", "ours vs nccl")),
    ("allreduce graph", "ours_graph_us", "nccl_graph_us", ("ours graph",)),
    ("allreduce in-kernel vs NCCL graph", "ours_inkernel_us", "nccl_graph_us", ("ours in-kernel",)),
)


def combine_ranks(per_rank: list[dict[str, Any]], size_bytes: int) -> tuple[list[dict[str, Any]], list[str]]:
    """Table rows from every rank's measurements (times: max over ranks; checks: all ranks).

    Returns (rows, failures); a failure names its rank and check.
    """
    failures = [f"rank {p['rank']}: {detail}" for p in per_rank for ok, detail in p["checks"].values() if not ok]
    world = len(per_rank)
    rows = []
    for test, ours_key, nccl_key, checks in ROW_SPECS:
        ours, nccl = max(p[ours_key] for p in per_rank), max(p[nccl_key] for p in per_rank)
        ok = all(p["checks"].get(c, (False,))[0] for p in per_rank for c in checks)  # a missing check fails
        rows.append({"test": test, "size_bytes": size_bytes, "ranks": world, "ours_us": ours, "nccl_us": nccl,
                     "ours_over_nccl": ours / nccl if nccl > 0 else None, "ok": ok})
    pp = [p["pingpong_us"] for p in per_rank if p.get("pingpong_us") is not None]
    pp_ok = all(p["checks"].get("pingpong", (False,))[0] for p in per_rank)
    rows.append({"test": "pingpong one-way (ranks 0-1)", "size_bytes": 4, "ranks": 2, "ours_us": pp[0] if pp else None,
                 "nccl_us": None, "ours_over_nccl": None, "ok": pp_ok and bool(pp)})
    return rows, failures


def _num(v: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if v is None else fmt.format(v)


def format_table(rows: list[dict[str, Any]], failures: list[str], preamble: list[str]) -> str:
    """nccl-tests-like text: preamble, header with units, one row per test, OK/FAILED footer."""
    lines = [f"# {p}" for p in preamble]
    lines.append(f"| {'test':<34} | {'size (B)':>8} | {'ranks':>5} | {'ours (us)':>9} | {'NCCL (us)':>9} | "
                 f"{'ours/NCCL':>9} | check  |")
    lines.append(f"|{'-' * 36}|{'-' * 10}|{'-' * 7}|{'-' * 11}|{'-' * 11}|{'-' * 11}|--------|")
    for r in rows:
        lines.append(f"| {r['test']:<34} | {r['size_bytes']:>8} | {r['ranks']:>5} | {_num(r['ours_us']):>9} | "
                     f"{_num(r['nccl_us']):>9} | {_num(r['ours_over_nccl'], '{:.3f}'):>9} | "
                     f"{'OK' if r['ok'] else 'FAILED':<6} |")
    pp = rows[-1]["ours_us"]
    lines.append(f"# pingpong one-way latency: {_num(pp, '{:.3f}')} us")
    ok = not failures and all(r["ok"] for r in rows)
    lines += [f"# FAILED {f}" for f in failures]
    lines.append("# OK" if ok else "# FAILED")
    return "\n".join(lines)


def build_record(rows: list[dict[str, Any]], failures: list[str], per_rank: list[dict[str, Any]],
                 opts: CommOptions, environment: dict[str, Any]) -> dict[str, Any]:
    """The JSON copy of the table (plus every rank's raw figures and the environment)."""
    return {"schema": SCHEMA, "size_bytes": opts.size_bytes, "dtype": "bfloat16", "ranks": len(per_rank),
            "iters": opts.iters, "warmup": opts.warmup, "graph_len": opts.graph_len,
            "pingpong_one_way_us": rows[-1]["ours_us"], "rows": rows, "failures": failures,
            "ok": not failures and all(r["ok"] for r in rows),
            "per_rank": [{k: v for k, v in p.items() if k != "checks"} | {"checks": {n: list(c) for n, c in p["checks"].items()}}
                         for p in per_rank],
            **environment}


def preamble(opts: CommOptions, world: int, env: dict[str, Any]) -> list[str]:
    """Header lines: what ran on what."""
    v = env.get("versions", {})
    return [f"mpk-dist bench-comm: {world} ranks, {env.get('gpu')} x{env.get('gpu_count')}, torch {v.get('torch')}, "
            f"CUDA {v.get('cuda')}, NCCL {v.get('nccl')}, commit {str(env.get('git_commit'))[:12]}",
            f"size {opts.size_bytes} B bf16 ({opts.size_bytes // 2} elements), iters {opts.iters}, warmup "
            f"{opts.warmup}, CUDA graph of {opts.graph_len} calls; times in us per call, max over ranks"]

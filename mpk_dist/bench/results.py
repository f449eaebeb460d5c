"""One benchmark run as a JSON record, and reading many of them back.

Field names follow two tools people already compare against, where the meaning is the same:

- vLLM's latency benchmark (``benchmarks/latency.py``): ``avg_latency``, ``latencies`` and
  ``percentiles`` (keys "10".."99"), in **seconds**, one entry per iteration, where an iteration
  is one prefill plus all decode steps of the batch.
- SGLang's ``bench_one_batch``: ``run_name``, ``batch_size``, ``input_len``, ``output_len``,
  ``prefill_latency``, ``prefill_throughput``, ``median_decode_latency``,
  ``median_decode_throughput``, ``total_latency``, ``overall_throughput``, in **seconds** and
  tokens/s. Ours are medians over iterations (SGLang reports a single run).

Our own fields are in milliseconds and name their unit: ``ms_per_token_p50/p90/p99/mean`` (one
decode step = one token for each sequence of the batch), ``floor_ms_per_token`` (weights /
bandwidth), ``ratio_to_floor`` (p50 / floor), ``exposed_comm_share`` (fraction of decode time in
which only communication ran), plus model, tp, batch, transport, backend, GPU, versions, git
commit, host name and date. Raw ``prefill_ms`` and ``decode_step_ms`` are kept so records can be
re-analysed and data-parallel replicas pooled (:func:`combine_replicas`).
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path
from typing import Any, Iterable

from mpk_dist.errors import InputError

SCHEMA = "mpk_dist.bench/1"
VLLM_PERCENTILES = (10, 25, 50, 75, 90, 99)
REQUIRED_KEYS = ("model", "backend", "tp", "batch", "ms_per_token_p50", "avg_latency")


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default method) of a non-empty list."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def _iterations(prefill_ms: list[float], decode_step_ms: list[float]) -> list[float]:
    """End-to-end ms of each iteration: its prefill plus its share of the decode steps."""
    iters = len(prefill_ms)
    if iters == 0 or not decode_step_ms or len(decode_step_ms) % iters:
        raise InputError(
            f"bench timings: expected one prefill per iteration and the same number of decode steps "
            f"in each, got {iters} prefill(s) and {len(decode_step_ms)} decode step(s); pass decode "
            "steps of all iterations concatenated in order"
        )
    steps = len(decode_step_ms) // iters
    return [prefill_ms[i] + sum(decode_step_ms[i * steps:(i + 1) * steps]) for i in range(iters)]


def _check_inputs(tp: int, batch: int, prompt_len: int, output_len: int, dp_replicas: int) -> None:
    """Sizes must be positive; the messages name the flag to fix."""
    for name, value in (("tp", tp), ("batch", batch), ("prompt_len", prompt_len),
                        ("output_len", output_len), ("dp_replicas", dp_replicas)):
        if not isinstance(value, int) or value < 1:
            raise InputError(f"{name}: expected a positive integer, got {value!r}")


def _vllm_fields(iter_s: list[float]) -> dict[str, Any]:
    """vLLM latency-bench fields from per-iteration seconds."""
    return {
        "avg_latency": statistics.fmean(iter_s),
        "latencies": iter_s,
        "percentiles": {str(p): percentile(iter_s, p) for p in VLLM_PERCENTILES},
    }


def _sglang_fields(run_name: str, batch: int, prompt_len: int, output_len: int,
                   prefill_ms: list[float], decode_step_ms: list[float], iter_s: list[float]) -> dict[str, Any]:
    """SGLang bench_one_batch fields (seconds, tokens/s; medians over iterations)."""
    prefill_s = statistics.median(prefill_ms) / 1e3
    decode_s = statistics.median(decode_step_ms) / 1e3
    total_s = statistics.median(iter_s)
    return {
        "run_name": run_name,
        "batch_size": batch,
        "input_len": prompt_len,
        "output_len": output_len,
        "prefill_latency": prefill_s,
        "prefill_throughput": prompt_len * batch / prefill_s if prefill_s > 0 else None,
        "median_decode_latency": decode_s,
        "median_decode_throughput": batch / decode_s if decode_s > 0 else None,
        "total_latency": total_s,
        "overall_throughput": (prompt_len + output_len) * batch / total_s if total_s > 0 else None,
    }


def _token_fields(batch: int, decode_step_ms: list[float], floor_ms: float | None) -> dict[str, Any]:
    """Per-token (= per decode step) latency in ms, throughput, floor and ratio to it."""
    p50 = percentile(decode_step_ms, 50)
    return {
        "ms_per_token_p50": p50,
        "ms_per_token_p90": percentile(decode_step_ms, 90),
        "ms_per_token_p99": percentile(decode_step_ms, 99),
        "ms_per_token_mean": statistics.fmean(decode_step_ms),
        "tokens_per_s": batch * 1e3 / p50 if p50 > 0 else None,
        "floor_ms_per_token": floor_ms,
        "ratio_to_floor": p50 / floor_ms if floor_ms else None,
    }


def build_result(*, model: str, tp: int, batch: int, backend: str, transport: str, prompt_len: int,
                 output_len: int, prefill_ms: list[float], decode_step_ms: list[float],
                 floor_ms: float | None, exposed_comm_share: float | None, dp_replicas: int = 1,
                 extra: dict | None = None) -> dict[str, Any]:
    """Build the JSON record of one benchmark point.

    ``prefill_ms`` holds one prefill time per measured iteration; ``decode_step_ms`` the decode
    step times of all iterations concatenated in order (the same count per iteration). Raises
    InputError on empty or mismatched timings and non-positive sizes.
    """
    _check_inputs(tp, batch, prompt_len, output_len, dp_replicas)
    prefill_ms = [float(v) for v in prefill_ms]
    decode_step_ms = [float(v) for v in decode_step_ms]
    iter_s = [ms / 1e3 for ms in _iterations(prefill_ms, decode_step_ms)]
    if exposed_comm_share is not None and not 0.0 <= exposed_comm_share <= 1.0:
        raise InputError(f"exposed_comm_share: expected a fraction in [0, 1], got {exposed_comm_share}")
    from mpk_dist.bench.environment import collect_environment

    run_name = f"{model}_{backend}_{transport}_tp{tp}_b{batch}" + (f"_dp{dp_replicas}" if dp_replicas > 1 else "")
    record: dict[str, Any] = {
        "schema": SCHEMA,
        "model": model, "backend": backend, "transport": transport,
        "tp": tp, "batch": batch, "dp_replicas": dp_replicas,
        "prompt_len": prompt_len, "iters": len(prefill_ms),
        **_sglang_fields(run_name, batch, prompt_len, output_len, prefill_ms, decode_step_ms, iter_s),
        **_vllm_fields(iter_s),
        **_token_fields(batch, decode_step_ms, floor_ms),
        "exposed_comm_share": exposed_comm_share,
        "prefill_ms": prefill_ms,
        "decode_step_ms": decode_step_ms,
        **collect_environment(),
        "extra": dict(extra or {}),
    }
    return record


def combine_replicas(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Pool data-parallel replicas (one record per replica, same point) into one record.

    Timings are pooled, so percentiles cover every replica; ``tokens_per_s_total`` adds the
    replicas' throughputs and ``replicas`` keeps one summary line per replica.
    """
    if not records:
        raise InputError("combine_replicas: expected at least one record, got none")
    first = records[0]
    keys = ("model", "backend", "transport", "tp", "batch", "prompt_len", "output_len")
    for rec in records[1:]:
        if any(rec.get(k) != first.get(k) for k in keys):
            raise InputError(
                f"combine_replicas: expected replicas of one point ({', '.join(keys)} equal), got "
                f"{[first.get(k) for k in keys]} and {[rec.get(k) for k in keys]}"
            )
    exposed = [r["exposed_comm_share"] for r in records if r.get("exposed_comm_share") is not None]
    combined = build_result(
        **{k: first[k] for k in keys},
        prefill_ms=[v for r in records for v in r["prefill_ms"]],
        decode_step_ms=[v for r in records for v in r["decode_step_ms"]],
        floor_ms=first.get("floor_ms_per_token"),
        exposed_comm_share=max(exposed) if exposed else None,
        dp_replicas=len(records), extra=first.get("extra"),
    )
    combined["replicas"] = [
        {"replica": i, "hostname": r.get("hostname"), "gpu": r.get("gpu"),
         "ms_per_token_p50": r["ms_per_token_p50"], "tokens_per_s": r.get("tokens_per_s")}
        for i, r in enumerate(records)
    ]
    combined["tokens_per_s_total"] = sum(r.get("tokens_per_s") or 0.0 for r in records)
    return combined


def write_result(result: dict[str, Any] | list[dict[str, Any]], path: str | os.PathLike) -> Path:
    """Write a record (or a list of records) as indented JSON, atomically; return the path."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(tmp, target)  # readers never see half a file
    return target


def _records_in(path: Path) -> list[dict[str, Any]]:
    """Records in one file: a JSON object, a JSON list of objects, or JSON lines."""
    text = path.read_text()
    try:
        data = json.loads(text)
        items = data if isinstance(data, list) else [data]
    except json.JSONDecodeError:
        try:
            items = [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as exc:
            raise InputError(f"{path}: expected JSON (an object, a list or JSON lines), got a parse error: {exc}") from None
    for item in items:
        missing = [k for k in REQUIRED_KEYS if not isinstance(item, dict) or k not in item]
        if missing:
            raise InputError(
                f"{path}: expected mpk-dist bench records (keys {', '.join(REQUIRED_KEYS)}), got one "
                f"without {', '.join(missing)}; pass files written by mpk-dist bench --output-json"
            )
        item.setdefault("source_file", str(path))
    return items


def load_results(paths: Iterable[str | os.PathLike]) -> list[dict[str, Any]]:
    """Load every record from the given files (directories contribute their *.json files)."""
    files: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            files.extend(sorted(path.glob("*.json")))
        elif path.is_file():
            files.append(path)
        else:
            raise InputError(f"{path}: expected a result file or directory, got nothing there")
    records: list[dict[str, Any]] = []
    for path in files:
        records.extend(_records_in(path))
    return records

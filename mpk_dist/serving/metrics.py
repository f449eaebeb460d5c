"""Serving-benchmark summary of finished requests, in the field names of vLLM's serving benchmark.

Aggregates (ms): ``mean_/median_/std_/p<P>_`` x ``ttft_ms`` (time to first token), ``tpot_ms`` (time
per output token after the first, per request, requests with >= 2 outputs), ``itl_ms`` (every gap
between consecutive outputs of every request), ``e2el_ms`` (arrival to last output). Totals:
``duration`` (s, from time 0 to the last output), ``completed``, ``total_input_tokens``,
``total_output_tokens``, ``request_throughput`` (req/s), ``output_throughput`` and
``total_token_throughput`` (tok/s). Per-request lists as vLLM writes them, in seconds:
``input_lens``, ``output_lens``, ``ttfts``, ``itls``; plus our ``e2els`` and ``tpots``.
"""

from __future__ import annotations

import statistics

from mpk_dist.bench.results import percentile
from mpk_dist.serving.request import RequestOutput

DEFAULT_PERCENTILES = (99,)
"""vLLM's default ``--metric-percentiles``."""


def _pkey(p: float) -> str:
    return f"p{int(p) if float(p).is_integer() else p}"


def _stats(name: str, values_s: list[float], percentiles) -> dict[str, float]:
    """mean/median/std/percentiles of seconds, reported in ms (0 when there are none, as vLLM does)."""
    ms = [v * 1e3 for v in values_s] or [0.0]
    out = {f"mean_{name}_ms": statistics.fmean(ms), f"median_{name}_ms": statistics.median(ms),
           f"std_{name}_ms": statistics.pstdev(ms)}
    for p in percentiles:
        out[f"{_pkey(p)}_{name}_ms"] = percentile(ms, p)
    return out


def summarize(outputs: list[RequestOutput], percentiles=DEFAULT_PERCENTILES) -> dict:
    """The vLLM-style result dict of a finished run (see the module docstring for every field)."""
    if not outputs:
        raise ValueError("summarize: expected at least one finished request, got none")
    duration = max(o.token_times[-1] for o in outputs)
    n_in = sum(o.prompt_len for o in outputs)
    n_out = sum(len(o.tokens) for o in outputs)
    itls = [g for o in outputs for g in o.itls]
    tpots = [o.tpot for o in outputs if o.tpot is not None]
    res = {"duration": duration, "completed": len(outputs), "total_input_tokens": n_in,
           "total_output_tokens": n_out, "request_throughput": len(outputs) / duration,
           "output_throughput": n_out / duration, "total_token_throughput": (n_in + n_out) / duration}
    res.update(_stats("ttft", [o.ttft for o in outputs], percentiles))
    res.update(_stats("tpot", tpots, percentiles))
    res.update(_stats("itl", itls, percentiles))
    res.update(_stats("e2el", [o.e2e_latency for o in outputs], percentiles))
    res.update(input_lens=[o.prompt_len for o in outputs], output_lens=[len(o.tokens) for o in outputs],
               ttfts=[o.ttft for o in outputs], itls=[o.itls for o in outputs],
               e2els=[o.e2e_latency for o in outputs], tpots=[o.tpot for o in outputs])
    return res

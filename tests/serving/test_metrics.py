"""vLLM-style serving summary from hand-made request timelines (every number checked by hand)."""

from __future__ import annotations

import pytest

from mpk_dist.serving.metrics import summarize
from mpk_dist.serving.request import RequestOutput


def _out(i, arrival, times, prompt=4):
    return RequestOutput(i, prompt, list(range(len(times))), arrival, arrival, times, "length")


def test_summary_fields_and_values():
    outs = [_out(0, 0.0, [0.1, 0.2, 0.4]), _out(1, 0.5, [0.8]), _out(2, 1.0, [1.3, 1.4, 1.5, 2.0], prompt=10)]
    s = summarize(outs, percentiles=(50, 99))
    assert s["completed"] == 3 and s["duration"] == pytest.approx(2.0)
    assert s["total_input_tokens"] == 18 and s["total_output_tokens"] == 8
    assert s["request_throughput"] == pytest.approx(1.5) and s["output_throughput"] == pytest.approx(4.0)
    assert s["total_token_throughput"] == pytest.approx(13.0)
    assert s["ttfts"] == pytest.approx([0.1, 0.3, 0.3])
    assert s["mean_ttft_ms"] == pytest.approx(700 / 3) and s["median_ttft_ms"] == pytest.approx(300)
    # TPOT: (e2e - ttft) / (n - 1) for requests with >= 2 outputs: 0.15 s and 0.2333 s
    assert s["mean_tpot_ms"] == pytest.approx((150 + 700 / 3) / 2)
    # ITL: every gap of every request
    assert s["itls"][0] == pytest.approx([0.1, 0.2]) and s["itls"][1] == []
    assert s["median_itl_ms"] == pytest.approx(100) and s["p99_itl_ms"] == pytest.approx(200 + 0.96 * 300)  # sorted 100,100,100,200,500
    assert s["mean_e2el_ms"] == pytest.approx((400 + 300 + 1000) / 3)
    for key in ("mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p50_ttft_ms", "p99_ttft_ms", "mean_tpot_ms",
                "p99_tpot_ms", "mean_itl_ms", "p99_e2el_ms", "input_lens", "output_lens"):
        assert key in s


def test_no_requests_is_an_error():
    with pytest.raises(ValueError, match="at least one"):
        summarize([])
